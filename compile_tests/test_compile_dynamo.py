"""Dynamo: the decode step captures as one graph (fullgraph=True, no graph
breaks) whose kda_ops calls carry their written arguments, and batch and token
counts are dynamic (at most two compiles over batch sizes 1..64)."""

import contextlib

import expecttest
import pytest
import torch
from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

import kda_ops
from compile_helpers import (DEVICES, NOT_UNDER_INTERPRETER, assert_caches_close, assert_close,
                             clone_args, kda_call_targets, model_copy, op_problems,
                             render_kda_calls, run_batches_1_to_64, step_inputs, tiny_model,
                             TINY)

pytestmark = NOT_UNDER_INTERPRETER


def _capture(fn, *args, **kwargs):
    """Compiles `fn` fullgraph with a backend that keeps the Dynamo graphs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args, **kwargs)
    return out, graphs


class TestCapturedGraph(expecttest.TestCase):
    def test_decode_step_graph(self):
        """The whole step (2 layers of conv_verify, one commit) is one
        graph; each call names its caches (layer slices of the module buffers)
        and marks the written ones with `!`."""
        torch._dynamo.reset()
        model = tiny_model("cpu", conv_layout="token_first")
        _, graphs = _capture(model.decode_step, *step_inputs(model, [2, 3, 1]))
        self.assertEqual(len(graphs), 1)
        self.assertExpectedInline(render_kda_calls(graphs[0]), """\
kda_ops.conv_verify(x=float32[6, 96], conv_state!=self.conv_state.transpose(-1, -2)[0], conv_weight=self.conv_weight[0], conv_bias=self.conv_bias[0], g=float32[6, 2, 16], beta=float32[6, 2], A_log=self.A_log[0], dt_bias=self.dt_bias[0], state=self.state[0], correction!=self.correction[0], key_gate!=self.key_gate[0], query_start_loc=query_start_loc, state_indices=state_indices, activation='silu', lower_bound=-5.0, out!=float32[6, 2, 16])
kda_ops.conv_verify(x=float32[6, 96], conv_state!=self.conv_state.transpose(-1, -2)[1], conv_weight=self.conv_weight[1], conv_bias=self.conv_bias[1], g=float32[6, 2, 16], beta=float32[6, 2], A_log=self.A_log[1], dt_bias=self.dt_bias[1], state=self.state[1], correction!=self.correction[1], key_gate!=self.key_gate[1], query_start_loc=query_start_loc, state_indices=state_indices, activation='silu', lower_bound=-5.0, out!=float32[6, 2, 16])
kda_ops.commit(num_accepted_tokens=num_accepted_tokens, state_indices=state_indices, query_start_loc=query_start_loc, state!=self.state, conv_state!=self.conv_state.transpose(-1, -2), correction=self.correction, key_gate=self.key_gate, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=-5.0, spec_len=3)""")

    def test_caches_as_inputs_graph(self):
        """Caches passed in (KDACaches) instead of module buffers: the same
        calls, on the inputs."""
        torch._dynamo.reset()
        model = tiny_model("cpu", num_layers=1)
        caches = model.random_caches(3)
        hidden, qsl, si, accepted = step_inputs(model, [3, 1])
        _, graphs = _capture(model.decode_step, hidden, qsl, si, accepted, caches)
        self.assertEqual(len(graphs), 1)
        self.assertExpectedInline(render_kda_calls(graphs[0]), """\
kda_ops.conv_verify(x=float32[4, 96], conv_state!=caches_conv_state[0], conv_weight=self.conv_weight[0], conv_bias=self.conv_bias[0], g=float32[4, 2, 16], beta=float32[4, 2], A_log=self.A_log[0], dt_bias=self.dt_bias[0], state=caches_state[0], correction!=caches_correction[0], key_gate!=caches_key_gate[0], query_start_loc=query_start_loc, state_indices=state_indices, activation='silu', lower_bound=-5.0, out!=float32[4, 2, 16])
kda_ops.commit(num_accepted_tokens=num_accepted_tokens, state_indices=state_indices, query_start_loc=query_start_loc, state!=caches_state, conv_state!=caches_conv_state, correction=caches_correction, key_gate=caches_key_gate, A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=-5.0, spec_len=3)""")

    def test_plain_function_graph(self):
        """Ops called from a plain function on tensors: the public verify
        allocates `out` (empty_like) and the op writes into it; commit_plan
        returns new tensors and writes nothing."""
        torch._dynamo.reset()
        problem = op_problems("cpu")["verify"][1]
        names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "state", "correction",
                 "key_gate", "query_start_loc", "state_indices")

        def fn(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate, qsl, si):
            out = kda_ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                                 qsl, si, lower_bound=-5.0)
            lens, final, _, _ = kda_ops.commit_plan(si, si, qsl, spec_len=3)
            return out, lens + final

        _, graphs = _capture(fn, *(problem[name] for name in names))
        self.assertEqual(len(graphs), 1)
        self.assertExpectedInline(render_kda_calls(graphs[0]), """\
kda_ops.verify(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, state=state, correction!=correction, key_gate!=key_gate, query_start_loc=qsl, state_indices=si, lower_bound=-5.0, out!=empty_like(float32[9, 2, 16]))
kda_ops.commit_plan(num_accepted_tokens=si, state_indices=si, query_start_loc=qsl, spec_len=3)""")


@pytest.mark.parametrize("device", DEVICES)
def test_no_graph_breaks(device):
    model = tiny_model(device)
    inputs = step_inputs(model, [2, 3, 1])
    explanation = torch._dynamo.explain(model_copy(model).decode_step)(*inputs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()

    counter = CompileCounter()
    reference = model_copy(model)
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    out = compiled(*inputs)
    assert counter.frame_count == 1
    expected = reference.decode_step(*inputs)
    assert_close(out, expected, 1e-6, "out")
    assert_caches_close(model, reference, 1e-6)


def test_dynamic_batch_and_tokens_mark_dynamic_cpu():
    """Batch and token dims marked dynamic: at most two compiles over batch
    sizes 1..64 (batch 1 specialises, 0/1 specialisation; the next compile is
    dynamic). Backend aot_eager, so that guards added by the op bodies' fake
    implementations under AOTAutograd count too."""
    model = tiny_model("cpu", num_layers=1, num_blocks=72)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    run_batches_1_to_64(model, compiled, mark_dynamic=True)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


def test_deferred_step_compiles_alike_on_both_sides_of_the_eager_fold_cpu():
    """The deferred step over batch sizes 1..64, marked dynamic: the same two
    compiles at most, though commit folds eagerly below
    DEFERRED_EAGER_FOLD_BELOW_BATCH requests and not from it (the batch is
    compared as a tensor, not guarded), caches equal to eager."""
    from kda_ops.constants import DEFERRED_EAGER_FOLD_BELOW_BATCH

    assert 2 < DEFERRED_EAGER_FOLD_BELOW_BATCH < 64
    model = tiny_model("cpu", num_layers=1, num_blocks=72, record_len=TINY["spec_len"] + 4)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    run_batches_1_to_64(model, compiled, mark_dynamic=True)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


def test_dynamic_true_cpu():
    """`dynamic=True`: the same bound. With dynamic=True Dynamo also traces
    Python floats as symbols (specialize_float=False): the model's
    `lower_bound` would become a SymFloat, which a custom op's `float?`
    argument cannot take, and Dynamo restarts the analysis once (an extra
    backend call, same single graph). Specialising floats avoids that; the
    docs recommend mark_dynamic on the batch/token dims instead."""
    model = tiny_model("cpu", num_layers=1, num_blocks=72)
    counter = CompileCounterWithBackend("aot_eager")
    patch = (torch._dynamo.config.patch(specialize_float=True)
             if hasattr(torch._dynamo.config, "specialize_float") else contextlib.nullcontext())
    with patch:
        compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True,
                                 dynamic=True)
        run_batches_1_to_64(model, compiled, mark_dynamic=False)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


def test_dynamo_graph_lists_every_op():
    model = tiny_model("cpu")
    _, graphs = _capture(model.decode_step, *step_inputs(model, [1, 2]))
    assert kda_call_targets(graphs[0]) == [
        "kda_ops.conv_verify.default", "kda_ops.conv_verify.default", "kda_ops.commit.default"]


def _permuted_dense(t):
    """The same values in a dense layout whose first two dims are swapped in
    memory: `empty_like` keeps that layout, so an allocated `out` is strided."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_out_compiles_fullgraph(device):
    """A strided `out` (a column slice of a wider buffer, or allocated by the
    public function like a permuted `v` / `x`) compiles with no graph break
    and equals eager. Dynamo graph-breaks on any op given a non-contiguous
    `out=` keyword, so the public functions pass `out` by position."""
    problems = op_problems(device)
    verify_args = {n: a for n, a in problems["verify"][1].items() if n != "out"}
    conv_args = {n: a for n, a in problems["conv_update"][1].items() if n != "out"}

    def verify_into_slice(args):
        wide = torch.zeros(*args["v"].shape[:-1], 2 * args["v"].shape[-1], device=device)
        kda_ops.verify(**args, out=wide[..., 1::2])
        return wide

    def verify_permuted_v(args):
        return kda_ops.verify(**dict(args, v=_permuted_dense(args["v"])))

    def conv_into_slice_permuted_x(args):
        tokens, dim = args["x"].shape
        wide = torch.zeros(tokens, 2 * dim, device=device)
        kda_ops.conv_update(**dict(args, x=_permuted_dense(args["x"])), out=wide[:, dim:])
        return wide

    for fn, args in ((verify_into_slice, verify_args), (verify_permuted_v, verify_args),
                     (conv_into_slice_permuted_x, conv_args)):
        torch._dynamo.reset()
        eager_args, compiled_args = clone_args(args), clone_args(args)
        expected = fn(eager_args)
        out = torch.compile(fn, backend="aot_eager", fullgraph=True)(compiled_args)
        assert torch.equal(out, expected), fn.__name__
        for name, value in eager_args.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(compiled_args[name], value), f"{fn.__name__}: {name}"


@pytest.mark.parametrize("device", DEVICES)
def test_align_block_size_traced_as_symbol(device):
    """`dynamic=True` traces the int `block_size` as a symbol: commit_plan and
    commit in align mode take it, one graph serves block sizes 8 and 3, and
    both equal eager."""
    problems = op_problems(device)
    plan_args = problems["commit_plan_align"][1]
    commit_args = problems["commit_align_single_layer"][1]

    def step(plan_args, commit_args, block_size):
        plan = kda_ops.commit_plan(**dict(plan_args, block_size=block_size))
        kda_ops.commit(**dict(commit_args, block_size=block_size))
        return torch.stack(plan)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True, dynamic=True)
    for block_size in (8, 3):
        eager_commit, compiled_commit = clone_args(commit_args), clone_args(commit_args)
        expected = step(plan_args, eager_commit, block_size)
        assert torch.equal(compiled(plan_args, compiled_commit, block_size), expected)
        for name in ("state", "conv_state"):
            assert torch.equal(compiled_commit[name], eager_commit[name]), (block_size, name)
    assert counter.frame_count == 1, f"{counter.frame_count} compiles"
