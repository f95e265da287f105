"""Commit: fold the accepted prefix of every layer into its checkpoint; and
the deferred schedule's commit and flush.

Two launches cover all layers: one folds the recurrent state, one compacts the
convolution history. Both compute the commit plan of their request inline
(`commit_plan_row`, `deferred_plan_row`). In the deferred schedule the state launch
also copies each (layer, request)'s pending count to a per-call buffer, from
which the history launch plans and after which it writes the new counts (a
third launch writes them where there is no history). Where `dispatch.listed_folds`
says so, its state fold is two launches instead: a plan with a row per
(layer, request) pair that folds now, then a persistent grid over those
pairs' tiles, so that a commit in which few pairs fold launches few programs.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .common import (NULL_BLOCK, block_is_valid, commit_plan_row, deferred_plan_row,
                     int32_or_null, kda_gate, l2_normalize, live_range, path_position,
                     pending_count, wait_for_previous_kernel)
from .dispatch import (commit_config, conv_config, dependent_launch, fold_programs,
                       launch_options, listed_folds)

# Pairs the fold plan's one program plans at a time (16 layers of 256 requests), eight
# per thread.
FOLD_PLAN_BLOCK = 4096
FOLD_PLAN_WARPS = 16
# int32 entries of a fold-plan row: six used, padded to one 32-byte sector.
PLAN_ROW = tl.constexpr(8)


@triton.jit
def _fold_records(state, start, stop, kg_row, corr_row, stride_kg_tok, stride_kg_dim,
                  stride_c_tok, mask_k, mask_v, dt_bias, A, lower_bound, path_row,
                  stride_path_col, last_node, first, K: tl.constexpr,
                  USE_LOWER_BOUND: tl.constexpr, RECORD_STAGES: tl.constexpr,
                  TREE: tl.constexpr):
    """The state tile after the recorded tokens `start..stop-1` (in a tree, the
    `first` pending records, then those of the accepted path's nodes after them)."""
    # Triton's pipeliner requests the next tokens' records (through shared
    # memory) while a token is folded: these loads bounded the fold. On an
    # H200 pipelining took T = 8 from 72% to 93% of copy (stages: see
    # commit_config); register prefetch one or two tokens ahead, or the
    # loop unrolled, were slower at T = 8.
    for i in tl.range(start, stop, num_stages=RECORD_STAGES):
        t = i
        if TREE:
            node = path_position(path_row, stride_path_col, tl.maximum(i - first, 0), last_node,
                                 TREE)
            t = tl.where(i < first, i, first + node)
        raw_k = tl.load(kg_row + t * stride_kg_tok, mask=mask_k, other=0.0).to(tl.float32)
        raw_g = tl.load(kg_row + t * stride_kg_tok + K * stride_kg_dim, mask=mask_k,
                        other=0.0).to(tl.float32)
        u = tl.load(corr_row + t * stride_c_tok, mask=mask_v, other=0.0)
        kn = l2_normalize(raw_k, 1.0)
        decay = tl.exp(kda_gate(raw_g, dt_bias, A, lower_bound, USE_LOWER_BOUND))
        state = state * decay[None, :] + u[:, None] * kn[None, :]
    return state


@triton.jit
def _plan(b, accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr, computed_ptr,
          layer_pending_ptr, num_blocks, num_rows, bt_cols, block_size, stride_accepted,
          stride_request, stride_state_indices, stride_query_start, stride_computed,
          stride_p_blk, SPEC_LEN: tl.constexpr, RECORDS: tl.constexpr,
          HAS_REQUEST_INDICES: tl.constexpr, ALIGN: tl.constexpr, DEFERRED: tl.constexpr,
          FLUSH: tl.constexpr):
    """(count, row, final column, boundary column, recovery, records pending
    before) of request `b`: the commit plan's accepted count, the deferred
    plan's total (the caller decides whether it folds now, `folds_now`), or on
    a flush the pending count."""
    if FLUSH:
        source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
        valid = block_is_valid(source, num_blocks)
        count = pending_count(layer_pending_ptr + tl.where(valid, source, 0) * stride_p_blk,
                              valid, RECORDS)
        zero = tl.zeros_like(source)
        return count, zero, zero, zero - 1, zero, zero
    elif DEFERRED:
        _, total, row, final_col, boundary_col, recovery, first = deferred_plan_row(
            b, accepted_ptr, stride_accepted, request_ptr, stride_request, state_indices_ptr,
            stride_state_indices, query_start_ptr, stride_query_start, computed_ptr,
            stride_computed, layer_pending_ptr, stride_p_blk, num_rows, num_blocks, bt_cols,
            block_size, RECORDS, HAS_REQUEST_INDICES, ALIGN)
        return total, row, final_col, boundary_col, recovery, first
    else:
        commit, row, final_col, boundary_col, recovery = commit_plan_row(
            b, accepted_ptr, stride_accepted, request_ptr, stride_request,
            state_indices_ptr, stride_state_indices, query_start_ptr, stride_query_start,
            computed_ptr, stride_computed, num_rows, bt_cols, block_size,
            SPEC_LEN, HAS_REQUEST_INDICES, ALIGN)
        return commit, row, final_col, boundary_col, recovery, tl.zeros_like(commit)


@triton.jit
def folds_now(total, boundary_col, final, source, batch, off_chain, SPEC_LEN: tl.constexpr,
              RECORDS: tl.constexpr, EAGER_FOLD_BELOW: tl.constexpr):
    """Whether a deferred commit over `batch` requests writes the fold back:
    when the next window would not fit after the pending records, in align mode
    when the fold crosses a block boundary or its last token leaves the
    checkpoint's block, where a tree's accepted path leaves the chain
    (`off_chain`, _path_leaves_chain), and always below EAGER_FOLD_BELOW requests."""
    return (total > 0) & ((total + SPEC_LEN > RECORDS) | (boundary_col >= 0) | (final != source)
                          | (batch < EAGER_FOLD_BELOW) | off_chain)


@triton.jit
def _path_leaves_chain(path_row, stride_path_col, last_node, count, SPEC_LEN: tl.constexpr,
                       TREE: tl.constexpr):
    """Whether the first `count` nodes of a tree's accepted path (as
    path_position reads them) leave the chain 0, 1, ...: their records are
    then not contiguous and cannot stay pending. False for chains."""
    leaves = count < 0
    if TREE:
        for i in tl.static_range(SPEC_LEN):
            node = path_position(path_row, stride_path_col, i, last_node, TREE)
            leaves = leaves | ((i < count) & (node != i))
    return leaves


@triton.jit
def _fold_plan_kernel(
    fold_plan_ptr, accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr,
    block_table_ptr, computed_ptr, pending_ptr, counts_before_ptr,
    num_blocks, num_rows, bt_cols, block_size, batch, num_pairs,
    stride_accepted, stride_request, stride_state_indices, stride_query_start,
    stride_bt_row, stride_bt_col, stride_computed, stride_p_layer, stride_p_blk,
    SPEC_LEN: tl.constexpr, RECORDS: tl.constexpr, HAS_REQUEST_INDICES: tl.constexpr,
    ALIGN: tl.constexpr, EAGER_FOLD_BELOW: tl.constexpr, COUNTS_BEFORE: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program: a row (layer, count, source, final, boundary, recovery) for
    each (layer, request) pair whose deferred commit folds now, in order, then
    in row `num_pairs` their number and the fold's claims counter, zeroed; with
    COUNTS_BEFORE each pair's pending count at `counts_before_ptr + pair`."""
    wait_for_previous_kernel(PDL)
    listed = tl.full([], 0, tl.int32)
    for start in range(0, num_pairs, BLOCK):
        pairs = start + tl.arange(0, BLOCK)
        in_range = pairs < num_pairs
        pairs = tl.where(in_range, pairs, 0)
        b = pairs % batch
        layer = pairs // batch
        _, total, row, final_col, boundary_col, recovery, first = deferred_plan_row(
            b, accepted_ptr, stride_accepted, request_ptr, stride_request, state_indices_ptr,
            stride_state_indices, query_start_ptr, stride_query_start, computed_ptr,
            stride_computed, pending_ptr + layer.to(tl.int64) * stride_p_layer, stride_p_blk,
            num_rows, num_blocks, bt_cols, block_size, RECORDS, HAS_REQUEST_INDICES, ALIGN)
        if COUNTS_BEFORE:
            tl.store(counts_before_ptr + pairs, first.to(tl.int32), mask=in_range)
        source, final, boundary = _plan_blocks(
            b, state_indices_ptr, stride_state_indices, block_table_ptr, row, final_col,
            boundary_col, total, stride_bt_row, stride_bt_col, ALIGN)
        folds = (_folds(total, boundary_col, final, source, boundary, num_blocks, batch,
                        total < 0, SPEC_LEN, RECORDS, True, EAGER_FOLD_BELOW)
                 & in_range).to(tl.int32)
        at = fold_plan_ptr + (listed + tl.cumsum(folds, 0) - folds) * PLAN_ROW
        listing = folds > 0
        tl.store(at, layer, mask=listing)
        tl.store(at + 1, total.to(tl.int32), mask=listing)
        tl.store(at + 2, source.to(tl.int32), mask=listing)
        tl.store(at + 3, final.to(tl.int32), mask=listing)
        tl.store(at + 4, boundary.to(tl.int32), mask=listing)
        tl.store(at + 5, recovery.to(tl.int32), mask=listing)
        listed += tl.sum(folds, 0)
    tl.store(fold_plan_ptr + num_pairs * PLAN_ROW, listed)
    tl.store(fold_plan_ptr + num_pairs * PLAN_ROW + 1, 0)


@triton.jit
def _plan_blocks(b, state_indices_ptr, stride_state_indices, block_table_ptr, row, final_col,
                 boundary_col, count, stride_bt_row, stride_bt_col, ALIGN: tl.constexpr):
    """(source, final, boundary) blocks of request `b`'s plan: its checkpoint,
    and in align mode the block-table entries of the plan's columns (NULL_BLOCK
    where none), else the checkpoint again and none. The lookups stay in the
    kernel body: see commit_plan_row."""
    source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    if ALIGN:
        table_row = block_table_ptr + row * stride_bt_row
        final = tl.load(table_row + final_col * stride_bt_col, mask=count > 0,
                        other=NULL_BLOCK).to(tl.int64)
        boundary = tl.load(table_row + boundary_col * stride_bt_col, mask=boundary_col >= 0,
                           other=NULL_BLOCK).to(tl.int64)
    else:
        final = source
        boundary = tl.zeros_like(source)
    return source, final, boundary


@triton.jit
def _folds(count, boundary_col, final, source, boundary, num_blocks, batch, off_chain,
           SPEC_LEN: tl.constexpr, RECORDS: tl.constexpr, DEFERRED: tl.constexpr,
           EAGER_FOLD_BELOW: tl.constexpr):
    """Whether the commit over `batch` requests writes a fold: records to fold
    (deferred: now), a valid checkpoint and a valid block to write."""
    if DEFERRED:  # `count` holds the total so far: fold it now, or leave it pending
        count = tl.where(folds_now(count, boundary_col, final, source, batch, off_chain,
                                   SPEC_LEN, RECORDS, EAGER_FOLD_BELOW), count, 0)
    return ((count > 0) & block_is_valid(source, num_blocks)
            & (block_is_valid(final, num_blocks) | block_is_valid(boundary, num_blocks)))


@triton.jit
def _plan_row_entries(row_ptr, there):
    """(layer, count, source, final, boundary, recovery) of a fold-plan row."""
    layer = tl.load(row_ptr, mask=there, other=0).to(tl.int64)
    count = tl.load(row_ptr + 1, mask=there, other=0).to(tl.int64)
    source = tl.load(row_ptr + 2, mask=there, other=0).to(tl.int64)
    final = tl.load(row_ptr + 3, mask=there, other=0).to(tl.int64)
    boundary = tl.load(row_ptr + 4, mask=there, other=0).to(tl.int64)
    recovery = tl.load(row_ptr + 5, mask=there, other=0).to(tl.int64)
    return layer, count, source, final, boundary, recovery


@triton.jit
def _fold_tile(
    state_ptr, correction_ptr, key_gate_ptr, A_log_ptr, dt_bias_ptr, layer, h, pid_v,
    count, source, final, boundary, recovery, num_blocks, lower_bound,
    stride_s_layer, stride_s_blk, stride_s_head, stride_s_v, stride_s_k,
    stride_c_layer, stride_c_blk, stride_c_head, stride_c_tok, stride_c_dim,
    stride_kg_layer, stride_kg_blk, stride_kg_head, stride_kg_tok, stride_kg_dim,
    stride_A_layer, stride_A_head, stride_dt_layer, stride_dt_head, stride_dt_dim,
    path_row, stride_path_col, last_node, first,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, ALIGN: tl.constexpr, RECORD_STAGES: tl.constexpr,
    TREE: tl.constexpr,
):
    """Folds `count` records of one state tile into the checkpoint `source`,
    storing the boundary state after `recovery` of them (align mode) and the
    final one, where those blocks are valid; in a tree, the `first` pending
    records, then those of the accepted path at `path_row` (path_position)."""
    final_ok = block_is_valid(final, num_blocks)
    boundary_ok = block_is_valid(boundary, num_blocks)
    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    mask_tile = mask_v[:, None] & mask_k[None, :]
    tile = offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k
    head_base = state_ptr + layer * stride_s_layer + h * stride_s_head
    # The whole source tile is read before anything is stored, and no other
    # program touches it, so final == source (in-place) is race-free.
    state = tl.load(head_base + source * stride_s_blk + tile, mask=mask_tile,
                    other=0.0).to(tl.float32)
    tl.debug_barrier()  # every warp has read its part before any warp stores
    A = tl.exp(tl.load(A_log_ptr + layer * stride_A_layer + h * stride_A_head).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + layer * stride_dt_layer + h * stride_dt_head
                      + offs_k * stride_dt_dim, mask=mask_k, other=0.0).to(tl.float32)
    corr_row = (correction_ptr + layer * stride_c_layer + source * stride_c_blk
                + h * stride_c_head + offs_v * stride_c_dim)
    kg_row = (key_gate_ptr + layer * stride_kg_layer + source * stride_kg_blk
              + h * stride_kg_head + offs_k * stride_kg_dim)
    folded = 0
    if ALIGN:
        # Up to the boundary, then the rest: a store inside the pipelined
        # loop made it spill (H200: 1.6-1.9% slower, docs/performance.md).
        folded = tl.where(boundary_ok, tl.minimum(recovery, count), 0)
        state = _fold_records(state, 0, folded, kg_row, corr_row, stride_kg_tok,
                              stride_kg_dim, stride_c_tok, mask_k, mask_v, dt_bias, A,
                              lower_bound, path_row, stride_path_col, last_node, first, K,
                              USE_LOWER_BOUND, RECORD_STAGES, TREE)
        if boundary_ok:
            tl.store(head_base + boundary * stride_s_blk + tile, state, mask=mask_tile)
    state = _fold_records(state, folded, count, kg_row, corr_row, stride_kg_tok, stride_kg_dim,
                          stride_c_tok, mask_k, mask_v, dt_bias, A, lower_bound, path_row,
                          stride_path_col, last_node, first, K, USE_LOWER_BOUND, RECORD_STAGES,
                          TREE)
    if final_ok:
        tl.store(head_base + final * stride_s_blk + tile, state, mask=mask_tile)


@triton.jit
def _commit_state_kernel(
    state_ptr, correction_ptr, key_gate_ptr, A_log_ptr, dt_bias_ptr,
    accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr,
    block_table_ptr, computed_ptr, pending_ptr, path_ptr, counts_before_ptr,
    num_blocks, num_rows, bt_cols, block_size, lower_bound,
    stride_accepted, stride_request, stride_state_indices, stride_query_start,
    stride_bt_row, stride_bt_col, stride_computed, stride_p_layer, stride_p_blk,
    stride_path_row, stride_path_col,
    stride_s_layer, stride_s_blk, stride_s_head, stride_s_v, stride_s_k,
    stride_c_layer, stride_c_blk, stride_c_head, stride_c_tok, stride_c_dim,
    stride_kg_layer, stride_kg_blk, stride_kg_head, stride_kg_tok, stride_kg_dim,
    stride_A_layer, stride_A_head, stride_dt_layer, stride_dt_head, stride_dt_dim,
    fold_plan_ptr, num_pairs,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NUM_HEADS: tl.constexpr, SPEC_LEN: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    HAS_REQUEST_INDICES: tl.constexpr, ALIGN: tl.constexpr, RECORD_STAGES: tl.constexpr,
    RECORDS: tl.constexpr, DEFERRED: tl.constexpr, FLUSH: tl.constexpr,
    PDL: tl.constexpr, LISTED: tl.constexpr, V_TILES: tl.constexpr, TREE: tl.constexpr,
    EAGER_FOLD_BELOW: tl.constexpr, COUNTS_BEFORE: tl.constexpr,
):
    """Folds `commit` records into the checkpoint (the boundary state after
    `recovery` of them, in align mode): immediately the accepted ones; deferred
    all pending ones where the plan folds now (SPEC_LEN is then T and RECORDS
    R); on a flush every pending one. A program per tile, or with LISTED a
    persistent grid whose programs claim the tiles of the rows
    `_fold_plan_kernel` wrote one at a time. With TREE (immediate only) the
    records are those of each row's accepted path in `path_ptr`. With
    COUNTS_BEFORE (a program per tile) a row of programs per layer after the
    (layer, head) rows copies each (layer, request)'s pending count to
    `counts_before_ptr + layer * batch + b` for the history launch."""
    wait_for_previous_kernel(PDL)
    lower_bound = tl.cast(lower_bound, tl.float32)  # fp64 when launched by Inductor
    if LISTED:
        tiles = NUM_HEADS * V_TILES  # per listed pair
        items = tl.load(fold_plan_ptr + num_pairs * PLAN_ROW) * tiles
        # Programs claim items one by one from a counter: a static share was
        # 5% slower than a program per tile (the slowest program set the end).
        claims = fold_plan_ptr + num_pairs * PLAN_ROW + 1
        item = tl.atomic_add(claims, 1, sem="relaxed")
        layer, commit, source, final, boundary, recovery = _plan_row_entries(
            fold_plan_ptr + (item // tiles) * PLAN_ROW, item < items)
        while item < items:
            # The next claim and its row are requested before this tile is
            # folded, so that their latency hides behind the fold.
            following = tl.atomic_add(claims, 1, sem="relaxed")
            next_entries = _plan_row_entries(fold_plan_ptr + (following // tiles) * PLAN_ROW,
                                             following < items)
            _fold_tile(state_ptr, correction_ptr, key_gate_ptr, A_log_ptr, dt_bias_ptr, layer,
                       (item // V_TILES) % NUM_HEADS, item % V_TILES, commit, source, final,
                       boundary, recovery, num_blocks, lower_bound,
                       stride_s_layer, stride_s_blk, stride_s_head, stride_s_v, stride_s_k,
                       stride_c_layer, stride_c_blk, stride_c_head, stride_c_tok, stride_c_dim,
                       stride_kg_layer, stride_kg_blk, stride_kg_head, stride_kg_tok,
                       stride_kg_dim, stride_A_layer, stride_A_head, stride_dt_layer,
                       stride_dt_head, stride_dt_dim, path_ptr, 0, 0, 0, K, V, BK, BV,
                       USE_LOWER_BOUND, ALIGN, RECORD_STAGES, False)
            item = following
            layer, commit, source, final, boundary, recovery = next_entries
    elif COUNTS_BEFORE and (tl.program_id(2) >= _fold_rows(NUM_HEADS)):
        # The programs past the folds' copy each (layer, request)'s count: a copy in the
        # fold programs made align mode's fold spill 152 B against 40 (ptxas, T = 4).
        b = tl.program_id(1)
        layer = (tl.program_id(2) - _fold_rows(NUM_HEADS)).to(tl.int64)
        source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
        valid = block_is_valid(source, num_blocks)
        count = pending_count(pending_ptr + layer * stride_p_layer
                              + tl.where(valid, source, 0) * stride_p_blk, valid, RECORDS)
        tl.store(counts_before_ptr + layer * tl.num_programs(1) + b, count.to(tl.int32),
                 mask=tl.program_id(0) == 0)
    else:
        pid_v = tl.program_id(0)
        b = tl.program_id(1)
        # int64: a stacked cache passes 2**31 elements from about 274 blocks (16
        # layers, 32 heads, K = V = 128), and the layer stride is an int32 argument.
        layer = (tl.program_id(2) // NUM_HEADS).to(tl.int64)
        h = tl.program_id(2) % NUM_HEADS
        commit, row, final_col, boundary_col, recovery, first = _plan(
            b, accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr, computed_ptr,
            pending_ptr + layer * stride_p_layer, num_blocks, num_rows, bt_cols, block_size,
            stride_accepted, stride_request, stride_state_indices, stride_query_start,
            stride_computed, stride_p_blk, SPEC_LEN, RECORDS, HAS_REQUEST_INDICES, ALIGN,
            DEFERRED, FLUSH)
        source, final, boundary = _plan_blocks(
            b, state_indices_ptr, stride_state_indices, block_table_ptr, row, final_col,
            boundary_col, commit, stride_bt_row, stride_bt_col, ALIGN)
        path_row, last_node = _path_row(b, row, path_ptr, stride_path_row, query_start_ptr,
                                        stride_query_start, first, SPEC_LEN, RECORDS, TREE)
        off_chain = commit < 0
        if DEFERRED:  # the immediate commit folds whatever path it is given
            off_chain = _path_leaves_chain(path_row, stride_path_col, last_node, commit - first,
                                           SPEC_LEN, TREE)
        if _folds(commit, boundary_col, final, source, boundary, num_blocks, tl.num_programs(1),
                  off_chain, SPEC_LEN, RECORDS, DEFERRED, EAGER_FOLD_BELOW):
            _fold_tile(state_ptr, correction_ptr, key_gate_ptr, A_log_ptr, dt_bias_ptr, layer, h,
                       pid_v, commit, source, final, boundary, recovery, num_blocks, lower_bound,
                       stride_s_layer, stride_s_blk, stride_s_head, stride_s_v, stride_s_k,
                       stride_c_layer, stride_c_blk, stride_c_head, stride_c_tok, stride_c_dim,
                       stride_kg_layer, stride_kg_blk, stride_kg_head, stride_kg_tok,
                       stride_kg_dim, stride_A_layer, stride_A_head, stride_dt_layer,
                       stride_dt_head, stride_dt_dim, path_row, stride_path_col, last_node,
                       first, K, V, BK, BV, USE_LOWER_BOUND, ALIGN, RECORD_STAGES, TREE)


@triton.jit
def _fold_rows(NUM_HEADS: tl.constexpr):
    """The state launch's (layer, head) rows of fold programs, where a row of
    copy programs per layer follows them (COUNTS_BEFORE)."""
    return tl.num_programs(2) // (NUM_HEADS + 1) * NUM_HEADS


@triton.jit
def _path_row(b, row, path_ptr, stride_path_row, query_start_ptr, stride_query_start, first,
              SPEC_LEN: tl.constexpr, RECORDS: tl.constexpr, TREE: tl.constexpr):
    """(accepted path of `row`, last node of request `b`'s window that the path
    may name: of those recorded after `first` pending records) for
    path_position; nothing loaded for chains."""
    if TREE:
        window = (tl.load(query_start_ptr + (b + 1) * stride_query_start)
                  - tl.load(query_start_ptr + b * stride_query_start)).to(tl.int64)
        recorded = tl.minimum(tl.minimum(tl.maximum(window, 1), SPEC_LEN),
                              tl.maximum(RECORDS - first, 1))
        return path_ptr + row * stride_path_row, recorded - 1
    return path_ptr, tl.zeros_like(row)


@triton.jit
def _commit_conv_kernel(
    conv_ptr,
    accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr,
    block_table_ptr, computed_ptr, pending_ptr, path_ptr, counts_before_ptr,
    num_blocks, num_rows, bt_cols, block_size, conv_dim,
    stride_accepted, stride_request, stride_state_indices, stride_query_start,
    stride_bt_row, stride_bt_col, stride_computed, stride_p_layer, stride_p_blk,
    stride_path_row, stride_path_col,
    stride_layer, stride_blk, stride_dim, stride_col,
    HISTORY: tl.constexpr, BD: tl.constexpr,
    SPEC_LEN: tl.constexpr, HAS_REQUEST_INDICES: tl.constexpr, ALIGN: tl.constexpr,
    RECORDS: tl.constexpr, DEFERRED: tl.constexpr, TREE: tl.constexpr,
    EAGER_FOLD_BELOW: tl.constexpr, PDL: tl.constexpr,
):
    """Moves each request's history by its accepted tokens into the final block
    (and the boundary block's history). Deferred, every commit moves it: into
    the final block when the fold is written now, else within the source; the
    plan reads the pending counts the state launch copied to
    `counts_before_ptr` (`[layers, batch]`), and the first program of each
    (layer, request) writes its new counts, which no program here reads. In a
    tree the history runs along the accepted path (_path_column)."""
    wait_for_previous_kernel(PDL)
    pid_d = tl.program_id(0)
    b = tl.program_id(1)
    layer = tl.program_id(2).to(tl.int64)  # as in _commit_state_kernel

    if DEFERRED:
        commit, total, row, final_col, boundary_col, recovery, first = deferred_plan_row(
            b, accepted_ptr, stride_accepted, request_ptr, stride_request, state_indices_ptr,
            stride_state_indices, query_start_ptr, stride_query_start, computed_ptr,
            stride_computed, counts_before_ptr + layer * tl.num_programs(1), 1, num_rows,
            num_blocks, bt_cols, block_size, RECORDS, HAS_REQUEST_INDICES, ALIGN,
            COUNT_BY_REQUEST=True)
        # A boundary's history lies `recovery - first` tokens into the window.
        recovery = tl.minimum(tl.maximum(recovery - first, 1), SPEC_LEN)
    else:
        commit, row, final_col, boundary_col, recovery = commit_plan_row(
            b, accepted_ptr, stride_accepted, request_ptr, stride_request,
            state_indices_ptr, stride_state_indices, query_start_ptr, stride_query_start,
            computed_ptr, stride_computed, num_rows, bt_cols, block_size,
            SPEC_LEN, HAS_REQUEST_INDICES, ALIGN,
        )
        total = commit
        first = tl.zeros_like(commit)
    source, final, boundary = _plan_blocks(
        b, state_indices_ptr, stride_state_indices, block_table_ptr, row, final_col,
        boundary_col, total, stride_bt_row, stride_bt_col, ALIGN)
    path_row, last_node = _path_row(b, row, path_ptr, stride_path_row, query_start_ptr,
                                    stride_query_start, first, SPEC_LEN, RECORDS, TREE)
    if DEFERRED:  # a fold left for later keeps the history in the source block
        fold = folds_now(total, boundary_col, final, source, tl.num_programs(1),
                         _path_leaves_chain(path_row, stride_path_col, last_node, commit,
                                            SPEC_LEN, TREE),
                         SPEC_LEN, RECORDS, EAGER_FOLD_BELOW)
        if pid_d == 0:
            _store_counts(pending_ptr + layer * stride_p_layer, stride_p_blk, fold, total, source,
                          final, boundary, num_blocks)
        final = tl.where(fold, final, source)
        boundary = tl.where(fold, boundary, NULL_BLOCK)
    final_ok = block_is_valid(final, num_blocks)
    boundary_ok = block_is_valid(boundary, num_blocks)
    if (commit > 0) & block_is_valid(source, num_blocks) & (final_ok | boundary_ok):
        # One [BD] run of channels per history column: coalesced for the
        # engine's channel-contiguous layout (as conv_update).
        offs_d = pid_d * BD + tl.arange(0, BD)
        mask_d = offs_d < conv_dim
        final_mask = live_range(offs_d, conv_dim, final_ok)
        boundary_mask = live_range(offs_d, conv_dim, boundary_ok)
        cols = conv_ptr + layer * stride_layer + offs_d * stride_dim
        src = cols + source * stride_blk
        # History after n tokens: columns n-1 .. n-1+HISTORY-1 of the window buffer.
        final_hist = ()
        boundary_hist = ()
        for c in tl.static_range(HISTORY):
            column = _path_column(commit - 1 + c, path_row, stride_path_col, last_node, HISTORY,
                                  TREE)
            final_hist = final_hist + (tl.load(src + column * stride_col, mask=mask_d),)
            if ALIGN:
                column = _path_column(recovery - 1 + c, path_row, stride_path_col, last_node,
                                      HISTORY, TREE)
                boundary_hist = boundary_hist + (
                    tl.load(src + column * stride_col, mask=boundary_mask),)
        # Columns shift left in place: all loads land before any store.
        tl.debug_barrier()
        for c in tl.static_range(HISTORY):
            if ALIGN:
                tl.store(cols + boundary * stride_blk + c * stride_col, boundary_hist[c],
                         mask=boundary_mask)
            tl.store(cols + final * stride_blk + c * stride_col, final_hist[c], mask=final_mask)


@triton.jit
def _path_column(i, path_row, stride_path_col, last_node, HISTORY: tl.constexpr,
                 TREE: tl.constexpr):
    """The window buffer's column of entry i of the sequence [kept history
    (HISTORY - 1 columns), accepted tokens]: i itself in a chain; in a tree,
    the column of the path's node for entries past the history."""
    if TREE:
        node = path_position(path_row, stride_path_col, tl.maximum(i - (HISTORY - 1), 0),
                             last_node, TREE)
        return tl.where(i < HISTORY - 1, i, HISTORY - 1 + node)
    return i


@triton.jit
def _store_counts(counts, stride_p_blk, fold, total, source, final, boundary, num_blocks):
    """A request's pending counts after its deferred commit: zero in every
    block a fold writes, else the total in its checkpoint's block."""
    if fold:
        tl.store(counts + source * stride_p_blk, 0)
        if block_is_valid(boundary, num_blocks):
            tl.store(counts + boundary * stride_p_blk, 0)
        if block_is_valid(final, num_blocks):
            tl.store(counts + final * stride_p_blk, 0)
    elif total > 0:
        tl.store(counts + source * stride_p_blk, total.to(counts.dtype.element_ty))


@triton.jit
def _pending_counts_kernel(
    pending_ptr,
    accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr,
    block_table_ptr, computed_ptr, path_ptr,
    num_blocks, num_rows, bt_cols, block_size,
    stride_accepted, stride_request, stride_state_indices, stride_query_start,
    stride_bt_row, stride_bt_col, stride_computed, stride_p_layer, stride_p_blk,
    stride_path_row, stride_path_col,
    SPEC_LEN: tl.constexpr, RECORDS: tl.constexpr, HAS_REQUEST_INDICES: tl.constexpr,
    ALIGN: tl.constexpr, FLUSH: tl.constexpr, EAGER_FOLD_BELOW: tl.constexpr,
    TREE: tl.constexpr, PDL: tl.constexpr,
):
    """The pending counts after a deferred commit without conv history (the
    total where the fold waits; zero in every block a fold wrote) or after a
    flush (zero). Its own launch, after the state launch has read the counts."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    counts = pending_ptr + layer * stride_p_layer
    if FLUSH:
        source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
        if block_is_valid(source, num_blocks):
            tl.store(counts + source * stride_p_blk, 0)
    else:
        commit, total, row, final_col, boundary_col, _, first = deferred_plan_row(
            b, accepted_ptr, stride_accepted, request_ptr, stride_request, state_indices_ptr,
            stride_state_indices, query_start_ptr, stride_query_start, computed_ptr,
            stride_computed, counts, stride_p_blk, num_rows, num_blocks, bt_cols, block_size,
            RECORDS, HAS_REQUEST_INDICES, ALIGN)
        source, final, boundary = _plan_blocks(
            b, state_indices_ptr, stride_state_indices, block_table_ptr, row, final_col,
            boundary_col, total, stride_bt_row, stride_bt_col, ALIGN)
        path_row, last_node = _path_row(b, row, path_ptr, stride_path_row, query_start_ptr,
                                        stride_query_start, first, SPEC_LEN, RECORDS, TREE)
        fold = folds_now(total, boundary_col, final, source, tl.num_programs(0),
                         _path_leaves_chain(path_row, stride_path_col, last_node, commit,
                                            SPEC_LEN, TREE),
                         SPEC_LEN, RECORDS, EAGER_FOLD_BELOW)
        _store_counts(counts, stride_p_blk, fold, total, source, final, boundary, num_blocks)


def gate_param_strides(A_log, dt_bias, stacked, key_dim):
    """(A layer, A head, dt layer, dt head, dt dim) strides; layer strides are 0
    for a single layer, and a flat `[.., H*K]` dt_bias is split into (H, K)."""
    a_layer = A_log.stride(0) if stacked else 0
    lead = 1 if stacked else 0
    dt_layer = dt_bias.stride(0) if stacked else 0
    if dt_bias.dim() == lead + 2:
        dt_head, dt_dim = dt_bias.stride(lead), dt_bias.stride(lead + 1)
    else:
        dt_head, dt_dim = key_dim * dt_bias.stride(lead), dt_bias.stride(lead)
    return a_layer, A_log.stride(-1), dt_layer, dt_head, dt_dim


def layer_strides(t, stacked):
    return t.stride() if stacked else (0,) + t.stride()


def plan_launch_args(num_accepted_tokens, request_indices, state_indices, query_start_loc,
                     block_table, num_computed_tokens, block_size):
    """Pointer and scalar arguments of `commit_plan_row`, in kernel order."""
    align = block_table is not None
    num_rows = num_accepted_tokens.shape[0]
    if align:
        num_rows = min(num_rows, block_table.shape[0])
    # Unused optional pointers get a valid tensor; the constexpr flags keep them unread.
    request = request_indices if request_indices is not None else state_indices
    table = block_table if align else state_indices
    computed = num_computed_tokens if align else state_indices
    pointers = (num_accepted_tokens, request, state_indices, query_start_loc, table, computed)
    scalars = (num_rows, block_table.shape[1] if align else 1, block_size if align else 1)
    strides = (
        num_accepted_tokens.stride(0), request.stride(0), state_indices.stride(0),
        query_start_loc.stride(0),
        block_table.stride(0) if align else 0, block_table.stride(1) if align else 0,
        computed.stride(0),
    )
    return pointers, scalars, strides


def commit_state_launch(key_dim, value_dim, num_heads, spec_len, use_lower_bound,
                        has_request_indices, align, pdl, records=None, deferred=False,
                        flush=False, listed=False, tree=False, eager_fold_below=0,
                        counts_before=False):
    """The state fold's (kernel, constexprs, num_warps); tools/kernel_resources.py
    compiles exactly this. `spec_len` is T, `records` the records' positions
    (default T); `tree` folds accepted paths; a deferred commit over fewer than
    `eager_fold_below` requests folds whatever is pending; `counts_before`
    copies the pending counts for the history launch."""
    block_v, warps, record_stages = commit_config(value_dim)
    return _commit_state_kernel, dict(
        K=key_dim, V=value_dim, BK=triton.next_power_of_2(key_dim), BV=block_v,
        NUM_HEADS=num_heads, SPEC_LEN=spec_len, USE_LOWER_BOUND=use_lower_bound,
        HAS_REQUEST_INDICES=has_request_indices, ALIGN=align, RECORD_STAGES=record_stages,
        RECORDS=spec_len if records is None else records, DEFERRED=deferred, FLUSH=flush,
        PDL=pdl, LISTED=listed, V_TILES=triton.cdiv(value_dim, block_v), TREE=tree,
        EAGER_FOLD_BELOW=eager_fold_below, COUNTS_BEFORE=counts_before), warps


def commit_conv_launch(conv_dim, history, deferred, tree, pdl, **flags):
    """The history compaction's (kernel, constexprs, num_warps); `flags`:
    SPEC_LEN, HAS_REQUEST_INDICES, ALIGN, RECORDS, EAGER_FOLD_BELOW."""
    BD, warps = conv_config(conv_dim)
    return _commit_conv_kernel, dict(HISTORY=history, BD=BD, DEFERRED=deferred, TREE=tree,
                                     PDL=pdl, **flags), warps


def fold_plan_launch(spec_len, records, has_request_indices, align, pdl, eager_fold_below,
                     counts_before):
    """The deferred commit's fold plan: (kernel, constexprs, num_warps)."""
    return _fold_plan_kernel, dict(
        SPEC_LEN=spec_len, RECORDS=records, HAS_REQUEST_INDICES=has_request_indices, ALIGN=align,
        EAGER_FOLD_BELOW=eager_fold_below, COUNTS_BEFORE=counts_before, BLOCK=FOLD_PLAN_BLOCK,
        PDL=pdl), FOLD_PLAN_WARPS


def _pending_strides(pending, stacked):
    """(layer, block) strides of `[(L,) N]` pending counts; (0, 0) without them."""
    if pending is None:
        return 0, 0
    return (pending.stride(0), pending.stride(1)) if stacked else (0, pending.stride(0))


def launch_commit(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                  correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                  block_table, num_computed_tokens, block_size, dims, plan, pending=None,
                  spec_len=None, accepted_path=None):
    """With `pending`, the deferred commit for windows of up to `spec_len` = T
    tokens (the records hold dims.spec_len = R positions); with
    `accepted_path`, the commit of tree windows' accepted paths."""
    if plan.batch == 0:
        return
    pointers, scalars, strides = plan_launch_args(
        num_accepted_tokens, request_indices, state_indices, query_start_loc,
        block_table, num_computed_tokens, block_size)
    deferred = pending is not None
    records = dims.spec_len
    spec_len = records if spec_len is None else spec_len
    counts = pending if deferred else state_indices  # unread in the immediate schedule
    pending_strides = _pending_strides(pending, dims.stacked)
    tree = accepted_path is not None
    # A path tensor with no row is never read (nothing is folded); strides of 0 then.
    path = accepted_path if tree else state_indices  # unread for chains
    path_strides = tuple(accepted_path.stride()) if tree else (0, 0)
    flags = dict(SPEC_LEN=spec_len, HAS_REQUEST_INDICES=request_indices is not None,
                 ALIGN=plan.align, RECORDS=records, EAGER_FOLD_BELOW=dims.eager_fold_below)
    K, V = dims.key_dim, dims.value_dim
    launch = dependent_launch(state, plan.batch)
    # A tree's commit plans its folds in the tile programs: no fold plan.
    listed = deferred and not tree and listed_folds(plan.batch)
    num_pairs = dims.num_layers * plan.batch
    # The history launch writes the new pending counts, from a copy of the old
    # ones the state launch (or the fold plan) makes: no launch of their own.
    history_counts = deferred and conv_state is not None
    counts_before = (torch.empty(num_pairs, dtype=torch.int32, device=state.device)
                     if history_counts else state_indices)  # unread without the copy
    kernel, constexprs, warps = commit_state_launch(
        K, V, dims.num_heads, spec_len, lower_bound is not None,
        request_indices is not None, plan.align, launch["PDL"], records, deferred, listed=listed,
        tree=tree, eager_fold_below=dims.eager_fold_below,
        counts_before=history_counts and not listed)
    if listed:
        fold_plan = torch.empty((num_pairs + 1) * PLAN_ROW.value, dtype=torch.int32,
                                device=state.device)
        kernel_plan, constexprs_plan, warps_plan = fold_plan_launch(
            spec_len, records, request_indices is not None, plan.align, launch["PDL"],
            dims.eager_fold_below, history_counts)
        wrap_triton(kernel_plan)[(1,)](
            fold_plan, *pointers, counts, counts_before, dims.num_blocks, *scalars, plan.batch,
            num_pairs,
            *strides, *pending_strides, **constexprs_plan, num_warps=warps_plan,
            **launch_options(launch))
        grid = (fold_programs(state),)
    else:
        fold_plan = state_indices  # unread
        copy_rows = dims.num_layers if constexprs["COUNTS_BEFORE"] else 0
        grid = (constexprs["V_TILES"], plan.batch, dims.num_layers * dims.num_heads + copy_rows)
    wrap_triton(kernel)[grid](
        state, correction, key_gate, A_log, dt_bias, *pointers, counts, path, counts_before,
        dims.num_blocks, *scalars, float(lower_bound or 0.0), *strides, *pending_strides,
        *path_strides,
        *layer_strides(state, dims.stacked), *layer_strides(correction, dims.stacked),
        *layer_strides(key_gate, dims.stacked),
        *gate_param_strides(A_log, dt_bias, dims.stacked, K),
        fold_plan, num_pairs,
        **constexprs, num_warps=warps, **launch_options(launch),
    )
    if conv_state is not None:
        kernel, constexprs, warps = commit_conv_launch(dims.conv_dim, dims.conv_history,
                                                       deferred, tree, launch["PDL"], **flags)
        grid = (triton.cdiv(dims.conv_dim, constexprs["BD"]), plan.batch, dims.num_layers)
        wrap_triton(kernel)[grid](
            conv_state, *pointers, counts, path, counts_before, dims.num_blocks, *scalars,
            dims.conv_dim,
            *strides, *pending_strides, *path_strides, *layer_strides(conv_state, dims.stacked),
            **constexprs, num_warps=warps, **launch_options(launch),
        )
    if deferred and not history_counts:
        wrap_triton(_pending_counts_kernel)[(plan.batch, dims.num_layers)](
            pending, *pointers, path, dims.num_blocks, *scalars, *strides, *pending_strides,
            *path_strides, FLUSH=False, TREE=tree, **flags, num_warps=1, **launch,
        )


def launch_flush(state_indices, state, correction, key_gate, pending, A_log, dt_bias,
                 lower_bound, dims):
    batch = state_indices.shape[0]
    if batch == 0:
        return
    K, V = dims.key_dim, dims.value_dim
    launch = dependent_launch(state, batch)
    kernel, constexprs, warps = commit_state_launch(
        K, V, dims.num_heads, dims.spec_len, lower_bound is not None, False, False,
        launch["PDL"], deferred=False, flush=True)
    # A flush reads only the indices of what `plan_launch_args` passes.
    pointers = (state_indices,) * 6
    scalars = (0, 1, 1)
    strides = (0, 0, state_indices.stride(0), 0, 0, 0, 0)
    pending_strides = _pending_strides(pending, dims.stacked)
    grid = (triton.cdiv(V, constexprs["BV"]), batch, dims.num_layers * dims.num_heads)
    wrap_triton(kernel)[grid](
        state, correction, key_gate, A_log, dt_bias, *pointers, pending, state_indices,
        state_indices, dims.num_blocks, *scalars, float(lower_bound or 0.0), *strides,
        *pending_strides, 0, 0,
        *layer_strides(state, dims.stacked), *layer_strides(correction, dims.stacked),
        *layer_strides(key_gate, dims.stacked),
        *gate_param_strides(A_log, dt_bias, dims.stacked, K),
        state_indices, 0,
        **constexprs, num_warps=warps, **launch_options(launch),
    )
    wrap_triton(_pending_counts_kernel)[(batch, dims.num_layers)](
        pending, *pointers, state_indices, dims.num_blocks, *scalars, *strides,
        *pending_strides, 0, 0, SPEC_LEN=dims.spec_len, RECORDS=dims.spec_len,
        HAS_REQUEST_INDICES=False, ALIGN=False, FLUSH=True, EAGER_FOLD_BELOW=0, TREE=False,
        num_warps=1, **launch,
    )


@triton.jit
def _commit_plan_kernel(
    accepted_ptr, request_ptr, state_indices_ptr, query_start_ptr, block_table_ptr, computed_ptr,
    commit_out_ptr, final_out_ptr, boundary_out_ptr, recovery_out_ptr,
    num_rows, bt_cols, block_size,
    stride_accepted, stride_request, stride_state_indices, stride_query_start,
    stride_bt_row, stride_bt_col, stride_computed,
    SPEC_LEN: tl.constexpr, HAS_REQUEST_INDICES: tl.constexpr, ALIGN: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    commit, row, final_col, boundary_col, recovery = commit_plan_row(
        b, accepted_ptr, stride_accepted, request_ptr, stride_request,
        state_indices_ptr, stride_state_indices, query_start_ptr, stride_query_start,
        computed_ptr, stride_computed, num_rows, bt_cols, block_size,
        SPEC_LEN, HAS_REQUEST_INDICES, ALIGN,
    )
    source, final, boundary = _plan_blocks(
        b, state_indices_ptr, stride_state_indices, block_table_ptr, row, final_col,
        boundary_col, commit, stride_bt_row, stride_bt_col, ALIGN)
    tl.store(commit_out_ptr + b, commit.to(tl.int32))
    tl.store(final_out_ptr + b, int32_or_null(tl.where(commit > 0, final, NULL_BLOCK)))
    tl.store(boundary_out_ptr + b, int32_or_null(boundary))
    tl.store(recovery_out_ptr + b, recovery.to(tl.int32))


def launch_commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                       request_indices, block_table, num_computed_tokens, block_size, outputs):
    batch = state_indices.shape[0]
    if batch == 0:
        return
    pointers, scalars, strides = plan_launch_args(
        num_accepted_tokens, request_indices, state_indices, query_start_loc,
        block_table, num_computed_tokens, block_size)
    wrap_triton(_commit_plan_kernel)[(batch,)](
        *pointers, *outputs, *scalars, *strides,
        SPEC_LEN=spec_len, HAS_REQUEST_INDICES=request_indices is not None,
        ALIGN=block_table is not None, num_warps=1, **dependent_launch(state_indices, batch),
    )
