"""kda_ops: speculative decoding kernels for Kimi Delta Attention (KDA).

Every op is a `torch.library.triton_op` in the `kda_ops` namespace
(`torch.ops.kda_ops.<name>`); the functions here are the public entry points,
with the argument order of SPEC §6.
"""

__version__ = "0.1.0"

from typing import Optional

import torch
from torch import Tensor

from . import ops as _ops
from ._validation import (check_activation, check_int, check_int_or_tensor, check_lower_bound,
                          check_scale)

from .torch_impl import NULL_BLOCK

__all__ = ["verify", "commit", "commit_plan", "conv_update", "aligned_state_indices",
           "stage_spec_decode_metadata", "NULL_BLOCK"]


def verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor,
           dt_bias: Tensor, state: Tensor, correction: Tensor, key_gate: Tensor,
           query_start_loc: Tensor, state_indices: Tensor, *,
           lower_bound: Optional[float] = None, scale: Optional[float] = None,
           out: Optional[Tensor] = None) -> Tensor:
    """Runs each request's window from its checkpoint `state[state_indices[b]]`
    (left unchanged) and returns the outputs (like `v`).

    Records, per window token t < min(L, T), the correction `u_t` into
    `correction[block, :, t]` and the raw key and gate into `key_gate[block, :, t]`.
    Tokens of null rows (index <= 0 or >= num_blocks) and tokens past T get zero
    outputs; tokens outside every window are not written.
    """
    # Checked here too: the dispatcher would refuse a wrong type with a RuntimeError.
    check_lower_bound(lower_bound)
    check_scale(scale)
    if out is None:
        out = torch.empty_like(v)
    # Positional: Dynamo graph-breaks on any op given a non-contiguous `out=`
    # keyword (its rule for out= variants), and `out` may be a strided view.
    _ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                query_start_loc, state_indices, lower_bound, scale, out)
    return out


def commit(num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor, *,
           state: Tensor, conv_state: Optional[Tensor], correction: Tensor, key_gate: Tensor,
           A_log: Tensor, dt_bias: Tensor, lower_bound: Optional[float] = None,
           request_indices: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
           num_computed_tokens: Optional[Tensor] = None,
           block_size: Optional[int] = None) -> None:
    """Folds each request's accepted prefix into its checkpoint, for every layer
    (buffers stacked `[num_layers, N, ...]`, or one layer's 4-D buffers), and
    compacts the convolution history (`conv_state=None` skips it). SPEC §2, §4."""
    check_lower_bound(lower_bound)
    if block_size is not None:
        check_int("block_size", block_size)
    _ops.commit(num_accepted_tokens, state_indices, query_start_loc, state=state,
                conv_state=conv_state, correction=correction, key_gate=key_gate, A_log=A_log,
                dt_bias=dt_bias, lower_bound=lower_bound, request_indices=request_indices,
                block_table=block_table, num_computed_tokens=num_computed_tokens,
                block_size=block_size)


def commit_plan(num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor, *,
                spec_len: int, request_indices: Optional[Tensor] = None,
                block_table: Optional[Tensor] = None,
                num_computed_tokens: Optional[Tensor] = None,
                block_size: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per request: (commit_lens, final_state_indices, boundary_state_indices,
    boundary_recovery_lens), int32 `[B]` each, by the formula of SPEC §4. This is
    what `commit` computes inline; it is exposed for engines and tests."""
    check_int("spec_len", spec_len)
    if block_size is not None:
        check_int("block_size", block_size)
    return _ops.commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                            request_indices, block_table, num_computed_tokens, block_size)


def conv_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
                query_start_loc: Tensor, state_indices: Tensor, *,
                activation: Optional[str] = "silu", out: Optional[Tensor] = None) -> Tensor:
    """Causal depthwise convolution over each request's window (SPEC §2) and
    returns the outputs (like `x`, or written into `out`).

    `conv_state [N, D, W-1+T-1]` (any strides that do not overlap) holds the
    history in columns 0..W-2 of block `state_indices[b]`; the window's first
    min(L, T) tokens are convolved, and `[h_1..h_{W-2}, x_0..x_{min(L,T)-1}]`
    is written into columns 0..W-3+min(L, T); later columns are untouched (and
    all of them when L = 0).
    Tokens past T, and all tokens of null rows (index <= 0 or >= N, state
    untouched), get zero outputs; tokens outside every window are not written.
    """
    check_activation(activation)
    if out is None:
        out = torch.empty_like(x)
    # Positional, as in `verify`: a strided `out=` keyword makes Dynamo graph-break.
    _ops.conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                     activation, out)
    return out


def aligned_state_indices(block_table: Tensor, seq_lens: Tensor, block_size: int,
                          num_state_slots: int) -> Tensor:
    """`out[r, j] = block_table[r, max((seq_lens[r] - 1) // block_size, 0) + j]` for
    `j < num_state_slots` (SPEC §5): the state block that holds token
    `seq_lens[r] - 1` and the ones after it. Slots whose column would run past
    the table give NULL_BLOCK (nothing outside the table is read). Returns
    `[R, num_state_slots]` with the dtype of `block_table`.

    With `seq_lens = num_computed_tokens` this is where align mode keeps each
    request's checkpoint (SPEC §4: the block of its last folded token).
    """
    check_int("block_size", block_size)
    check_int("num_state_slots", num_state_slots)
    return _ops.aligned_state_indices(block_table, seq_lens, block_size, num_state_slots)


def stage_spec_decode_metadata(state_indices: Tensor, query_start_loc: Tensor,
                               num_accepted_tokens: Tensor, staged_state_indices: Tensor,
                               staged_query_start_loc: Tensor,
                               staged_num_accepted_tokens: Tensor,
                               num_spec_decodes) -> None:
    """Copies the first `n = num_spec_decodes` requests' metadata into the fixed
    buffers of a captured batch of `B = staged_state_indices.shape[0]` rows and
    fills the rest as padding (SPEC §5):

    - `staged_state_indices[:n] = state_indices[:n]`, the rest NULL_BLOCK
      (`[B]`, or `[B, slots]` like a 2-D `state_indices`); an index outside
      int32, null for any cache, is staged as NULL_BLOCK;
    - `staged_query_start_loc[:n+1] = query_start_loc[:n+1]`, the rest
      `query_start_loc[n]` (padding windows are empty);
    - `staged_num_accepted_tokens[:n] = num_accepted_tokens[:n]`, the rest 1.

    `num_spec_decodes` is either
    - an int in `[0, min(rows of state_indices, B)]` (checked): it is a launch
      argument, so a traced graph specialises on it (torch.compile guards on
      it, or marks it dynamic after it changes) and a CUDA graph captured around
      this call replays with the same `n`; or
    - a one-element integer tensor on the device of the other tensors: it is
      read by the kernel (no host sync), clamped to that range, so the call can
      sit inside a captured CUDA graph and each replay stages the current `n`.
    """
    check_int_or_tensor("num_spec_decodes", num_spec_decodes)
    args = (state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
            staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes)
    if isinstance(num_spec_decodes, Tensor):
        _ops.stage_spec_decode_metadata_tensor_count(*args)
    else:
        _ops.stage_spec_decode_metadata(*args)
