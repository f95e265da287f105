"""Align mode (prefix caching): commit_plan and commit against the oracle."""

import itertools

import pytest
import torch

import kda_ops
from kda_ops import naive

from helpers import DEVICES, assert_rel_close, query_start_loc

# docs/semantics.md#4-the-commit-plan's example rows:
# (nc, commit, final column, boundary column or None, recovery).
SPEC_TABLE = [(8188, 4, 3, 3, 4), (8190, 4, 4, 3, 2), (8180, 4, 3, None, None),
              (8192, 1, 4, None, None), (2047, 1, 0, 0, 1)]


@pytest.mark.parametrize("device", DEVICES)
def test_commit_plan_spec_table(device):
    rows, width, T = len(SPEC_TABLE), 6, 4
    table = (torch.arange(rows * width, dtype=torch.int32).view(rows, width) + 1).to(device)
    computed = torch.tensor([r[0] for r in SPEC_TABLE], dtype=torch.int32, device=device)
    accepted = torch.tensor([r[1] for r in SPEC_TABLE], dtype=torch.int32, device=device)
    commit, final, boundary, recovery = kda_ops.commit_plan(
        accepted, torch.arange(rows, dtype=torch.int32, device=device) + 100,
        query_start_loc([T] * rows, device), spec_len=T, block_table=table,
        num_computed_tokens=computed, block_size=2048)
    for r, (nc, c, final_col, boundary_col, rec) in enumerate(SPEC_TABLE):
        assert int(commit[r]) == c
        assert int(final[r]) == int(table[r, final_col])
        if boundary_col is None:
            assert int(boundary[r]) == 0
        else:
            assert int(boundary[r]) == int(table[r, boundary_col]) and int(recovery[r]) == rec


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 8])
def test_align_commit_every_offset(device, block_size):
    """Every computed-token offset around two block boundaries and every accepted
    count, one request each, in one commit; sources shared with the final or the
    boundary block (in place) when the table says so."""
    T, H, K, V, D, W, L = 4, 2, 16, 8, 6, 3, 2
    cases = list(itertools.product(range(0, 2 * block_size + T), range(0, T + 2)))
    R = len(cases)
    width = (2 * block_size + 2 * T) // block_size + 2
    gen = torch.Generator().manual_seed(block_size)
    table = torch.randperm(R * width, generator=gen).view(R, width).to(torch.int32) + 1
    computed = torch.tensor([nc for nc, _ in cases], dtype=torch.int32)
    accepted = torch.tensor([c for _, c in cases], dtype=torch.int32)
    # The checkpoint sits in the block of the last computed token, as engines keep it;
    # every other request reads a fresh block so both in-place and out-of-place occur.
    source = torch.tensor([int(table[r, max(nc - 1, 0) // block_size]) for r, (nc, _) in
                           enumerate(cases)], dtype=torch.int32)
    N = R * width + 1
    state = torch.randn(L, N, H, V, K, generator=gen)
    conv = torch.randn(L, N, D, W - 1 + T - 1, generator=gen)
    correction = torch.randn(L, N, H, T, V, generator=gen)
    key_gate = torch.randn(L, N, H, T, 2 * K, generator=gen)
    A_log, dt_bias = torch.randn(L, H, generator=gen) * 0.5, torch.randn(L, H, K, generator=gen)
    lens = [T] * R
    kwargs = dict(correction=correction, key_gate=key_gate, A_log=A_log, dt_bias=dt_bias,
                  lower_bound=-5.0, block_table=table, num_computed_tokens=computed,
                  block_size=block_size)
    expected_state, expected_conv = naive.commit(accepted, source, query_start_loc(lens, "cpu"),
                                                 state=state, conv_state=conv, **kwargs)
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    state_d, conv_d = state.to(device), conv.to(device)
    kda_ops.commit(accepted.to(device), source.to(device), query_start_loc(lens, device),
                   state=state_d, conv_state=conv_d, **on)
    assert torch.equal(conv_d.cpu(), expected_conv)
    changed = (expected_state != state.double()).flatten(-3).any(-1)
    assert torch.equal(state_d.cpu()[~changed], state[~changed])
    assert_rel_close(state_d.cpu()[changed], expected_state[changed].float(), name="state")


@pytest.mark.parametrize("device", DEVICES)
def test_align_empty_block_table(device):
    """A block table with no rows: every request's row is out of range, so
    every plan is null and commit writes nothing, without reading the empty
    `num_computed_tokens` (docs/semantics.md#7-null-rows-and-bounds: no read
    outside a tensor)."""
    T, H, K, V, D, W, N = 2, 1, 8, 4, 6, 3, 3
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device)

    empty_table = dict(block_table=torch.zeros(0, 3, dtype=torch.int32, device=device),
                       num_computed_tokens=torch.zeros(0, dtype=torch.int32, device=device),
                       block_size=4)
    accepted = torch.tensor([2, 1], dtype=torch.int32, device=device)
    source = torch.tensor([1, 2], dtype=torch.int32, device=device)
    qsl = query_start_loc([2, 1], device)
    plan = kda_ops.commit_plan(accepted, source, qsl, spec_len=T, **empty_table)
    assert [column.cpu().tolist() for column in plan] == [[0, 0]] * 4
    state, conv = rand(N, H, V, K), rand(N, D, W - 1 + T - 1)
    state_before, conv_before = state.clone(), conv.clone()
    kda_ops.commit(accepted, source, qsl, state=state, conv_state=conv,
                   correction=rand(N, H, T, V), key_gate=rand(N, H, T, 2 * K), A_log=rand(H),
                   dt_bias=rand(H, K), **empty_table)
    assert torch.equal(state, state_before) and torch.equal(conv, conv_before)
