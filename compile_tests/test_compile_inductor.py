"""Inductor: the decode step compiles fullgraph and equals eager (CPU through
the PyTorch path of the op bodies, CUDA through the Triton kernels); on CUDA
the kernels appear in Inductor's output code; and for every op the arguments
that torch's Triton analysis finds written are exactly the op's declared
mutations (an argument missed here would make torch.compile drop or reorder
the write; an extra one copies inputs and blocks CUDA graphs)."""

import contextlib
import importlib
import logging
import pkgutil

import pytest
import torch
import triton
from torch._dynamo.testing import CompileCounterWithBackend

import kda_ops.kernels

from compile_helpers import (DEVICES, LAYER_COUNTS, NOT_UNDER_INTERPRETER,
                             assert_caches_close, assert_close, clone_args,
                             declared_mutations, kernel_writes, model_copy, op_problems,
                             requires_cuda, run_batches_1_to_64, stand_in_cuda_target,
                             step_inputs, tiny_model)

pytestmark = NOT_UNDER_INTERPRETER

KERNELS = ("_conv_update_kernel", "_verify_kernel", "_commit_state_kernel", "_commit_conv_kernel")


def test_inductor_matches_eager_cpu():
    """One dynamic compile serves every batch >= 2 (CPU Inductor compiles are
    slow on CI's two cores, so batch 1, which specialises, is left to the
    aot_eager test in test_compile_dynamo)."""
    model = tiny_model("cpu", conv_layout="token_first", num_blocks=20)
    reference = model_copy(model)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    for i, lens in enumerate(([2, 3, 1], [3, 3], [1, 2, 3, 1, 2], [3] * 19)):
        inputs = step_inputs(model, lens, seed=i)
        for t in inputs:
            torch._dynamo.mark_dynamic(t, 0)
        out = compiled(*inputs)
        expected = reference.decode_step(*inputs)
        assert_close(out, expected, 1e-5, f"out {lens}")
        assert_caches_close(model, reference, 1e-5)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


def test_inductor_metadata_ops_cpu():
    """commit_plan, aligned_state_indices and staging compile with Inductor too."""
    problems = op_problems("cpu")
    plan = problems["commit_plan_align"][1]
    aligned = problems["aligned_state_indices"][1]
    stage = problems["stage_spec_decode_metadata_tensor_count"][1]

    def fn(plan, aligned, stage):
        columns = torch.ops.kda_ops.commit_plan(**plan)
        slots = torch.ops.kda_ops.aligned_state_indices(**aligned)
        torch.ops.kda_ops.stage_spec_decode_metadata_tensor_count(**stage)
        return torch.stack(columns), slots * 2

    stage_eager = clone_args(stage)
    expected = fn(plan, aligned, stage_eager)
    out = torch.compile(fn, backend="inductor", fullgraph=True)(plan, aligned, stage)
    for a, b in zip(out, expected):
        assert torch.equal(a, b)
    for name in ("staged_state_indices", "staged_query_start_loc", "staged_num_accepted_tokens"):
        assert torch.equal(stage[name], stage_eager[name]), name


@requires_cuda
@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inductor_matches_eager_cuda(dtype, num_layers):
    """One layer: no cache slice at a non-zero offset (see the mark)."""
    model = tiny_model("cuda", conv_layout="token_first", dtype=dtype, num_blocks=20,
                       num_layers=num_layers)
    reference = model_copy(model)
    compiled = torch.compile(model.decode_step, backend="inductor", fullgraph=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, lens in enumerate(([2, 3, 1], [3, 1, 3, 3], [1] * 7)):
        inputs = step_inputs(model, lens, seed=i)
        out = compiled(*inputs)
        expected = reference.decode_step(*inputs)
        assert_close(out, expected, tol, f"out {lens}")
        assert_caches_close(model, reference, tol)


@requires_cuda
def test_dynamic_batch_across_verify_tile_grouping_cuda():
    """V = 64 and 8 heads: batch x heads crosses verify's two-tile threshold
    (256) at batch 32, inside 1..64. A symbolic batch must not guard on it:
    still at most two compiles."""
    model = tiny_model("cuda", num_blocks=72, num_layers=1, num_heads=8, head_dim=64)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    run_batches_1_to_64(model, compiled, mark_dynamic=True, check_every=7)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


@requires_cuda
@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
def test_dynamic_batch_and_tokens_cuda(num_layers):
    """Batch sizes 1..64 through Inductor on CUDA: at most two compiles."""
    model = tiny_model("cuda", num_blocks=72, num_layers=num_layers)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    run_batches_1_to_64(model, compiled, mark_dynamic=True, check_every=7)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


@requires_cuda
def test_triton_kernels_in_inductor_output_cuda():
    from torch._inductor.utils import run_and_get_code

    model = tiny_model("cuda")
    inputs = step_inputs(model, [2, 3, 1])
    compiled = torch.compile(model.decode_step, backend="inductor", fullgraph=True)
    _, codes = run_and_get_code(compiled, *inputs)
    code = "\n".join(codes)
    missing = [name for name in KERNELS if name not in code]
    assert not missing, f"kernels missing from Inductor's output code: {missing}"


CASES = sorted(op_problems("cpu"))
ANALYSIS_LOGGER = "torch._higher_order_ops.triton_kernel_wrap"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_kernel_writes_match_declared_mutations(device, case, caplog):
    """Per op: every Triton kernel it launches, the arguments torch's TTIR
    analysis finds written (what functionalization clones and Inductor
    orders by); their union must equal the op's declared mutations. On CPU
    the analysis runs against a stand-in sm_90 target (TTIR needs no GPU)."""
    op, kwargs = op_problems(device)[case]
    context = stand_in_cuda_target() if device == "cpu" else contextlib.nullcontext()
    with caplog.at_level(logging.WARNING, logger=ANALYSIS_LOGGER):
        try:
            with context:
                writes = kernel_writes(op, kwargs)
        except stand_in_cuda_target.Unavailable as error:
            pytest.skip(f"this Triton cannot name a stand-in target without a GPU: {error}")
    failed = [r.getMessage() for r in caplog.records if "exception" in r.getMessage().lower()]
    if failed and device == "cpu":
        pytest.skip(f"TTIR analysis failed with the stand-in target: {failed[0]}")
    assert not failed, f"torch's kernel analysis failed (it then assumes every input written): {failed}"
    assert writes, "no Triton kernel was traced"
    declared = {name for name in declared_mutations(op) if kwargs.get(name) is not None}
    inferred = set().union(*(set(w) for _, w in writes)) - {"<internal>"}
    assert inferred == declared, f"per kernel: {writes}; declared: {sorted(declared)}"
    for kernel, written in writes:
        assert written, f"{kernel}: no written argument found"


def test_kernel_sources_have_no_backslash():
    """Inductor writes each Triton kernel's source, with the jit functions it
    calls, into a string literal of its output code, where a backslash escape
    (in a PTX string or even in a comment) turns into a character that breaks
    that code: every compiled verify with an L2 prefetch failed to import on
    the H200 until the escape was gone."""
    functions = 0
    for info in pkgutil.iter_modules(kda_ops.kernels.__path__):
        module = importlib.import_module(f"kda_ops.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction):
                functions += 1
                assert "\\" not in value.src, f"a backslash in {module.__name__}.{name}"
    assert functions > 20, "the kernels' jit functions were not found"
