"""Argument checks, one helper per op.

Every check reads shapes, dtypes, devices and strides only (never values), so
the same helpers run eagerly, under Dynamo and with fake tensors, and always
before anything is launched or written.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from .constants import DEFERRED_EAGER_FOLD_BELOW_BATCH

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
STATE_DTYPES = (torch.float32, torch.bfloat16)
# Converted on load, so any floating dtype will do.
GATE_DTYPES = ACTIVATION_DTYPES + (torch.float64,)
INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT64 = (torch.float64,)


def fail(name: str, message: str) -> None:
    raise ValueError(f"kda_ops: `{name}` {message}")


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _is_int(value):
    # A SymInt is what Dynamo passes for an int it traces as dynamic.
    return not isinstance(value, bool) and isinstance(value, (int, torch.SymInt))


def _is_float(value):
    return _is_int(value) or isinstance(value, (float, torch.SymFloat))


def check_tensor(name, t, *, shape=None, ndim=None, dtypes=None, device=None, written=False,
                 inner_dims=None, dtype_hint=""):
    """Checks one tensor; `shape` entries of None match any size. A `written`
    tensor must not overlap itself (an expanded view would take one element's
    writes from several programs in an undefined order). The kernels index
    blocks, layers and tokens in int64 and the last `inner_dims` dims (one
    block's or token's elements) in int32, so those must span < 2**31."""
    if not isinstance(t, torch.Tensor):
        fail(name, f"must be a tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        fail(name, f"must be a dense (strided) tensor, got layout {t.layout}")
    if ndim is not None and t.dim() not in ((ndim,) if isinstance(ndim, int) else ndim):
        fail(name, f"must have {ndim} dims, got shape {_shape(t)}")
    if shape is not None:
        if t.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(t.shape, shape)
        ):
            expected = tuple("*" if s is None else s for s in shape)
            fail(name, f"must have shape {expected}, got {_shape(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        fail(name, f"must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}{dtype_hint}")
    if device is not None and t.device != device:
        fail(name, f"must be on {device} like the other tensors, got {t.device}")
    if written and overlaps_itself(t):
        fail(name, f"is written, so it must not overlap itself (ordered by stride, each dim "
              f"must step past the span of the smaller ones), got strides {tuple(t.stride())} "
              f"for shape {_shape(t)}")
    if inner_dims is not None and t.dim() >= inner_dims and sum(
            (size - 1) * abs(stride) for size, stride in
            zip(t.shape[t.dim() - inner_dims:], t.stride()[t.dim() - inner_dims:])) >= 2**31:
        fail(name, f"must keep each block's (or token's) elements within 2**31 elements of "
              f"each other, got strides {tuple(t.stride())} for shape {_shape(t)}")


def check_devices(**tensors):
    """Every tensor argument on one device. The tensor off the others' device
    is named; with no majority (two tensors, say), each is."""
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    ranked = Counter(devices.values()).most_common()
    if len(ranked) < 2:
        return
    if ranked[0][1] == ranked[1][1]:
        where = ", ".join(f"`{name}` on {device}" for name, device in devices.items())
        raise ValueError(f"kda_ops: the tensors must share one device, got {where}")
    majority = ranked[0][0]
    name = next(name for name, device in devices.items() if device != majority)
    fail(name, f"must be on {majority} like the other tensors, got {devices[name]}")


def overlaps_itself(t) -> bool:
    """Whether two elements of `t` may share memory: true unless its dims,
    ordered by stride, each step past everything the smaller ones reach. Exotic
    interleaved layouts that happen not to overlap are refused too (proving
    them disjoint is a hard problem in general)."""
    if t.numel() == 0:
        return False
    reach = 0  # the largest offset the dims taken so far can reach
    for stride, size in sorted((abs(st), sz) for sz, st in zip(t.shape, t.stride()) if sz > 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


def _token_view(name, t, leading_ndim):
    """Accepts `[num_tokens, ...]` or `[1, num_tokens, ...]` and returns the
    shape without the optional leading 1."""
    if t.dim() == leading_ndim + 1:
        if t.shape[0] != 1:
            fail(name, f"may have an extra leading dim only of size 1, got shape {_shape(t)}")
        return tuple(t.shape[1:])
    if t.dim() != leading_ndim:
        fail(name, f"must have {leading_ndim} dims (or {leading_ndim + 1} with a leading 1), "
              f"got shape {_shape(t)}")
    return tuple(t.shape)


def _gate_params(A_log, dt_bias, num_heads, key_dim, device, num_layers=None):
    """A_log `[H]` / dt_bias `[H, K]` or `[H*K]`; with layers, `[L, H]` and
    `[L, H, K]` (or `[L, H*K]`)."""
    lead = () if num_layers is None else (num_layers,)
    check_tensor("A_log", A_log, shape=lead + (num_heads,), dtypes=GATE_DTYPES, device=device)
    check_tensor("dt_bias", dt_bias, dtypes=GATE_DTYPES, device=device)
    if _shape(dt_bias) not in (lead + (num_heads, key_dim), lead + (num_heads * key_dim,)):
        fail("dt_bias", f"must have shape {lead + (num_heads, key_dim)} or "
              f"{lead + (num_heads * key_dim,)}, got {_shape(dt_bias)}")


def _has_features(name, t, *sizes):
    """Head and channel dims hold at least one element (the kernels tile them)."""
    if any(size < 1 for size in sizes):
        fail(name, f"must have non-empty head / channel dims, got shape {_shape(t)}")


def _has_null_block(name, t, num_blocks):
    if num_blocks < 1:
        fail(name, f"must hold at least block 0, the null block, got shape {_shape(t)}")


def _request_metadata(query_start_loc, state_indices, device):
    check_tensor("state_indices", state_indices, ndim=1, dtypes=INDEX_DTYPES, device=device)
    batch = state_indices.shape[0]
    check_tensor("query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES, device=device)
    if query_start_loc.shape[0] != batch + 1:
        hint = ""
        if query_start_loc.shape[0] + 1 == batch:
            hint = (" (swapped with state_indices? verify and conv_update take (..., "
                    "query_start_loc, state_indices); commit, commit_plan and "
                    "stage_spec_decode_metadata take (num_accepted_tokens, state_indices, "
                    "query_start_loc))")
        fail("query_start_loc", f"must have shape ({batch + 1},) (one more entry than "
              f"state_indices), got {_shape(query_start_loc)}{hint}")
    return batch


def _correction_dtype(correction, origin):
    if origin is not None:
        check_tensor("correction", correction, dtypes=FLOAT64,
                     dtype_hint=_dtypes(origin, FLOAT64)[1])
    elif isinstance(correction, torch.Tensor) and correction.dtype != torch.float32:
        fail("correction", f"must have dtype torch.float32, got {correction.dtype} (a "
              f"module.to(dtype) converts buffers: keep the correction float32, see "
              f"docs/integration.md#7-caches-in-a-model-dtypes-and-gradients)")


def _float64_origin(**tensors):
    """The name of the first float64 tensor, or None. A call with one runs in
    float64, and every floating tensor but the gate parameters must be float64."""
    return next((name for name, t in tensors.items()
                 if isinstance(t, torch.Tensor) and t.dtype == torch.float64), None)


def _dtypes(origin, dtypes):
    """(allowed dtypes, hint) for a floating tensor of a call that runs in
    float64 because of tensor `origin`, or not (origin None)."""
    if origin is None:
        return dtypes, ""
    return FLOAT64, (f" (`{origin}` is float64, and a call in float64 has every tensor but "
                     f"A_log and dt_bias in float64: docs/semantics.md#12-float64)")


@dataclass(frozen=True)
class VerifyDims:
    num_tokens: int
    num_heads: int
    key_dim: int
    value_dim: int
    num_blocks: int
    spec_len: int  # the records' positions, R
    batch: int
    window_len: int  # the longest window, T <= R
    float64: bool  # runs the PyTorch path in float64


def _check_window_len(window_len, pending, positions):
    """T of the deferred schedule: required with `pending`, at most the records'
    positions; without `pending` T is the records' length (given or not)."""
    if pending is not None:
        if window_len is None:
            fail("spec_len", "is required with `pending` (the window capacity T; the records "
                 "hold R >= T positions)")
        _positive_int("spec_len", window_len)
        if window_len > positions:
            fail("spec_len", f"must be at most the records' {positions} positions, got "
                 f"{window_len}")
    elif window_len is not None and window_len != positions:
        fail("spec_len", f"must be the records' length {positions} without `pending` (the "
             f"immediate schedule's T), got {window_len}")
    return positions if window_len is None else window_len


def check_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                 query_start_loc, state_indices, lower_bound, out, pending=None,
                 window_len=None, parent=None) -> VerifyDims:
    check_devices(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias, state=state,
                  correction=correction, key_gate=key_gate, query_start_loc=query_start_loc,
                  state_indices=state_indices, out=out, pending=pending, parent=parent)
    origin = _float64_origin(state=state, q=q)
    activation_dtypes, hint = _dtypes(origin, ACTIVATION_DTYPES)
    check_tensor("q", q, dtypes=activation_dtypes, inner_dims=2, dtype_hint=hint)
    device = q.device
    num_tokens, num_heads, key_dim = _token_view("q", q, 3)
    _has_features("q", q, key_dim)
    for name, t in (("k", k), ("g", g)):
        check_tensor(name, t, dtypes=(q.dtype,), device=device, inner_dims=2)
        if _shape(t) != _shape(q):
            fail(name, f"must have the shape of q {_shape(q)}, got {_shape(t)}")
    check_tensor("v", v, dtypes=(q.dtype,), device=device, inner_dims=2)
    v_shape = _token_view("v", v, 3)
    if v.dim() != q.dim() or v_shape[:2] != (num_tokens, num_heads):
        fail("v", f"must have shape {_shape(q)[:-1] + ('V',)}, got {_shape(v)}")
    value_dim = v_shape[2]
    _has_features("v", v, value_dim)
    check_tensor("beta", beta, dtypes=activation_dtypes, device=device, inner_dims=1,
                 dtype_hint=hint)
    if beta.dim() != q.dim() - 1 or _token_view("beta", beta, 2) != (num_tokens, num_heads):
        fail("beta", f"must have shape {_shape(q)[:-1]}, got {_shape(beta)}")
    _gate_params(A_log, dt_bias, num_heads, key_dim, device)

    check_tensor("state", state, shape=(None, num_heads, value_dim, key_dim),
                 dtypes=_dtypes(origin, STATE_DTYPES)[0], device=device, inner_dims=3,
                 dtype_hint=hint)
    num_blocks = state.shape[0]
    _has_null_block("state", state, num_blocks)
    _correction_dtype(correction, origin)
    check_tensor("correction", correction, shape=(num_blocks, num_heads, None, value_dim),
                 device=device, written=True, inner_dims=3)
    spec_len = correction.shape[2]
    if spec_len < 1:
        fail("correction", f"must hold at least one token per window, got shape "
              f"{_shape(correction)}")
    check_tensor("key_gate", key_gate, shape=(num_blocks, num_heads, spec_len, 2 * key_dim),
                 dtypes=(k.dtype,), device=device, written=True, inner_dims=3)
    batch = _request_metadata(query_start_loc, state_indices, device)
    check_tensor("out", out, shape=_shape(v), dtypes=(v.dtype,), device=device, written=True,
                 inner_dims=2)
    if pending is not None:
        check_tensor("pending", pending, shape=(num_blocks,), dtypes=INDEX_DTYPES, device=device)
    window_len = _check_window_len(window_len, pending, spec_len)
    check_lower_bound(lower_bound)
    _check_tree_argument("parent", parent, (num_tokens,), device)
    return VerifyDims(num_tokens, num_heads, key_dim, value_dim, num_blocks, spec_len, batch,
                      window_len, origin is not None)


def _check_tree_argument(name, t, shape, device):
    """`parent` or `accepted_path` (docs/semantics.md#13-tree-drafts): index
    tensors of the given shape."""
    if t is not None:
        check_tensor(name, t, shape=shape, dtypes=INDEX_DTYPES, device=device)


def check_lower_bound(lower_bound):
    if lower_bound is not None and not (_is_float(lower_bound)
                                        and float("-inf") < lower_bound < 0):
        fail("lower_bound", f"must be a negative finite float or None, got {lower_bound!r}")


def check_scale(scale):
    if scale is not None and not _is_float(scale):
        fail("scale", f"must be a float or None, got {scale!r}")


def _positive_int(name, value):
    # The schema's int arguments arrive as ints (the dispatcher has already
    # turned a bool into one and refused a float) or, traced, as SymInts.
    if value < 1:
        fail(name, f"must be a positive int, got {value!r}")


@dataclass(frozen=True)
class PlanArgs:
    batch: int
    align: bool


def check_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
               request_indices, block_table, num_computed_tokens, block_size,
               device) -> PlanArgs:
    check_devices(num_accepted_tokens=num_accepted_tokens, state_indices=state_indices,
                  query_start_loc=query_start_loc, request_indices=request_indices,
                  block_table=block_table, num_computed_tokens=num_computed_tokens)
    batch = _request_metadata(query_start_loc, state_indices, device)
    check_tensor("num_accepted_tokens", num_accepted_tokens, ndim=1, dtypes=INDEX_DTYPES,
                 device=device)
    _positive_int("spec_len", spec_len)
    if request_indices is not None:
        check_tensor("request_indices", request_indices, shape=(batch,), dtypes=INDEX_DTYPES,
                     device=device)
    elif num_accepted_tokens.shape[0] < batch:
        fail("num_accepted_tokens", f"must have at least {batch} entries (one per request "
              f"without request_indices), got shape {_shape(num_accepted_tokens)}")
    align_args = {"block_table": block_table, "num_computed_tokens": num_computed_tokens,
                  "block_size": block_size}
    given = [name for name, a in align_args.items() if a is not None]
    if given and len(given) != 3:
        missing = [name for name in align_args if name not in given]
        fail(missing[0], f"is required in align mode (given: {', '.join(given)})")
    align = bool(given)
    if align:
        check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES, device=device)
        if block_table.shape[1] < 1:
            fail("block_table", f"must have at least one column, got {_shape(block_table)}")
        rows = block_table.shape[0]
        check_tensor("num_computed_tokens", num_computed_tokens, shape=(rows,),
                     dtypes=INDEX_DTYPES, device=device)
        _positive_int("block_size", block_size)
    return PlanArgs(batch, align)


@dataclass(frozen=True)
class CommitDims:
    num_layers: int
    stacked: bool
    num_blocks: int
    num_heads: int
    value_dim: int
    key_dim: int
    spec_len: int
    conv_dim: int
    conv_history: int
    float64: bool  # runs the PyTorch path in float64
    # A deferred commit over fewer requests folds whatever is pending (eager_fold_below).
    eager_fold_below: int = 0


def _check_layer_caches(state, correction, key_gate, A_log, dt_bias, lower_bound):
    """The caches and gate parameters that commit and flush take, stacked
    `[L, N, ...]` or one layer's. Returns (device, stacked, lead dims, layers,
    blocks, heads, V, K, record positions, the name of the float64 tensor or None)."""
    origin = _float64_origin(state=state)
    activation_dtypes, hint = _dtypes(origin, ACTIVATION_DTYPES)
    check_tensor("state", state, ndim=(4, 5), dtypes=_dtypes(origin, STATE_DTYPES)[0],
                 written=True, inner_dims=3)
    device = state.device
    stacked = state.dim() == 5
    lead = tuple(state.shape[:1]) if stacked else ()
    num_layers = state.shape[0] if stacked else 1
    num_blocks, num_heads, value_dim, key_dim = state.shape[-4:]
    _has_features("state", state, value_dim, key_dim)
    _has_null_block("state", state, num_blocks)
    _correction_dtype(correction, origin)
    check_tensor("correction", correction, shape=lead + (num_blocks, num_heads, None, value_dim),
                 device=device, inner_dims=3)
    positions = correction.shape[-2]
    if positions < 1:
        fail("correction", f"must hold at least one token per window, got shape "
             f"{_shape(correction)}")
    check_tensor("key_gate", key_gate, shape=lead + (num_blocks, num_heads, positions, 2 * key_dim),
                 dtypes=activation_dtypes, device=device, inner_dims=3, dtype_hint=hint)
    _gate_params(A_log, dt_bias, num_heads, key_dim, device,
                 num_layers=num_layers if stacked else None)
    check_lower_bound(lower_bound)
    return (device, stacked, lead, num_layers, num_blocks, num_heads, value_dim, key_dim,
            positions, origin)


def check_commit(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                 correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                 block_table, num_computed_tokens, block_size, pending=None,
                 window_len=None, accepted_path=None,
                 eager_fold=None) -> tuple[CommitDims, PlanArgs]:
    """With `pending`, the deferred schedule: `window_len` (T) is required and
    the records hold `spec_len` = R >= T positions."""
    check_devices(num_accepted_tokens=num_accepted_tokens, state_indices=state_indices,
                  query_start_loc=query_start_loc, state=state, conv_state=conv_state,
                  correction=correction, key_gate=key_gate, A_log=A_log, dt_bias=dt_bias,
                  request_indices=request_indices, block_table=block_table,
                  num_computed_tokens=num_computed_tokens, pending=pending,
                  accepted_path=accepted_path)
    (device, stacked, lead, num_layers, num_blocks, num_heads, value_dim, key_dim,
     spec_len, origin) = _check_layer_caches(state, correction, key_gate, A_log, dt_bias,
                                             lower_bound)
    if pending is not None:
        check_tensor("pending", pending, shape=lead + (num_blocks,), dtypes=INDEX_DTYPES,
                     device=device, written=True)
    window_len = _check_window_len(window_len, pending, spec_len)
    conv_dim, conv_history = 0, 0
    if conv_state is not None:
        conv_dtypes, hint = _dtypes(origin, ACTIVATION_DTYPES)
        check_tensor("conv_state", conv_state, shape=lead + (num_blocks, None, None),
                     dtypes=conv_dtypes, device=device, written=True, inner_dims=2,
                     dtype_hint=hint)
        conv_dim = conv_state.shape[-2]
        _has_features("conv_state", conv_state, conv_dim)
        conv_history = conv_state.shape[-1] - (window_len - 1)
        if conv_history < 1:
            fail("conv_state", f"must have W-1+T-1 >= T columns for T={window_len} "
                  f"(viewed [N, D, W-1+T-1]), got shape {_shape(conv_state)}")
    plan = check_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                      request_indices, block_table, num_computed_tokens, block_size, device)
    _check_tree_argument("accepted_path", accepted_path,
                         (num_accepted_tokens.shape[0], window_len), device)
    dims = CommitDims(num_layers, stacked, num_blocks, num_heads, value_dim, key_dim, spec_len,
                      conv_dim, conv_history, origin is not None,
                      eager_fold_below(eager_fold, pending))
    return dims, plan


# eager_fold=True: every batch is below it.
EVERY_BATCH = 2 ** 31 - 1


def check_eager_fold(eager_fold):
    """In the public function: the op's schema turns any value into a bool."""
    if eager_fold is not None and not isinstance(eager_fold, bool):
        fail("eager_fold", f"must be True, False or None, got {eager_fold!r}")


def eager_fold_below(eager_fold, pending):
    """The batch below which a deferred commit folds whatever is pending
    (docs/semantics.md#11-the-deferred-schedule): DEFERRED_EAGER_FOLD_BELOW_BATCH
    for None, every batch for True, none for False."""
    if eager_fold is None:
        return DEFERRED_EAGER_FOLD_BELOW_BATCH
    if pending is None:
        fail("eager_fold", "applies to the deferred schedule only: give it with `pending`")
    return EVERY_BATCH if eager_fold else 0


CONV_ACTIVATIONS = ("silu", None)


def check_activation(activation):
    if activation not in CONV_ACTIVATIONS:
        fail("activation", f"must be one of {list(CONV_ACTIVATIONS)}, got {activation!r}")


@dataclass(frozen=True)
class ConvDims:
    num_tokens: int
    dim: int
    width: int
    spec_len: int
    num_blocks: int
    batch: int
    float64: bool  # runs the PyTorch path in float64


def check_conv_update(x, conv_state, weight, bias, query_start_loc, state_indices, activation,
                      out, parent=None, weight_name="weight", bias_name="bias") -> ConvDims:
    """`weight_name`, `bias_name`: what the public function calls them."""
    check_devices(x=x, conv_state=conv_state, **{weight_name: weight, bias_name: bias},
                  query_start_loc=query_start_loc, state_indices=state_indices, out=out,
                  parent=parent)
    origin = _float64_origin(x=x, conv_state=conv_state)
    dtypes, hint = _dtypes(origin, ACTIVATION_DTYPES)
    check_tensor("x", x, ndim=2, dtypes=dtypes, inner_dims=1, dtype_hint=hint)
    device = x.device
    num_tokens, dim = x.shape
    _has_features("x", x, dim)
    check_tensor("conv_state", conv_state, shape=(None, dim, None), dtypes=dtypes,
                 device=device, written=True, inner_dims=2, dtype_hint=hint)
    _has_null_block("conv_state", conv_state, conv_state.shape[0])
    if isinstance(weight, torch.Tensor) and weight.dim() == 3 and weight.shape[1] == 1:
        fail(weight_name, f"must have shape ({dim}, W), got {_shape(weight)} (an nn.Conv1d "
             f"weight [D, 1, W]: pass {weight_name}.squeeze(1))")
    check_tensor(weight_name, weight, shape=(dim, None), dtypes=dtypes, device=device,
                 dtype_hint=hint)
    width = weight.shape[1]
    # The history keeps W-1 >= 1 columns, from which commit drops the oldest.
    if width < 2:
        fail(weight_name, f"must have shape ({dim}, W) with W >= 2, got {_shape(weight)}")
    spec_len = conv_state.shape[2] - (width - 1) + 1
    if spec_len < 1:
        fail("conv_state", f"must have W-1+T-1 >= {width - 1} columns for W={width} "
              f"(viewed [N, D, W-1+T-1]), got shape {_shape(conv_state)}")
    if bias is not None:
        check_tensor(bias_name, bias, shape=(dim,), dtypes=dtypes, device=device,
                     dtype_hint=hint)
    check_activation(activation)
    batch = _request_metadata(query_start_loc, state_indices, device)
    if out is not None:  # conv_verify keeps the outputs to itself
        check_tensor("out", out, shape=_shape(x), dtypes=dtypes, device=device, written=True,
                     inner_dims=1, dtype_hint=hint)
    _check_tree_argument("parent", parent, (num_tokens,), device)
    return ConvDims(num_tokens, dim, width, spec_len, conv_state.shape[0], batch,
                    origin is not None)


@dataclass(frozen=True)
class ConvVerifyDims:
    conv: ConvDims
    verify: VerifyDims

    @property
    def float64(self) -> bool:
        return self.verify.float64


def conv_verify_split(x, num_heads, key_dim, value_dim):
    """The q, k and v views of `[tokens, H (2K + V)]` convolution outputs."""
    return tuple(part.unflatten(-1, (num_heads, -1)) for part in
                 x.split([num_heads * key_dim, num_heads * key_dim, num_heads * value_dim], -1))


def conv_verify_out_shape(x, g, state):
    """`out`'s shape `[tokens, H, V]` from x, g (H, K) and state (V), their
    ranks checked first; check_verify checks the rest of g and state."""
    for name, t, ndim in (("x", x, 2), ("g", g, 3), ("state", state, 4)):
        check_tensor(name, t, ndim=ndim)
    return x.shape[0], g.shape[1], state.shape[2]


def check_conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state,
                      correction, key_gate, query_start_loc, state_indices, activation,
                      lower_bound, out, pending=None, window_len=None,
                      parent=None) -> ConvVerifyDims:
    conv = check_conv_update(x, conv_state, conv_weight, conv_bias, query_start_loc,
                             state_indices, activation, None, parent, "conv_weight", "conv_bias")
    _, num_heads, value_dim = conv_verify_out_shape(x, g, state)
    key_dim = g.shape[2]
    if conv.dim != num_heads * (2 * key_dim + value_dim):
        fail("x", f"must hold q | k | v, H (2K + V) = {num_heads * (2 * key_dim + value_dim)} "
             f"channels for H = {num_heads}, K = {key_dim} (g) and V = {value_dim} (state), got "
             f"shape {_shape(x)}")
    q, k, v = conv_verify_split(x, num_heads, key_dim, value_dim)
    verify = check_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                          query_start_loc, state_indices, lower_bound, out, pending, window_len,
                          parent)
    if conv.spec_len != verify.window_len:
        fail("conv_state", f"must hold windows of verify's T = {verify.window_len} tokens, "
             f"W-1+T-1 = {conv.width - 1 + verify.window_len - 1} columns for W = {conv.width}, "
             f"got shape {_shape(conv_state)} (T = {conv.spec_len})")
    return ConvVerifyDims(conv, verify)


def check_flush(state_indices, state, correction, key_gate, pending, A_log, dt_bias,
                lower_bound) -> CommitDims:
    check_devices(state_indices=state_indices, state=state, correction=correction,
                  key_gate=key_gate, pending=pending, A_log=A_log, dt_bias=dt_bias)
    (device, stacked, lead, num_layers, num_blocks, num_heads, value_dim, key_dim,
     positions, origin) = _check_layer_caches(state, correction, key_gate, A_log, dt_bias,
                                              lower_bound)
    check_tensor("pending", pending, shape=lead + (num_blocks,), dtypes=INDEX_DTYPES,
                 device=device, written=True)
    check_tensor("state_indices", state_indices, ndim=1, dtypes=INDEX_DTYPES, device=device)
    return CommitDims(num_layers, stacked, num_blocks, num_heads, value_dim, key_dim, positions,
                      0, 0, origin is not None)


def check_aligned_state_indices(block_table, seq_lens, block_size, num_state_slots):
    check_devices(block_table=block_table, seq_lens=seq_lens)
    check_tensor("block_table", block_table, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, shape=(block_table.shape[0],), dtypes=INDEX_DTYPES,
                 device=block_table.device)
    _positive_int("block_size", block_size)
    _positive_int("num_state_slots", num_state_slots)


def check_stage_spec_decode_metadata(state_indices, query_start_loc, num_accepted_tokens,
                                     staged_state_indices, staged_query_start_loc,
                                     staged_num_accepted_tokens, num_spec_decodes) -> int:
    """Returns how many rows can be real: min(source rows, staged rows)."""
    check_devices(state_indices=state_indices, query_start_loc=query_start_loc,
                  num_accepted_tokens=num_accepted_tokens,
                  staged_state_indices=staged_state_indices,
                  staged_query_start_loc=staged_query_start_loc,
                  staged_num_accepted_tokens=staged_num_accepted_tokens,
                  num_spec_decodes=num_spec_decodes)
    check_tensor("state_indices", state_indices, ndim=(1, 2), dtypes=INDEX_DTYPES)
    device = state_indices.device
    source_rows = state_indices.shape[0]
    check_tensor("query_start_loc", query_start_loc, shape=(source_rows + 1,),
                 dtypes=INDEX_DTYPES, device=device)
    check_tensor("num_accepted_tokens", num_accepted_tokens, ndim=1, dtypes=INDEX_DTYPES,
                 device=device)
    if num_accepted_tokens.shape[0] < source_rows:
        fail("num_accepted_tokens", f"must have at least {source_rows} entries (one per row "
              f"of state_indices), got shape {_shape(num_accepted_tokens)}")
    slots = tuple(state_indices.shape[1:])
    if slots == (0,):
        fail("state_indices", f"must hold at least one slot per row, got shape "
             f"{_shape(state_indices)}")
    check_tensor("staged_state_indices", staged_state_indices, shape=(None,) + slots,
                 dtypes=INDEX_DTYPES, device=device, written=True)
    batch = staged_state_indices.shape[0]
    check_tensor("staged_query_start_loc", staged_query_start_loc, shape=(batch + 1,),
                 dtypes=INDEX_DTYPES, device=device, written=True)
    check_tensor("staged_num_accepted_tokens", staged_num_accepted_tokens, shape=(batch,),
                 dtypes=INDEX_DTYPES, device=device, written=True)
    count_limit = min(source_rows, batch)
    if isinstance(num_spec_decodes, torch.Tensor):
        check_tensor("num_spec_decodes", num_spec_decodes, dtypes=INDEX_DTYPES, device=device)
        if num_spec_decodes.numel() != 1:
            fail("num_spec_decodes", f"must hold one element, got shape "
                  f"{_shape(num_spec_decodes)}")
    elif not 0 <= num_spec_decodes <= count_limit:  # an int or SymInt, as in _positive_int
        fail("num_spec_decodes", f"must be an int in [0, {count_limit}] (at most the rows of "
              f"state_indices and of staged_state_indices) or a one-element tensor, "
              f"got {num_spec_decodes!r}")
    return count_limit


def check_int(name, value):
    """For the public functions' int arguments, checked before the op is
    called: the dispatcher would turn a bool into an int and reject a float
    with a RuntimeError."""
    if not _is_int(value):
        fail(name, f"must be an int, got {value!r}")


def check_int_or_tensor(name, value):
    """As `check_int`, for arguments that pick between an int schema and a
    tensor schema."""
    if not isinstance(value, torch.Tensor) and not _is_int(value):
        fail(name, f"must be an int or a one-element tensor, got {value!r}")
