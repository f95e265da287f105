"""CUDA graphs: torch.compile(mode="reduce-overhead") records graphs (no
"skipping cudagraphs") with the caches as module buffers or as inputs marked
static, and stays correct over many replays with changing inputs; a manual
torch.cuda.CUDAGraph capture of a whole step (staging, every layer, commit)
replays correctly with no host sync or host-to-device copy on the captured
path. On CPU only the fixed-shape padding convention the graphs rely on is
checked."""

import contextlib
import random

import pytest
import torch
from torch._dynamo.utils import counters

import kda_ops
from compile_helpers import (LAYER_COUNTS, NOT_UNDER_INTERPRETER, assert_caches_close,
                             assert_close, clone_caches, device_random_caches, large_cache_model,
                             model_copy, padded_step_inputs, recorded_cuda_graphs, requires_cuda,
                             step_inputs, tiny_model)

pytestmark = NOT_UNDER_INTERPRETER

MAX_BATCH = 4
STEPS = 10


def random_lens(rng, spec_len, max_batch=MAX_BATCH):
    return [rng.randint(1, spec_len) for _ in range(rng.randint(1, max_batch))]


def test_padding_rows_are_no_ops_cpu():
    """What the graph tests rely on: a padded fixed-shape batch gives the same
    outputs (on the real tokens) and caches as the unpadded batch."""
    model = tiny_model("cpu", conv_layout="token_first", num_blocks=20)
    reference = model_copy(model)
    rng = random.Random(0)
    for step in range(3):
        padded, unpadded, n = padded_step_inputs(model, random_lens(rng, model.spec_len),
                                                 MAX_BATCH, seed=step)
        out = model.decode_step(*padded)
        expected = reference.decode_step(*unpadded)
        assert_close(out[:n], expected, 1e-6, "out")
        assert_caches_close(model, reference, 0.0)


def cudagraph_settings(or_error=True):
    """No FX graph cache (it can replay an old skip decision), and, where this
    torch has it, an error instead of a silent skip."""
    settings = {"fx_graph_cache": False}
    if or_error and hasattr(torch._inductor.config.triton, "cudagraph_or_error"):
        settings["triton.cudagraph_or_error"] = True
    return torch._inductor.config.patch(settings)


def run_reduce_overhead(model, caches, reference, reference_caches, steps=STEPS, seed=0):
    compiled = torch.compile(model.decode_step, mode="reduce-overhead", fullgraph=True)
    rng = random.Random(seed)
    for step in range(steps):
        padded, unpadded, n = padded_step_inputs(model, random_lens(rng, model.spec_len),
                                                 MAX_BATCH, seed=seed * 100 + step)
        out = compiled(*padded, caches)[:n].clone()  # the next replay reuses the output
        expected = reference.decode_step(*unpadded, reference_caches)
        assert_close(out, expected, 1e-5, f"out at step {step}")
        assert_caches_close(model, reference, 1e-5, caches, reference_caches)


@requires_cuda
@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
@pytest.mark.parametrize("caches_as", ["buffers", "static_inputs"])
def test_reduce_overhead_records_and_replays(caches_as, num_layers):
    """Stacked caches of a GiB or more, every layer's slices written."""
    model = large_cache_model("cuda", num_layers, conv_layout="token_first")
    reference = model_copy(model)
    caches = reference_caches = None
    if caches_as == "static_inputs":
        caches = device_random_caches(model, 5)
        reference_caches = clone_caches(caches)
        for t in caches:
            torch._dynamo.mark_static_address(t)
    counters.clear()
    with cudagraph_settings():
        run_reduce_overhead(model, caches, reference, reference_caches)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    recorded = recorded_cuda_graphs()
    assert recorded is None or recorded >= 1, "no CUDA graph was recorded"


@requires_cuda
@pytest.mark.parametrize("num_layers", LAYER_COUNTS)
def test_reduce_overhead_skips_unmarked_cache_inputs(num_layers):
    """The control for the test above: caches passed as plain inputs are
    mutated inputs, so cudagraphs are skipped (and the result stays right).
    This is why caches must be buffers or marked static."""
    model = large_cache_model("cuda", num_layers)
    reference = model_copy(model)
    caches = device_random_caches(model, 5)
    reference_caches = clone_caches(caches)
    counters.clear()
    with cudagraph_settings(or_error=False):
        run_reduce_overhead(model, caches, reference, reference_caches, steps=4)
    assert counters["inductor"]["cudagraph_skips"] >= 1


@contextlib.contextmanager
def sync_debug_error():
    """Any synchronizing CUDA call (a host read, a blocking copy) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@requires_cuda
@pytest.mark.parametrize("compiled,num_layers", [(False, 2)] + [(True, n) for n in LAYER_COUNTS],
                         ids=["eager-2"] + [f"inductor-{n}" for n in LAYER_COUNTS])
def test_manual_cuda_graph_of_a_full_step(compiled, num_layers):
    """One graph: stage this step's metadata into the graph's fixed buffers
    (count read on the device), conv_verify for every layer, commit
    of all layers (stacked caches of a GiB or more). Replayed with new tokens,
    windows, blocks and counts."""
    model = large_cache_model("cuda", num_layers, conv_layout="token_first")
    reference = model_copy(model)
    device, T = "cuda", model.spec_len
    i32 = dict(dtype=torch.int32, device=device)
    # What the host side fills before each replay (device buffers).
    source_indices = torch.zeros(MAX_BATCH, **i32)
    source_starts = torch.zeros(MAX_BATCH + 1, **i32)
    source_accepted = torch.ones(MAX_BATCH, **i32)
    count = torch.zeros(1, **i32)
    hidden = torch.zeros(MAX_BATCH * T, model.hidden_size, device=device, dtype=model.dtype)
    # The graph's own metadata buffers.
    staged = (torch.zeros(MAX_BATCH, **i32), torch.zeros(MAX_BATCH + 1, **i32),
              torch.zeros(MAX_BATCH, **i32))
    step_fn = (torch.compile(model.decode_step, fullgraph=True) if compiled
               else model.decode_step)

    def full_step():
        kda_ops.stage_spec_decode_metadata(source_indices, source_starts, source_accepted,
                                           *staged, count)
        staged_indices, staged_starts, staged_accepted = staged
        return step_fn(hidden, staged_starts, staged_indices, staged_accepted)

    def load(inputs, num_requests, num_tokens):
        h, starts, indices, accepted = inputs
        hidden[:num_tokens].copy_(h)
        source_indices[:num_requests].copy_(indices)
        source_starts[:num_requests + 1].copy_(starts)
        source_accepted[:num_requests].copy_(accepted)
        count.fill_(num_requests)

    # Warm up (Triton and Inductor compile) on a side stream with a full batch,
    # then put the caches back as they were.
    saved = clone_caches(model.buffers_as_caches())
    warm = step_inputs(model, [T] * MAX_BATCH, seed=99)
    load(warm, MAX_BATCH, MAX_BATCH * T)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            full_step()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    model.load_caches(saved)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with sync_debug_error():
            out = full_step()

    rng = random.Random(1)
    for step in range(STEPS):
        lens = random_lens(rng, T)
        inputs = step_inputs(model, lens, seed=step)  # made on the device beforehand
        torch.cuda.synchronize()
        with sync_debug_error():
            load(inputs, len(lens), sum(lens))
            graph.replay()
        expected = reference.decode_step(*inputs)
        assert_close(out[:sum(lens)], expected, 1e-5, f"out at step {step}")
        assert_caches_close(model, reference, 1e-5)
