"""The reference model's API (kda_ops.models), which the compile tests, the
benchmark and users build on: its paths agree with each other eagerly, and the
benchmark variant (no projections) also captures as one graph."""

import torch
from torch._dynamo.testing import CompileCounter

from compile_helpers import (NOT_UNDER_INTERPRETER, assert_caches_close, assert_close, model_copy,
                             step_inputs, tiny_model)
from kda_ops.bench import Shape
from kda_ops.models import KDACaches, KDADecodeStep

pytestmark = NOT_UNDER_INTERPRETER


def test_step_paths_agree():
    """forward + commit == decode_step; caches passed in == buffers; the
    token-first conv layout == dim-first; none of it is the identity."""
    model = tiny_model("cpu")
    inputs = step_inputs(model, [2, 3, 1])
    split = model_copy(model)
    before = model.state.clone()
    out = model.decode_step(*inputs)
    assert not torch.equal(model.state, before), "commit must fold something"
    out_split = split(*inputs[:3])
    split.commit(inputs[3], inputs[2], inputs[1])
    assert torch.equal(out, out_split)
    assert_caches_close(model, split, 0.0)

    fresh = tiny_model("cpu")
    caches = KDACaches(*(t.clone() for t in fresh.buffers_as_caches()))
    out_inputs = fresh.decode_step(*inputs, caches)
    assert torch.equal(out_inputs, out)
    assert_caches_close(model, fresh, 0.0, caches_b=caches)

    token_first = tiny_model("cpu", conv_layout="token_first")
    token_first.conv_state.copy_(fresh.conv_state.transpose(-1, -2))
    out_tf = token_first.decode_step(*inputs)
    assert_close(out_tf, out, 1e-6, "token-first out")
    assert torch.equal(token_first.conv_state_dim_first(), model.conv_state)


def test_benchmark_variant():
    shape = Shape(batch=3, spec_len=3, layers=2, heads=2, key_dim=16, value_dim=8,
                  conv_width=4, act_dtype=torch.float32)
    model = KDADecodeStep.for_benchmark(shape, "cpu")
    assert not model.projections and model.conv_layout == "token_first"
    assert model.state.abs().sum() > 0, "benchmark caches must be random"
    inputs = model.example_inputs(shape.batch)
    assert inputs[0].shape == (shape.batch * shape.spec_len, model.hidden_size)
    reference = model_copy(model)
    counter = CompileCounter()
    out = torch.compile(model.step, backend=counter, fullgraph=True)(*inputs)
    assert counter.frame_count == 1
    assert out.shape == (shape.batch * shape.spec_len, shape.heads * shape.value_dim)
    assert_close(out, reference.step(*inputs), 1e-6, "out")
    assert_caches_close(model, reference, 1e-6)
