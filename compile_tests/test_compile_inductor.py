"""Inductor: the decode step compiles fullgraph and equals eager, on CPU and
on CUDA with 1, 2, 4 and 16 layers over caches of a GiB and more, stacked or
one tensor per layer. The ops that write their arguments stay single nodes
through functionalization and run in place on the caches: Inductor's output
code calls them on views of the caches, with no allocation or copy the size
of a cache. The ops that only return new tensors are decomposed, and for
their kernels torch's Triton analysis finds no input written."""

import contextlib
import importlib
import logging
import math
import os
import pkgutil
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.utils import run_and_get_code

import kda_ops.kernels
from kda_ops.models import KDACaches, KDADecodeStep

from compile_helpers import (DEVICES, LAYER_COUNTS, NOT_UNDER_INTERPRETER,
                             assert_caches_close, assert_close, assert_compiled_steps_match,
                             clone_args, declared_mutations, functionalized_graph, kernel_writes,
                             large_cache_model, layers_of, model_copy, op_problems, requires_cuda,
                             run_batches_1_to_64, stand_in_cuda_target, step_inputs, tiny_model,
                             TINY)

pytestmark = NOT_UNDER_INTERPRETER


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
    """Every layer's slices of stacked caches of a GiB or more, written in one
    graph: a layer slice at a non-zero offset is what a decomposed op got
    wrong (an illegal memory access at this size, wrong values at small
    ones)."""
    model = large_cache_model("cuda", num_layers, conv_layout="token_first", dtype=dtype)
    assert_compiled_steps_match(model, model_copy(model),
                                1e-5 if dtype == torch.float32 else 2e-2)


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
    model = large_cache_model("cuda", num_layers)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model.decode_step, backend=counter, fullgraph=True)
    run_batches_1_to_64(model, compiled, mark_dynamic=True, check_every=7)
    assert counter.frame_count <= 2, f"{counter.frame_count} compiles"


@pytest.mark.parametrize("device", DEVICES)
def test_per_layer_caches_match_stacked(device):
    """The other layout a model author may choose, each layer's caches a tensor
    of its own committed layer by layer, compiles fullgraph and equals the
    stacked model eagerly, step after step (CUDA: 4 layers over caches of a
    GiB and more)."""
    if device == "cuda":
        stacked = large_cache_model(device, 4, conv_layout="token_first", cache_seed=3)
    else:
        stacked = tiny_model(device, conv_layout="token_first", num_blocks=20)
    assert_compiled_steps_match(with_cache_layout(stacked, "per_layer"), stacked)


def with_cache_layout(model, cache_layout):
    """A model like `model`, with its parameters and caches, that keeps its
    caches in `cache_layout`."""
    other = KDADecodeStep(
        model.num_layers, model.num_heads, model.key_dim, model.spec_len, model.conv_width,
        model.num_blocks, value_dim=model.value_dim, projections=model.projections,
        hidden_size=model.hidden_size if model.projections else None, dtype=model.dtype,
        state_dtype=model.state_dtype, conv_layout=model.conv_layout,
        cache_layout=cache_layout, lower_bound=model.lower_bound, device=model.A_log.device)
    parameters = {name: value for name, value in model.state_dict().items()
                  if name not in KDACaches._fields}
    missing, unexpected = other.load_state_dict(parameters, strict=False)
    assert not unexpected and all(name.rsplit("_", 1)[0] in KDACaches._fields
                                  for name in missing), (missing, unexpected)
    other.load_caches(KDACaches(*map(layers_of, model.buffers_as_caches())))
    return other


def allocations(code):
    """(sizes, numel) of every buffer that Inductor's output code allocates."""
    found = []
    for sizes in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", code):
        dims = [d.strip() for d in sizes.split(",") if d.strip()]
        assert all(d.isdigit() for d in dims), f"a symbolic allocation: ({sizes})"
        found.append((sizes, math.prod(int(d) for d in dims)))
    return found


def assert_in_place(model, compiled, inputs, caches=None):
    """Runs `compiled` once; its output code must call each op on the caches
    (conv_verify per layer, commit once or per layer) and allocate
    or copy nothing as large as the smallest cache tensor of one layer."""
    _, codes = run_and_get_code(compiled, *inputs, *(() if caches is None else (caches,)))
    code = "\n".join(codes)
    layers = model.num_layers
    calls = {op: len(re.findall(rf"torch\.ops\.kda_ops\.{op}\.default\(", code))
             for op in ("conv_verify", "commit")}
    commits = 1 if model.cache_layout == "stacked" else layers
    assert calls == dict(conv_verify=layers, commit=commits), calls
    used = caches if caches is not None else model.buffers_as_caches()
    smallest = min(layer.numel() for field in used for layer in layers_of(field))
    large = [(sizes, n) for sizes, n in allocations(code) if n >= smallest]
    assert not large, f"allocations the size of a cache ({smallest} elements): {large}"
    assert ".copy_(" not in code, "the output code copies a tensor"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("setup", ["buffers", "cache_inputs", "per_layer"])
def test_output_code_runs_ops_in_place(device, setup):
    """No hidden cost: the compiled step calls the ops on the caches
    themselves. Without projections the step is nothing but the ops and views,
    so compiled and eager must agree bit for bit."""
    if device == "cuda":
        model = large_cache_model(device, 4, conv_layout="token_first", projections=False)
    else:
        model = tiny_model(device, conv_layout="token_first", projections=False, num_blocks=64,
                           num_layers=4)
    if setup == "per_layer":
        model = with_cache_layout(model, "per_layer")
    reference = model_copy(model)
    caches = reference_caches = None
    if setup == "cache_inputs":
        caches = model.buffers_as_caches()
        reference_caches = reference.buffers_as_caches()
    inputs = step_inputs(model, [2, 3, 1, 3], seed=5)
    compiled = torch.compile(model.decode_step, backend="inductor", fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False):
        assert_in_place(model, compiled, inputs, caches)
    # run_and_get_code ran the step once; run the reference once, then again both.
    args = (() if caches is None else (reference_caches,))
    reference.decode_step(*inputs, *args)
    inputs = step_inputs(model, [3, 1, 2], seed=6)
    out = compiled(*inputs, *(() if caches is None else (caches,)))
    expected = reference.decode_step(*inputs, *args)
    assert torch.equal(out, expected), "compiled and eager outputs differ"
    assert_caches_close(model, reference, 0.0)


@requires_cuda
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                    reason="compute-sanitizer (CUDA toolkit) is not on PATH")
def test_compiled_two_layer_step_under_memcheck():
    """compute-sanitizer's memcheck finds no access outside an allocation in
    a compiled two-layer step (every tensor its own allocation, see the
    worker), and the step still equals eager under it."""
    worker = Path(__file__).with_name("memcheck_worker.py")
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    proc = subprocess.run(["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3",
                           sys.executable, str(worker)], capture_output=True, text=True,
                          env=env, timeout=1200)
    output = proc.stdout + proc.stderr
    assert "ERROR SUMMARY: 0 errors" in output and proc.returncode == 0, output[-4000:]


WRITING_CASES = sorted(case for case, (op, _) in op_problems("cpu").items()
                       if declared_mutations(op))
RETURNING_CASES = sorted(case for case, (op, _) in op_problems("cpu").items()
                         if not declared_mutations(op))
ANALYSIS_LOGGER = "torch._higher_order_ops.triton_kernel_wrap"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", WRITING_CASES)
def test_writing_ops_stay_single_nodes(device, case):
    """Functionalization (torch.compile, AOTInductor) keeps an op that writes
    its arguments as one auto-functionalized node, not its Triton launches."""
    from torch._higher_order_ops.auto_functionalize import (auto_functionalized,
                                                            auto_functionalized_v2)

    op, kwargs = op_problems(device)[case]
    gm, _ = functionalized_graph(op, kwargs)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    wrapped = [n for n in calls if n.target in (auto_functionalized, auto_functionalized_v2)]
    kernels = [n for n in calls if "triton_kernel_wrapper" in str(n.target)]
    assert len(wrapped) == 1 and not kernels, (
        f"{len(wrapped)} auto-functionalized nodes, {len(kernels)} kernel launches, "
        f"{len(calls)} calls in all")
    assert wrapped[0].args[0] is op


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", RETURNING_CASES)
def test_kernel_writes_match_declared_mutations(device, case, caplog):
    """An op that only returns new tensors is decomposed into its Triton
    kernels. For each kernel, the arguments torch's TTIR analysis finds
    written (what functionalization clones and Inductor orders by) must be
    the op's own outputs: an input found written would be copied back and
    would make CUDA graphs skip. On CPU the analysis runs against a stand-in
    sm_90 target (TTIR needs no GPU)."""
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
    inferred = set().union(*(set(w) for _, w in writes)) - {"<internal>"}
    assert not inferred, f"per kernel: {writes}"
    for kernel, written in writes:
        assert written, f"{kernel}: no written argument found"


def test_kernel_sources_have_no_backslash():
    """Inductor writes each Triton kernel's source, with the jit functions it
    calls, into a string literal of its output code, where a backslash escape
    (in a PTX string or even in a comment) turns into a character that breaks
    that code, and the compiled module then fails to import."""
    functions = 0
    for info in pkgutil.iter_modules(kda_ops.kernels.__path__):
        module = importlib.import_module(f"kda_ops.kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction):
                functions += 1
                assert "\\" not in value.src, f"a backslash in {module.__name__}.{name}"
    assert functions > 20, "the kernels' jit functions were not found"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("eager_fold", [None, False])
@pytest.mark.parametrize("cache_layout", ["stacked", "per_layer"])
def test_deferred_schedule_compiles_and_matches_eager(device, cache_layout, eager_fold):
    """The deferred schedule (record_len > spec_len): verify with pending
    records and the deferred commit through Inductor (fullgraph) against eager,
    pending counts included (eager_fold=None folds every commit at these
    batches); then the flush, compiled too."""
    model = tiny_model(device, record_len=TINY["spec_len"] + 4, cache_layout=cache_layout,
                       eager_fold=eager_fold)
    reference = model_copy(model)
    assert_compiled_steps_match(model, reference)
    blocks = torch.arange(1, model.num_blocks, dtype=torch.int32, device=device)
    torch.compile(model.flush, backend="inductor", fullgraph=True)(blocks)
    reference.flush(blocks)
    assert_caches_close(model, reference)
    assert all(int(counts[1:].abs().sum()) == 0  # block 0, the null block, is never flushed
               for counts in layers_of(model.buffers_as_caches().pending))
