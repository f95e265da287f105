"""torch.export: the decode step exports with dynamic batch and token dims,
keeps its torch.ops.kda_ops.* nodes (with their mutated buffers or inputs),
survives torch.export.save/load, and the loaded program equals eager."""

import pytest
import torch
from torch.export import Dim

from compile_helpers import (DEVICES, NOT_UNDER_INTERPRETER, StepWithBuffers, StepWithCacheInputs,
                             assert_close, model_copy, step_inputs, tiny_model)
from kda_ops.models import KDACaches

pytestmark = NOT_UNDER_INTERPRETER


def dynamic_shapes(with_caches):
    batch = Dim("batch", min=1, max=64)
    tokens = Dim("tokens", min=1, max=64 * 3)
    spec = ({0: tokens}, {0: batch + 1}, {0: batch}, {0: batch})
    return spec + (None,) * 4 if with_caches else spec


def export_step(model, with_caches):
    inputs = step_inputs(model, [2, 3, 1], seed=100)
    module = (StepWithCacheInputs if with_caches else StepWithBuffers)(model)
    args = inputs + (tuple(model.random_caches(7)) if with_caches else ())
    return torch.export.export(module, args, dynamic_shapes=dynamic_shapes(with_caches),
                               strict=False)


def kda_nodes(ep):
    return [str(n.target) for n in ep.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("kda_ops.")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_caches", [False, True], ids=["buffers", "cache_inputs"])
def test_export_save_load_matches_eager(device, with_caches, tmp_path):
    model = tiny_model(device, conv_layout="token_first", num_blocks=40)
    eager = model_copy(model)
    ep = export_step(model_copy(model), with_caches)
    assert kda_nodes(ep) == ["kda_ops.conv_verify.default"] * 2 + ["kda_ops.commit.default"]

    path = tmp_path / "step.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    assert kda_nodes(loaded) == kda_nodes(ep)
    program = loaded.module()

    if with_caches:
        caches = model.random_caches(11)
        reference_caches = KDACaches(*(t.clone() for t in caches))
    else:
        # Start the loaded program's buffers from the same random caches as eager.
        buffers = dict(program.named_buffers())
        for name, value in eager.buffers_as_caches()._asdict().items():
            buffers[f"model.{name}"].copy_(value)
    for step, lens in enumerate(([1], [3, 1, 2, 2], [2, 3, 1], [3] * 33)):
        inputs = step_inputs(eager, lens, seed=step)
        if with_caches:
            out = program(*inputs, *caches)
            expected = eager.decode_step(*inputs, reference_caches)
            got, want = caches, reference_caches
        else:
            out = program(*inputs)
            expected = eager.decode_step(*inputs)
            buffers = dict(program.named_buffers())
            got = KDACaches(*(buffers[f"model.{n}"] for n in KDACaches._fields))
            want = eager.buffers_as_caches()
        assert_close(out, expected, 1e-5, f"out {lens}")
        for name, a, b in zip(KDACaches._fields, got, want):
            assert_close(a, b, 1e-5, f"{name} after {lens}")


@pytest.mark.parametrize("device", DEVICES)
def test_export_deferred_step_matches_eager(device, tmp_path):
    """The deferred schedule exports with its pending counts as a mutated
    buffer, and the saved and loaded program equals eager."""
    model = tiny_model(device, num_blocks=40, record_len=7)
    eager = model_copy(model)
    ep = export_step(model_copy(model), with_caches=False)
    torch.export.save(ep, tmp_path / "deferred.pt2")
    program = torch.export.load(tmp_path / "deferred.pt2").module()
    buffers = dict(program.named_buffers())
    for name, value in eager.buffers_as_caches()._asdict().items():
        buffers[f"model.{name}"].copy_(value)
    for step, lens in enumerate(([1], [3, 1, 2, 2], [2, 3, 1], [3] * 33)):
        inputs = step_inputs(eager, lens, seed=step)
        assert_close(program(*inputs), eager.decode_step(*inputs), 1e-5, f"out {lens}")
        buffers = dict(program.named_buffers())
        for name, want in eager.buffers_as_caches()._asdict().items():
            assert_close(buffers[f"model.{name}"], want, 1e-5, f"{name} after {lens}")
