"""Conv update: the causal depthwise convolution over a speculative window, with
the extended history kept in the conv state (SPEC §2).

One program per (request, channel tile). The state of a request is
`conv_state[block]`, `[D, W-1+T-1]` viewed dim-first with any strides; an
engine's `[N, W-1+T-1, D]` buffer arrives transposed, with the channel axis
contiguous. Every tile here runs along channels, so loads and stores are
coalesced for that layout, and for `x` and `out` (`[num_tokens, D]`).
"""

import triton
import triton.language as tl
from torch.library import wrap_triton

from .common import block_is_valid


@triton.jit
def _conv_update_kernel(
    x_ptr, conv_ptr, weight_ptr, bias_ptr, out_ptr, query_start_ptr, state_indices_ptr,
    num_blocks, dim,
    stride_x_tok, stride_x_dim,
    stride_conv_blk, stride_conv_dim, stride_conv_col,
    stride_w_dim, stride_w_tap, stride_bias,
    stride_out_tok, stride_out_dim,
    stride_query_start, stride_state_indices,
    WIDTH: tl.constexpr, SPEC_LEN: tl.constexpr,
    BD: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BW: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
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
    mask_d = (offs_d < dim)[:, None]
    steps = tl.arange(0, BT)[None, :]
    x_rows = x_ptr + bos * stride_x_tok + offs_d[:, None] * stride_x_dim
    out_rows = out_ptr + bos * stride_out_tok + offs_d[:, None] * stride_out_dim
    if processed > 0:
        state_rows = conv_ptr + block * stride_conv_blk + offs_d[:, None] * stride_conv_dim
        live = mask_d & (steps < processed)
        y = tl.zeros([BD, BT], dtype=tl.float32)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_d[:, None] * stride_bias, mask=mask_d,
                         other=0.0).to(tl.float32)
        # The weights load once as one [BD, W] tile; each tap is picked out of it
        # in registers (per-tap strided loads would drag y into their layout).
        taps = tl.arange(0, BW)[None, :]
        weights = tl.load(weight_ptr + offs_d[:, None] * stride_w_dim + taps * stride_w_tap,
                          mask=mask_d & (taps < WIDTH), other=0.0).to(tl.float32)
        # y_t = sum_j w_j * seq[t + j] over seq = [history, window]: one tile per
        # tap, each element coming from the history or from x.
        for j in tl.static_range(WIDTH):
            seq = steps + j
            from_history = tl.load(state_rows + seq * stride_conv_col,
                                   mask=live & (seq < HISTORY), other=0.0)
            from_window = tl.load(x_rows + (seq - HISTORY) * stride_x_tok,
                                  mask=live & (seq >= HISTORY), other=0.0)
            tap = tl.sum(tl.where(taps == j, weights, 0.0), axis=1)[:, None]
            y += tap * (from_history.to(tl.float32) + from_window.to(tl.float32))
        if SILU:
            y = y * tl.sigmoid(y)
        tl.store(out_rows + steps * stride_out_tok, y.to(out_ptr.dtype.element_ty), mask=live)

        # New state: column c takes seq[c + 1] for c < HISTORY - 1 + processed
        # (h_0 drops out); later columns are left as they are.
        cols = tl.arange(0, BC)[None, :]
        shifted = cols + 1
        written = mask_d & (cols < HISTORY - 1 + processed)
        kept_history = tl.load(state_rows + shifted * stride_conv_col,
                               mask=written & (shifted < HISTORY), other=0.0)
        new_tokens = tl.load(x_rows + (shifted - HISTORY) * stride_x_tok,
                             mask=written & (shifted >= HISTORY), other=0.0)
        new_state = tl.where(shifted < HISTORY, kept_history,
                             new_tokens.to(conv_ptr.dtype.element_ty))
        # Every read of the block happens before any write to it, across all
        # threads of the program, so updating the state in place is race-free.
        tl.debug_barrier()
        tl.store(state_rows + cols * stride_conv_col, new_state, mask=written)

    # Tokens of null rows and tokens past T get zeros.
    zeros = tl.zeros([BD, 1], dtype=out_ptr.dtype.element_ty)
    for t in range(processed, window):
        tl.store(out_rows + t * stride_out_tok, zeros, mask=mask_d)


def launch_conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                       activation, out, dims):
    if dims.batch == 0:
        return
    BD = min(triton.next_power_of_2(dims.dim), 256)
    # Batch on the first grid axis: it has no 65535 limit.
    grid = (dims.batch, triton.cdiv(dims.dim, BD))
    wrap_triton(_conv_update_kernel)[grid](
        x, conv_state, weight, bias if bias is not None else weight, out,
        query_start_loc, state_indices,
        dims.num_blocks, dims.dim,
        *x.stride(), *conv_state.stride(), *weight.stride(),
        bias.stride(0) if bias is not None else 0,
        *out.stride(), query_start_loc.stride(0), state_indices.stride(0),
        WIDTH=dims.width, SPEC_LEN=dims.spec_len,
        BD=BD, BT=triton.next_power_of_2(dims.spec_len),
        BC=triton.next_power_of_2(conv_state.shape[-1]), BW=triton.next_power_of_2(dims.width),
        HAS_BIAS=bias is not None, SILU=activation == "silu",
        num_warps=4,
    )
