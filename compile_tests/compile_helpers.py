"""Shared pieces of the compile tests: devices, markers, tiny problems for every
op, the reference model, and the renderer of captured graphs.

(Named apart from tests/helpers.py: both folders are on sys.path in one run.)
"""

from __future__ import annotations

import copy
import gc
import os
import random
import tempfile
import time
from pathlib import Path

import pytest
import torch

from kda_ops.models import KDACaches, KDADecodeStep, make_step_inputs

try:
    import fcntl
except ImportError:  # no POSIX file locks: the test processes do not take turns
    fcntl = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])

# Every compile test module sets `pytestmark = NOT_UNDER_INTERPRETER`.
NOT_UNDER_INTERPRETER = pytest.mark.skipif(
    INTERPRET, reason="TRITON_INTERPRET=1: torch.compile, opcheck and export would run the "
    "Triton interpreter on fake tensors, which is not supported; the interpreter is for "
    "eager numerics only (tests/)")
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# Layer counts of the CUDA compile checks: one layer has no cache slice at a
# non-zero offset; 2, 4 and 16 have (the case that a decomposed op got wrong).
LAYER_COUNTS = [1, 2, 4, 16]
# The CUDA checks' stacked state is at least this large (and the other caches
# about as large), so that an access outside a layer's slice, or outside a
# temporary sized as one, faults instead of reading neighbouring memory.
LARGE_STATE_BYTES = 1 << 30

# The reference model of the compile tests: tiny, fp32, every feature on.
TINY = dict(num_layers=2, num_heads=2, head_dim=16, spec_len=3, conv_width=4, num_blocks=8,
            lower_bound=-5.0)


def tiny_model(device, *, seed=0, cache_seed=1, **overrides) -> KDADecodeStep:
    """The tiny reference model with random (never zero) caches loaded."""
    model = KDADecodeStep(**{**TINY, **overrides}, seed=seed, device=device)
    model.load_caches(model.random_caches(cache_seed))
    return model


# A test that draws caches of LARGE_STATE_BYTES held up to 17.6 GiB of GPU memory with
# its copies (an out-of-memory report); eight at once overflowed an 80 GB H100. So the test
# processes sharing a GPU take turns: the first large_cache_model of a test waits for one
# of GPU memory // LARGE_TEST_GPU_BYTES slots (a lock file each), and the test's teardown
# (conftest.py) frees the memory and gives the slot back.
LARGE_TEST_GPU_BYTES = 20 << 30
_LOCK_STEM = Path(tempfile.gettempdir()) / "kda_ops_compile_tests_large_caches"
_held_slot = None


def _take_large_caches_turn(device):
    global _held_slot
    if fcntl is None or _held_slot is not None or torch.device(device).type != "cuda":
        return
    count = max(1, torch.cuda.get_device_properties(device).total_memory // LARGE_TEST_GPU_BYTES)
    while True:
        for slot in range(count):
            lock = open(f"{_LOCK_STEM}.{slot}.lock", "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            _held_slot = lock
            return
        time.sleep(0.2)


def end_large_caches_turn():
    """Frees this process's cached GPU memory and lets the next large test
    start; a no-op where the test drew no large caches."""
    global _held_slot
    if _held_slot is None:
        return
    gc.collect()
    torch.cuda.empty_cache()
    fcntl.flock(_held_slot, fcntl.LOCK_UN)
    _held_slot.close()
    _held_slot = None


def large_cache_model(device, num_layers, *, seed=0, cache_seed=1, **overrides) -> KDADecodeStep:
    """The tiny model with as many blocks as make its stacked state at least
    LARGE_STATE_BYTES, its caches drawn on the device (random, never zero).
    On CUDA the test then holds a large-caches slot (LARGE_TEST_GPU_BYTES)."""
    _take_large_caches_turn(device)
    config = {**TINY, **overrides, "num_layers": num_layers}
    head_dim = config["head_dim"]
    state_dtype = config.get("state_dtype", torch.float32)
    block_bytes = num_layers * config["num_heads"] * head_dim * head_dim * state_dtype.itemsize
    config["num_blocks"] = -(-LARGE_STATE_BYTES // block_bytes) + 1
    model = KDADecodeStep(**config, seed=seed, device=device)
    model.randomize_caches(cache_seed)
    return model


def device_random_caches(model, seed):
    """New random caches of the model's shapes and layout, drawn on its device."""
    caches = model.empty_caches()
    model.randomize_caches(seed, caches)
    return caches


def model_copy(model: KDADecodeStep) -> KDADecodeStep:
    """An independent copy (parameters and caches) to run eagerly beside a compiled one."""
    return copy.deepcopy(model)


def step_inputs(model, lens, seed=0, **kwargs):
    return make_step_inputs(model, lens, seed=seed, **kwargs)


def rel_error(actual, expected):
    """In float64, on the tensors' device (caches of a GiB stay there)."""
    actual, expected = actual.detach().double(), expected.detach().to(actual.device).double()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if not torch.isfinite(actual).all() or not torch.isfinite(expected).all():
        return float("inf")
    return (torch.linalg.vector_norm(actual - expected)
            / torch.linalg.vector_norm(expected).clamp_min(1e-30)).item()


def assert_close(actual, expected, tol=1e-5, name="value"):
    err = rel_error(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def layers_of(field):
    """A cache field's tensor of each layer, stacked or kept per layer."""
    return list(field.unbind(0)) if torch.is_tensor(field) else list(field)


def assert_caches_close(model_a, model_b, tol=1e-5, caches_a=None, caches_b=None):
    """Layer by layer, so that stacked and per-layer caches compare too."""
    a = caches_a if caches_a is not None else model_a.buffers_as_caches()
    b = caches_b if caches_b is not None else model_b.buffers_as_caches()
    for name, x, y in zip(a._fields, a, b):
        x, y = layers_of(x), layers_of(y)
        assert len(x) == len(y), f"{name}: {len(x)} layers against {len(y)}"
        for layer, (x_layer, y_layer) in enumerate(zip(x, y)):
            assert_close(x_layer, y_layer, tol, f"{name}[{layer}]")


def assert_compiled_steps_match(model, reference, tol=1e-5):
    """`model.decode_step` through Inductor (fullgraph) for three steps of
    ragged windows, each step's outputs and then caches against
    `reference.decode_step` run eagerly."""
    compiled = torch.compile(model.decode_step, backend="inductor", fullgraph=True)
    for step, lens in enumerate(([2, 3, 1], [3, 1, 3, 3], [1] * 7)):
        inputs = step_inputs(model, lens, seed=step)
        assert_close(compiled(*inputs), reference.decode_step(*inputs), tol, f"out {lens}")
        assert_caches_close(model, reference, tol)


def clone_caches(caches):
    return type(caches)(*(t.clone() if torch.is_tensor(t) else tuple(x.clone() for x in t)
                          for t in caches))


def clone_args(args):
    """A copy of an op's keyword arguments with every tensor cloned."""
    return {name: (a.clone() if isinstance(a, torch.Tensor) else a) for name, a in args.items()}


# ---------------------------------------------------------------- op problems
def _qsl(lens, device):
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out.to(device)


def op_problems(device, seed=0):
    """Small random argument sets for every op: {case: (op overload, kwargs)}.
    Windows are ragged, with a padding row (index 0) and an out-of-range index."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    H, K, V, T, N, L, W = 2, 16, 16, 3, 6, 2, 4
    lens = [2, 3, 1, 3]
    indices = [3, 1, 0, 9]
    n = sum(lens)
    qsl, si = _qsl(lens, device), ints(indices)
    accepted = ints([1, 3, 1, 2])
    D = 2 * K + V
    cols = W - 1 + T - 1
    problems = {}

    def verify_kwargs(heads, spec_len, lens, indices):
        tokens = sum(lens)
        return dict(q=rand(tokens, heads, K), k=rand(tokens, heads, K),
                    v=rand(tokens, heads, V), g=rand(tokens, heads, K), beta=rand(tokens, heads),
                    A_log=rand(heads), dt_bias=rand(heads, K), state=rand(N, heads, V, K),
                    correction=rand(N, heads, spec_len, V),
                    key_gate=rand(N, heads, spec_len, 2 * K),
                    query_start_loc=_qsl(lens, device), state_indices=ints(indices),
                    lower_bound=None, scale=None, out=rand(tokens, heads, V))

    # The metadata tensors shared with commit's problems.
    verify_args = dict(verify_kwargs(H, T, lens, indices), query_start_loc=qsl, state_indices=si)
    problems["verify"] = (torch.ops.kda_ops.verify.default, verify_args)
    bf16 = {name: (t.to(torch.bfloat16) if name in ("q", "k", "v", "g", "beta", "key_gate", "out")
                   else t) for name, t in verify_args.items()}
    # bf16 activations, a leading dim of 1 on the token tensors, lower bound and scale.
    for name in ("q", "k", "v", "g", "beta", "out"):
        bf16[name] = bf16[name].unsqueeze(0)
    problems["verify_bf16_lower_bound"] = (torch.ops.kda_ops.verify.default,
                                           dict(bf16, lower_bound=-5.0, scale=0.3))
    # Six-token windows over 8 x 32 (request, head) pairs: verify's tensor-core form.
    problems["verify_tensor_cores"] = (torch.ops.kda_ops.verify.default, dict(
        verify_kwargs(32, 6, [6, 1, 4, 6, 0, 3, 6, 2], [1, 2, 0, 3, 4, 5, 9, 2]),
        lower_bound=-5.0))
    # Four-token windows over 64 x 32 pairs: the tensor-core form in two kernels.
    problems["verify_separate_terms"] = (torch.ops.kda_ops.verify.default, dict(
        verify_kwargs(32, 4, [4, 1, 3, 0, 4, 2, 4, 4] * 8, [1, 2, 0, 3, 4, 5, 9, 2] * 8),
        lower_bound=-5.0))

    # Engine layout: conv state stored [L, N, cols, D], passed dim-first.
    commit_args = dict(num_accepted_tokens=accepted, state_indices=si, query_start_loc=qsl,
                       state=rand(L, N, H, V, K),
                       conv_state=rand(L, N, cols, D).transpose(-1, -2),
                       correction=rand(L, N, H, T, V), key_gate=rand(L, N, H, T, 2 * K),
                       A_log=rand(L, H), dt_bias=rand(L, H, K), lower_bound=-5.0,
                       spec_len=T)  # the last argument given, as kda_ops.commit gives it
    problems["commit"] = (torch.ops.kda_ops.commit.default, commit_args)
    # The deferred schedule: records of R = 6 > T positions, counts leaving room.
    R = 6
    deferred = dict(commit_args, correction=rand(L, N, H, R, V), key_gate=rand(L, N, H, R, 2 * K),
                    pending=ints([[0, 2, 1, 3, 0, 2], [1, 0, 3, 2, 2, 0]]), spec_len=T)
    problems["commit_deferred"] = (torch.ops.kda_ops.commit.default, deferred)
    # Counts kept pending at this batch (its default folds every commit).
    problems["commit_deferred_lazy"] = (torch.ops.kda_ops.commit.default,
                                        dict(deferred, accepted_path=None, eager_fold=False))
    problems["flush"] = (torch.ops.kda_ops.flush.default, dict(
        state_indices=si, state=deferred["state"], correction=deferred["correction"],
        key_gate=deferred["key_gate"], pending=deferred["pending"], A_log=deferred["A_log"],
        dt_bias=deferred["dt_bias"], lower_bound=-5.0))
    problems["verify_pending"] = (torch.ops.kda_ops.verify.default, dict(
        verify_kwargs(H, R, lens, indices), query_start_loc=qsl, state_indices=si,
        pending=ints([0, 2, 1, 3, 0, 2]), spec_len=T))
    # Tree windows (docs/semantics.md#13-tree-drafts) and the commit of their
    # accepted paths, in both schedules.
    parent = ints([-1, 0, -1, 0, 0, -1, -1, 0, 1])
    tree_commit = dict(num_accepted_tokens=ints([2, 2, 1, 3]),
                       accepted_path=ints([[0, 1, 0], [0, 2, 0], [0, 0, 0], [0, 1, 2]]))
    problems["verify_tree_pending"] = (torch.ops.kda_ops.verify.default, dict(
        problems["verify_pending"][1], parent=parent))
    problems["commit_tree"] = (torch.ops.kda_ops.commit.default, dict(commit_args,
                                                                       **tree_commit))
    problems["commit_tree_deferred"] = (torch.ops.kda_ops.commit.default, dict(deferred,
                                                                                **tree_commit))
    align = dict(block_table=ints([[1, 2], [3, 4], [5, 1], [2, 3]]),
                 num_computed_tokens=ints([6, 2, 7, 0]), block_size=8,
                 request_indices=ints([2, 0, 1, 3]))
    problems["commit_align_single_layer"] = (
        torch.ops.kda_ops.commit.default,
        dict(num_accepted_tokens=accepted, state_indices=si, query_start_loc=qsl,
             state=rand(N, H, V, K), conv_state=rand(N, D, cols), correction=rand(N, H, T, V),
             key_gate=rand(N, H, T, 2 * K), A_log=rand(H), dt_bias=rand(H * K), spec_len=T,
             **align))
    problems["commit_plan"] = (torch.ops.kda_ops.commit_plan.default,
                               dict(num_accepted_tokens=accepted, state_indices=si,
                                    query_start_loc=qsl, spec_len=T))
    problems["commit_plan_align"] = (torch.ops.kda_ops.commit_plan.default,
                                     dict(num_accepted_tokens=accepted, state_indices=si,
                                          query_start_loc=qsl, spec_len=T, **align))
    problems["conv_update"] = (torch.ops.kda_ops.conv_update.default,
                               dict(x=rand(n, D), conv_state=rand(N, cols, D).transpose(-1, -2),
                                    weight=rand(D, W), bias=rand(D), query_start_loc=qsl,
                                    state_indices=si, activation="silu", out=rand(n, D)))
    problems["conv_update_no_bias"] = (torch.ops.kda_ops.conv_update.default,
                                       dict(x=rand(n, D), conv_state=rand(N, D, cols),
                                            weight=rand(D, W), bias=None, query_start_loc=qsl,
                                            state_indices=si, activation=None, out=rand(n, D)))
    # conv_verify: x holds q | k | v of H heads; the engine's conv layout.
    conv_verify = dict(x=rand(n, H * D), conv_state=rand(N, cols, H * D).transpose(-1, -2),
                       conv_weight=rand(H * D, W), conv_bias=rand(H * D), activation="silu",
                       **{name: t for name, t in verify_args.items() if name not in "qkv"})
    problems["conv_verify"] = (torch.ops.kda_ops.conv_verify.default, conv_verify)
    problems["conv_verify_pending"] = (torch.ops.kda_ops.conv_verify.default, dict(
        conv_verify, conv_bias=None, activation=None, lower_bound=-5.0,
        correction=rand(N, H, R, V), key_gate=rand(N, H, R, 2 * K),
        pending=ints([0, 2, 1, 3, 0, 2]), spec_len=T))
    problems["conv_verify_tree"] = (torch.ops.kda_ops.conv_verify.default, dict(
        conv_verify, parent=ints([-1, 0, -1, 0, 0, -1, -1, 0, 1])))
    problems["aligned_state_indices"] = (
        torch.ops.kda_ops.aligned_state_indices.default,
        dict(block_table=ints([[1, 2, 3], [4, 5, 6]]), seq_lens=ints([9, 1]), block_size=4,
             num_state_slots=2))
    staged = lambda: dict(staged_state_indices=ints([7] * 6),  # noqa: E731
                          staged_query_start_loc=ints([7] * 7),
                          staged_num_accepted_tokens=ints([7] * 6))
    problems["stage_spec_decode_metadata"] = (
        torch.ops.kda_ops.stage_spec_decode_metadata.default,
        dict(state_indices=si, query_start_loc=qsl, num_accepted_tokens=accepted,
             **staged(), num_spec_decodes=3))
    problems["stage_spec_decode_metadata_tensor_count"] = (
        torch.ops.kda_ops.stage_spec_decode_metadata_tensor_count.default,
        dict(state_indices=si, query_start_loc=qsl, num_accepted_tokens=accepted,
             **staged(), num_spec_decodes=ints([2])))
    return problems


def declared_mutations(op) -> set[str]:
    """The argument names an op's schema marks as written (`Tensor(a!)`)."""
    return {a.name for a in op._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write}


# ---------------------------------------------------------------- graph rendering
def _clean_placeholder(name: str) -> str:
    """Dynamo's source-derived placeholder names, made readable and stable:
    `L_self_buffers_state_` -> `self.state`, `L_hidden_` -> `hidden`."""
    for prefix in ("L_", "G_", "l_", "g_"):
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    name = name.rstrip("_")
    for scope in ("self_buffers_", "self_parameters_"):
        if name.startswith(scope):
            return "self." + name[len(scope):]
    return name


def _tensor_meta(node) -> str:
    value = node.meta.get("example_value", node.meta.get("val"))
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    return node.name


def _source(node):
    """`name`, `name[i]`, `name.transpose(a, b)` chains rooted at a graph input,
    else None."""
    import operator

    from torch.fx import Node

    if node.op == "placeholder":
        return _clean_placeholder(str(node.target))
    if node.op == "get_attr":
        return "self." + str(node.target).split("___")[-1].lstrip("_")
    base = node.args[0] if node.args and isinstance(node.args[0], Node) else None
    inner = _source(base) if base is not None else None
    if inner is None:
        return None
    if (node.op == "call_function" and node.target is operator.getitem
            and isinstance(node.args[1], int)):
        return f"{inner}[{node.args[1]}]"
    if node.op == "call_method" and node.target == "transpose":
        return f"{inner}.transpose{tuple(node.args[1:])}"
    return None


def _describe(value) -> str:
    from torch.fx import Node

    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    if not isinstance(value, Node):
        return repr(value)
    source = _source(value)
    if source is not None:
        return source
    if value.op == "call_function" and getattr(value.target, "__name__", "") == "empty_like":
        return f"empty_like({_tensor_meta(value)})"
    return _tensor_meta(value)


def render_kda_calls(gm) -> str:
    """One line per kda_ops call of a captured graph, in graph order, every
    argument by its source (placeholders by name, layer slices as `x[l]`,
    intermediates as dtype[shape]); written arguments (the schema's `(a!)`)
    carry a `!`. None arguments are left out."""
    lines = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != "kda_ops":
            continue
        parts = []
        for i, arg in enumerate(target._schema.arguments):
            if i < len(node.args):
                value = node.args[i]
            elif arg.name in node.kwargs:
                value = node.kwargs[arg.name]
            else:
                continue
            if value is None:
                continue
            written = arg.alias_info is not None and arg.alias_info.is_write
            parts.append(f"{arg.name}{'!' if written else ''}={_describe(value)}")
        name = target._schema.name.split("::")[1]
        lines.append(f"kda_ops.{name}({', '.join(parts)})")
    return "\n".join(lines)


def kda_call_targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("kda_ops.")]


# ---------------------------------------------------------------- mutation analysis
class _Captured(Exception):
    pass


def _graph_input(node):
    """Follows view ops back to the placeholder a tensor argument comes from."""
    from torch.fx import Node

    while isinstance(node, Node) and node.op == "call_function":
        target = node.target
        schema = getattr(target, "_schema", None)
        returns = schema.returns if schema is not None else ()
        is_view = (len(returns) == 1 and returns[0].alias_info is not None
                   and not returns[0].alias_info.is_write)
        if not is_view or not node.args or not isinstance(node.args[0], Node):
            return None
        node = node.args[0]
    return node if isinstance(node, Node) and node.op == "placeholder" else None


def functionalized_graph(op, kwargs):
    """`op(**kwargs)` traced by AOTAutograd (functionalized, as torch.compile
    and AOTInductor trace it), and the op's tensor argument names in the
    order of the graph's placeholders. Nothing is executed."""
    from torch._functorch.aot_autograd import aot_function

    names = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
    graphs = []

    def compiler(gm, example_inputs):
        graphs.append(gm)

        def stop(*args):
            raise _Captured()
        return stop

    def fn(*tensors):
        call = dict(kwargs)
        call.update(zip(names, tensors))
        result = op(**call)
        return result if result is not None else ()

    try:
        aot_function(fn, fw_compiler=compiler)(*(kwargs[name] for name in names))
    except _Captured:
        pass
    assert len(graphs) == 1, "AOTAutograd produced no forward graph"
    return graphs[0], names


def kernel_writes(op, kwargs):
    """The written arguments that torch infers for every Triton kernel of
    `op(**kwargs)`: traced through AOTAutograd's functionalization, where each
    `wrap_triton` launch of a decomposed op becomes a
    `triton_kernel_wrapper_functional` node whose `tensors_to_clone` is the set
    of kernel arguments that Triton's TTIR analysis found written (what
    Inductor uses too). Returns a list of (kernel name, sorted op argument
    names written; "<internal>" for tensors the op allocates itself)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    gm, names = functionalized_graph(op, kwargs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert len(placeholders) == len(names)
    wrapper = torch.ops.higher_order.triton_kernel_wrapper_functional
    found = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not wrapper:
            continue
        kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        kernel_name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
        written = set()
        for param in node.kwargs["tensors_to_clone"]:
            source = _graph_input(node.kwargs["kwargs"][param])
            written.add(names[placeholders.index(source)] if source is not None else "<internal>")
        found.append((kernel_name, sorted(written)))
    return found


class stand_in_cuda_target:
    """Lets Triton build TTIR for an sm_90 target without a GPU (CPU-only CI),
    routing the op bodies to their Triton launches for CPU tensors
    (tools/stand_in_target.py). Only for tracing (kernel_writes); nothing may
    run. Restores both on exit."""

    class Unavailable(Exception):
        """This Triton offers no way to name a target without a driver."""

    def __enter__(self):
        from tools.stand_in_target import sm90_launches

        self._context = sm90_launches()
        try:
            self._context.__enter__()
        except (ImportError, AttributeError) as error:  # an API this Triton does not have
            raise stand_in_cuda_target.Unavailable(repr(error)) from error
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


# ---------------------------------------------------------------- fixed-shape (graph) inputs
def padded_step_inputs(model, lens, max_batch, seed=0, device=None):
    """Inputs of a step for a graph captured at `max_batch` rows and
    `max_batch * T` tokens: the first len(lens) rows are the requests, the
    rest are padding rows (state index 0, empty window, accepted 1); tokens
    past the last window hold random values. Returns (padded, unpadded,
    num_tokens), each a (hidden, query_start_loc, state_indices,
    num_accepted_tokens) tuple on `device` (default: the model's)."""
    device = model.A_log.device if device is None else device
    hidden, qsl, si, accepted = make_step_inputs(model, lens, seed=seed, device="cpu")
    n, num_tokens = len(lens), int(qsl[-1])
    gen = torch.Generator().manual_seed(10_000 + seed)
    full = torch.randn(max_batch * model.spec_len, model.hidden_size, generator=gen).to(model.dtype)
    full[:num_tokens] = hidden
    pad = max_batch - n
    qsl_p = torch.cat([qsl, qsl[-1:].expand(pad)])
    si_p = torch.cat([si, torch.zeros(pad, dtype=torch.int32)])
    acc_p = torch.cat([accepted, torch.ones(pad, dtype=torch.int32)])
    move = lambda ts: tuple(t.to(device) for t in ts)  # noqa: E731
    return move((full, qsl_p, si_p, acc_p)), move((hidden, qsl, si, accepted)), num_tokens


def recorded_cuda_graphs():
    """How many CUDA graphs cudagraph trees recorded on this device (None if
    this torch's internals differ)."""
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(torch.cuda.current_device(), False)
        if manager is None:
            return 0
        return sum(len(nodes) for nodes in manager.roots.values())
    except (ImportError, AttributeError, TypeError):
        return None


# ---------------------------------------------------------------- shared test bodies
def run_batches_1_to_64(model, compiled, *, mark_dynamic, check_every=9, tol=1e-5):
    """Calls `compiled` (a compiled `model.decode_step`) at batch sizes 1..64
    with random windows of 1..T tokens, against an eager copy of the model."""
    reference = model_copy(model)
    rng = random.Random(0)
    for batch in range(1, 65):
        lens = [rng.randint(1, model.spec_len) for _ in range(batch)]
        inputs = step_inputs(model, lens, seed=batch)
        if mark_dynamic:
            for t in inputs:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        out = compiled(*inputs)
        expected = reference.decode_step(*inputs)
        if batch % check_every == 1:
            n = int(inputs[1][-1])
            assert_close(out[:n], expected[:n], tol, f"out at batch {batch}")
    assert_caches_close(model, reference, tol)


# ---------------------------------------------------------------- export wrappers
class StepWithBuffers(torch.nn.Module):
    """The model's decode step; caches are the model's buffers."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden, query_start_loc, state_indices, num_accepted_tokens):
        return self.model.decode_step(hidden, query_start_loc, state_indices, num_accepted_tokens)


class StepWithCacheInputs(torch.nn.Module):
    """The same step with the caches passed in (mutated in place)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, hidden, query_start_loc, state_indices, num_accepted_tokens,
                state, conv_state, correction, key_gate):
        caches = KDACaches(state, conv_state, correction, key_gate)
        return self.model.decode_step(hidden, query_start_loc, state_indices,
                                      num_accepted_tokens, caches)
