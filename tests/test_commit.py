"""kda_ops.commit and kda_ops.commit_plan against the float64 oracle."""

import pytest
import torch

import kda_ops
from kda_ops import naive

from helpers import DEVICES, INTERPRET, TOLERANCE, assert_rel_close, guarded, outside, query_start_loc

LENS = (1, 2, 3, 4, 4, 4, 6, 3, 2, 4, 0, 4)
# Every accepted count 0..T and beyond, a count above its window, a negative one.
ACCEPTED = (1, 2, 3, 4, 0, 2, 5, 9, -1, 1, 3, 3)
# Valid blocks, the null block, a negative and an out-of-range index.
INDICES = (1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, -4)


def make_commit_problem(device, *, num_layers=2, stacked=True, H=2, K=16, V=8, T=4, N=12,
                        W=4, D=10, dtype=torch.bfloat16, state_dtype=torch.float32,
                        lens=LENS, accepted=ACCEPTED, indices=INDICES, with_conv=True,
                        flat_dt_bias=False, transposed_conv=False, decay_shift=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    lead = (num_layers,) if stacked else ()

    def buffer(shape, dt):
        # Guard bands along the block dim, which is dim 1 when stacked.
        if not stacked:
            return guarded(shape, dt, device, gen)
        full = torch.randn((shape[0], shape[1] + 4) + tuple(shape[2:]), generator=gen).to(dt).to(device)
        return full[:, 2:2 + shape[1]], full

    state, state_buf = buffer(lead + (N, H, V, K), state_dtype)
    correction, corr_buf = buffer(lead + (N, H, T, V), torch.float32)
    key_gate, _ = buffer(lead + (N, H, T, 2 * K), dtype)
    conv_state = conv_buf = None
    if with_conv:
        cols = W - 1 + T - 1
        if transposed_conv:
            conv_state, conv_buf = buffer(lead + (N, cols, D), dtype)
            conv_state = conv_state.transpose(-1, -2)
        else:
            conv_state, conv_buf = buffer(lead + (N, D, cols), dtype)
    A_log = (torch.randn(lead + (H,), generator=gen) * 0.5 + decay_shift).to(device)
    dt_bias = torch.randn(lead + ((H * K,) if flat_dt_bias else (H, K)), generator=gen).to(device)
    args = dict(
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32, device=device),
        state_indices=torch.tensor(indices, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc(lens, device),
        state=state, conv_state=conv_state, correction=correction, key_gate=key_gate,
        A_log=A_log, dt_bias=dt_bias)
    buffers = dict(state=state_buf, correction=corr_buf, conv_state=conv_buf)
    return args, buffers


def run_and_check(args, buffers, **kwargs):
    a = dict(args, **kwargs)
    pos = (a.pop("num_accepted_tokens"), a.pop("state_indices"), a.pop("query_start_loc"))
    expected_state, expected_conv = naive.commit(*pos, **a)
    state_before = args["state"].clone()
    buffers_before = {n: b.clone() for n, b in buffers.items() if b is not None}
    kda_ops.commit(*pos, **a)

    state = args["state"]
    # Blocks the oracle left alone keep their exact bits; folded blocks match.
    unchanged = (expected_state == state_before.double()).flatten(-3).all(-1)
    assert torch.equal(state.cpu()[unchanged.cpu()], state_before.cpu()[unchanged.cpu()])
    assert (~unchanged).any(), "the problem must fold something"
    assert_rel_close(state[~unchanged].float(), expected_state[~unchanged],
                     tol=TOLERANCE[state.dtype], name="state")
    if args["conv_state"] is not None:
        assert torch.equal(args["conv_state"].cpu(), expected_conv.cpu()), "conv history must be exact"
    for name, buf in buffers.items():
        if buf is None:
            continue
        view = args[name]
        block_dim = 1 if state.dim() == 5 else 0
        before = buffers_before[name]
        if block_dim == 1:
            assert torch.equal(buf[:, :2], before[:, :2]) and torch.equal(buf[:, -2:], before[:, -2:]), \
                f"{name} guard band written"
        else:
            view_base = view if name != "conv_state" or view.stride(-1) == 1 else view.transpose(-1, -2)
            assert torch.equal(outside(view_base, buf), outside(view_base, before)), \
                f"{name} guard band written"
    assert torch.equal(buffers["correction"], buffers_before["correction"]), "records are read-only"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_commit_matches_oracle(device, state_dtype, dtype):
    args, buffers = make_commit_problem(device, state_dtype=state_dtype, dtype=dtype, seed=1)
    run_and_check(args, buffers)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_commit_single_layer_and_gate(device, lower_bound):
    args, buffers = make_commit_problem(device, stacked=False, flat_dt_bias=True, seed=2)
    run_and_check(args, buffers, lower_bound=lower_bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("decay_shift", [0.0, 4.0])
def test_commit_long_window(device, lower_bound, decay_shift):
    """T = 8 with every accepted count 0..8 and beyond, several value tiles
    (V = 136: five tiles of 32 rows, the last one 8 rows), mild and extreme decay
    (cumulative decays underflow fp32)."""
    lens = (8, 8, 8, 8, 8, 8, 8, 8, 8, 5, 8)
    accepted = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12)
    args, buffers = make_commit_problem(device, T=8, K=32, V=136, N=12, lens=lens,
                                        accepted=accepted, indices=tuple(range(1, 12)),
                                        decay_shift=decay_shift, seed=11)
    run_and_check(args, buffers, lower_bound=lower_bound)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_in_the_softplus_tail(device):
    """Raw gates whose g + dt_bias lies near -8, with A near e^8: the fold's
    decays need an accurate float32 softplus (see test_verify)."""
    args, buffers = make_commit_problem(device, decay_shift=8.0, dtype=torch.float32, seed=14)
    K = args["state"].shape[-1]
    args["key_gate"][..., K:] *= 0.5
    args["dt_bias"] = args["dt_bias"] * 0.3 - 8.0
    run_and_check(args, buffers)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_layouts(device):
    """Transposed conv state, no conv state, three layers, odd head dims, W = 2."""
    args, buffers = make_commit_problem(device, transposed_conv=True, seed=3)
    run_and_check(args, buffers)
    args, buffers = make_commit_problem(device, with_conv=False, num_layers=3, K=12, V=10, seed=4)
    run_and_check(args, buffers)
    args, buffers = make_commit_problem(device, W=2, T=2, lens=(1, 2, 2), accepted=(1, 2, 1),
                                        indices=(3, 1, 2), seed=5)
    run_and_check(args, buffers)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_request_indices(device):
    """Accepted counts indexed through request_indices, including an out-of-range row."""
    args, buffers = make_commit_problem(device, seed=6)
    batch = args["state_indices"].shape[0]
    rows = torch.randperm(batch + 3, generator=torch.Generator().manual_seed(0))[:batch]
    rows[0] = batch + 7  # no such row: null plan
    accepted = torch.randint(0, 6, (batch + 3,), dtype=torch.int32).to(device)
    args["num_accepted_tokens"] = accepted
    run_and_check(args, buffers, request_indices=rows.to(torch.int32).to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_commit_plan_matches_oracle(device):
    args, _ = make_commit_problem(device, seed=7, with_conv=False)
    a = args
    got = kda_ops.commit_plan(a["num_accepted_tokens"], a["state_indices"], a["query_start_loc"],
                              spec_len=4)
    expected = naive.commit_plan(a["num_accepted_tokens"].cpu(), a["state_indices"].cpu(),
                                 a["query_start_loc"].cpu(), 4)
    assert [g.dtype for g in got] == [torch.int32] * 4
    assert [g.tolist() for g in got] == expected


@pytest.mark.parametrize("device", DEVICES)
def test_sequential_decoding_end_to_end(device):
    """Windows through verify and commit over many steps equal plain sequential
    decoding of the accepted tokens, for two layers with their own parameters."""
    gen = torch.Generator().manual_seed(11)
    L, H, K, V, T, N, B = 2, 2, 16, 8, 4, 6, 4
    blocks = [1, 3, 4, 5]
    state = torch.randn(L, N, H, V, K, generator=gen)
    reference = {(layer, b): state[layer, blocks[b]].double().clone()
                 for layer in range(L) for b in range(B)}
    state = state.to(device)
    correction = torch.randn(L, N, H, T, V, generator=gen).to(device)
    key_gate = torch.randn(L, N, H, T, 2 * K, generator=gen).to(device)
    A_log = (torch.randn(L, H, generator=gen) * 0.5).to(device)
    dt_bias = torch.randn(L, H, K, generator=gen).to(device)
    indices = torch.tensor(blocks, dtype=torch.int32, device=device)
    worst = 0.0
    for step in range(8):
        lens = torch.randint(1, T + 1, (B,), generator=gen)
        accepted = torch.minimum(torch.randint(0, T + 2, (B,), generator=gen), lens)
        starts = query_start_loc(lens.tolist(), device)
        n = int(lens.sum())
        for layer in range(L):
            q, k, g = (torch.randn(n, H, K, generator=gen) for _ in range(3))
            v, beta = torch.randn(n, H, V, generator=gen), torch.randn(n, H, generator=gen)
            out = kda_ops.verify(q.to(device), k.to(device), v.to(device), g.to(device),
                                 beta.to(device), A_log[layer], dt_bias[layer], state[layer],
                                 correction[layer], key_gate[layer], starts, indices,
                                 lower_bound=-5.0).cpu()
            for b in range(B):
                for t in range(int(accepted[b])):
                    tok = int(starts[b]) + t
                    for h in range(H):
                        S, _, o = naive.step(reference[layer, b][h], q[tok, h], k[tok, h],
                                             v[tok, h], g[tok, h], beta[tok, h],
                                             A_log[layer, h].cpu(), dt_bias[layer, h].cpu(),
                                             -5.0, K ** -0.5)
                        reference[layer, b][h] = S
                        worst = max(worst, (out[tok, h].double() - o).abs().max().item())
        kda_ops.commit(accepted.to(torch.int32).to(device), indices, starts, state=state,
                       conv_state=None, correction=correction, key_gate=key_gate, A_log=A_log,
                       dt_bias=dt_bias, lower_bound=-5.0)
    assert worst < 1e-4, f"accepted-token outputs differ from sequential decoding by {worst}"
    for (layer, b), S in reference.items():
        assert_rel_close(state[layer, blocks[b]], S.float(), name=f"state {layer},{b}")


@pytest.mark.parametrize("device", DEVICES)
def test_commit_layer_offsets_past_int32(device):
    """A stacked state whose last layer starts past 2**31 elements while each
    layer's stride stays below it (an int32 kernel argument): the layer
    offset must not wrap. About 8 GB of address space, of which the CPU runs
    touch only the blocks used."""
    L, H, K, V, T = 3, 1, 16, 16, 1
    N = (1 << 22) + 8  # H * V * K * N < 2**31 <= 2 * H * V * K * N
    state = torch.empty(L, N, H, V, K, dtype=torch.bfloat16, device=device)
    correction = torch.empty(L, N, H, T, V, device=device)
    key_gate = torch.empty(L, N, H, T, 2 * K, dtype=torch.bfloat16, device=device)
    assert state.stride(0) < 2**31 <= 2 * state.stride(0)
    blocks = [1, N - 1]
    gen = torch.Generator().manual_seed(21)
    for buffer in (state, correction, key_gate):
        for b in blocks:
            buffer[:, b] = torch.randn(buffer[:, b].shape, generator=gen).to(buffer.dtype)
    A_log, dt_bias = torch.randn(L, H, generator=gen) * 0.5, torch.randn(L, H, K, generator=gen)
    expected = {(layer, b): naive.fold(state[layer, b, 0].cpu(), correction[layer, b, 0].cpu(),
                                       key_gate[layer, b, 0].cpu(), A_log[layer, 0],
                                       dt_bias[layer, 0], -5.0, 1)
                for layer in range(L) for b in blocks}
    kda_ops.commit(torch.ones(2, dtype=torch.int32, device=device),
                   torch.tensor(blocks, dtype=torch.int32, device=device),
                   query_start_loc([1, 1], device), state=state, conv_state=None,
                   correction=correction, key_gate=key_gate, A_log=A_log.to(device),
                   dt_bias=dt_bias.to(device), lower_bound=-5.0)
    for (layer, b), folded in expected.items():
        assert_rel_close(state[layer, b, 0].cpu(), folded.to(torch.bfloat16),
                         name=f"layer {layer}, block {b}")


@pytest.mark.skipif(INTERPRET, reason="opcheck traces the op; the interpreter runs eagerly only")
@pytest.mark.parametrize("device", DEVICES)
def test_commit_opcheck(device):
    args, _ = make_commit_problem(device, seed=8)
    a = dict(args)
    pos = (a.pop("num_accepted_tokens"), a.pop("state_indices"), a.pop("query_start_loc"))
    # The last argument given, as kda_ops.commit gives it (see there).
    torch.library.opcheck(torch.ops.kda_ops.commit.default, pos,
                          dict(a, lower_bound=-5.0, spec_len=a["correction"].shape[-2]))
    torch.library.opcheck(torch.ops.kda_ops.commit_plan.default, pos + (4,))


BAD_COMMIT_INPUTS = [
    ("state ndim", lambda a: a.update(state=a["state"][0, 0]), "state"),
    ("state without keys", lambda a: a.update(state=a["state"][..., :0]), "state"),
    ("conv without channels", lambda a: a.update(conv_state=a["conv_state"][..., :0, :]),
     "conv_state"),
    ("state dtype", lambda a: a.update(state=a["state"].half()), "state"),
    ("state without blocks", lambda a: a.update(state=a["state"][:, :0]), "state"),
    ("state overlapping", lambda a: a.update(state=a["state"][:, :1].expand_as(a["state"])),
     "state"),
    ("correction layers", lambda a: a.update(correction=a["correction"][:1]), "correction"),
    ("correction dtype", lambda a: a.update(correction=a["correction"].bfloat16()), "correction"),
    ("key_gate T", lambda a: a.update(key_gate=a["key_gate"][:, :, :, :-1]), "key_gate"),
    ("key_gate K", lambda a: a.update(key_gate=a["key_gate"][..., :-1]), "key_gate"),
    ("A_log unstacked", lambda a: a.update(A_log=a["A_log"][0]), "A_log"),
    ("dt_bias", lambda a: a.update(dt_bias=a["dt_bias"][..., :-1]), "dt_bias"),
    ("conv too short", lambda a: a.update(conv_state=a["conv_state"][..., :2]), "conv_state"),
    ("conv blocks", lambda a: a.update(conv_state=a["conv_state"][:, :-1]), "conv_state"),
    ("conv sparse", lambda a: a.update(conv_state=a["conv_state"].to_sparse()), "conv_state"),
    ("accepted too short", lambda a: a.update(num_accepted_tokens=a["num_accepted_tokens"][:3]),
     "num_accepted_tokens"),
    ("accepted dtype", lambda a: a.update(num_accepted_tokens=a["num_accepted_tokens"].float()),
     "num_accepted_tokens"),
    ("query_start_loc", lambda a: a.update(query_start_loc=a["query_start_loc"][1:]),
     "query_start_loc"),
    ("request_indices", lambda a: a.update(request_indices=a["state_indices"][:-1]),
     "request_indices"),
    ("align missing block_size", lambda a: a.update(
        block_table=torch.ones(12, 4, dtype=torch.int32),
        num_computed_tokens=torch.zeros(12, dtype=torch.int32)), "block_size"),
    ("align missing table", lambda a: a.update(
        num_computed_tokens=torch.zeros(12, dtype=torch.int32), block_size=4), "block_table"),
    ("align table 1-D", lambda a: a.update(
        block_table=torch.ones(12, dtype=torch.int32),
        num_computed_tokens=torch.zeros(12, dtype=torch.int32), block_size=4), "block_table"),
    ("align computed rows", lambda a: a.update(
        block_table=torch.ones(12, 4, dtype=torch.int32),
        num_computed_tokens=torch.zeros(11, dtype=torch.int32), block_size=4),
     "num_computed_tokens"),
    ("align block_size 0", lambda a: a.update(
        block_table=torch.ones(12, 4, dtype=torch.int32),
        num_computed_tokens=torch.zeros(12, dtype=torch.int32), block_size=0), "block_size"),
    ("align block_size 4.0", lambda a: a.update(
        block_table=torch.ones(12, 4, dtype=torch.int32),
        num_computed_tokens=torch.zeros(12, dtype=torch.int32), block_size=4.0), "block_size"),
    ("align block_size True", lambda a: a.update(
        block_table=torch.ones(12, 4, dtype=torch.int32),
        num_computed_tokens=torch.zeros(12, dtype=torch.int32), block_size=True), "block_size"),
    ("lower_bound", lambda a: a.update(lower_bound=1.0), "lower_bound"),
    ("lower_bound type", lambda a: a.update(lower_bound="-5"), "lower_bound"),
]


@pytest.mark.parametrize("case,mutate,name", BAD_COMMIT_INPUTS, ids=[c[0] for c in BAD_COMMIT_INPUTS])
def test_commit_rejects_bad_input(case, mutate, name):
    args, buffers = make_commit_problem("cpu", seed=9)
    mutate(args)
    snapshot = {n: b.clone() for n, b in buffers.items()}
    a = dict(args)
    pos = (a.pop("num_accepted_tokens"), a.pop("state_indices"), a.pop("query_start_loc"))
    with pytest.raises(ValueError, match=f"`{name}`"):
        kda_ops.commit(*pos, **a)
    for n, b in buffers.items():
        assert torch.equal(b, snapshot[n]), f"{n} written before validation failed"


def test_commit_plan_rejects_bad_input():
    args, _ = make_commit_problem("cpu", seed=9)
    pos = (args["num_accepted_tokens"], args["state_indices"], args["query_start_loc"])
    align = dict(block_table=torch.ones(12, 4, dtype=torch.int32),
                 num_computed_tokens=torch.zeros(12, dtype=torch.int32))
    for bad in (0, 4.0, True):
        with pytest.raises(ValueError, match="`spec_len`"):
            kda_ops.commit_plan(*pos, spec_len=bad)
        with pytest.raises(ValueError, match="`block_size`"):
            kda_ops.commit_plan(*pos, spec_len=4, **align, block_size=bad)
    with pytest.raises(ValueError, match="`block_size`"):
        kda_ops.commit_plan(*pos, spec_len=4, **align)
