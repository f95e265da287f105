"""kda_ops.verify against the float64 oracle."""

import pytest
import torch
import triton
import triton.language as tl

import kda_ops
from kda_ops import naive
from kda_ops.kernels.dispatch import kernel_choices, verify_config
from kda_ops.kernels.verify_tensor_cores import split_tf32

from helpers import (DEVICES, INTERPRET, assert_rel_close, guarded, outside, query_start_loc,
                     assert_out_required)

ACT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_problem(device, *, dtype=torch.float32, state_dtype=torch.float32, H=2, K=16, V=8,
                 T=4, N=7, lens=(1, 3, 4, 2, 0, 6, 2, 1), indices=(1, 2, 0, 3, 4, 5, -2, 9),
                 prefix=2, suffix=3, leading_one=False, flat_dt_bias=False, decay_shift=0.0,
                 seed=0, records=None):
    """A verify problem. Tokens [0, prefix) and the last `suffix` lie outside every
    window; `indices` mixes valid blocks, the null block, a negative and an
    out-of-range index; `lens` covers every L in 1..T, L = 0 and L > T.
    `decay_shift` is added to A_log (large: gates far below -1, products of
    decays that underflow fp32). `records`: positions of the records (default T)."""
    records = T if records is None else records
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    starts = query_start_loc(lens, "cpu") + prefix
    num_tokens = int(starts[-1]) + suffix
    lead = (1,) if leading_one else ()
    q, k, g = (rand(*lead, num_tokens, H, K).to(dtype).to(device) for _ in range(3))
    v = rand(*lead, num_tokens, H, V).to(dtype).to(device)
    beta = rand(*lead, num_tokens, H).to(dtype).to(device)
    A_log = (rand(H) * 0.5 + decay_shift).to(device)
    dt_bias = rand(H * K if flat_dt_bias else H, *(() if flat_dt_bias else (K,))).to(device)
    state, state_buf = guarded((N, H, V, K), state_dtype, device, gen)
    correction, corr_buf = guarded((N, H, records, V), torch.float32, device, gen)
    key_gate, kg_buf = guarded((N, H, records, 2 * K), dtype, device, gen)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, state=state,
                correction=correction, key_gate=key_gate,
                query_start_loc=starts.to(device),
                state_indices=torch.tensor(indices, dtype=torch.int32, device=device))
    buffers = dict(state=state_buf, correction=corr_buf, key_gate=kg_buf)
    return args, buffers


def call_verify(args, **kwargs):
    a = args
    return kda_ops.verify(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"],
                          a["state"], a["correction"], a["key_gate"], a["query_start_loc"],
                          a["state_indices"], **kwargs)


def check_against_oracle(args, buffers, out_before, **kwargs):
    before = {name: buf.clone() for name, buf in buffers.items()}
    corr_before = args["correction"].clone().cpu()
    expected_out, expected_corr, expected_kg = naive.verify(
        *(args[n].cpu() for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state",
                                  "correction", "key_gate", "query_start_loc", "state_indices")),
        out=None if out_before is None else out_before.cpu(),
        **{k: v for k, v in kwargs.items() if k != "out"})
    result = call_verify(args, **kwargs)
    assert result.shape == args["v"].shape
    out = result.reshape(expected_out.shape)

    assert torch.equal(buffers["state"], before["state"]), "verify modified the checkpoint"
    for name in ("correction", "key_gate"):
        view, buf = args[name], buffers[name]
        assert torch.equal(outside(view, buf), outside(view, before[name])), f"{name} guard written"
    written = ~torch.isnan(expected_out)
    out = out.cpu()
    assert not torch.isnan(out.double()[written]).any()
    assert_rel_close(out.cpu()[written], expected_out[written].to(out.dtype), name="out")
    if out_before is not None:  # tokens outside every window keep their bits
        out_before = out_before.cpu()
        untouched = ~(expected_out != out_before.double().reshape(expected_out.shape)).any(-1).any(-1)
        outside_tokens = torch.ones(expected_out.shape[0], dtype=torch.bool)
        starts = args["query_start_loc"].cpu()
        outside_tokens[int(starts[0]):int(starts[-1])] = False
        assert torch.equal(out[outside_tokens].cpu(),
                           out_before.reshape(expected_out.shape)[outside_tokens].cpu())
        assert untouched[outside_tokens].all()
    corr = args["correction"].cpu()
    recorded = expected_corr != corr_before.double()
    assert torch.equal(corr[~recorded], corr_before[~recorded])
    assert_rel_close(corr[recorded], expected_corr[recorded].float(), name="correction")
    assert torch.equal(args["key_gate"].cpu(), expected_kg.cpu()), "key/gate records must be exact"
    return result


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_verify_matches_oracle(device, dtype, state_dtype):
    args, buffers = make_problem(device, dtype=dtype, state_dtype=state_dtype, seed=1)
    out_before = torch.randn(args["v"].shape).to(dtype).to(device)
    check_against_oracle(args, buffers, out_before, out=out_before.clone())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("scale", [None, 0.37])
def test_verify_gate_and_scale(device, lower_bound, scale):
    args, buffers = make_problem(device, seed=2)
    check_against_oracle(args, buffers, None, lower_bound=lower_bound, scale=scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("decay_shift", [0.0, 4.0])
def test_verify_long_window(device, lower_bound, decay_shift):
    """T = 8 with every L in 0..10, several value tiles (V = 72), mild and
    extreme decay (exp(A_log) near 55: cumulative decays underflow)."""
    args, buffers = make_problem(device, T=8, K=32, V=72, N=12,
                                 lens=(8, 1, 2, 3, 4, 5, 6, 7, 0, 10, 8),
                                 indices=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0),
                                 decay_shift=decay_shift, seed=9)
    check_against_oracle(args, buffers, None, lower_bound=lower_bound)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_in_the_softplus_tail(device):
    """g + dt_bias near -8 (KDA initialises dt_bias from -7 to -2) with A near
    e^8: the gate is about A e^x, which a float32 log(1 + e^x) gets 3e-4 wrong
    (1e-4 of the outputs)."""
    args, buffers = make_problem(device, decay_shift=8.0, seed=13)
    args["dt_bias"] = args["dt_bias"] * 0.3 - 8.0
    args["g"] = (args["g"].float() * 0.5).to(args["g"].dtype)
    check_against_oracle(args, buffers, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("K", [64, 72])
def test_verify_key_chunks(device, K):
    """K above the kernel's 32-key chunk: two full chunks (K = 64), and K = 72,
    whose tile has a partial third chunk and an all-padding fourth one."""
    args, buffers = make_problem(device, K=K, V=40, seed=11)
    check_against_oracle(args, buffers, None, lower_bound=-5.0)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_two_tiles_per_program(device):
    """Enough (request, head) pairs that one program walks two V tiles: V = 72
    is three 32-row tiles, so the second program's second tile is all padding."""
    H, lens = 32, (1, 3, 4, 2, 0, 6, 2, 1)
    config = verify_config(16, 72, len(lens) * H, 4)
    assert (config.v_tiles, config.unroll_tokens) == (2, True), "the two-tile path is not taken"
    args, buffers = make_problem(device, H=H, K=16, V=72, lens=lens, seed=12)
    check_against_oracle(args, buffers, None, lower_bound=-5.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, heads, unrolled", [(8, 4, True), (12, 32, False), (12, 4, False)])
def test_verify_token_loop_forms(device, T, heads, unrolled):
    """The unrolled token loop (it also runs the tokens past a short window, and
    must neither read past the tokens nor store them) and the runtime loop,
    with one and two V tiles per program (with two, windows of up to four
    tokens run in closed form instead of an unrolled loop); windows of 0, 1, 2,
    3, T - 1, T and T + 2 tokens."""
    lens = (T, 1, 0, T + 2, 3, T - 1, 2, T)
    config = verify_config(16, 40, len(lens) * heads, T)
    assert (config.v_tiles, config.unroll_tokens, config.closed_form) == (
        2 if heads == 32 else 1, unrolled, False), "another kernel form is taken"
    args, buffers = make_problem(device, H=heads, K=16, V=40, T=T, N=len(lens) + 1, lens=lens,
                                 indices=tuple(range(1, len(lens) + 1)), seed=13 + T)
    check_against_oracle(args, buffers, None, lower_bound=-5.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("heads, lower_bound, decay_shift", [
    (4, -5.0, 0.0), (4, None, 4.0), (4, -100.0, 4.0), (32, -100.0, 4.0)])
def test_verify_closed_form(device, T, heads, lower_bound, decay_shift):
    """Windows of up to four tokens run in closed form, with one and two V
    tiles per program: the coupling must link every token to the earlier ones
    of its window and to no other (windows of 0 to T + 2 tokens; steep gates,
    with and without a lower bound, make some decay products underflow). The
    gate cases share the coupling code, so two tiles (about 6x the interpreter
    time) take the steepest one only."""
    lens = (T, 1, 0, T + 2, 3, max(T - 1, 1), 2, T)
    config = verify_config(16, 40, len(lens) * heads, T)
    assert (config.v_tiles, config.closed_form) == (2 if heads == 32 else 1, True), (
        "the closed form is not taken")
    args, buffers = make_problem(device, H=heads, K=16, V=40, T=T, N=len(lens) + 1, lens=lens,
                                 indices=tuple(range(1, len(lens) + 1)),
                                 decay_shift=decay_shift, seed=31 + T)
    check_against_oracle(args, buffers, None, lower_bound=lower_bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("T, heads, lower_bound, decay_shift, K, V", [
    (5, 4, -5.0, 0.0, 16, 40), (8, 4, None, 4.0, 16, 40), (8, 4, -100.0, 4.0, 72, 72),
    (6, 32, -5.0, 0.0, 16, 40)])
def test_verify_tensor_cores(device, T, heads, lower_bound, decay_shift, K, V):
    """Windows of five to eight tokens over enough (request, head) pairs run
    the closed form with its products on tensor cores, in one kernel: windows
    of 0 to T + 2 tokens, steep gates with and without a lower bound; K = 72
    leaves a partial and an all-padding key chunk, V = 72 a partial 128-row
    tile. Four heads take the form by choice (the interpreter is slow at 32
    heads, where the policy takes it)."""
    lens = (T, 1, 0, T + 2, 3, T - 1, 2, T)
    forced = {} if heads >= 32 else dict(verify_form="tensor_cores")
    with kernel_choices(**forced):
        config = verify_config(K, V, len(lens) * heads, T)
        assert (config.form, config.v_tiles) == ("tensor_cores", 1), (
            "the one-kernel tensor-core form is not taken")
        args, buffers = make_problem(device, H=heads, K=K, V=V, T=T, N=len(lens) + 1, lens=lens,
                                     indices=tuple(range(1, len(lens) + 1)),
                                     decay_shift=decay_shift, seed=41 + T)
        check_against_oracle(args, buffers, None, lower_bound=lower_bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("link_on_tensor_cores, cheap_split", [(False, False), (False, True),
                                                               (True, False), (True, True)])
@pytest.mark.parametrize("T, lower_bound, decay_shift, K, V", [
    (4, -5.0, 0.0, 16, 40), (5, None, 0.0, 16, 40), (8, None, 4.0, 16, 40),
    (8, -100.0, 4.0, 72, 72)])
def test_verify_separate_terms(device, T, lower_bound, decay_shift, K, V, link_on_tensor_cores,
                               cheap_split):
    """The tensor-core form in two kernels (the window terms, then the state
    products), four to eight tokens: windows of 0 to T + 2 tokens, steep gates
    with and without a lower bound (decay products that underflow); K = 72
    leaves a partial and an all-padding key chunk, V = 72 a partial 64-row tile
    and one of padding only; the null block, a negative and an out-of-range
    index. Four heads take the form by choice (the policy takes it from 768
    pairs); each case with the tokens linked token by token and on
    tensor cores, and with either 3xTF32 split (whose rounding matters only
    on a GPU: the interpreter computes TF32 products in fp32)."""
    lens = (T, 1, 0, T + 2, 3, T - 1, 2, T)
    with kernel_choices(verify_form="separate_terms", link_on_tensor_cores=link_on_tensor_cores,
                        cheap_tf32_split=cheap_split):
        config = verify_config(K, V, len(lens) * 4, T)
        assert (config.form, config.link_on_tensor_cores, config.cheap_tf32_split) == (
            "separate_terms", link_on_tensor_cores, cheap_split)
        args, buffers = make_problem(device, H=4, K=K, V=V, T=T, N=6, lens=lens,
                                     indices=(1, 2, 0, 3, -2, 4, 6, 5),
                                     decay_shift=decay_shift, seed=51 + T)
        check_against_oracle(args, buffers, None, lower_bound=lower_bound)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form, T, K, V, lower_bound, decay_shift", [
    ("closed_form", 3, 16, 8, -5.0, 0.0), ("closed_form", 4, 16, 40, None, 4.0),
    ("token_loop", 5, 16, 40, -5.0, 0.0), ("token_loop", 3, 72, 8, None, 4.0),
    ("tensor_cores", 6, 16, 40, -5.0, 0.0), ("tensor_cores", 8, 72, 72, None, 4.0),
    ("separate_terms", 2, 16, 8, -5.0, 0.0), ("separate_terms", 4, 16, 40, None, 0.0),
    ("separate_terms", 8, 72, 72, -100.0, 4.0)])
def test_verify_with_pending_records(device, form, T, K, V, lower_bound, decay_shift):
    """The deferred schedule's verify in every form: each window starts from
    its checkpoint folded with the block's pending records and is recorded
    after them. Records of R = 2T + 3 positions (one or two record chunks);
    counts of 0 (the kernels then skip the records' terms), 1, some, R - T,
    R - 1 (room for one token), R (no room), a negative and one past R;
    windows of 0 to T + 2 tokens (those past T get zero outputs), the null
    block, a negative and an out-of-range index."""
    R = 2 * T + 3
    lens = (T, 1, 0, T + 2, 3, T - 1, 2, T, 2, T, T)
    indices = (1, 2, 0, 3, -2, 4, 6, 5, 9, 7, 8)
    with kernel_choices(verify_form=form):
        args, buffers = make_problem(device, H=4, K=K, V=V, T=T, N=9, lens=lens, indices=indices,
                                     decay_shift=decay_shift, seed=61 + T + K, records=R)
        pending = torch.tensor([5, R - 1, 3, R - T, R, -3, R + 4, 0, 1], dtype=torch.int32)
        check_against_oracle(args, buffers, None, lower_bound=lower_bound,
                             pending=pending.to(device), spec_len=T)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form, T", [("closed_form", 4), ("token_loop", 5), ("tensor_cores", 6),
                                     ("separate_terms", 8)])
def test_verify_with_pending_records_never_reads_unrecorded_tokens(device, form, T):
    """Window tokens that are not recorded (past the records' room, past T, in
    null rows) may hold NaN: the recorded tokens of every window come out as
    the reference gives them, finite. Rooms of 1, 2, T and 0 tokens."""
    R = 2 * T + 3
    lens = (T, T, T + 2, T, 3)
    indices = (1, 2, 3, 0, 4)
    with kernel_choices(verify_form=form):
        args, buffers = make_problem(device, H=4, K=16, V=40, T=T, N=5, lens=lens,
                                     indices=indices, seed=71 + T, records=R)
        pending = torch.tensor([0, R - 1, R - 2, 3, R], dtype=torch.int32)
        starts = args["query_start_loc"].cpu().tolist()
        for b, block in enumerate(indices):
            room = R - int(pending[block]) if block > 0 else 0
            recorded = min(lens[b], T, room)
            for name in ("q", "k", "v", "g", "beta"):
                args[name][starts[b] + recorded:starts[b + 1]] = float("nan")
        check_against_oracle(args, buffers, None, pending=pending.to(device), spec_len=T)


def test_verify_tensor_cores_threshold():
    """The tensor-core forms by window length and (request, head) pairs: in one
    kernel at T = 5..8 from 256 pairs (below, four token-loop programs per head
    finish sooner), in two from 768 at T = 4..8 (below it the one-kernel forms
    are faster); never at T <= 3 or T >= 9, nor with a batch whose size is not
    known."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def form(pairs, T):
        config = verify_config(128, 128, pairs, T)
        return config.tensor_cores, config.separate_terms

    assert form(32 * 7, 8) == (False, False)
    assert form(32 * 8, 8) == (True, False)
    assert form(32 * 23, 5) == (True, False)
    assert form(32 * 24, 8) == (True, True)
    assert form(32 * 24, 5) == (True, True)
    assert form(32 * 23, 4) == (False, False)
    assert form(32 * 24, 4) == (True, True)
    assert form(32 * 256, 3) == (False, False)
    assert form(32 * 256, 2) == (False, False)
    assert form(32 * 256, 9) == (False, False)
    symbolic_batch = ShapeEnv().create_unbacked_symint()
    assert form(symbolic_batch * 32, 8) == (False, False)


def test_verify_tensor_cores_threshold_deferred():
    """With pending records the tensor-core forms start at fewer pairs: in two
    kernels from 128 pairs at T = 2..4 and from 512 at T = 5..8, in one from
    128 at T = 5..8; never at T = 1 or T >= 9, nor with a batch whose size is
    not known. The immediate schedule keeps its own thresholds."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    def form(pairs, T, deferred=True):
        return verify_config(128, 128, pairs, T, deferred).form

    assert form(32 * 3, 4) == "closed_form"
    assert form(32 * 4, 4) == "separate_terms"
    assert form(32 * 4, 4, deferred=False) == "closed_form"
    assert form(32 * 3, 2) == "closed_form"
    assert form(32 * 4, 2) == "separate_terms"
    assert form(32 * 4, 3) == "separate_terms"
    assert form(32 * 256, 1) == "closed_form"
    assert form(32 * 3, 8) == "token_loop"
    assert form(32 * 4, 8) == "tensor_cores"
    assert form(32 * 4, 8, deferred=False) == "token_loop"
    assert form(32 * 15, 5) == "tensor_cores"
    assert form(32 * 16, 5) == "separate_terms"
    assert form(32 * 16, 8, deferred=False) == "tensor_cores"
    assert form(32 * 256, 9) == "token_loop"
    assert verify_config(8, 128, 32 * 256, 4, True).form == "closed_form"
    symbolic_batch = ShapeEnv().create_unbacked_symint()
    assert form(symbolic_batch * 32, 4) == "closed_form"
    assert form(symbolic_batch * 32, 8) == "token_loop"


def test_verify_expects_pending_records_from_the_eager_fold_batch():
    """Below DEFERRED_EAGER_FOLD_BELOW_BATCH requests commit folds every
    commit by default, so verify takes the immediate forms there; a batch of
    unknown size keeps the deferred ones."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kda_ops.constants import DEFERRED_EAGER_FOLD_BELOW_BATCH as EAGER_BELOW
    from kda_ops.kernels.dispatch import expects_pending

    assert not expects_pending(True, EAGER_BELOW - 1)
    assert expects_pending(True, EAGER_BELOW)
    assert not expects_pending(False, 256)
    assert expects_pending(True, ShapeEnv().create_unbacked_symint())


@pytest.mark.parametrize("device", DEVICES)
def test_verify_layouts(device):
    """Leading dim of 1, flat dt_bias, non-power-of-two head dims, T = 1."""
    args, buffers = make_problem(device, leading_one=True, flat_dt_bias=True, K=12, V=10, seed=3)
    check_against_oracle(args, buffers, None)
    args, buffers = make_problem(device, T=1, lens=(1, 1, 0, 2), indices=(1, 0, 2, 3), seed=4)
    check_against_oracle(args, buffers, None)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_strided_tokens(device):
    """q/k/v/g as column slices of one fused projection (token stride != H*K)."""
    args, buffers = make_problem(device, seed=5)
    num_tokens, H, K = args["q"].shape
    V = args["v"].shape[-1]
    fused = torch.randn(num_tokens, H, 3 * K + V, device=device)
    args.update(q=fused[..., :K], k=fused[..., K:2 * K], g=fused[..., 2 * K:3 * K],
                v=fused[..., 3 * K:])
    check_against_oracle(args, buffers, None)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_strided_out(device):
    """`out` every other column of a wider buffer (the rest untouched), then a
    `v` that is dense but permuted, whose `empty_like` output is permuted too."""
    args, buffers = make_problem(device, seed=12)
    v = args["v"]
    wide = torch.randn(*v.shape[:-1], 2 * v.shape[-1]).to(v.dtype).to(device)
    wide_before = wide.clone()
    out = wide[..., 1::2]
    check_against_oracle(args, buffers, out.clone(), out=out)
    assert torch.equal(wide[..., 0::2], wide_before[..., 0::2])
    args["v"] = v.transpose(0, 1).contiguous().transpose(0, 1)
    check_against_oracle(args, buffers, None)


@pytest.mark.parametrize("device", DEVICES)
def test_verify_empty_batch(device):
    args, buffers = make_problem(device, lens=(), indices=(), prefix=0, suffix=2)
    out_before = torch.randn(args["v"].shape, device=device)
    out = call_verify(args, out=out_before.clone())
    assert torch.equal(out, out_before)


@pytest.mark.skipif(INTERPRET, reason="opcheck traces the op; the interpreter runs eagerly only")
@pytest.mark.parametrize("device", DEVICES)
def test_verify_opcheck(device):
    args, _ = make_problem(device, seed=6)
    a = args
    out = torch.empty_like(a["v"])
    torch.library.opcheck(
        torch.ops.kda_ops.verify.default,
        (a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"],
         a["correction"], a["key_gate"], a["query_start_loc"], a["state_indices"]),
        {"lower_bound": -5.0, "scale": 0.25, "out": out})


BAD_VERIFY_INPUTS = [
    ("q ndim", lambda a: a.update(q=a["q"][0]), "q"),
    ("q without keys", lambda a: a.update(q=a["q"][..., :0]), "q"),
    ("v without values", lambda a: a.update(v=a["v"][..., :0]), "v"),
    ("q leading", lambda a: a.update(q=a["q"][None].expand(2, -1, -1, -1)), "q"),
    ("k dtype", lambda a: a.update(k=a["k"].double()), "k"),
    ("g shape", lambda a: a.update(g=a["g"][:-1]), "g"),
    ("v tokens", lambda a: a.update(v=a["v"][:-1]), "v"),
    ("beta", lambda a: a.update(beta=a["beta"][:, :1]), "beta"),
    ("A_log", lambda a: a.update(A_log=a["A_log"][:1]), "A_log"),
    ("dt_bias", lambda a: a.update(dt_bias=a["dt_bias"][:, :-1]), "dt_bias"),
    ("state heads", lambda a: a.update(state=a["state"][:, :1]), "state"),
    ("state dtype", lambda a: a.update(state=a["state"].half()), "state"),
    ("state without blocks", lambda a: a.update(state=a["state"][:0]), "state"),
    ("correction dtype", lambda a: a.update(correction=a["correction"].double()), "correction"),
    ("correction blocks", lambda a: a.update(correction=a["correction"][:-1]), "correction"),
    ("correction overlapping", lambda a: a.update(
        correction=a["correction"][:1].expand_as(a["correction"])), "correction"),
    ("key_gate T", lambda a: a.update(key_gate=a["key_gate"][:, :, :-1]), "key_gate"),
    ("key_gate dtype", lambda a: a.update(key_gate=a["key_gate"].half()), "key_gate"),
    ("key_gate sparse", lambda a: a.update(key_gate=a["key_gate"].to_sparse()), "key_gate"),
    ("query_start_loc", lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]),
     "query_start_loc"),
    ("query_start_loc dtype", lambda a: a.update(query_start_loc=a["query_start_loc"].float()),
     "query_start_loc"),
    ("state_indices 2-D", lambda a: a.update(state_indices=a["state_indices"][:, None]),
     "state_indices"),
]


@pytest.mark.parametrize("case,mutate,name", BAD_VERIFY_INPUTS, ids=[c[0] for c in BAD_VERIFY_INPUTS])
def test_verify_rejects_bad_input(case, mutate, name):
    args, buffers = make_problem("cpu", seed=7)
    mutate(args)
    snapshot = {n: b.clone() for n, b in buffers.items()}
    out = torch.randn(args["v"].shape).to(args["v"].dtype)
    out_before = out.clone()
    with pytest.raises(ValueError, match=f"`{name}`"):
        call_verify(args, out=out)
    for n, b in buffers.items():
        assert torch.equal(b, snapshot[n]), f"{n} written before validation failed"
    assert torch.equal(out, out_before)


@pytest.mark.parametrize("kwargs,name", [
    (dict(out=torch.empty(3, 2, 8)), "out"),
    (dict(lower_bound=2.0), "lower_bound"),
    (dict(lower_bound=float("-inf")), "lower_bound"),
    (dict(lower_bound="-5"), "lower_bound"),
    (dict(scale="0.5"), "scale"),
    (dict(scale=True), "scale"),
])
def test_verify_rejects_bad_options(kwargs, name):
    args, buffers = make_problem("cpu", seed=8)
    snapshot = {n: b.clone() for n, b in buffers.items()}
    with pytest.raises(ValueError, match=f"`{name}`"):
        call_verify(args, **kwargs)
    for n, b in buffers.items():
        assert torch.equal(b, snapshot[n])


def test_verify_op_requires_out():
    args, _ = make_problem("cpu", seed=9)
    a = args
    assert_out_required(torch.ops.kda_ops.verify, lambda: torch.ops.kda_ops.verify(
        a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"],
        a["correction"], a["key_gate"], a["query_start_loc"], a["state_indices"], None, None))


def test_verify_rejects_mixed_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU to mix devices")
    args, _ = make_problem("cpu", seed=10)
    args["state_indices"] = args["state_indices"].cuda()
    with pytest.raises(ValueError, match="`state_indices`"):
        call_verify(args)


@triton.jit
def _split_kernel(x_ptr, hi_ptr, lo_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    hi, lo = split_tf32(tl.load(x_ptr + offs))
    tl.store(hi_ptr + offs, hi)
    tl.store(lo_ptr + offs, lo)


@pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()),
                    reason="runs a Triton kernel: the interpreter or a GPU")
def test_split_tf32_parts():
    """verify_tensor_cores.split_tf32 (CHEAP_TF32_SPLIT): hi keeps TF32's 10
    mantissa bits, rounded to nearest (half away from zero), and hi + lo is x
    exactly, so lo holds what the tensor cores would drop from x; infinities
    stay infinite."""
    device = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1024, generator=gen) * torch.exp(torch.randn(1024, generator=gen) * 10)
    x[:4] = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    x = x.to(device)
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    _split_kernel[(1,)](x, hi, lo, N=1024)
    hi, lo, x = hi.cpu(), lo.cpu(), x.cpu()
    assert torch.equal(hi[:4], x[:4]) and torch.equal(lo[2:4], x[2:4])
    x, hi, lo = x[4:], hi[4:], lo[4:]
    assert (hi.view(torch.int32) & 0x1FFF == 0).all(), "hi has more than 10 mantissa bits"
    assert torch.equal(hi + lo, x), "hi + lo is not x"
    # Nearest: the dropped part is at most half a TF32 unit of x.
    half_unit = torch.ldexp(torch.ones_like(x), torch.frexp(x.abs()).exponent - 12)
    assert (lo.abs() <= half_unit).all(), "hi is not x rounded to nearest"
