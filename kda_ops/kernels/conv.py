"""Conv update: the causal depthwise convolution over a speculative window, with
the extended history kept in the conv state (docs/semantics.md#6-conv_update).

One program per (request, channel tile). The state of a request is
`conv_state[block]`, `[D, W-1+T-1]` viewed dim-first with any strides; an
engine's `[N, W-1+T-1, D]` buffer arrives transposed, with the channel axis
contiguous. Every load and store here is one `[BD]` run of channels (one
column of the history, or one token of `x` / `out`), so they are coalesced for
that layout and for `x` and `out` (`[num_tokens, D]`), four channels (8 bytes
of bf16) per thread. The sequence `[history, window]` is loaded once, column by
column, into registers; the outputs and the new history are built from it.
"""

import triton
import triton.language as tl
from torch.library import wrap_triton

from .common import block_is_valid, live_range, tree_parents, wait_for_previous_kernel
from .dispatch import conv_config, dependent_launch, launch_options


@triton.jit
def _conv_update_kernel(
    x_ptr, conv_ptr, weight_ptr, bias_ptr, out_ptr, query_start_ptr, state_indices_ptr,
    parent_ptr, num_blocks, dim,
    stride_x_tok, stride_x_dim,
    stride_conv_blk, stride_conv_dim, stride_conv_col,
    stride_w_dim, stride_w_tap, stride_bias,
    stride_out_tok, stride_out_dim,
    stride_query_start, stride_state_indices, stride_parent,
    WIDTH: tl.constexpr, SPEC_LEN: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, TREE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    pid_d = tl.program_id(1)
    HISTORY: tl.constexpr = WIDTH - 1

    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    # Tokens past SPEC_LEN do not fit the state: they are neither convolved nor stored.
    processed = tl.where(block_is_valid(block, num_blocks), tl.minimum(window, SPEC_LEN), 0)

    offs_d = pid_d * BD + tl.arange(0, BD)
    mask_d = offs_d < dim
    x_cols = x_ptr + bos * stride_x_tok + offs_d * stride_x_dim
    out_cols = out_ptr + bos * stride_out_tok + offs_d * stride_out_dim
    if processed > 0:
        state_cols = conv_ptr + block * stride_conv_blk + offs_d * stride_conv_dim
        # seq = [h_0 .. h_{W-2}, x_0 .. x_{T-1}], one [BD] vector per column;
        # tokens past the window read nothing (zeros, never stored).
        seq = ()
        for c in tl.static_range(HISTORY):
            seq = seq + (tl.load(state_cols + c * stride_conv_col, mask=mask_d, other=0.0),)
        for t in tl.static_range(SPEC_LEN):
            seq = seq + (tl.load(x_cols + t * stride_x_tok,
                                 mask=live_range(offs_d, dim, t < processed), other=0.0),)
        taps = ()
        for j in tl.static_range(WIDTH):
            taps = taps + (tl.load(weight_ptr + offs_d * stride_w_dim + j * stride_w_tap,
                                   mask=mask_d, other=0.0).to(tl.float32),)
        if HAS_BIAS:
            bias = tl.load(bias_ptr + offs_d * stride_bias, mask=mask_d, other=0.0).to(tl.float32)
        else:
            bias = tl.zeros([BD], dtype=tl.float32)
        # y_t = bias + sum_j w_j * seq[t + j]; in a tree, tap j reads node t's
        # (W-1-j)-th ancestor, or past the root the history (column `col`).
        for t in tl.static_range(SPEC_LEN):
            y = bias
            if TREE:
                node = tl.full([], t, tl.int64)
                col = tl.full([], HISTORY + t, tl.int64)
                for back in tl.static_range(WIDTH):
                    on_path = (node >= 0) & (t < processed)
                    from_window = tl.load(x_cols + tl.maximum(node, 0) * stride_x_tok,
                                          mask=live_range(offs_d, dim, on_path), other=0.0)
                    from_history = tl.load(state_cols + tl.minimum(col, HISTORY - 1) *
                                           stride_conv_col,
                                           mask=live_range(offs_d, dim, node < 0), other=0.0)
                    y += taps[WIDTH - 1 - back] * tl.where(node >= 0, from_window.to(tl.float32),
                                                           from_history.to(tl.float32))
                    node, col = up_the_path(parent_ptr, stride_parent, bos, node, col,
                                            processed, HISTORY)
            else:
                for j in tl.static_range(WIDTH):
                    y += taps[j] * seq[t + j].to(tl.float32)
            if SILU:
                y = y * tl.sigmoid(y)
            tl.store(out_cols + t * stride_out_tok, y.to(out_ptr.dtype.element_ty),
                     mask=live_range(offs_d, dim, t < processed))
        # New state: column c takes seq[c + 1] for c < HISTORY - 1 + processed
        # (h_0 drops out); later columns are left as they are. Every read of the
        # block happened above, across all threads of the program, so updating
        # the state in place is race-free.
        tl.debug_barrier()
        for c in tl.static_range(HISTORY - 1 + SPEC_LEN):
            tl.store(state_cols + c * stride_conv_col, seq[c + 1].to(conv_ptr.dtype.element_ty),
                     mask=live_range(offs_d, dim, c < HISTORY - 1 + processed))

    # Tokens of null rows and tokens past T get zeros.
    zeros = tl.zeros([BD], dtype=out_ptr.dtype.element_ty)
    for t in range(processed, window):
        tl.store(out_cols + t * stride_out_tok, zeros, mask=mask_d)


def conv_update_launch(dim, width, spec_len, has_bias, silu, pdl, tree=False):
    """conv_update's (kernel, constexprs, num_warps), of tree windows with
    `tree`; tools/kernel_resources.py compiles exactly this."""
    block_d, warps = conv_config(dim)
    return _conv_update_kernel, dict(WIDTH=width, SPEC_LEN=spec_len, BD=block_d,
                                     HAS_BIAS=has_bias, SILU=silu, TREE=tree, PDL=pdl), warps


def launch_conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                       activation, out, dims, parent=None):
    if dims.batch == 0:
        return
    launch = dependent_launch(x, dims.batch)
    kernel, constexprs, warps = conv_update_launch(dims.dim, dims.width, dims.spec_len,
                                                   bias is not None, activation == "silu",
                                                   launch["PDL"], parent is not None)
    parents = parent if parent is not None else state_indices  # unread for chains
    # Batch on the first grid axis: it has no 65535 limit.
    grid = (dims.batch, triton.cdiv(dims.dim, constexprs["BD"]))
    wrap_triton(kernel)[grid](
        x, conv_state, weight, bias if bias is not None else weight, out,
        query_start_loc, state_indices, parents,
        dims.num_blocks, dims.dim,
        *x.stride(), *conv_state.stride(), *weight.stride(),
        bias.stride(0) if bias is not None else 0,
        *out.stride(), query_start_loc.stride(0), state_indices.stride(0), parents.stride(0),
        **constexprs, num_warps=warps, **launch_options(launch),
    )


@triton.jit
def up_the_path(parent_ptr, stride_parent, bos, node, column, processed,
                HISTORY: tl.constexpr):
    """One tap further back along tree paths: (the parents of `node`, the
    column of [history, window] each then reads). Past a root the taps read
    the history backwards from its last column."""
    on_window = node >= 0
    node = tree_parents(parent_ptr, stride_parent, bos, node, processed)
    return node, tl.where(node >= 0, HISTORY + node,
                          tl.where(on_window, HISTORY - 1, column - 1))


@triton.jit
def convolve_channels(x_ptr, conv_ptr, weight_ptr, bias_ptr, y_ptr, parent_ptr, bos, block,
                      processed, first_channel, stride_x_tok, stride_x_dim, stride_conv_blk,
                      stride_conv_dim, stride_conv_col, stride_w_dim, stride_w_tap, stride_bias,
                      stride_y_tok, stride_y_dim, stride_parent, C: tl.constexpr,
                      BC: tl.constexpr, WIDTH: tl.constexpr, BT: tl.constexpr,
                      BH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                      TREE: tl.constexpr):
    """conv_update of channels `first_channel .. + C` over one window's first
    `processed` tokens, all tokens at once (`[BT, BC]` tiles): the outputs
    into `y` in its dtype, then the history shifted (`BH` >= W-2+T columns):
    conv_verify's prologue (one program per request and head). The arithmetic
    is `_conv_update_kernel`'s, tap by tap."""
    HISTORY: tl.constexpr = WIDTH - 1
    steps = tl.arange(0, BT)
    live = steps < processed
    offs_c = first_channel + tl.arange(0, BC)
    mask_c = tl.arange(0, BC) < C
    x_cols = x_ptr + bos * stride_x_tok + offs_c[None, :] * stride_x_dim
    state_cols = conv_ptr + block * stride_conv_blk + offs_c[None, :] * stride_conv_dim
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_c * stride_bias, mask=mask_c, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BC], dtype=tl.float32)
    y = tl.zeros([BT, BC], dtype=tl.float32) + bias[None, :]
    if TREE:
        # Tap WIDTH-1-back reads the input `back` nodes up node t's path.
        node = steps.to(tl.int64)
        column = HISTORY + node
        for back in tl.static_range(WIDTH):
            tap = _tap(weight_ptr, offs_c, mask_c, stride_w_dim, stride_w_tap, WIDTH - 1 - back)
            y += tap * _sequence_at(x_cols, state_cols, column, live, mask_c, stride_x_tok,
                                    stride_conv_col, HISTORY)
            node, column = up_the_path(parent_ptr, stride_parent, bos, node, column, processed,
                                       HISTORY)
    else:  # tap j reads position t + j of [history, window]
        for j in tl.static_range(WIDTH):
            tap = _tap(weight_ptr, offs_c, mask_c, stride_w_dim, stride_w_tap, j)
            y += tap * _sequence_at(x_cols, state_cols, steps + j, live, mask_c, stride_x_tok,
                                    stride_conv_col, HISTORY)
    if SILU:
        y = y * tl.sigmoid(y)
    tl.store(y_ptr + (bos + steps)[:, None] * stride_y_tok + offs_c[None, :] * stride_y_dim,
             y.to(y_ptr.dtype.element_ty), mask=live[:, None] & mask_c[None, :])
    # The history conv_update leaves: column c takes [history, window][c + 1]
    # up to column W-3 + processed (none for an empty window). Loaded before a
    # barrier and stored after it, so no thread overwrites a column another
    # has yet to read.
    columns = tl.arange(0, BH)
    written = columns < tl.where(processed > 0, HISTORY - 1 + processed, 0)
    shifted = _sequence_at(x_cols, state_cols, columns + 1, written, mask_c, stride_x_tok,
                           stride_conv_col, HISTORY)
    tl.debug_barrier()
    tl.store(state_cols + columns[:, None] * stride_conv_col,
             shifted.to(conv_ptr.dtype.element_ty), mask=written[:, None] & mask_c[None, :])


@triton.jit
def _tap(weight_ptr, offs_c, mask_c, stride_w_dim, stride_w_tap, j):
    """Tap j of the channels, `[1, BC]` in fp32."""
    return tl.load(weight_ptr + offs_c * stride_w_dim + j * stride_w_tap, mask=mask_c,
                   other=0.0).to(tl.float32)[None, :]


@triton.jit
def _sequence_at(x_cols, state_cols, column, live, mask_c, stride_x_tok, stride_conv_col,
                 HISTORY: tl.constexpr):
    """Row t: position `column[t]` of [history, window] of the channels, in fp32
    (zero where not `live`)."""
    in_window = column >= HISTORY
    inputs = tl.where(
        in_window[:, None],
        tl.load(x_cols + tl.maximum(column - HISTORY, 0)[:, None] * stride_x_tok,
                mask=(in_window & live)[:, None] & mask_c[None, :], other=0.0),
        tl.load(state_cols + tl.maximum(column, 0)[:, None] * stride_conv_col,
                mask=((~in_window) & live)[:, None] & mask_c[None, :], other=0.0))
    return inputs.to(tl.float32)
