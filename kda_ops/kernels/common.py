"""Device functions shared by the kernels: the KDA gate and the commit plan."""

import triton
import triton.language as tl

# State block 0 is the null block: an index <= NULL_BLOCK marks a padding row.
# A constexpr, because @triton.jit code may read no other kind of global.
NULL_BLOCK = tl.constexpr(0)


@triton.jit
def kda_gate(raw_g, dt_bias, A, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Per-channel log decay (<= 0) from the raw gate, SPEC §1."""
    x = raw_g + dt_bias
    if USE_LOWER_BOUND:
        return lower_bound * tl.sigmoid(A * x)
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return -A * softplus


@triton.jit
def l2_normalize(x, scale):
    return x * (tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6) * scale)


@triton.jit
def live_range(offs, size, live):
    """`(offs < size) & live` for a scalar `live`, written as one comparison: the
    Triton 3.9 interpreter mis-broadcasts a scalar bool and-ed with a vector."""
    return offs < tl.where(live, size, 0)


@triton.jit
def block_is_valid(block, num_blocks):
    return (block > NULL_BLOCK) & (block < num_blocks)


@triton.jit
def commit_plan_row(
    b,
    accepted_ptr, stride_accepted,
    request_ptr, stride_request,
    state_indices_ptr, stride_state_indices,
    query_start_ptr, stride_query_start,
    block_table_ptr, stride_bt_row, stride_bt_col, bt_cols,
    computed_ptr, stride_computed,
    num_rows, block_size,
    SPEC_LEN: tl.constexpr,
    HAS_REQUEST_INDICES: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """SPEC §4 for request `b`: (commit_len, final, boundary, recovery), int64.

    Rows outside `[0, num_rows)` and source indices <= NULL_BLOCK give the null
    plan. In align mode `num_computed_tokens` is clamped at 0 and block-table
    columns at the table width, so no input can index outside the table.
    """
    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    if HAS_REQUEST_INDICES:
        row = tl.load(request_ptr + b * stride_request).to(tl.int64)
    else:
        row = b.to(tl.int64)
    row_ok = (row >= 0) & (row < num_rows)
    row = tl.where(row_ok, row, 0)
    accepted = tl.load(accepted_ptr + row * stride_accepted, mask=row_ok, other=0).to(tl.int64)
    commit = tl.minimum(tl.minimum(tl.maximum(accepted, 0), window), SPEC_LEN)
    source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    final = source
    boundary = tl.zeros_like(source)
    recovery = tl.zeros_like(source)
    if ALIGN:
        computed = tl.maximum(tl.load(computed_ptr + row * stride_computed).to(tl.int64), 0)
        final_col = tl.minimum(tl.maximum(computed + commit - 1, 0) // block_size, bt_cols - 1)
        final = tl.load(block_table_ptr + row * stride_bt_row + final_col * stride_bt_col).to(tl.int64)
        next_boundary = (computed // block_size + 1) * block_size
        recovery = next_boundary - computed
        boundary_col = tl.minimum(next_boundary // block_size - 1, bt_cols - 1)
        crosses = computed + commit >= next_boundary
        boundary = tl.load(block_table_ptr + row * stride_bt_row + boundary_col * stride_bt_col,
                           mask=crosses, other=NULL_BLOCK).to(tl.int64)
    null = (source <= NULL_BLOCK) | (commit == 0) | (row_ok == 0)
    commit = tl.where(null, 0, commit)
    final = tl.where(null, NULL_BLOCK, final)
    boundary = tl.where(null, NULL_BLOCK, boundary)
    recovery = tl.where(null, 0, recovery)
    return commit, final, boundary, recovery


@triton.jit
def align_block_columns(
    b, commit,
    request_ptr, stride_request, computed_ptr, stride_computed,
    num_rows, bt_cols, block_size,
    HAS_REQUEST_INDICES: tl.constexpr,
):
    """(row, final column, boundary column) of request `b` in the block table,
    the same as inside `commit_plan_row` (align mode). The commit kernels load
    the block indices that address their stores from these in their own body.

    Why: torch (`triton_kernel_wrap`, used by torch.compile) finds the tensors a
    kernel writes by walking each store's address back to the kernel's
    arguments. The walk stops at a load, but through a call it takes every
    pointer the callee receives. A store addressed by `commit_plan_row`'s
    `final` would therefore mark num_accepted_tokens, state_indices,
    query_start_loc, ... as written: compiled graphs would copy them back as
    mutated inputs, and CUDA graphs (reduce-overhead) would be skipped.
    """
    if HAS_REQUEST_INDICES:
        row = tl.load(request_ptr + b * stride_request).to(tl.int64)
    else:
        row = b.to(tl.int64)
    row = tl.where((row >= 0) & (row < num_rows), row, 0)
    computed = tl.maximum(tl.load(computed_ptr + row * stride_computed).to(tl.int64), 0)
    final_col = tl.minimum(tl.maximum(computed + commit - 1, 0) // block_size, bt_cols - 1)
    next_boundary = (computed // block_size + 1) * block_size
    boundary_col = tl.minimum(next_boundary // block_size - 1, bt_cols - 1)
    return row, final_col, boundary_col
