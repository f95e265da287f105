"""Float64 calls (docs/semantics.md#12-float64): every op computes in float64
on the PyTorch path, on every device, and agrees with the float64 oracle to
float64 rounding; float64 mixed with other dtypes is refused by name."""

import pytest
import torch

import kda_ops
from kda_ops import naive

from helpers import DEVICES, assert_rel_close, query_start_loc

F64 = torch.float64
TIGHT = 1e-12  # float64 arithmetic over a few tokens lands near 1e-15
H, K, V, T, W, N = 2, 8, 4, 4, 4, 7
D = H * (2 * K + V)


def problem(device, seed, records=T):
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64).to(device)  # noqa: E731
    lens = [1, 3, 4, 2, 0, 6]
    indices = [1, 2, 0, 3, 9, 5]
    qsl = query_start_loc(lens, device)
    n = sum(lens)
    return dict(
        q=rand(n, H, K), k=rand(n, H, K), v=rand(n, H, V), g=rand(n, H, K), beta=rand(n, H),
        A_log=rand(H) * 0.5, dt_bias=rand(H, K), state=rand(N, H, V, K),
        correction=rand(N, H, records, V), key_gate=rand(N, H, records, 2 * K),
        query_start_loc=qsl, state_indices=torch.tensor(indices, dtype=torch.int32,
                                                        device=device),
        x=rand(n, D), conv_state=rand(N, D, W - 1 + T - 1), weight=rand(D, W), bias=rand(D),
        accepted=torch.tensor([1, 2, 4, 2, 1, 3], dtype=torch.int32, device=device))


VERIFY_ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "correction",
               "key_gate", "query_start_loc", "state_indices")


def cpu(p, names):
    return [p[name].cpu() for name in names]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_verify_and_commit_in_float64(device, lower_bound):
    p = problem(device, seed=1)
    expected_out, expected_corr, expected_kg = naive.verify(*cpu(p, VERIFY_ARGS),
                                                            lower_bound=lower_bound)
    out = kda_ops.verify(*(p[name] for name in VERIFY_ARGS), lower_bound=lower_bound)
    assert out.dtype == F64
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], tol=TIGHT, name="out")
    assert_rel_close(p["correction"].cpu(), expected_corr, tol=TIGHT, name="correction")
    assert torch.equal(p["key_gate"].cpu(), expected_kg)

    expected_state, expected_conv = naive.commit(
        p["accepted"].cpu(), p["state_indices"].cpu(), p["query_start_loc"].cpu(),
        state=p["state"].cpu(), conv_state=p["conv_state"].cpu(),
        correction=p["correction"].cpu(), key_gate=p["key_gate"].cpu(), A_log=p["A_log"].cpu(),
        dt_bias=p["dt_bias"].cpu(), lower_bound=lower_bound)
    kda_ops.commit(p["accepted"], p["state_indices"], p["query_start_loc"], state=p["state"],
                   conv_state=p["conv_state"], correction=p["correction"],
                   key_gate=p["key_gate"], A_log=p["A_log"], dt_bias=p["dt_bias"],
                   lower_bound=lower_bound)
    assert_rel_close(p["state"].cpu(), expected_state, tol=TIGHT, name="state")
    assert torch.equal(p["conv_state"].cpu(), expected_conv)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_update_in_float64(device):
    p = problem(device, seed=2)
    expected_out, expected_state = naive.conv_update(
        *cpu(p, ("x", "conv_state", "weight", "bias", "query_start_loc", "state_indices")))
    out = kda_ops.conv_update(p["x"], p["conv_state"], p["weight"], p["bias"],
                              p["query_start_loc"], p["state_indices"])
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], tol=TIGHT, name="out")
    assert torch.equal(p["conv_state"].cpu(), expected_state)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_verify_in_float64(device):
    p = problem(device, seed=3)
    names = ("x", "conv_state", "weight", "bias", "g", "beta", "A_log", "dt_bias", "state",
             "correction", "key_gate", "query_start_loc", "state_indices")
    expected_out, expected_conv, expected_corr, expected_kg = naive.conv_verify(
        *cpu(p, names), lower_bound=-5.0)
    out = kda_ops.conv_verify(*(p[name] for name in names), lower_bound=-5.0)
    assert out.dtype == F64
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], tol=TIGHT, name="out")
    assert torch.equal(p["conv_state"].cpu(), expected_conv)
    assert_rel_close(p["correction"].cpu(), expected_corr, tol=TIGHT, name="correction")
    assert_rel_close(p["key_gate"].cpu(), expected_kg, tol=TIGHT, name="key_gate")


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_schedule_in_float64(device):
    """Verify from pending records, a deferred commit and a flush, in float64."""
    R = 9
    p = problem(device, seed=3, records=R)
    pending = torch.tensor([0, 2, 5, 1, 0, 3, 4], dtype=torch.int32, device=device)
    window = dict(pending=pending, spec_len=T)
    expected_out, expected_corr, _ = naive.verify(*cpu(p, VERIFY_ARGS), pending=pending.cpu(),
                                                  spec_len=T)
    out = kda_ops.verify(*(p[name] for name in VERIFY_ARGS), **window)
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], tol=TIGHT, name="out")
    assert_rel_close(p["correction"].cpu(), expected_corr, tol=TIGHT, name="correction")

    caches = dict(state=p["state"], correction=p["correction"], key_gate=p["key_gate"],
                  A_log=p["A_log"], dt_bias=p["dt_bias"])
    expected_state, _, expected_pending = naive.commit(
        p["accepted"].cpu(), p["state_indices"].cpu(), p["query_start_loc"].cpu(),
        conv_state=None, pending=pending.cpu(), spec_len=T,
        **{name: t.cpu() for name, t in caches.items()})
    kda_ops.commit(p["accepted"], p["state_indices"], p["query_start_loc"], **caches,
                   pending=pending, spec_len=T)
    assert_rel_close(p["state"].cpu(), expected_state, tol=TIGHT, name="state after commit")
    assert torch.equal(pending.cpu(), expected_pending.to(pending.dtype))

    blocks = torch.arange(N, dtype=torch.int32, device=device)
    expected_state, expected_pending = naive.flush(
        blocks.cpu(), pending=pending.cpu(), **{name: t.cpu() for name, t in caches.items()})
    kda_ops.flush(blocks, pending=pending, **caches)
    assert_rel_close(p["state"].cpu(), expected_state, tol=TIGHT, name="state after flush")
    assert not pending.any()


@pytest.mark.parametrize("name, dtype", [("q", torch.float32), ("state", torch.float32),
                                         ("correction", torch.float32),
                                         ("beta", torch.float32)])
def test_verify_refuses_float64_mixed_with_other_dtypes(name, dtype):
    p = problem("cpu", seed=4)
    p[name] = p[name].to(dtype)
    origin = "q" if name == "state" else "state"
    with pytest.raises(ValueError, match=rf"`{name}` must have dtype .*float64.*`{origin}` is "
                                         rf"float64.*12-float64"):
        kda_ops.verify(*(p[n] for n in VERIFY_ARGS))


@pytest.mark.parametrize("name", ["conv_state", "key_gate"])
def test_commit_refuses_float64_state_with_other_dtypes(name):
    p = problem("cpu", seed=5)
    p[name] = p[name].float()
    with pytest.raises(ValueError, match=rf"`{name}` must have dtype .*float64"):
        kda_ops.commit(p["accepted"], p["state_indices"], p["query_start_loc"],
                       state=p["state"], conv_state=p["conv_state"],
                       correction=p["correction"], key_gate=p["key_gate"], A_log=p["A_log"],
                       dt_bias=p["dt_bias"])


@pytest.mark.parametrize("name", ["conv_state", "weight", "bias"])
def test_conv_update_refuses_float64_mixed_with_other_dtypes(name):
    p = problem("cpu", seed=6)
    p[name] = p[name].float()
    with pytest.raises(ValueError, match=rf"`{name}` must have dtype .*float64"):
        kda_ops.conv_update(p["x"], p["conv_state"], p["weight"], p["bias"],
                            p["query_start_loc"], p["state_indices"])
