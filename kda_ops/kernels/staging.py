"""Metadata kernels: aligned state indices and CUDA-graph staging
(docs/semantics.md#8-metadata-helpers).

Both are tiny, launch-bound kernels: one program covers BLOCK_ROWS requests.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .common import NULL_BLOCK, fits_int32, wait_for_previous_kernel
from .dispatch import dependent_launch

BLOCK_ROWS = 32


@triton.jit
def _aligned_state_indices_kernel(
    block_table_ptr, seq_lens_ptr, out_ptr,
    num_rows, table_cols, block_size,
    stride_bt_row, stride_bt_col, stride_seq_lens, stride_out_row, stride_out_slot,
    NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < num_rows
    seq_lens = tl.load(seq_lens_ptr + rows * stride_seq_lens, mask=row_ok, other=1).to(tl.int64)
    # Clamping before dividing makes Triton's truncating division agree with
    # floor division for seq_lens <= 0.
    first_col = tl.maximum(seq_lens - 1, 0) // block_size
    slots = tl.arange(0, BLOCK_SLOTS)
    cols = first_col[:, None] + slots[None, :]
    store_mask = row_ok[:, None] & (slots < NUM_SLOTS)[None, :]
    # Columns past the table read nothing and give the null block.
    indices = tl.load(block_table_ptr + rows[:, None].to(tl.int64) * stride_bt_row
                      + cols * stride_bt_col,
                      mask=store_mask & (cols < table_cols), other=NULL_BLOCK)
    tl.store(out_ptr + rows[:, None] * stride_out_row + slots[None, :] * stride_out_slot,
             indices, mask=store_mask)


def launch_aligned_state_indices(block_table, seq_lens, block_size, out):
    num_rows, num_slots = out.shape
    if num_rows == 0:
        return
    wrap_triton(_aligned_state_indices_kernel)[(triton.cdiv(num_rows, BLOCK_ROWS),)](
        block_table, seq_lens, out,
        num_rows, block_table.shape[1], block_size,
        block_table.stride(0), block_table.stride(1), seq_lens.stride(0),
        out.stride(0), out.stride(1),
        NUM_SLOTS=num_slots, BLOCK_SLOTS=triton.next_power_of_2(num_slots),
        BLOCK_ROWS=BLOCK_ROWS, num_warps=1, **dependent_launch(out, num_rows),
    )


# The count and the batch size change every step: keep them out of Triton's
# integer specialisation so that a new value never compiles a new kernel.
@triton.jit(do_not_specialize=["count", "count_limit", "batch"])
def _stage_spec_decode_kernel(
    state_indices_ptr, query_start_ptr, accepted_ptr, count_ptr,
    staged_state_indices_ptr, staged_query_start_ptr, staged_accepted_ptr,
    count, count_limit, batch,
    stride_si_row, stride_si_slot, stride_query_start, stride_accepted,
    stride_staged_si_row, stride_staged_si_slot, stride_staged_query_start,
    stride_staged_accepted,
    NUM_SLOTS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    COUNT_IN_TENSOR: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    if COUNT_IN_TENSOR:
        requested = tl.load(count_ptr).to(tl.int64)
    else:
        requested = tl.cast(count, tl.int64)  # a plain int when torch analyses the kernel
    # A device count is read, never trusted: clamping keeps every read inside
    # the source tensors.
    num_real = tl.minimum(tl.maximum(requested, 0), count_limit)

    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    real = rows < num_real
    in_batch = rows < batch

    slots = tl.arange(0, BLOCK_SLOTS)
    slot_ok = (slots < NUM_SLOTS)[None, :]
    indices = tl.load(state_indices_ptr + rows[:, None] * stride_si_row
                      + slots[None, :] * stride_si_slot,
                      mask=real[:, None] & slot_ok, other=NULL_BLOCK).to(tl.int64)
    # Indices past int32 are null anyway; made NULL_BLOCK, an int32 buffer
    # cannot wrap them into real blocks.
    indices = tl.where(fits_int32(indices), indices, NULL_BLOCK)
    tl.store(staged_state_indices_ptr + rows[:, None] * stride_staged_si_row
             + slots[None, :] * stride_staged_si_slot,
             indices, mask=in_batch[:, None] & slot_ok)

    # Padding rows repeat the last real start, so their windows are empty.
    source_row = tl.minimum(rows, num_real)
    starts = tl.load(query_start_ptr + source_row * stride_query_start, mask=rows <= batch)
    tl.store(staged_query_start_ptr + rows * stride_staged_query_start, starts,
             mask=rows <= batch)

    accepted = tl.load(accepted_ptr + rows * stride_accepted, mask=real, other=1)
    tl.store(staged_accepted_ptr + rows * stride_staged_accepted, accepted, mask=in_batch)


def _row_slot_strides(t):
    """(row, slot) strides of a `[B]` or `[B, slots]` index tensor."""
    return (t.stride(0), t.stride(1) if t.dim() == 2 else 0)


def launch_stage_spec_decode_metadata(state_indices, query_start_loc, num_accepted_tokens,
                                      staged_state_indices, staged_query_start_loc,
                                      staged_num_accepted_tokens, num_spec_decodes, count_limit):
    """`num_spec_decodes` is an int or a one-element device tensor."""
    batch = staged_state_indices.shape[0]
    num_slots = staged_state_indices.shape[1] if staged_state_indices.dim() == 2 else 1
    count_in_tensor = isinstance(num_spec_decodes, torch.Tensor)
    # Unused pointer gets a valid tensor; the constexpr flag keeps it unread.
    count_ptr = num_spec_decodes if count_in_tensor else query_start_loc
    wrap_triton(_stage_spec_decode_kernel)[(triton.cdiv(batch + 1, BLOCK_ROWS),)](
        state_indices, query_start_loc, num_accepted_tokens, count_ptr,
        staged_state_indices, staged_query_start_loc, staged_num_accepted_tokens,
        0 if count_in_tensor else num_spec_decodes, count_limit, batch,
        *_row_slot_strides(state_indices), query_start_loc.stride(0),
        num_accepted_tokens.stride(0),
        *_row_slot_strides(staged_state_indices), staged_query_start_loc.stride(0),
        staged_num_accepted_tokens.stride(0),
        NUM_SLOTS=num_slots, BLOCK_SLOTS=triton.next_power_of_2(num_slots),
        BLOCK_ROWS=BLOCK_ROWS, COUNT_IN_TENSOR=count_in_tensor, num_warps=1,
        **dependent_launch(staged_state_indices, batch),
    )
