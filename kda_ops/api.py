"""The public functions: argument checks a dispatcher would make less clear,
`out` allocation, then the registered op (ops.py). Re-exported by `kda_ops`.

Conventions (docs/semantics.md#9-conventions): the state is `[N, H, V, K]`
(V first); `g` and `beta` are raw (the gate and the sigmoid are applied
inside); `q` and `k` are L2-normalised inside.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import ops as _ops
from . import value_checks
from ._validation import (check_activation, check_eager_fold, check_int, check_int_or_tensor,
                          check_lower_bound, check_scale, conv_verify_out_shape)

__all__ = ["verify", "commit", "flush", "commit_plan", "CommitPlan", "conv_update",
           "conv_verify", "aligned_state_indices", "stage_spec_decode_metadata"]


def verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor,
           dt_bias: Tensor, state: Tensor, correction: Tensor, key_gate: Tensor,
           query_start_loc: Tensor, state_indices: Tensor, *,
           lower_bound: Optional[float] = None, scale: Optional[float] = None,
           out: Optional[Tensor] = None, pending: Optional[Tensor] = None,
           spec_len: Optional[int] = None, parent: Optional[Tensor] = None) -> Tensor:
    """Runs each request's window from its checkpoint and records what `commit`
    needs to fold the accepted prefix later (docs/semantics.md#3-verify).

    The checkpoint `state[state_indices[b]]` is only read. Per window token
    t < min(L, T) the correction `u_t` goes to `correction[block, :, t]` and the
    raw key and gate to `key_gate[block, :, t]`. Tokens of null rows (index <= 0
    or >= N) and tokens past T get zero outputs; tokens outside every window are
    not written.

    Args:
        q, k: `[num_tokens, H, K]` (or `[1, num_tokens, H, K]`), float16, bfloat16
            or float32: queries and keys, NOT normalised (L2-normalised inside).
        v: `[num_tokens, H, V]`, the dtype of q.
        g: `[num_tokens, H, K]`, the dtype of q: the RAW gate input, before
            `dt_bias`, `A_log` and the lower bound are applied.
        beta: `[num_tokens, H]`: RAW beta logits (sigmoid applied inside; a beta
            already passed through sigmoid gives wrong results).
        A_log: `[H]`, log of the decay rate A.
        dt_bias: `[H, K]` or `[H * K]`.
        state: `[N, H, V, K]`, float32 or bfloat16: the checkpoints, V before K
            (transpose a `[K, V]` state with `state.transpose(-1, -2)`). Block 0
            is the null block.
        correction: `[N, H, T, V]` float32, written: per-token corrections; T is
            the window capacity.
        key_gate: `[N, H, T, 2K]`, the dtype of k, written: raw key, then raw gate.
        query_start_loc: `[B + 1]` int32/int64: request b's tokens are
            `query_start_loc[b] : query_start_loc[b + 1]`.
        state_indices: `[B]` int32/int64: request b's block (<= 0: padding row).
        lower_bound: negative finite float: the gate is `lower_bound * sigmoid(A (g +
            dt_bias))`; None: `-A softplus(g + dt_bias)`. Give commit the same.
        scale: query scale, default `K ** -0.5`.
        out: `[num_tokens, H, V]` like v, written (allocated when None).
        pending: `[N]` int32/int64, the deferred schedule's count of records not
            yet folded into each block's checkpoint (then `correction` and
            `key_gate` hold R >= T positions): each window starts from the
            checkpoint folded with them and is recorded after them
            (docs/semantics.md#11-the-deferred-schedule). Read only.
        spec_len: T, the longest window, when `pending` is given (the records
            then hold R >= T positions); tokens past it get zero outputs.
        parent: `[num_tokens]` int32/int64, packed like the tokens: the windows
            are trees (docs/semantics.md#13-tree-drafts). Node t of a window
            (its t-th token) continues the path of node `parent[t]` (window-
            relative, `0 .. t-1`; the root's is -1): its output and record are
            those of sequential decoding along its path from the checkpoint
            (with `pending`, folded with the pending records). None: chains.

    Returns:
        `out`, `[num_tokens, H, V]` like v.
    """
    # Checked here too: the dispatcher would refuse a wrong type with a RuntimeError.
    check_lower_bound(lower_bound)
    check_scale(scale)
    if spec_len is not None:
        check_int("spec_len", spec_len)
    if out is None:
        out = torch.empty_like(v)
    checked = None
    if value_checks.should_check(q, query_start_loc, state_indices):
        checked = value_checks.verify_call(q, k, v, g, beta, A_log, dt_bias, state, correction,
                                           key_gate, query_start_loc, state_indices,
                                           lower_bound, scale, out, pending, spec_len, parent)
    # Positional: Dynamo graph-breaks on any op given a non-contiguous `out=`
    # keyword (its rule for out= variants), and `out` may be a strided view.
    # A chain passes no `parent`: its calls and compiled graphs stay as they were.
    tree = () if parent is None else (parent,)
    _ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                query_start_loc, state_indices, lower_bound, scale, out, pending, spec_len,
                *tree)
    if checked is not None:
        value_checks.verify_done(checked, out, correction)
    return _ops.inference_only("verify", out, q, k, v, g, beta, A_log, dt_bias, state)


def commit(num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor, *,
           state: Tensor, conv_state: Optional[Tensor] = None, correction: Tensor,
           key_gate: Tensor, A_log: Tensor, dt_bias: Tensor,
           lower_bound: Optional[float] = None, request_indices: Optional[Tensor] = None,
           block_table: Optional[Tensor] = None, num_computed_tokens: Optional[Tensor] = None,
           block_size: Optional[int] = None, pending: Optional[Tensor] = None,
           spec_len: Optional[int] = None, accepted_path: Optional[Tensor] = None,
           eager_fold: Optional[bool] = None) -> None:
    """Folds each request's accepted prefix into its checkpoint and compacts
    the convolution history (docs/semantics.md#5-commit), for every layer at
    once (buffers stacked `[L, N, ...]`) or for one layer (4-D buffers).

    Args:
        num_accepted_tokens: `[rows]` int32/int64: tokens to fold per request
            row (clamped to `[0, min(L, T)]`; 0 leaves the request untouched).
        state_indices: `[B]` int32/int64: each request's checkpoint block (the
            source; <= 0 or >= N: padding row).
        query_start_loc: `[B + 1]`: the windows that verify ran.
        state: `[(L,) N, H, V, K]` float32/bfloat16, written.
        conv_state: `[(L,) N, D, W-1+T-1]` (any non-overlapping strides), written;
            None skips the history.
        correction, key_gate: the records verify wrote, `[(L,) N, H, T, V]` and
            `[(L,) N, H, T, 2K]`.
        A_log, dt_bias: `[(L,) H]` and `[(L,) H, K]` (or `[(L,) H * K]`): the
            gate parameters verify was given, layer by layer.
        lower_bound: as given to verify.
        request_indices: `[B]`: the row of `num_accepted_tokens` (and of the
            block table) for request b; default b.
        block_table, num_computed_tokens, block_size: align mode (prefix
            caching), all three or none: `[rows, columns]` blocks, `[rows]`
            tokens already folded, tokens per block
            (docs/semantics.md#4-the-commit-plan).
        pending: `[(L,) N]` int32/int64, written: the deferred schedule's counts
            (docs/semantics.md#11-the-deferred-schedule); the records then hold
            R >= T positions, and `spec_len` gives T.
        spec_len: T, the window capacity: required with `pending`; without it
            T is the records' length (and spec_len, if given, must equal it).
        accepted_path: `[rows, T]` int32/int64, the rows of
            `num_accepted_tokens`: for windows that verify ran as trees, each
            row's accepted nodes in path order (window-relative, entry 0 the
            root 0); the first `num_accepted_tokens` are folded in that order
            and the history follows them (docs/semantics.md#13-tree-drafts).
            None: chains. With `pending`, `[rows, spec_len]`: a row whose path
            leaves the chain 0, 1, ... folds at once (the pending records,
            then the path's); one along it is a chain's.
        eager_fold: with `pending`, whether this commit folds whatever is
            pending, as the immediate schedule does (True), or only what the
            next window needs (False); None: True below
            DEFERRED_EAGER_FOLD_BELOW_BATCH requests (16), where that is faster
            (docs/semantics.md#11-the-deferred-schedule).
    """
    check_lower_bound(lower_bound)
    if block_size is not None:
        check_int("block_size", block_size)
    if spec_len is not None:
        check_int("spec_len", spec_len)
    check_eager_fold(eager_fold)
    checked = None
    if value_checks.should_check(state, query_start_loc, state_indices):
        checked = value_checks.commit_call(
            num_accepted_tokens, state_indices, query_start_loc, state, conv_state, correction,
            key_gate, A_log, dt_bias, lower_bound, request_indices, block_table,
            num_computed_tokens, block_size, pending, spec_len, accepted_path, eager_fold)
    if spec_len is None and pending is None and isinstance(correction, Tensor) \
            and correction.dim() >= 2:
        # Always given: torch 2.11 drops trailing arguments left at their defaults
        # before it bumps the versions of the written ones, and then cannot find
        # `pending` (an IndexError outside inference mode).
        spec_len = correction.shape[-2]
    # Given only when set, so that calls without them keep their compiled graphs.
    optional = {name: value for name, value in (("accepted_path", accepted_path),
                                                ("eager_fold", eager_fold)) if value is not None}
    _ops.commit(num_accepted_tokens, state_indices, query_start_loc, state=state,
                conv_state=conv_state, correction=correction, key_gate=key_gate, A_log=A_log,
                dt_bias=dt_bias, lower_bound=lower_bound, request_indices=request_indices,
                block_table=block_table, num_computed_tokens=num_computed_tokens,
                block_size=block_size, pending=pending, spec_len=spec_len, **optional)
    if checked is not None:
        value_checks.commit_done(checked, state)


def flush(state_indices: Tensor, *, state: Tensor, correction: Tensor, key_gate: Tensor,
          pending: Tensor, A_log: Tensor, dt_bias: Tensor,
          lower_bound: Optional[float] = None) -> None:
    """The deferred schedule's write-back (docs/semantics.md#11-the-deferred-schedule):
    folds each listed block's pending records into its checkpoint and zeroes
    its count, so that `state[block]` holds the exact state after every
    accepted token. For requests that finish into the prefix cache, are
    preempted, or whose state another kernel will read.

    Args:
        state_indices: `[B]` int32/int64: blocks to flush (<= 0 or >= N: skipped;
            a block listed twice is folded twice by the Triton kernels, once on
            the PyTorch path: list each once; the value checks refuse it).
        state, correction, key_gate, A_log, dt_bias, lower_bound: as in `commit`
            (stacked `[L, N, ...]` or one layer's).
        pending: `[(L,) N]` int32/int64, written: pending records per block.
    """
    check_lower_bound(lower_bound)
    checked = None
    if value_checks.should_check(state, state_indices):
        checked = value_checks.flush_call(state_indices, state, correction, key_gate, pending,
                                          A_log, dt_bias, lower_bound)
    _ops.flush(state_indices, state, correction, key_gate, pending, A_log, dt_bias, lower_bound)
    if checked is not None:
        value_checks.flush_done(checked, state)


class CommitPlan(NamedTuple):
    """What `commit` does per request b, int32 `[B]` each."""

    commit_lens: Tensor  #: tokens folded
    final_state_indices: Tensor  #: block that receives the folded state (NULL_BLOCK: none)
    boundary_state_indices: Tensor  #: align mode: block that receives the boundary state
    boundary_recovery_lens: Tensor  #: align mode: tokens folded into the boundary state


def commit_plan(num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor, *,
                spec_len: int, request_indices: Optional[Tensor] = None,
                block_table: Optional[Tensor] = None,
                num_computed_tokens: Optional[Tensor] = None,
                block_size: Optional[int] = None) -> CommitPlan:
    """The plan `commit` computes inline, by the formula of
    docs/semantics.md#4-the-commit-plan, exposed for engines and tests.

    Takes `commit`'s metadata arguments (same shapes) and `spec_len`, the
    window capacity T. Indices outside int32 are planned as NULL_BLOCK, as
    staging does. Returns a `CommitPlan` of int32 `[B]` tensors.
    """
    check_int("spec_len", spec_len)
    if block_size is not None:
        check_int("block_size", block_size)
    if value_checks.should_check(state_indices, query_start_loc):
        value_checks.commit_plan_call(num_accepted_tokens, state_indices, query_start_loc,
                                      spec_len, request_indices, block_table,
                                      num_computed_tokens, block_size)
    return CommitPlan(*_ops.commit_plan(num_accepted_tokens, state_indices, query_start_loc,
                                        spec_len, request_indices, block_table,
                                        num_computed_tokens, block_size))


def conv_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Optional[Tensor],
                query_start_loc: Tensor, state_indices: Tensor, *,
                activation: Optional[str] = "silu", out: Optional[Tensor] = None,
                parent: Optional[Tensor] = None) -> Tensor:
    """Causal depthwise convolution over each request's window
    (docs/semantics.md#6-conv_update).

    The first min(L, T) tokens are convolved with the history in columns
    0..W-2 of block `state_indices[b]`, and `[h_1..h_{W-2}, x_0..x_{min(L,T)-1}]`
    is written into columns 0..W-3+min(L, T) (the later columns are untouched,
    and all of them when L = 0); commit later keeps the accepted part. Tokens
    past T, and all tokens of null rows (index <= 0 or >= N, state untouched),
    get zero outputs; tokens outside every window are not written.

    Args:
        x: `[num_tokens, D]` float16/bfloat16/float32: the convolution input.
        conv_state: `[N, D, W-1+T-1]`, the activation dtypes, any strides that
            do not overlap (an engine's `[N, W-1+T-1, D]` passed as
            `.transpose(-1, -2)`), written. T is read from its width: with only
            W-1 columns, T = 1.
        weight: `[D, W]` (an `nn.Conv1d` weight `[D, 1, W]`: `.squeeze(1)`).
        bias: `[D]` or None.
        query_start_loc: `[B + 1]` int32/int64; state_indices: `[B]` int32/int64.
        activation: "silu" or None.
        out: `[num_tokens, D]`, written (allocated like x when None).
        parent: `[num_tokens]` int32/int64: tree windows, as in `verify`; node t
            convolves its path's last W inputs, continuing into the history
            past its root (docs/semantics.md#13-tree-drafts).

    Returns:
        `out`, `[num_tokens, D]`.
    """
    check_activation(activation)
    if out is None:
        out = torch.empty_like(x)
    checked = None
    if value_checks.should_check(x, query_start_loc, state_indices):
        checked = value_checks.conv_update_call(x, conv_state, weight, bias, query_start_loc,
                                                state_indices, activation, out, parent)
    # Positional, as in `verify`: a strided `out=` keyword makes Dynamo graph-break.
    tree = () if parent is None else (parent,)
    _ops.conv_update(x, conv_state, weight, bias, query_start_loc, state_indices, activation,
                     out, *tree)
    if checked is not None:
        value_checks.conv_update_done(checked, out)
    return _ops.inference_only("conv_update", out, x, conv_state, weight, bias)


def conv_verify(x: Tensor, conv_state: Tensor, conv_weight: Tensor, conv_bias: Optional[Tensor],
                g: Tensor, beta: Tensor, A_log: Tensor, dt_bias: Tensor, state: Tensor,
                correction: Tensor, key_gate: Tensor, query_start_loc: Tensor,
                state_indices: Tensor, *, activation: Optional[str] = "silu",
                lower_bound: Optional[float] = None, scale: Optional[float] = None,
                out: Optional[Tensor] = None, pending: Optional[Tensor] = None,
                spec_len: Optional[int] = None, parent: Optional[Tensor] = None) -> Tensor:
    """`conv_update` of a layer's q | k | v input, then `verify` of its output,
    in one op (docs/semantics.md#14-conv_verify): the same results and writes
    as the two calls, with the convolution's output (in x's dtype) kept to the
    op; one node per layer in a traced graph.

    Args:
        x: `[num_tokens, D]`, `D = H (2K + V)`: the convolution's input, whose
            output splits into q (`H K` channels, head-major), k (`H K`) and
            v (`H V`).
        conv_state, conv_weight, conv_bias, activation: as conv_update's
            `conv_state`, `weight`, `bias` and `activation`; the conv state's
            columns must hold windows of verify's T (`W-1+T-1`).
        g, beta, A_log, dt_bias, state, correction, key_gate, query_start_loc,
        state_indices, lower_bound, scale, out, pending, spec_len, parent: as
            in `verify` (`g` gives H and K, `state` gives V).

    Returns:
        `out`, `[num_tokens, H, V]` in x's dtype.
    """
    check_activation(activation)
    check_lower_bound(lower_bound)
    check_scale(scale)
    if spec_len is not None:
        check_int("spec_len", spec_len)
    if out is None:
        out = x.new_empty(conv_verify_out_shape(x, g, state))
    checked = None
    if value_checks.should_check(x, query_start_loc, state_indices):
        checked = value_checks.conv_verify_call(
            x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state, correction,
            key_gate, query_start_loc, state_indices, activation, lower_bound, scale, out,
            pending, spec_len, parent)
    # Positional, as in `verify`: a strided `out=` keyword makes Dynamo graph-break.
    tree = () if parent is None else (parent,)
    _ops.conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state,
                     correction, key_gate, query_start_loc, state_indices, activation,
                     lower_bound, scale, out, pending, spec_len, *tree)
    if checked is not None:
        value_checks.verify_done(checked, out, correction)
    return _ops.inference_only("conv_verify", out, x, conv_state, conv_weight, conv_bias, g,
                               beta, A_log, dt_bias, state)


def aligned_state_indices(block_table: Tensor, seq_lens: Tensor, block_size: int,
                          num_state_slots: int) -> Tensor:
    """`out[r, j] = block_table[r, max((seq_lens[r] - 1) // block_size, 0) + j]`
    for `j < num_state_slots` (docs/semantics.md#8-metadata-helpers): the block
    that holds token `seq_lens[r] - 1` and the ones after it. Slots whose
    column would run past the table give NULL_BLOCK.

    Args:
        block_table: `[R, columns]` int32/int64.
        seq_lens: `[R]` int32/int64 (with `num_computed_tokens`: where align
            mode keeps each request's checkpoint).
        block_size: tokens per block; num_state_slots: columns of the result.

    Returns:
        `[R, num_state_slots]`, the dtype of `block_table`.
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
    fills the rest as padding (docs/semantics.md#8-metadata-helpers):

    - `staged_state_indices[:n] = state_indices[:n]`, the rest NULL_BLOCK
      (`[B]`, or `[B, slots]` like a 2-D `state_indices`); an index outside
      int32, null for any cache, is staged as NULL_BLOCK;
    - `staged_query_start_loc[:n+1] = query_start_loc[:n+1]`, the rest
      `query_start_loc[n]` (padding windows are empty);
    - `staged_num_accepted_tokens[:n] = num_accepted_tokens[:n]`, the rest 1.

    Args:
        state_indices: `[R]` or `[R, slots]` int32/int64; query_start_loc:
            `[R + 1]`; num_accepted_tokens: at least `[R]`.
        staged_*: the captured batch's buffers, `[B]` (or `[B, slots]`),
            `[B + 1]` and `[B]`, int32/int64, written.
        num_spec_decodes: an int in `[0, min(R, B)]` (checked): a launch
            argument, so a traced graph specialises on it and a CUDA graph
            captured around this call replays with the same `n`; or a
            one-element integer tensor on the same device, read by the kernel
            (no host sync) and clamped to that range, so one captured graph
            stages the current `n` on every replay.
    """
    check_int_or_tensor("num_spec_decodes", num_spec_decodes)
    args = (state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
            staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes)
    if value_checks.should_check(state_indices, query_start_loc):
        value_checks.stage_call(*args)
    if isinstance(num_spec_decodes, Tensor):
        _ops.stage_spec_decode_metadata_tensor_count(*args)
    else:
        _ops.stage_spec_decode_metadata(*args)
