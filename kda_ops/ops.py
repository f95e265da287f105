"""Registration of every kda_ops operator: schemas and mutation annotations.

Each body validates its arguments, then routes by device: CUDA tensors (and CPU
tensors under TRITON_INTERPRET=1, eagerly) to the Triton kernels through
`wrap_triton`, other CPU tensors to `torch_impl`. The body doubles as the fake
implementation, so it reads no tensor values.

Custom ops take no keyword-only tensors, so the op schemas keep the public
functions' argument order (README.md#usage) with every argument
positional-or-keyword.

An op that writes its arguments stays one opaque node when torch.compile or
AOTInductor functionalizes a graph (`opaque_when_functionalized`); only the
ops that write nothing but their own outputs are decomposed into their kernels.
"""

import logging
import os
from typing import Optional

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.library import triton_op

from . import torch_impl
from ._validation import (check_aligned_state_indices, check_commit, check_conv_update,
                          check_conv_verify, check_flush, check_plan,
                          check_stage_spec_decode_metadata, check_verify)

try:  # CPU tensors need no triton; use_triton refuses the tensors that do when it is missing
    from .kernels.commit import launch_commit, launch_commit_plan, launch_flush
    from .kernels.conv import launch_conv_update
    from .kernels.staging import launch_aligned_state_indices, launch_stage_spec_decode_metadata
    from .kernels.verify import launch_conv_verify, launch_verify
except ImportError as error:
    if error.name is None or error.name.partition(".")[0] != "triton":
        raise
    triton_import_error: Optional[ImportError] = error
    # Without triton, torch warns at every triton_op below that it finds no kernels: expected here.
    logging.getLogger("torch._library.triton").addFilter(
        lambda record: not record.getMessage().startswith("Triton not available"))
else:
    triton_import_error = None

MISSING_TRITON = ("kda_ops: CUDA tensors need triton (pip install 'triton>=3.6,<3.10'); "
                  "the PyTorch path serves CPU tensors")
MISSING_TRITON_INTERPRET = ("kda_ops: TRITON_INTERPRET=1 sends CPU tensors to the Triton "
                            "kernels, which need triton (pip install 'triton>=3.6,<3.10'); "
                            "without TRITON_INTERPRET=1 the PyTorch path serves them")


def use_triton(t: Tensor) -> bool:
    # The interpreter runs eagerly only: traced (fake) CPU tensors take the torch path.
    needed = t.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and t.device.type == "cpu"
                           and not is_fake(t))
    if needed and triton_import_error is not None:
        raise ImportError(MISSING_TRITON if t.is_cuda else MISSING_TRITON_INTERPRET) \
            from triton_import_error
    return needed


def runs_triton(t: Tensor, dims) -> bool:
    """Float64 calls run the PyTorch path on every device: the kernels
    compute in float32 (docs/semantics.md#12-float64)."""
    return not dims.float64 and use_triton(t)


def opaque_when_functionalized(op):
    """Makes functionalization keep `op` as one node (auto-functionalized: the
    written tensors, views of a stacked cache included, are tracked through
    their base and written in place) instead of replacing it by its Triton
    launches. triton_op decomposes by default, and Inductor then clones each
    written argument for the kernel: for a view at a non-zero offset (a layer
    slice `state[l]`, l >= 1) it sized the clone as the view but addressed it
    at the view's offset, so the kernel read and wrote past it (torch 2.11 on
    CUDA: wrong values, or an illegal memory access with large caches).
    Applies on every device, so that CPU graphs have the same shape."""
    def functionalize_opaque(mode, overload, types, args, kwargs):
        return mode.__torch_dispatch__(overload, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, functionalize_opaque)
    return op


@opaque_when_functionalized
@triton_op("kda_ops::verify", mutates_args={"correction", "key_gate", "out"})
def verify(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor,
    state: Tensor, correction: Tensor, key_gate: Tensor,
    query_start_loc: Tensor, state_indices: Tensor,
    lower_bound: Optional[float], scale: Optional[float], out: Tensor,
    pending: Optional[Tensor] = None, spec_len: Optional[int] = None,
    parent: Optional[Tensor] = None,
) -> None:
    # Custom ops cannot return an alias of an input, so the op writes into a
    # caller-provided `out` (required here); `kda_ops.verify` allocates it when not given.
    # The options before it have no default either: a required argument cannot follow
    # defaulted ones, and keeping the positions keeps compiled graphs cached by Inductor
    # valid (its cache key does not cover op schemas).
    dims = check_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                        query_start_loc, state_indices, lower_bound, out, pending, spec_len,
                        parent)
    scale = dims.key_dim ** -0.5 if scale is None else scale
    impl = launch_verify if runs_triton(q, dims) else torch_impl.verify
    impl(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate, query_start_loc,
         state_indices, lower_bound, scale, out, dims, pending, dims.window_len, parent)


@opaque_when_functionalized
@triton_op("kda_ops::commit", mutates_args={"state", "conv_state", "pending"})
def commit(
    num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor,
    state: Tensor, conv_state: Optional[Tensor], correction: Tensor, key_gate: Tensor,
    A_log: Tensor, dt_bias: Tensor, lower_bound: Optional[float] = None,
    request_indices: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
    num_computed_tokens: Optional[Tensor] = None, block_size: Optional[int] = None,
    pending: Optional[Tensor] = None, spec_len: Optional[int] = None,
    accepted_path: Optional[Tensor] = None, eager_fold: Optional[bool] = None,
) -> None:
    dims, plan = check_commit(num_accepted_tokens, state_indices, query_start_loc, state,
                              conv_state, correction, key_gate, A_log, dt_bias, lower_bound,
                              request_indices, block_table, num_computed_tokens, block_size,
                              pending, spec_len, accepted_path, eager_fold)
    if runs_triton(state, dims):
        launch_commit(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                      correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                      block_table, num_computed_tokens, block_size, dims, plan, pending, spec_len,
                      accepted_path)
    elif pending is not None:
        torch_impl.commit_deferred(num_accepted_tokens, state_indices, query_start_loc, state,
                                   conv_state, correction, key_gate, A_log, dt_bias, lower_bound,
                                   request_indices, block_table, num_computed_tokens, block_size,
                                   pending, spec_len, dims, accepted_path)
    else:
        torch_impl.commit(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                          correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                          block_table, num_computed_tokens, block_size, dims, plan,
                          accepted_path)


@opaque_when_functionalized
@triton_op("kda_ops::flush", mutates_args={"state", "pending"})
def flush(
    state_indices: Tensor, state: Tensor, correction: Tensor, key_gate: Tensor, pending: Tensor,
    A_log: Tensor, dt_bias: Tensor, lower_bound: Optional[float] = None,
) -> None:
    dims = check_flush(state_indices, state, correction, key_gate, pending, A_log, dt_bias,
                       lower_bound)
    impl = launch_flush if runs_triton(state, dims) else torch_impl.flush
    impl(state_indices, state, correction, key_gate, pending, A_log, dt_bias, lower_bound, dims)


@triton_op("kda_ops::commit_plan", mutates_args=())
def commit_plan(
    num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor,
    spec_len: int, request_indices: Optional[Tensor] = None,
    block_table: Optional[Tensor] = None, num_computed_tokens: Optional[Tensor] = None,
    block_size: Optional[int] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len, request_indices,
               block_table, num_computed_tokens, block_size, state_indices.device)
    if use_triton(state_indices):
        outputs = tuple(torch.empty_like(state_indices, dtype=torch.int32) for _ in range(4))
        launch_commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                           request_indices, block_table, num_computed_tokens, block_size, outputs)
        return outputs
    plan = torch_impl.commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                                  request_indices, block_table, num_computed_tokens, block_size)
    return tuple(column.to(torch.int32) for column in plan)


@opaque_when_functionalized
@triton_op("kda_ops::conv_update", mutates_args={"conv_state", "out"})
def conv_update(
    x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
    query_start_loc: Tensor, state_indices: Tensor, activation: Optional[str], out: Tensor,
    parent: Optional[Tensor] = None,
) -> None:
    # Writes into a caller-provided `out`, as verify does; `kda_ops.conv_update`
    # allocates it when not given.
    dims = check_conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                             activation, out, parent)
    impl = launch_conv_update if runs_triton(x, dims) else torch_impl.conv_update
    impl(x, conv_state, weight, bias, query_start_loc, state_indices, activation, out, dims,
         parent)


@opaque_when_functionalized
@triton_op("kda_ops::conv_verify", mutates_args={"conv_state", "correction", "key_gate", "out"})
def conv_verify(
    x: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
    g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor,
    correction: Tensor, key_gate: Tensor, query_start_loc: Tensor, state_indices: Tensor,
    activation: Optional[str], lower_bound: Optional[float], scale: Optional[float],
    out: Tensor, pending: Optional[Tensor] = None, spec_len: Optional[int] = None,
    parent: Optional[Tensor] = None,
) -> None:
    # Writes into a caller-provided `out`, as verify does.
    dims = check_conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias,
                             state, correction, key_gate, query_start_loc, state_indices,
                             activation, lower_bound, out, pending, spec_len, parent)
    scale = dims.verify.key_dim ** -0.5 if scale is None else scale
    impl = launch_conv_verify if runs_triton(x, dims) else torch_impl.conv_verify
    impl(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state, correction,
         key_gate, query_start_loc, state_indices, activation, lower_bound, scale, out, dims,
         pending, dims.verify.window_len, parent)


@triton_op("kda_ops::aligned_state_indices", mutates_args=())
def aligned_state_indices(
    block_table: Tensor, seq_lens: Tensor, block_size: int, num_state_slots: int,
) -> Tensor:
    check_aligned_state_indices(block_table, seq_lens, block_size, num_state_slots)
    if use_triton(block_table):
        out = block_table.new_empty((block_table.shape[0], num_state_slots))
        launch_aligned_state_indices(block_table, seq_lens, block_size, out)
        return out
    return torch_impl.aligned_state_indices(block_table, seq_lens, block_size, num_state_slots)


STAGED_BUFFERS = {"staged_state_indices", "staged_query_start_loc", "staged_num_accepted_tokens"}


def _stage(state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
           staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes):
    args = (state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
            staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes)
    count_limit = check_stage_spec_decode_metadata(*args)
    impl = (launch_stage_spec_decode_metadata if use_triton(state_indices)
            else torch_impl.stage_spec_decode_metadata)
    impl(*args, count_limit)


# Two schemas, one per type of the count: an int is baked into the traced graph
# (and into a captured CUDA graph), a one-element tensor is read on the device,
# so one captured graph serves every count.
@opaque_when_functionalized
@triton_op("kda_ops::stage_spec_decode_metadata", mutates_args=STAGED_BUFFERS)
def stage_spec_decode_metadata(
    state_indices: Tensor, query_start_loc: Tensor, num_accepted_tokens: Tensor,
    staged_state_indices: Tensor, staged_query_start_loc: Tensor,
    staged_num_accepted_tokens: Tensor, num_spec_decodes: int,
) -> None:
    _stage(state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
           staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes)


@opaque_when_functionalized
@triton_op("kda_ops::stage_spec_decode_metadata_tensor_count", mutates_args=STAGED_BUFFERS)
def stage_spec_decode_metadata_tensor_count(
    state_indices: Tensor, query_start_loc: Tensor, num_accepted_tokens: Tensor,
    staged_state_indices: Tensor, staged_query_start_loc: Tensor,
    staged_num_accepted_tokens: Tensor, num_spec_decodes: Tensor,
) -> None:
    _stage(state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
           staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes)


# The ops are inference-only. A backward through their outputs must fail
# loudly rather than leave the inputs' gradients silently None; and it must
# fail when it runs, not when torch.compile traces the backward graph of a
# forward that merely has parameters requiring grad.
@torch.library.custom_op("kda_ops::no_backward", mutates_args=())
def no_backward(grad: Tensor, input: Tensor, op_name: str) -> Tensor:
    """Stands for the gradient of `input`: the backward graph keeps it (a
    gradient flows to an input that requires grad) and it raises when run."""
    raise RuntimeError(f"kda_ops.{op_name} is inference-only: it has no backward. Run the "
                       f"decode step under torch.no_grad() or torch.inference_mode(), or detach "
                       f"what flows into a loss")


@no_backward.register_fake
def _(grad, input, op_name):
    return torch.empty_like(input)


class _InferenceOnlyOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, op_name, out, *inputs):
        ctx.op_name = op_name
        ctx.save_for_backward(*inputs)
        return out

    @staticmethod
    def backward(ctx, grad):
        return (None, None) + tuple(no_backward(grad, t, ctx.op_name) for t in ctx.saved_tensors)


def inference_only(op_name: str, out: Tensor, *inputs: Optional[Tensor]) -> Tensor:
    """`out`, tied to the inputs that require grad (when grad mode tracks them)
    so that a backward through it raises instead of passing over the op."""
    tracked = [t for t in inputs if t is not None and t.requires_grad]
    if not tracked or not torch.is_grad_enabled():
        return out
    return _InferenceOnlyOutput.apply(op_name, out, *tracked)
