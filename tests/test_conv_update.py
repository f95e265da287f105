"""kda_ops.conv_update against the float64 oracle, and with commit over many steps."""

import pytest
import torch

import kda_ops
from kda_ops import naive

from helpers import (DEVICES, INTERPRET, assert_rel_close, guarded, outside, query_start_loc,
                     assert_out_required)

ACT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# With T = 3: every L in 1..T, L = 0 (block 2) and L > T (block 4); the null
# block, a negative index and one >= N (N = 7) among valid blocks.
LENS = (1, 2, 3, 5, 2, 0, 3, 1, 2)
INDICES = (1, 3, 0, 4, -1, 2, 7, 5, 6)
POSITIONAL = ("x", "conv_state", "weight", "bias", "query_start_loc", "state_indices")


def make_problem(device, *, D=12, W=4, T=3, N=7, dtype=torch.float32, weight_dtype=None,
                 lens=LENS, indices=INDICES, transposed=False, with_bias=True, prefix=2,
                 suffix=3, seed=0):
    """Tokens [0, prefix) and the last `suffix` lie outside every window. The conv
    state is a guarded view: dim-first `[N, D, W-1+T-1]`, or an engine's
    `[N, W-1+T-1, D]` transposed (channels contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    weight_dtype = weight_dtype or dtype
    starts = query_start_loc(lens, "cpu") + prefix
    num_tokens = int(starts[-1]) + suffix
    cols = W - 1 + T - 1
    if transposed:
        stored, conv_buffer = guarded((N, cols, D), dtype, device, gen)
        conv_state = stored.transpose(-1, -2)
    else:
        conv_state, conv_buffer = guarded((N, D, cols), dtype, device, gen)
    args = dict(
        x=torch.randn(num_tokens, D, generator=gen).to(dtype).to(device),
        conv_state=conv_state,
        weight=torch.randn(D, W, generator=gen).to(weight_dtype).to(device),
        bias=torch.randn(D, generator=gen).to(weight_dtype).to(device) if with_bias else None,
        query_start_loc=starts.to(device),
        state_indices=torch.tensor(indices, dtype=torch.int32, device=device))
    return args, conv_buffer


def stored_view(conv_state):
    """The first-dim slice of the guarded buffer that backs `conv_state`."""
    return conv_state if conv_state.stride(-1) == 1 else conv_state.transpose(-1, -2)


def check_against_oracle(args, conv_buffer, *, activation="silu", out_dtype=None):
    """Runs conv_update into a guarded, random `out` and checks outputs, the
    state, and that nothing outside the windows and the views was written."""
    x = args["x"]
    out, out_buffer = guarded(tuple(x.shape), out_dtype or x.dtype, x.device)
    out_before, out_buffer_before = out.clone(), out_buffer.clone()
    conv_buffer_before = conv_buffer.clone()
    expected_out, expected_state = naive.conv_update(
        *(args[n].cpu() if args[n] is not None else None for n in POSITIONAL),
        activation=activation, out=out_before.cpu())

    result = kda_ops.conv_update(*(args[n] for n in POSITIONAL), activation=activation, out=out)
    assert result is out

    assert torch.equal(args["conv_state"].cpu(), expected_state), "conv state must be exact"
    view = stored_view(args["conv_state"])
    assert torch.equal(outside(view, conv_buffer), outside(view, conv_buffer_before)), \
        "conv_state guard band written"
    assert torch.equal(outside(out, out_buffer), outside(out, out_buffer_before)), \
        "out guard band written"
    out = out.cpu()
    # Untouched tokens keep their bits, zeroed tokens are exactly zero.
    untouched = (expected_out == out_before.cpu().double()).all(-1)
    assert torch.equal(out[untouched], out_before.cpu()[untouched])
    zeroed = (expected_out == 0).all(-1)
    assert (out[zeroed] == 0).all(), "null rows and tokens past T must be zero"
    computed = ~untouched & ~zeroed
    assert computed.any(), "the problem must convolve something"
    assert_rel_close(out[computed], expected_out[computed], name="out")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ACT_DTYPES)
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("transposed", [False, True], ids=["dim_first", "transposed"])
@pytest.mark.parametrize("with_bias,activation", [(True, "silu"), (False, None)])
def test_conv_update_matches_oracle(device, dtype, W, transposed, with_bias, activation):
    args, conv_buffer = make_problem(device, W=W, dtype=dtype, transposed=transposed,
                                     with_bias=with_bias, seed=W)
    check_against_oracle(args, conv_buffer, activation=activation)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_bias,activation", [(True, None), (False, "silu")])
def test_conv_update_bias_and_activation(device, with_bias, activation):
    args, conv_buffer = make_problem(device, with_bias=with_bias, transposed=True, seed=5)
    check_against_oracle(args, conv_buffer, activation=activation)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("W", [2, 4])
def test_conv_update_plain_decode(device, W):
    """T = 1: the state holds just the W-1 history columns."""
    args, conv_buffer = make_problem(device, W=W, T=1, N=4, lens=(1, 1, 0, 2, 1),
                                     indices=(1, 0, 2, 3, 4), seed=6)
    check_against_oracle(args, conv_buffer)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_update_mixed_dtypes_and_strides(device):
    """bf16 tokens and state, fp32 weight and out; x a column slice of a fused
    projection, weight a transposed `[W, D]` buffer, a wide non-power-of-two D."""
    args, conv_buffer = make_problem(device, D=300, dtype=torch.bfloat16,
                                     weight_dtype=torch.float32, transposed=True, seed=7)
    x, weight = args["x"], args["weight"]
    fused = torch.randn(x.shape[0], x.shape[1] + 5, device=device).to(x.dtype)
    fused[:, 3:3 + x.shape[1]] = x
    args.update(x=fused[:, 3:3 + x.shape[1]], weight=weight.T.contiguous().T)
    check_against_oracle(args, conv_buffer, out_dtype=torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transposed", [False, True], ids=["dim_first", "transposed"])
def test_conv_update_several_channel_tiles(device, transposed):
    """D = 2100: several full channel tiles of the kernel and a partial one."""
    args, conv_buffer = make_problem(device, D=2100, dtype=torch.bfloat16,
                                     transposed=transposed, seed=17)
    check_against_oracle(args, conv_buffer)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_update_allocates_out(device):
    args, _ = make_problem(device, dtype=torch.bfloat16, seed=8)
    state_before = args["conv_state"].clone()
    given = torch.randn(args["x"].shape, device=device).to(torch.bfloat16)
    kda_ops.conv_update(*(args[n] for n in POSITIONAL), out=given)
    state_after = args["conv_state"].clone()
    args["conv_state"].copy_(state_before)
    allocated = kda_ops.conv_update(*(args[n] for n in POSITIONAL))
    assert allocated.dtype == args["x"].dtype and allocated.shape == args["x"].shape
    starts = args["query_start_loc"]
    in_windows = slice(int(starts[0]), int(starts[-1]))
    assert torch.equal(allocated[in_windows], given[in_windows])
    assert torch.equal(args["conv_state"], state_after)


@pytest.mark.parametrize("device", DEVICES)
def test_conv_update_empty_batch(device):
    args, conv_buffer = make_problem(device, lens=(), indices=(), prefix=0, suffix=2, seed=9)
    out_before = torch.randn(args["x"].shape, device=device)
    buffer_before = conv_buffer.clone()
    out = kda_ops.conv_update(*(args[n] for n in POSITIONAL), out=out_before.clone())
    assert torch.equal(out, out_before)
    assert torch.equal(conv_buffer, buffer_before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transposed", [False, True], ids=["dim_first", "transposed"])
def test_conv_update_then_commit_equals_plain_convolution(device, transposed):
    """Over many steps of windows with random accepted prefixes, conv_update
    followed by commit gives every accepted token the output of a plain causal
    convolution over the accepted tokens only."""
    gen = torch.Generator().manual_seed(12)
    D, W, T, N = 10, 4, 4, 6
    blocks = [1, 4, 0, 3]  # one null row rides along every step
    real = [b for b, block in enumerate(blocks) if block != 0]
    cols = W - 1 + T - 1
    stored = torch.randn((N, cols, D) if transposed else (N, D, cols), generator=gen)
    conv_state = (stored.transpose(-1, -2) if transposed else stored).to(device)
    weight, bias = torch.randn(D, W, generator=gen), torch.randn(D, generator=gen)
    history = {b: conv_state[blocks[b], :, :W - 1].cpu().clone() for b in real}
    accepted_tokens = {b: [] for b in real}
    # commit folds a recurrent state too; give it tiny dummy buffers.
    state = torch.randn(N, 1, 1, 1, generator=gen).to(device)
    correction = torch.randn(N, 1, T, 1, generator=gen).to(device)
    key_gate = torch.randn(N, 1, T, 2, generator=gen).to(device)
    A_log, dt_bias = torch.zeros(1, device=device), torch.zeros(1, 1, device=device)
    indices = torch.tensor(blocks, dtype=torch.int32, device=device)
    actual, expected = [], []
    for step in range(10):
        lens = torch.randint(1, T + 1, (len(blocks),), generator=gen)
        # The first window token is the last accepted one: at least 1 is accepted.
        accepted = torch.minimum(torch.randint(1, T + 1, (len(blocks),), generator=gen), lens)
        starts = query_start_loc(lens.tolist(), device)
        x = torch.randn(int(lens.sum()), D, generator=gen)
        out = kda_ops.conv_update(x.to(device), conv_state, weight.to(device), bias.to(device),
                                  starts, indices).cpu()
        kda_ops.commit(accepted.to(torch.int32).to(device), indices, starts, state=state,
                       conv_state=conv_state, correction=correction, key_gate=key_gate,
                       A_log=A_log, dt_bias=dt_bias)
        for b in real:
            bos, count = int(starts[b]), int(accepted[b])
            accepted_tokens[b].append(x[bos:bos + count])
            plain = naive.causal_conv(history[b], torch.cat(accepted_tokens[b]), weight, bias)
            actual.append(out[bos:bos + count])
            expected.append(plain[-count:])
    assert_rel_close(torch.cat(actual), torch.cat(expected), name="accepted outputs")
    for b in real:  # the committed history is the last W-1 accepted tokens, exactly
        tail = torch.cat([history[b].T, *accepted_tokens[b]])[-(W - 1):].T
        assert torch.equal(conv_state[blocks[b], :, :W - 1].cpu(), tail)


@pytest.mark.skipif(INTERPRET, reason="opcheck traces the op; the interpreter runs eagerly only")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transposed,with_bias,activation",
                         [(True, True, "silu"), (False, False, None)])
def test_conv_update_opcheck(device, transposed, with_bias, activation):
    args, _ = make_problem(device, transposed=transposed, with_bias=with_bias, seed=13)
    torch.library.opcheck(torch.ops.kda_ops.conv_update.default,
                          tuple(args[n] for n in POSITIONAL),
                          {"activation": activation, "out": torch.empty_like(args["x"])})


def channels_far_apart(x):
    """`x`'s shape with its channels 2**31 elements apart: a bf16 view of about
    5 GB of address space, none of it touched."""
    tokens, dim = x.shape
    return torch.empty(dim, 2**31 // (dim - 1) + tokens, dtype=torch.bfloat16)[:, :tokens].t()


BAD_CONV_INPUTS = [
    ("x ndim", lambda a: a.update(x=a["x"][None]), "x"),
    ("x without channels", lambda a: a.update(x=a["x"][:, :0]), "x"),
    ("x channels past int32", lambda a: a.update(x=channels_far_apart(a["x"])), "x"),
    ("x dtype", lambda a: a.update(x=a["x"].double()), "x"),
    ("conv_state dim", lambda a: a.update(conv_state=a["conv_state"][:, :-1]), "conv_state"),
    ("conv_state dtype", lambda a: a.update(conv_state=a["conv_state"].double()), "conv_state"),
    ("conv_state columns", lambda a: a.update(conv_state=a["conv_state"][..., :2]), "conv_state"),
    ("conv_state without blocks", lambda a: a.update(conv_state=a["conv_state"][:0]),
     "conv_state"),
    ("conv_state sparse", lambda a: a.update(conv_state=a["conv_state"].to_sparse()),
     "conv_state"),
    ("conv_state overlapping", lambda a: a.update(
        conv_state=a["conv_state"][:1].expand_as(a["conv_state"])), "conv_state"),
    ("conv_state device", lambda a: a.update(conv_state=a["conv_state"].to("meta")),
     "conv_state"),
    ("weight dim", lambda a: a.update(weight=a["weight"][:-1]), "weight"),
    ("weight width", lambda a: a.update(weight=a["weight"][:, :1]), "weight"),
    ("weight dtype", lambda a: a.update(weight=a["weight"].int()), "weight"),
    ("bias shape", lambda a: a.update(bias=a["bias"][:-1]), "bias"),
    ("bias dtype", lambda a: a.update(bias=a["bias"].double()), "bias"),
    ("query_start_loc length", lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]),
     "query_start_loc"),
    ("query_start_loc dtype", lambda a: a.update(query_start_loc=a["query_start_loc"].float()),
     "query_start_loc"),
    ("state_indices 2-D", lambda a: a.update(state_indices=a["state_indices"][:, None]),
     "state_indices"),
    ("state_indices dtype", lambda a: a.update(state_indices=a["state_indices"].short()),
     "state_indices"),
]


@pytest.mark.parametrize("case,mutate,name", BAD_CONV_INPUTS, ids=[c[0] for c in BAD_CONV_INPUTS])
def test_conv_update_rejects_bad_input(case, mutate, name):
    args, conv_buffer = make_problem("cpu", seed=14)
    mutate(args)
    buffer_before = conv_buffer.clone()
    out = torch.randn(args["x"].shape).to(args["x"].dtype)
    out_before = out.clone()
    with pytest.raises(ValueError, match=f"`{name}`"):
        kda_ops.conv_update(*(args[n] for n in POSITIONAL), out=out)
    assert torch.equal(conv_buffer, buffer_before), "conv_state written before validation failed"
    assert torch.equal(out, out_before), "out written before validation failed"


BAD_CONV_OPTIONS = [
    ("activation", lambda x: dict(activation="gelu"), "activation"),
    ("activation type", lambda x: dict(activation=1), "activation"),
    ("out shape", lambda x: dict(out=torch.empty(3, x.shape[1])), "out"),
    ("out dtype", lambda x: dict(out=torch.empty(x.shape, dtype=torch.int32)), "out"),
    ("out device", lambda x: dict(out=torch.empty(x.shape, device="meta")), "out"),
]


@pytest.mark.parametrize("case,options,name", BAD_CONV_OPTIONS,
                         ids=[c[0] for c in BAD_CONV_OPTIONS])
def test_conv_update_rejects_bad_options(case, options, name):
    args, conv_buffer = make_problem("cpu", seed=15)
    buffer_before = conv_buffer.clone()
    with pytest.raises(ValueError, match=f"`{name}`"):
        kda_ops.conv_update(*(args[n] for n in POSITIONAL), **options(args["x"]))
    assert torch.equal(conv_buffer, buffer_before)


def test_conv_update_op_requires_out():
    args, conv_buffer = make_problem("cpu", seed=16)
    buffer_before = conv_buffer.clone()
    assert_out_required(torch.ops.kda_ops.conv_update, lambda: torch.ops.kda_ops.conv_update(
        *(args[n] for n in POSITIONAL), "silu"))
    assert torch.equal(conv_buffer, buffer_before)
