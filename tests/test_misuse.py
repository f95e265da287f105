"""Misuse is loud: overlapping written tensors, the opt-in value checks,
conventions (with the recipe for fla's conventions), dtype moves of the
reference model, backward through the ops, int64 indices in the plan, and the
hints in argument errors."""

import pytest
import torch

import kda_ops
from kda_ops import naive
from kda_ops.models import KDADecodeStep, make_step_inputs

from helpers import DEVICES, assert_rel_close, query_start_loc, requires_cuda
from test_commit import make_commit_problem
from test_conv_update import POSITIONAL as CONV_POSITIONAL
from test_conv_update import make_problem as make_conv_problem
from test_verify import call_verify, make_problem as make_verify_problem

H, K, V, T = 2, 16, 8, 4


def strided(base, shape, strides):
    return base.as_strided(shape, strides)


def snapshot(*tensors):
    return [t.clone() for t in tensors if t is not None]


def assert_unchanged(before, *tensors):
    for old, new in zip(before, (t for t in tensors if t is not None)):
        assert torch.equal(old, new), "a refused call wrote a buffer"


# --------------------------------------------------------------- overlapping
def overlapping_cases():
    """(op, argument, how the written tensor overlaps), each built on the
    problem's own shapes; none has a zero stride, so only a general check sees
    them."""
    return [
        ("verify", "out", "heads half a row apart"),
        ("verify", "correction", "blocks half a block apart"),
        ("verify", "key_gate", "tokens overlap the next token's keys"),
        ("commit", "state", "blocks half a block apart"),
        ("commit", "conv_state", "channel stride equals column stride"),
        ("conv_update", "conv_state", "channel stride equals column stride"),
        ("conv_update", "out", "tokens one channel apart"),
    ]


@pytest.mark.parametrize("op,name,how", overlapping_cases(),
                         ids=[f"{c[0]}-{c[1]}" for c in overlapping_cases()])
def test_written_tensor_that_overlaps_itself_is_refused(op, name, how):
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(1 << 16, generator=gen)
    if op == "verify":
        args, buffers = make_verify_problem("cpu", seed=20)
        num_tokens = args["v"].shape[0]
        N, T_ = args["correction"].shape[0], args["correction"].shape[2]
        bad = {"out": strided(base, (num_tokens, H, V), (V, V // 2, 1)),
               "correction": strided(base, (N, H, T_, V), (H * T_ * V // 2, T_ * V, V, 1)),
               "key_gate": strided(base, (N, H, T_, 2 * K), (H * T_ * 2 * K, T_ * 2 * K, K, 1))}
        out = bad["out"] if name == "out" else torch.empty_like(args["v"])
        args[name] = bad[name] if name != "out" else args[name] if name in args else None
        before = snapshot(base, *buffers.values())
        with pytest.raises(ValueError, match=f"`{name}` is written, so it must not overlap"):
            call_verify(args, out=out)
        assert_unchanged(before, base, *buffers.values())
    elif op == "commit":
        args, buffers = make_commit_problem("cpu", seed=21, stacked=False)
        N = args["state"].shape[0]
        cols = args["conv_state"].shape[-1]
        D = args["conv_state"].shape[-2]
        bad = {"state": strided(base, (N, H, V, K), (H * V * K // 2, V * K, K, 1)),
               "conv_state": strided(base, (N, D, cols), (D * cols, 1, 1)).to(
                   args["conv_state"].dtype).as_strided((N, D, cols), (D * cols, 1, 1))}
        args[name] = bad[name]
        before = snapshot(args["state"], args["conv_state"], *buffers.values())
        pos = [args.pop(n) for n in ("num_accepted_tokens", "state_indices", "query_start_loc")]
        with pytest.raises(ValueError, match=f"`{name}` is written, so it must not overlap"):
            kda_ops.commit(*pos, **args)
        assert_unchanged(before, args["state"], args["conv_state"], *buffers.values())
    else:
        args, conv_buffer = make_conv_problem("cpu", seed=22)
        N, D, cols = args["conv_state"].shape
        num_tokens = args["x"].shape[0]
        out = torch.empty_like(args["x"])
        if name == "conv_state":
            args["conv_state"] = strided(base, (N, D, cols), (D * cols, 1, 1))
        else:
            out = strided(base, (num_tokens, D), (1, 1))
        before = snapshot(base, conv_buffer)
        with pytest.raises(ValueError, match=f"`{name}` is written, so it must not overlap"):
            kda_ops.conv_update(*(args[n] for n in CONV_POSITIONAL), out=out)
        assert_unchanged(before, base, conv_buffer)


@pytest.mark.parametrize("device", DEVICES)
def test_permuted_layouts_that_do_not_overlap_are_accepted(device):
    """The general check accepts any permutation of a dense layout, and
    gapped strides: verify into a head-major `out` matches a dense one."""
    args, _ = make_verify_problem(device, seed=23, lens=(1, 3, 4, 2), indices=(1, 2, 3, 4))
    num_tokens = args["v"].shape[0]
    dense = call_verify(dict(args, correction=args["correction"].clone(),
                             key_gate=args["key_gate"].clone()))
    head_major = torch.empty(H, V + 3, num_tokens, device=device).permute(2, 0, 1)[:, :, :V]
    call_verify(args, out=head_major)
    starts = args["query_start_loc"].cpu()
    window = slice(int(starts[0]), int(starts[-1]))
    assert torch.equal(head_major[window], dense[window])


# --------------------------------------------------------------- value checks
def clean_verify_problem(device, seed=30):
    return make_verify_problem(device, seed=seed, lens=(1, 3, 4, 2, 0), indices=(1, 2, 0, 3, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_are_off_by_default_and_on_in_the_context(device, monkeypatch):
    monkeypatch.delenv("KDA_OPS_CHECK_VALUES", raising=False)
    args, _ = clean_verify_problem(device)
    args["query_start_loc"][-1] += 1000  # the last window runs past the tokens
    if device == "cpu":  # off: no check (on CUDA an unchecked read past q would be unsafe)
        call_verify(dict(args, query_start_loc=args["query_start_loc"].clone() * 0))
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match="`query_start_loc` row 4's window .* runs past"):
            call_verify(args)
        with kda_ops.value_checks(False):
            call_verify(dict(args, query_start_loc=args["query_start_loc"] * 0))
    monkeypatch.setenv("KDA_OPS_CHECK_VALUES", "1")
    with pytest.raises(ValueError, match="`query_start_loc` row 4's window"):
        call_verify(args)
    with kda_ops.value_checks(False):  # the context wins over the environment
        call_verify(dict(args, query_start_loc=args["query_start_loc"] * 0))


def verify_violations():
    def past_tokens(a):
        a["query_start_loc"][-1] = a["q"].shape[0] + 1

    def decreasing(a):
        a["query_start_loc"][2] = a["query_start_loc"][1] - 1

    def negative_start(a):
        a["query_start_loc"][0] = -1

    def longer_than_T(a):
        a["query_start_loc"][2:] += 2  # row 1's window: 3 + 2 tokens > T = 4

    def outside_cache(a):
        a["state_indices"][3] = a["state"].shape[0]

    def shared_block(a):
        a["state_indices"][3] = a["state_indices"][1]

    return [
        ("past the tokens", past_tokens, "query_start_loc", r"row 4's window \[\d+, \d+\) runs "
                                                            r"past the \d+ tokens of `q`"),
        ("decreasing", decreasing, "query_start_loc", "must not decrease: row 1's window"),
        ("negative start", negative_start, "query_start_loc", "must start at 0 or more"),
        ("longer than T", longer_than_T, "query_start_loc",
         "row 1's window holds 5 tokens, more than T = 4"),
        ("outside the cache", outside_cache, "state_indices", "row 3's block 7 is outside"),
        ("shared block", shared_block, "state_indices", "rows 1 and 3 share block 2"),
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case,mutate,name,message", verify_violations(),
                         ids=[c[0] for c in verify_violations()])
def test_value_checks_name_the_argument_and_row_in_verify(device, case, mutate, name, message):
    args, buffers = clean_verify_problem(device)
    with kda_ops.value_checks():
        call_verify(args)  # the clean problem passes every check
        mutate(args)
        before = snapshot(*buffers.values())
        with pytest.raises(ValueError, match=f"`{name}` {message}"):
            call_verify(args)
    assert_unchanged(before, *buffers.values())


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_catch_a_conv_state_too_narrow_for_the_windows(device):
    """A `[N, D, W-1]` conv state means T = 1; the checks catch the longer
    windows that conv_update would otherwise convolve only one token of."""
    args, conv_buffer = make_conv_problem(device, seed=31, lens=(1, 3, 2), indices=(1, 2, 3),
                                          T=1)
    assert args["conv_state"].shape[-1] == 3  # W - 1 = 3 columns
    before = snapshot(conv_buffer)
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match="`query_start_loc` row 1's window holds 3 tokens, "
                                             r"more than T = 1 \(from conv_state's W-1\+T-1 = 3 "
                                             "columns for W = 4\\)"):
            kda_ops.conv_update(*(args[n] for n in CONV_POSITIONAL))
    assert_unchanged(before, conv_buffer)
    args["query_start_loc"] = torch.arange(4, dtype=torch.int32, device=device)  # L = 1 each
    args["state_indices"][2] = 99
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match="`state_indices` row 2's block 99 is outside "
                                             "`conv_state`'s"):
            kda_ops.conv_update(*(args[n] for n in CONV_POSITIONAL))


def clean_commit_problem(device, seed=32, **kwargs):
    return make_commit_problem(device, seed=seed, lens=(1, 2, 3, 4, 0), accepted=(1, 2, 0, 4, 1),
                               indices=(1, 2, 3, 4, 0), **kwargs)


def split_commit(args):
    a = dict(args)
    return [a.pop(n) for n in ("num_accepted_tokens", "state_indices", "query_start_loc")], a


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_catch_accepted_counts_out_of_range(device):
    for count, row in ((3, 1), (-1, 0)):
        args, buffers = clean_commit_problem(device)
        with kda_ops.value_checks():
            pos, kw = split_commit(args)
            pos[0][row] = count
            before = snapshot(*(b for b in buffers.values() if b is not None))
            with pytest.raises(ValueError, match=rf"`num_accepted_tokens` \[{row}\] = {count} "
                                                 rf"\(row {row}\) must lie in \[0, {row + 1}\]"):
                kda_ops.commit(*pos, **kw)
            assert_unchanged(before, *(b for b in buffers.values() if b is not None))
            with pytest.raises(ValueError, match=rf"`num_accepted_tokens` \[{row}\] = {count}"):
                kda_ops.commit_plan(*pos, spec_len=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stacked", [True, False])
def test_value_checks_compare_the_gates_of_verify_and_commit(device, stacked):
    """Commit must fold with the gate parameters verify used; a layer whose
    records verify wrote with other parameters is refused."""
    model = KDADecodeStep(num_layers=2, lower_bound=-5.0, device=device,
                          cache_layout="stacked" if stacked else "per_layer")
    model.randomize_caches(1)
    hidden, qsl, indices, accepted = make_step_inputs(model, [2, 4, 3], seed=2)
    with kda_ops.value_checks():
        with torch.no_grad():
            model(hidden, qsl, indices)
            model.commit(accepted, indices, qsl)  # the model passes the same parameters
            model(hidden, qsl, indices)
        caches = model.buffers_as_caches()
        layer = 1
        state = caches.state if stacked else caches.state[layer]
        conv = model.conv_state_dim_first()
        conv = conv if stacked else conv[layer]
        correction = caches.correction if stacked else caches.correction[layer]
        key_gate = caches.key_gate if stacked else caches.key_gate[layer]
        A_log, dt_bias = ((model.A_log, model.dt_bias) if stacked
                          else (model.A_log[layer], model.dt_bias[layer]))
        common = dict(state=state, conv_state=conv, correction=correction, key_gate=key_gate)
        where = " for layer 1" if stacked else ""
        other_A_log, other_dt_bias = A_log.clone(), dt_bias.clone()
        other_A_log.view(-1)[-1] += 0.5  # stacked: layer 1 only
        other_dt_bias.view(-1)[-1] += 1.0
        before = snapshot(state)
        for changed, message in (
                (dict(A_log=other_A_log, dt_bias=dt_bias, lower_bound=-5.0),
                 f"`A_log` differs{where} from the A_log that verify used"),
                (dict(A_log=A_log, dt_bias=other_dt_bias, lower_bound=-5.0),
                 f"`dt_bias` differs{where} from the dt_bias that verify used"),
                (dict(A_log=A_log, dt_bias=dt_bias),
                 "`lower_bound` is None.*, but verify wrote these records with lower_bound=-5.0")):
            with pytest.raises(ValueError, match=message):
                kda_ops.commit(accepted, indices, qsl, **common, **changed)
            assert_unchanged(before, state)
        kda_ops.commit(accepted, indices, qsl, **common, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=-5.0)


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_catch_a_staged_count_out_of_range(device):
    indices = torch.tensor([3, 1, 2], dtype=torch.int32, device=device)
    qsl = query_start_loc([2, 1, 3], device)
    accepted = torch.tensor([1, 1, 2], dtype=torch.int32, device=device)
    staged = (torch.zeros(4, dtype=torch.int32, device=device),
              torch.zeros(5, dtype=torch.int32, device=device),
              torch.zeros(4, dtype=torch.int32, device=device))
    count = torch.tensor([4], device=device)
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`num_spec_decodes` holds 4, outside \[0, 3\]"):
            kda_ops.stage_spec_decode_metadata(indices, qsl, accepted, *staged, count)
        kda_ops.stage_spec_decode_metadata(indices, qsl, accepted, *staged, count - 1)


@requires_cuda
def test_value_checks_refuse_a_cuda_graph_capture():
    args, _ = clean_verify_problem("cuda")
    call_verify(args)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with kda_ops.value_checks(), pytest.raises(RuntimeError, match="CUDA graph capture"):
        with torch.cuda.graph(graph):
            call_verify(args)


def test_value_checks_are_eager_only():
    """torch.compile traces the public functions without the checks, so the
    compiled step holds none (no graph break, no host sync), while the same
    call made eagerly is checked."""
    model = KDADecodeStep(num_layers=2)
    model.randomize_caches(3)
    hidden, qsl, indices, accepted = make_step_inputs(model, [2, 4, 3], seed=4)
    indices[2] = indices[0]  # two live rows share a block
    compiled = torch.compile(model.decode_step, fullgraph=True)
    with kda_ops.value_checks(), torch.no_grad():
        compiled(hidden, qsl, indices, accepted)
        compiled(hidden, qsl, indices, accepted)  # the compiled graph runs no check either
        with pytest.raises(ValueError, match="`state_indices` rows 0 and 2 share block"):
            model.decode_step(hidden, qsl, indices, accepted)


# --------------------------------------------------------------- conventions
def test_recipe_from_fla_op_conventions():
    """fla's KDA ops default to a `[K, V]` state and a beta already passed
    through sigmoid. The recipe: `state.transpose(-1, -2)` and
    `torch.logit(beta)`; raw q, k (kda_ops normalises) and the raw gate with
    A_log and dt_bias. Checked against fla's own reference recurrence and gate."""
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    fla_gate = pytest.importorskip("fla.ops.kda.gate")
    gen = torch.Generator().manual_seed(40)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k, g = rand(T, H, K), rand(T, H, K), rand(T, H, K)
    v = rand(T, H, V)
    beta_sigmoided = torch.sigmoid(rand(T, H))
    A_log, dt_bias = rand(H) * 0.5, rand(H * K)
    state_kv = rand(1, H, K, V)  # fla: [batch, H, K, V]

    normalise = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    for lower_bound in (None, -5.0):
        fla_g = (fla_gate.naive_kda_gate(g, A_log, dt_bias) if lower_bound is None else
                 fla_gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound))
        expected_out, expected_state = fla_naive.naive_recurrent_kda(
            normalise(q)[None], normalise(k)[None], v[None], fla_g[None], beta_sigmoided[None],
            initial_state=state_kv.clone(), output_final_state=True)

        N = 3
        state = torch.zeros(N, H, V, K)
        state[1] = state_kv[0].transpose(-1, -2)  # recipe: [K, V] -> kda_ops' [V, K]
        correction = torch.zeros(N, H, T, V)
        key_gate = torch.zeros(N, H, T, 2 * K)
        qsl = torch.tensor([0, T], dtype=torch.int32)
        block = torch.tensor([1], dtype=torch.int32)
        out = kda_ops.verify(q, k, v, g, torch.logit(beta_sigmoided), A_log, dt_bias, state,
                             correction, key_gate, qsl, block, lower_bound=lower_bound)
        kda_ops.commit(torch.tensor([T], dtype=torch.int32), block, qsl, state=state,
                       correction=correction, key_gate=key_gate, A_log=A_log, dt_bias=dt_bias,
                       lower_bound=lower_bound)
        assert_rel_close(out, expected_out[0], tol=1e-5, name="out")
        assert_rel_close(state[1].transpose(-1, -2), expected_state[0], tol=1e-5, name="state")


def test_recipe_from_fla_ops_given_a_gated_g_and_normalised_q_k():
    """fla's KDA ops also default to a gate already computed
    (`use_gate_in_kernel=False`: g is the log decay) and to q, k already
    L2-normalised (`use_qk_l2norm_in_kernel=False`). The recipe: the raw gate
    `log(expm1(-g))` with A_log = 0 and dt_bias = 0 (then kda_ops' gate
    -softplus gives g back), and the normalised q, k as they are."""
    fla_naive = pytest.importorskip("fla.ops.kda.naive")
    fla_gate = pytest.importorskip("fla.ops.kda.gate")
    gen = torch.Generator().manual_seed(41)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    normalise = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    q, k = normalise(rand(T, H, K)), normalise(rand(T, H, K))
    v, beta = rand(T, H, V), torch.sigmoid(rand(T, H))
    gated = fla_gate.naive_kda_gate(rand(T, H, K), rand(H) * 0.5, rand(H * K))  # the log decay
    expected_out, _ = fla_naive.naive_recurrent_kda(q[None], k[None], v[None], gated[None],
                                                     beta[None], output_final_state=True)
    N = 2
    out = kda_ops.verify(q, k, v, torch.log(torch.expm1(-gated)), torch.logit(beta),
                         torch.zeros(H), torch.zeros(H, K), torch.zeros(N, H, V, K),
                         torch.zeros(N, H, T, V), torch.zeros(N, H, T, 2 * K),
                         torch.tensor([0, T], dtype=torch.int32),
                         torch.tensor([1], dtype=torch.int32))
    assert_rel_close(out, expected_out[0], tol=1e-5, name="out")
    # Passing fla's gated g as kda_ops' raw gate is a different recurrence.
    wrong = kda_ops.verify(q, k, v, gated, torch.logit(beta), torch.zeros(H), torch.zeros(H, K),
                           torch.zeros(N, H, V, K), torch.zeros(N, H, T, V),
                           torch.zeros(N, H, T, 2 * K), torch.tensor([0, T], dtype=torch.int32),
                           torch.tensor([1], dtype=torch.int32))
    assert (wrong - expected_out[0]).abs().max() > 1e-2


# --------------------------------------------------------------- dtype moves
@pytest.mark.parametrize("cache_layout", ["stacked", "per_layer"])
def test_model_to_dtype_keeps_the_checkpoint_and_record_dtypes(cache_layout):
    model = KDADecodeStep(num_layers=2, cache_layout=cache_layout)
    model.randomize_caches(5)
    caches = model.buffers_as_caches()
    states = [s.clone() for s in (caches.state if cache_layout == "per_layer"
                                  else (caches.state,))]
    model.to(torch.bfloat16)
    caches = model.buffers_as_caches()
    for layer in range(2):
        assert caches.state[layer].dtype == torch.float32
        assert caches.correction[layer].dtype == torch.float32
        assert caches.key_gate[layer].dtype == torch.bfloat16
        assert caches.conv_state[layer].dtype == torch.bfloat16
    kept = caches.state if cache_layout == "per_layer" else (caches.state,)
    assert all(torch.equal(a, b) for a, b in zip(kept, states)), "the checkpoint lost bits"
    assert model.conv_weight.dtype == torch.bfloat16 and model.dtype == torch.bfloat16
    with torch.no_grad():
        out = model.decode_step(*make_step_inputs(model, [2, 4], seed=6))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    built_bf16 = KDADecodeStep(num_layers=2, state_dtype=torch.bfloat16).to(torch.float32)
    assert built_bf16.buffers_as_caches().state[0].dtype == torch.bfloat16


# --------------------------------------------------------------- backward
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_backward_through_the_ops_raises_and_forward_works_with_grad(compiled):
    reference = KDADecodeStep(num_layers=2)
    reference.randomize_caches(7)
    model = KDADecodeStep(num_layers=2)
    model.randomize_caches(7)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    inputs = make_step_inputs(model, [2, 4, 3], seed=8)
    def prepare(step):
        return torch.compile(step, fullgraph=True) if compiled else step

    out = prepare(model.decode_step)(*inputs)  # no no_grad: parameters that require grad are fine
    with torch.no_grad():  # the same forward, compiled alike (Inductor may round otherwise)
        expected = prepare(reference.decode_step)(*inputs)
    assert out.requires_grad
    assert torch.equal(out.detach(), expected)
    assert torch.equal(model.state, reference.state)
    with pytest.raises(RuntimeError, match="kda_ops.conv_verify is inference-only"):
        out.sum().backward()


def test_backward_through_conv_update_raises():
    args, _ = make_conv_problem("cpu", seed=41, lens=(2, 1), indices=(1, 2))
    weight = args["weight"].clone().requires_grad_(True)
    out = kda_ops.conv_update(*(dict(args, weight=weight)[n] for n in CONV_POSITIONAL))
    with pytest.raises(RuntimeError, match="kda_ops.conv_update is inference-only"):
        out.sum().backward()


# --------------------------------------------------------------- int64 indices
@pytest.mark.parametrize("device", DEVICES)
def test_commit_plan_treats_indices_outside_int32_as_null(device):
    qsl = query_start_loc([4, 4, 4], device)
    accepted = torch.tensor([4, 2, 3], device=device)
    indices = torch.tensor([2**32 + 3, 5, -(2**32) + 6], device=device)
    plan = kda_ops.commit_plan(accepted, indices, qsl, spec_len=4)
    assert plan.commit_lens.tolist() == [0, 2, 0]
    assert plan.final_state_indices.tolist() == [0, 5, 0]
    expected = naive.commit_plan(accepted.cpu(), indices.cpu(), qsl.cpu(), 4)
    assert [column.tolist() for column in plan] == expected

    table = torch.tensor([[2**33 + 5, 7], [9, 2**31]], device=device)
    computed = torch.tensor([6, 3], device=device)
    plan = kda_ops.commit_plan(accepted[:2], torch.tensor([1, 1], device=device), qsl[:3],
                               spec_len=4, block_table=table, num_computed_tokens=computed,
                               block_size=8)
    # Row 0 folds tokens 6..9: final column 1 (block 7), boundary column 0 (2**33 + 5: null).
    # Row 1 folds tokens 3..4: final column 0 (block 9); row 1 never reaches 2**31's column.
    assert plan.final_state_indices.tolist() == [7, 9]
    assert plan.boundary_state_indices.tolist() == [0, 0]
    assert plan.commit_lens.tolist() == [4, 2]
    expected = naive.commit_plan(accepted[:2].cpu(), torch.tensor([1, 1]), qsl[:3].cpu(), 4,
                                 block_table=table.cpu(), num_computed_tokens=computed.cpu(),
                                 block_size=8)
    assert [column.tolist() for column in plan] == expected


# --------------------------------------------------------------- small ones
def test_swapped_metadata_gets_a_hint():
    args, _ = clean_verify_problem("cpu")
    swapped = dict(args, query_start_loc=args["state_indices"],
                   state_indices=args["query_start_loc"])
    with pytest.raises(ValueError, match="swapped with state_indices"):
        call_verify(swapped)
    commit_args, _ = clean_commit_problem("cpu")
    pos, kw = split_commit(commit_args)
    with pytest.raises(ValueError, match="swapped with state_indices"):
        kda_ops.commit(pos[0], pos[2], pos[1], **kw)


def test_commit_without_conv_state_and_a_named_plan():
    args, _ = clean_commit_problem("cpu", with_conv=False)
    pos, kw = split_commit(args)
    kw.pop("conv_state")
    kda_ops.commit(*pos, **kw)  # conv_state defaults to None
    plan = kda_ops.commit_plan(*pos, spec_len=4)
    assert isinstance(plan, kda_ops.CommitPlan)
    assert plan._fields == ("commit_lens", "final_state_indices", "boundary_state_indices",
                            "boundary_recovery_lens")
    assert plan.commit_lens.tolist() == [1, 2, 0, 4, 0]


def test_conv1d_weight_gets_a_hint():
    args, _ = make_conv_problem("cpu", seed=42)
    weight = torch.nn.Conv1d(12, 12, 4, groups=12).weight.detach()
    assert weight.shape == (12, 1, 4)
    with pytest.raises(ValueError, match=r"nn.Conv1d weight \[D, 1, W\]: pass weight.squeeze\(1\)"):
        kda_ops.conv_update(*(dict(args, weight=weight)[n] for n in CONV_POSITIONAL))


def test_a_converted_correction_gets_a_hint():
    """A model of one's own whose `.to(torch.bfloat16)` converted the records."""
    args, _ = clean_verify_problem("cpu")
    with pytest.raises(ValueError, match=r"`correction` must have dtype torch.float32, got "
                                         r"torch.bfloat16 \(a module.to\(dtype\) converts"):
        call_verify(dict(args, correction=args["correction"].bfloat16()))
    commit_args, _ = clean_commit_problem("cpu")
    pos, kw = split_commit(commit_args)
    with pytest.raises(ValueError, match=r"module.to\(dtype\) converts buffers"):
        kda_ops.commit(*pos, **dict(kw, correction=kw["correction"].bfloat16()))
