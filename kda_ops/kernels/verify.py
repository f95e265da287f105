"""Verify: run a speculative window from the checkpoint, record (u, k, g).

The checkpoint is only read. Each (request, head) runs in two phases. Phase 1
does the token-side work of the whole window at once (every token's decay and
normalised key and query, and k.q or the T x T couplings) and writes it to a
per-call workspace. Phase 2 streams the state tile and applies the window,
loading those vectors in the tile's layout, so no reduction, exponential or
layout conversion sits in the serial per-token chain (15-19% faster at large
batch on an H200 than doing that work per token).

`dispatch.verify_config` picks one of four forms from the window length T and the
number of (request, head) pairs:

- Token loop (T > 4 where no tensor-core form applies): phase 2 walks the
  tokens over the state tile.
- Closed form up to dispatch.CLOSED_FORM_UP_TO = 4 tokens: the state is read by 2T
  independent products with the checkpoint (every token's decayed key and
  query), and a T x T coupling from phase 1 links the tokens.
- Tensor cores in one kernel (T = 5 to 8, from dispatch.TENSOR_CORES_FROM_PAIRS pairs):
  the closed form with its `[V, 2T]` product on tensor cores, one program per
  (request, head).
- Tensor cores in two kernels (T = 4 to 8, from dispatch.SEPARATE_TERMS_FROM_PAIRS
  pairs; verify_tensor_cores.py): the window terms in one-warp programs of
  their own, then programs that only stream the state through 3xTF32
  products; from five tokens one more tensor-core product links the tokens.

The first two run on CUDA cores, one program per (V tile, request, head), two
V tiles per program from dispatch.TWO_TILES_FROM_PAIRS pairs. Their tile is held
chunk-major, `[BK / KEY_CHUNK * BV, KEY_CHUNK]`, so a row's products reduce
mostly inside a thread (3 shuffle rounds instead of 5: 3-29% faster).
Below 8 requests the kernels launch programmatically (dispatch.dependent_launch)
and each program asks the L2 for its state tile before waiting on the
previous kernel. The constants below carry the measurements behind them.

conv_verify launches conv_update's kernel and then this one; with
FUSED_CONV (`kernel_choices(fused_conv=True)`) one program per (request,
head) first convolves the head's channels itself (`_convolve_head`).
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .._validation import conv_verify_split
from .conv import convolve_channels, launch_conv_update
from .common import (block_is_valid, line_starts, link_tokens, live_range, load_window,
                     pending_records, pending_terms, prefetch_block, prefetch_block_rows,
                     tree_window_terms, wait_for_previous_kernel, window_after_records,
                     window_vectors)
from .dispatch import (WINDOW_TERMS_WARPS, conv_verify_config, dependent_launch,
                       expects_pending, launch_options, verify_config)
from .verify_tensor_cores import tensor_core_tile, tensor_core_verify_kernel, window_terms_kernel


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr,
    state_ptr, correction_ptr, key_gate_ptr, out_ptr, vectors_ptr, coupling_ptr,
    pending_ptr, pending_terms_ptr, query_start_ptr, state_indices_ptr, parent_ptr,
    x_ptr, conv_ptr, conv_weight_ptr, conv_bias_ptr,
    num_blocks, lower_bound, scale,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_g_tok, stride_g_head, stride_g_dim,
    stride_beta_tok, stride_beta_head,
    stride_A_head, stride_dt_head, stride_dt_dim,
    stride_s_blk, stride_s_head, stride_s_v, stride_s_k,
    stride_c_blk, stride_c_head, stride_c_tok, stride_c_dim,
    stride_kg_blk, stride_kg_head, stride_kg_tok, stride_kg_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_query_start, stride_state_indices, stride_pending, stride_parent,
    stride_x_tok, stride_x_dim, stride_conv_blk, stride_conv_dim, stride_conv_col,
    stride_w_dim, stride_w_tap, stride_bias,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SPEC_LEN: tl.constexpr, BT: tl.constexpr, RECORDS: tl.constexpr, BR: tl.constexpr,
    DEFERRED: tl.constexpr, TREE: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    KEY_CHUNK: tl.constexpr, V_TILES: tl.constexpr, UNROLL_TOKENS: tl.constexpr,
    CLOSED_FORM: tl.constexpr, TENSOR_CORES: tl.constexpr, NP: tl.constexpr,
    STAGES: tl.constexpr, PREFETCH_STATE: tl.constexpr, PREFETCH_RECORDS: tl.constexpr,
    FUSED_CONV: tl.constexpr, WIDTH: tl.constexpr, BH: tl.constexpr, BVH: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    first_tile = tl.program_id(0) * V_TILES
    b = tl.program_id(1)
    h = tl.program_id(2)
    if PREFETCH_STATE:
        early_block = prefetch_block(state_indices_ptr + b * stride_state_indices, num_blocks)
        tile_rows = tl.minimum(first_tile * BV + tl.arange(0, V_TILES * BV), V - 1)
        prefetch_block_rows(state_ptr + h * stride_s_head, stride_s_blk, early_block, num_blocks,
                            tile_rows, stride_s_v, line_starts(0, K, stride_s_k, BK))
        if DEFERRED and PREFETCH_RECORDS:
            # Every record position: the pending count is not known before the wait.
            positions = tl.minimum(tl.arange(0, BR), RECORDS - 1)
            prefetch_block_rows(key_gate_ptr + h * stride_kg_head, stride_kg_blk, early_block,
                                num_blocks, positions, stride_kg_tok,
                                line_starts(0, 2 * K, stride_kg_dim, 2 * BK))
            prefetch_block_rows(correction_ptr + h * stride_c_head, stride_c_blk, early_block,
                                num_blocks, positions, stride_c_tok,
                                line_starts(first_tile * BV, V, stride_c_dim, V_TILES * BV))
    wait_for_previous_kernel(PDL)
    # Inductor passes Python floats as fp64 scalars; the arithmetic is fp32.
    lower_bound = tl.cast(lower_bound, tl.float32)
    scale = tl.cast(scale, tl.float32)

    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K

    valid = block_is_valid(block, num_blocks)
    # The window is recorded after the block's pending records. Their count is
    # loaded here, not in a helper, as it addresses stores (see commit_plan_row).
    count = tl.zeros_like(block)
    if DEFERRED:
        count = tl.load(pending_ptr + tl.where(valid, block, 0) * stride_pending, mask=valid,
                        other=0).to(tl.int64)
    first, processed = window_after_records(count, window, valid, SPEC_LEN, RECORDS)
    if valid:
        # The first state tile is requested before phase 1, so that its latency
        # overlaps phase 1's loads and arithmetic.
        NUM_CHUNKS: tl.constexpr = BK // KEY_CHUNK
        slots = tl.arange(0, NUM_CHUNKS * BV)
        slot_keys = (slots // BV)[:, None] * KEY_CHUNK + tl.arange(0, KEY_CHUNK)[None, :]
        slot_key_mask = slot_keys < K
        state_head = state_ptr + block * stride_s_blk + h * stride_s_head
        kg_head = key_gate_ptr + block * stride_kg_blk + h * stride_kg_head
        corr_head = correction_ptr + block * stride_c_blk + h * stride_c_head
        if not TENSOR_CORES:  # the tensor-core products load their own chunks
            state = _load_state_tile(state_head, first_tile, slots, slot_keys, slot_key_mask,
                                     stride_s_v, stride_s_k, V, BV)
        if FUSED_CONV:
            # conv_verify: this program owns the head's channels of x and of the
            # conv state (grid (1, B, H)); q, k and v point into the window's
            # convolution outputs, written here and read from phase 1 on.
            _convolve_head(x_ptr, conv_ptr, conv_weight_ptr, conv_bias_ptr, q_ptr, parent_ptr,
                           bos, block, tl.minimum(window, SPEC_LEN), h, tl.num_programs(2),
                           stride_x_tok, stride_x_dim, stride_conv_blk, stride_conv_dim,
                           stride_conv_col, stride_w_dim, stride_w_tap, stride_bias,
                           stride_q_tok, stride_q_dim, stride_parent, K, V, BK, BVH, WIDTH,
                           BT, BH, HAS_BIAS, SILU, TREE)
        # Phase 1: every token's decay and normalised key and query, all
        # tokens at once, into this (request, head)'s workspace rows. The token
        # loop below then only loads them, in the state tile's layout, instead of
        # reducing and converting layouts (barriers) inside its serial chain.
        # Every program of the head writes the same values.
        A = tl.exp(tl.load(A_log_ptr + h * stride_A_head).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h * stride_dt_head + offs_k * stride_dt_dim,
                          mask=mask_k, other=0.0).to(tl.float32)
        steps = tl.arange(0, BT)
        tokens = bos + steps[:, None]
        tile_mask = (steps < processed)[:, None] & mask_k[None, :]
        load_mask = (steps < tl.minimum(window, SPEC_LEN))[:, None] & mask_k[None, :]
        raw_k, raw_g, raw_q = load_window(
            k_ptr, g_ptr, q_ptr, tokens, h, offs_k, load_mask, tile_mask, stride_k_tok,
            stride_k_head, stride_k_dim, stride_g_tok, stride_g_head, stride_g_dim,
            stride_q_tok, stride_q_head, stride_q_dim, DEFERRED)
        keys, queries, decays = window_vectors(raw_k, raw_g, raw_q, dt_bias, A, lower_bound,
                                               scale, USE_LOWER_BOUND)
        head_row = (b * tl.num_programs(2) + h).to(tl.int64)  # workspace rows: int64 offsets
        NUM_VECTORS: tl.constexpr = 5 if CLOSED_FORM else 3
        vec_base = vectors_ptr + head_row * (BT * NUM_VECTORS * BK)
        # All BT rows are written: past the window (and past K) they hold finite
        # values (those of zero inputs; a decay of 1 in closed form), for the
        # unrolled token loop to run over.
        vec_tile = vec_base + offs_k[None, :] + steps[:, None] * (NUM_VECTORS * BK)
        # Deferred: closed forms keep the coefficients of pending_terms, `[BR, 2 BT]`;
        # the token loop the pending records' decays and keys, `[BR, 2 BK]`.
        pending_at = pending_terms_ptr + head_row * (BR * 2 * (BT if CLOSED_FORM else BK))
        if TREE:
            # The same terms along each node's path: the walk gathers its
            # ancestors' keys and decays from the rows written first.
            decays = tl.where(tile_mask, decays, 1.0)
            tl.store(vec_tile + 2 * BK, keys)
            tl.store(vec_tile + 3 * BK, queries)
            tl.store(vec_tile + 4 * BK, decays)
            tl.debug_barrier()  # the rows are written before the walk gathers them
            key_terms, query_terms, key_coupling, query_coupling = tree_window_terms(
                keys, queries, decays, vec_base + 2 * BK, NUM_VECTORS * BK, 2 * BK, parent_ptr,
                stride_parent, bos, processed, steps, offs_k, mask_k, SPEC_LEN)
            if DEFERRED:  # every node's path starts after the pending records
                key_terms, query_terms = pending_terms(
                    key_terms, query_terms, steps, kg_head, stride_kg_tok, stride_kg_dim, first,
                    dt_bias, A, lower_bound, offs_k, mask_k, pending_at, K, BK, BR,
                    USE_LOWER_BOUND, PREFETCHED=PREFETCH_STATE and PREFETCH_RECORDS)
            tl.store(vec_tile, key_terms)
            tl.store(vec_tile + BK, query_terms)
            coupling_at = coupling_ptr + head_row * (2 * BT * BT)
            coupling_tile = coupling_at + steps[:, None] * BT + steps[None, :]
            tl.store(coupling_tile, key_coupling)
            tl.store(coupling_tile + BT * BT, query_coupling)
        elif CLOSED_FORM:
            # E_t, the decay product of tokens 0..t, scales the token's key and
            # query for their products with the checkpoint; k, q and the decay
            # feed the coupling below.
            decays = tl.where(tile_mask, decays, 1.0)
            window_decays = tl.cumprod(decays, axis=0)
            key_terms = keys * window_decays
            query_terms = queries * window_decays
            if DEFERRED:
                key_terms, query_terms = pending_terms(
                    key_terms, query_terms, steps, kg_head, stride_kg_tok, stride_kg_dim, first,
                    dt_bias, A, lower_bound, offs_k, mask_k, pending_at, K, BK, BR, USE_LOWER_BOUND,
                    PREFETCHED=PREFETCH_STATE and PREFETCH_RECORDS)
            tl.store(vec_tile, key_terms)
            tl.store(vec_tile + BK, query_terms)
            tl.store(vec_tile + 2 * BK, keys)
            tl.store(vec_tile + 3 * BK, queries)
            tl.store(vec_tile + 4 * BK, decays)
            coupling_at = coupling_ptr + head_row * (2 * BT * BT)
            tl.debug_barrier()  # the key, query and decay rows are written
            _store_coupling(keys, vec_base, offs_k, mask_k, steps, coupling_at, BK, BT, SPEC_LEN)
        else:
            tl.store(vec_tile, decays)
            tl.store(vec_tile + BK, keys)
            tl.store(vec_tile + 2 * BK, queries)
            coupling_at = coupling_ptr + head_row * BT
            tl.store(coupling_at + steps, tl.sum(keys * queries, axis=1))
            if DEFERRED:
                pending_keys, pending_decays = pending_records(
                    kg_head, stride_kg_tok, stride_kg_dim, first, dt_bias, A, lower_bound,
                    offs_k, mask_k, K, BR, USE_LOWER_BOUND)
                pending_rows = pending_at + tl.arange(0, BR)[:, None] * (2 * BK) + offs_k[None, :]
                tl.store(pending_rows, pending_decays)
                tl.store(pending_rows + BK, pending_keys)
        # Pending records are only read (positions < first): no program writes them.
        if tl.program_id(0) == 0:
            kg_tile = (kg_head + (first + steps)[:, None] * stride_kg_tok
                       + offs_k[None, :] * stride_kg_dim)
            tl.store(kg_tile, raw_k, mask=tile_mask)
            tl.store(kg_tile + K * stride_kg_dim, raw_g, mask=tile_mask)
        tl.debug_barrier()  # the workspace rows are written before any thread reads them

        # Phase 2: the recurrence over the state tile. With S the state before
        # token t and D its decay, S' = S D:
        #   u = beta (v - S' k),  out = (S' + u k^T) q = S' q + u (k . q),
        # so both products read S' independently; then S <- S' + u k^T. Applying
        # D to the state first needs one workspace vector fewer per token than
        # products with D k and D q (the same multiplications): less L1 traffic.
        # The state tile is split into key chunks stacked chunk-major: slot
        # c * BV + r holds row r's keys [c * KEY_CHUNK, (c + 1) * KEY_CHUNK).
        # With 32-key chunks a warp spans 4 rows x 32 keys and each thread holds
        # all chunks of its rows, so a row's dot product is summed in registers
        # and then over 8 lanes; the [BV, BK] tile spread each row over 32 lanes.
        # A 3-D [BV, chunks, KEY_CHUNK] tile would do it too, but Triton 3.6 and
        # 3.9 lay that one out differently; this 2-D one they lay out alike.
        beta_at = beta_ptr + bos * stride_beta_tok + h * stride_beta_head
        # Unrolled over the group, and the zero stores below form their offsets
        # inside their own loop, so that nothing of either is held across the
        # token loop: a runtime tile loop with the zero-store offsets formed up
        # front took 13-17 registers more and was 4-7% slower at B = 1, T = 4
        # and 8 on an H200.
        for tile_in_group in tl.static_range(V_TILES):
            tile = first_tile + tile_in_group
            offs_v = tile * BV + tl.arange(0, BV)
            mask_v = offs_v < V
            v_rows = v_ptr + bos * stride_v_tok + h * stride_v_head + offs_v * stride_v_dim
            if (tile_in_group > 0) and (not TENSOR_CORES):
                state = _load_state_tile(state_head, tile, slots, slot_keys, slot_key_mask,
                                         stride_s_v, stride_s_k, V, BV)
            if DEFERRED and (not CLOSED_FORM):
                state = _fold_pending(state, first, pending_at, slot_keys, slot_key_mask,
                                      corr_head, tile * BV + slots % BV, stride_c_tok,
                                      stride_c_dim, V, BK)
            # Each token's outputs are kept in `[BV, BT]` tiles, in the layout
            # the row sums come in, and stored once after the loop: a store per
            # token needed a layout conversion through shared memory (four
            # barriers per token).
            outs = tl.zeros([BV, BT], dtype=tl.float32)
            corrections = tl.zeros([BV, BT], dtype=tl.float32)
            if TENSOR_CORES:
                # Column n reads token n % BT's E k (n < BT) or E q (BT <= n < 2 BT).
                cols = tl.arange(0, NP)
                term_cols = vec_base + (cols % BT) * (5 * BK) + (cols // BT) * BK
                outs, corrections = tensor_core_tile(
                    state_head, term_cols, outs, corrections, processed, steps, coupling_at,
                    v_rows, offs_v, beta_at, stride_s_v, stride_s_k, stride_v_tok,
                    stride_beta_tok, first, corr_head, pending_at, stride_c_tok, stride_c_dim,
                    K, V, BK, BV, BT, NP, SPEC_LEN, BR, DEFERRED, KEY_CHUNK, STAGES,
                    CHEAP_SPLIT=False)
            elif CLOSED_FORM:
                outs, corrections = _closed_form_tile(
                    state, outs, corrections, processed, steps, vec_base, slot_keys,
                    slot_key_mask, coupling_at, v_rows, offs_v, beta_at, stride_v_tok,
                    stride_beta_tok, first, corr_head, pending_at, tile, stride_c_tok,
                    stride_c_dim, V, BK, BV, BT, SPEC_LEN, BR, DEFERRED, NUM_CHUNKS, KEY_CHUNK)
            elif UNROLL_TOKENS:
                for t in tl.static_range(SPEC_LEN):
                    state, outs, corrections = _token_step(
                        state, outs, corrections, t, t < processed, steps,
                        vec_base, slot_keys, slot_key_mask, coupling_at, v_rows, offs_v, beta_at,
                        stride_v_tok, stride_beta_tok, V, BK, BV, NUM_CHUNKS, KEY_CHUNK)
            else:
                for t in range(0, processed):
                    state, outs, corrections = _token_step(
                        state, outs, corrections, t, t < processed, steps,
                        vec_base, slot_keys, slot_key_mask, coupling_at, v_rows, offs_v, beta_at,
                        stride_v_tok, stride_beta_tok, V, BK, BV, NUM_CHUNKS, KEY_CHUNK)
            step_mask = mask_v[:, None] & (steps < processed)[None, :]
            tl.store(out_ptr + (bos + steps[None, :]) * stride_o_tok + h * stride_o_head
                     + offs_v[:, None] * stride_o_dim, outs, mask=step_mask)
            tl.store(corr_head + (first + steps)[None, :] * stride_c_tok
                     + offs_v[:, None] * stride_c_dim, corrections, mask=step_mask)
    for t in range(processed, window):
        # Formed here, in a rarely taken loop, so that nothing of it is held
        # across phase 2 (see the tile loop).
        offs_group = first_tile * BV + tl.arange(0, V_TILES * BV)
        tl.store(out_ptr + (bos + t) * stride_o_tok + h * stride_o_head + offs_group * stride_o_dim,
                 tl.zeros([V_TILES * BV], dtype=tl.float32), mask=offs_group < V)


@triton.jit
def _convolve_head(x_ptr, conv_ptr, weight_ptr, bias_ptr, y_ptr, parent_ptr, bos, block,
                   processed, h, num_heads, stride_x_tok, stride_x_dim, stride_conv_blk,
                   stride_conv_dim, stride_conv_col, stride_w_dim, stride_w_tap, stride_bias,
                   stride_y_tok, stride_y_dim, stride_parent, K: tl.constexpr, V: tl.constexpr,
                   BK: tl.constexpr, BVH: tl.constexpr, WIDTH: tl.constexpr, BT: tl.constexpr,
                   BH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                   TREE: tl.constexpr):
    """conv_update of head h's channels of the window (x is q | k | v, `H K`,
    `H K` and `H V` channels) into `y`, its history shifted; the three
    groups' channels are disjoint, so each shifts its own after its barrier."""
    for group in tl.static_range(3):
        first = (h + group * num_heads) * K if group < 2 else 2 * num_heads * K + h * V
        convolve_channels(x_ptr, conv_ptr, weight_ptr, bias_ptr, y_ptr, parent_ptr, bos, block,
                          processed, first, stride_x_tok, stride_x_dim, stride_conv_blk,
                          stride_conv_dim, stride_conv_col, stride_w_dim, stride_w_tap,
                          stride_bias, stride_y_tok, stride_y_dim, stride_parent,
                          K if group < 2 else V, BK if group < 2 else BVH, WIDTH, BT, BH,
                          HAS_BIAS, SILU, TREE)


def _token_strides(t):
    """Strides of the (token, head, dim) axes of a `[(1,) tokens, H, D]` tensor."""
    return t.stride()[-3:]


@triton.jit
def _load_state_tile(state_head, tile, slots, slot_keys, slot_key_mask, stride_s_v, stride_s_k,
                     V: tl.constexpr, BV: tl.constexpr):
    """One `[BV, K]` tile of a head's state, chunk-major (see phase 2), in fp32."""
    slot_rows = tile * BV + slots % BV
    return tl.load(state_head + slot_rows[:, None] * stride_s_v + slot_keys * stride_s_k,
                   mask=(slot_rows < V)[:, None] & slot_key_mask, other=0.0).to(tl.float32)


@triton.jit
def _token_step(state, outs, corrections, t, live, steps,
                vec_base, slot_keys, slot_key_mask, key_query_at, v_rows, offs_v, beta_at,
                stride_v_tok, stride_beta_tok, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr, NUM_CHUNKS: tl.constexpr, KEY_CHUNK: tl.constexpr):
    """Token t over the state tile: returns the next state and the output and
    correction tiles with column t filled. An unrolled loop runs every token of
    the capacity; `live` (t inside the window) keeps the ones past the window
    from reading v and beta out of bounds; what they compute (finite, from the
    workspace's zero-input rows) is never stored.
    The workspace vectors are loaded at the state tile's shape, every row
    reading the same keys: they then arrive in the tile's layout, where a
    `[BK]` load would need a layout conversion (shared memory, barriers)."""
    row = vec_base + t * (3 * BK) + slot_keys
    decay = tl.load(row, mask=slot_key_mask, other=0.0)
    key = tl.load(row + BK, mask=slot_key_mask, other=0.0)
    query = tl.load(row + 2 * BK, mask=slot_key_mask, other=0.0)
    key_query = tl.load(key_query_at + t)
    v = tl.load(v_rows + t * stride_v_tok, mask=live_range(offs_v, V, live),
                other=0.0).to(tl.float32)
    beta = tl.load(beta_at + t * stride_beta_tok, mask=live, other=0.0).to(tl.float32)
    # After the token's other loads, as measured: multiplying at the decay's
    # load instead compiles the unrolled loops differently (Triton 3.6).
    state = state * decay
    key_dot = _row_dot(state * key, NUM_CHUNKS, BV, KEY_CHUNK)
    query_dot = _row_dot(state * query, NUM_CHUNKS, BV, KEY_CHUNK)
    u = (v - key_dot) * tl.sigmoid(beta)
    out = query_dot + u * key_query
    u_slots = tl.reshape(tl.broadcast_to(u[None, :], (NUM_CHUNKS, BV)), [NUM_CHUNKS * BV])
    state = state + u_slots[:, None] * key
    is_t = steps[None, :] == t
    return state, tl.where(is_t, out[:, None], outs), tl.where(is_t, u[:, None], corrections)


@triton.jit
def _store_coupling(keys, vec_base, offs_k, mask_k, steps, coupling_at, BK: tl.constexpr,
                    BT: tl.constexpr, SPEC_LEN: tl.constexpr):
    """The window's T x T coupling, from its keys `[BT, BK]` and the workspace
    rows: A[t, s] = k_s . (D_{s+1} ... D_t) k_t (s < t) and B[t, s] likewise
    with q_t (s <= t, B[t, t] = k_t . q_t), stored as `[2, BT, BT]` with A[t, s]
    at [0, s, t]. The decay products are carried multiplicatively, token by
    token: from exp of differences of cumulative gates they would lose digits
    when one gate is large. Token t's rows are loaded at the `[BT, BK]` tile's
    shape, so that they arrive in its layout."""
    key_mask = tl.broadcast_to(mask_k[None, :], (BT, BK))
    carried = keys  # row s: k_s decayed by tokens s+1..t
    key_coupling = tl.zeros([BT, BT], dtype=tl.float32)
    query_coupling = tl.zeros([BT, BT], dtype=tl.float32)
    for t in tl.static_range(SPEC_LEN):
        token_row = tl.broadcast_to((vec_base + t * (5 * BK) + offs_k)[None, :], (BT, BK))
        key = tl.load(token_row + 2 * BK, mask=key_mask, other=0.0)
        query = tl.load(token_row + 3 * BK, mask=key_mask, other=0.0)
        if t > 0:
            decay = tl.load(token_row + 4 * BK, mask=key_mask, other=0.0)
            carried = tl.where(steps[:, None] < t, carried * decay, keys)
        column_t = steps[None, :] == t
        key_coupling = tl.where(column_t & (steps[:, None] < t),
                                tl.sum(carried * key, axis=1)[:, None], key_coupling)
        query_coupling = tl.where(column_t & (steps[:, None] <= t),
                                  tl.sum(carried * query, axis=1)[:, None], query_coupling)
    coupling_tile = coupling_at + steps[:, None] * BT + steps[None, :]
    tl.store(coupling_tile, key_coupling)
    tl.store(coupling_tile + BT * BT, query_coupling)


@triton.jit
def _closed_form_tile(state, outs, corrections, processed, steps, vec_base, slot_keys,
                      slot_key_mask, coupling_at, v_rows, offs_v, beta_at, stride_v_tok,
                      stride_beta_tok, pending, corr_head, pending_at, tile, stride_c_tok,
                      stride_c_dim, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      BT: tl.constexpr, SPEC_LEN: tl.constexpr, BR: tl.constexpr,
                      DEFERRED: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                      KEY_CHUNK: tl.constexpr):
    """A state tile's outputs in closed form. With S0 the checkpoint and E_t
    the decay product of tokens 0..t, the recurrence unrolls to
        u_t = beta_t (v_t - S0 (E_t k_t) - sum_{s<t} A[t, s] u_s),
        out_t = S0 (E_t q_t) + sum_{s<=t} B[t, s] u_s,
    so the state is only read, by 2T products that do not wait on each other
    (the token loop's decay and update passes are gone), and the tokens are
    linked afterwards through the coupling, on `[BV]` vectors held in tuples.
    Tokens past the window read no v or beta: their u is 0 and nothing of
    theirs is stored. Deferred, `state` is the checkpoint and the pending
    records' corrections add their part (common.pending_terms), held over
    the records as the state tile is over keys."""
    if DEFERRED:
        RECORD_CHUNKS: tl.constexpr = (BR + KEY_CHUNK - 1) // KEY_CHUNK
        record_slots = tl.arange(0, RECORD_CHUNKS * BV)
        records = ((record_slots // BV)[:, None] * KEY_CHUNK
                   + tl.arange(0, KEY_CHUNK)[None, :])
        record_rows = tile * BV + record_slots % BV
        pending_corrections = tl.load(
            corr_head + records * stride_c_tok + record_rows[:, None] * stride_c_dim,
            mask=(records < pending) & (record_rows < V)[:, None], other=0.0).to(tl.float32)
    residuals = ()
    query_dots = ()
    for t in tl.static_range(SPEC_LEN):
        row = vec_base + t * (5 * BK) + slot_keys
        key = tl.load(row, mask=slot_key_mask, other=0.0)
        query = tl.load(row + BK, mask=slot_key_mask, other=0.0)
        v = tl.load(v_rows + t * stride_v_tok, mask=live_range(offs_v, V, t < processed),
                    other=0.0).to(tl.float32)
        residual = v - _row_dot(state * key, NUM_CHUNKS, BV, KEY_CHUNK)
        query_dot = _row_dot(state * query, NUM_CHUNKS, BV, KEY_CHUNK)
        if DEFERRED:
            # Skipped with none pending (after a fold): B = 1, T = 4 5.3 µs, not 6.4 (H100).
            if pending > 0:
                coef = pending_at + records * (2 * BT) + t
                key_coef = tl.load(coef, mask=records < pending, other=0.0)
                query_coef = tl.load(coef + BT, mask=records < pending, other=0.0)
                residual -= _row_dot(pending_corrections * key_coef, RECORD_CHUNKS, BV,
                                     KEY_CHUNK)
                query_dot += _row_dot(pending_corrections * query_coef, RECORD_CHUNKS, BV,
                                      KEY_CHUNK)
        residuals = residuals + (residual,)
        query_dots = query_dots + (query_dot,)
    return link_tokens(residuals, query_dots, outs, corrections, processed, steps, coupling_at,
                       beta_at, stride_beta_tok, BT, SPEC_LEN)


@triton.jit
def _fold_pending(state, pending, pending_at, slot_keys, slot_key_mask, corr_head, slot_rows,
                  stride_c_tok, stride_c_dim, V: tl.constexpr, BK: tl.constexpr):
    """The token loop's state tile with the block's pending records folded in,
    from phase 1's decay and key rows; each row's correction is loaded at the
    tile's shape (every key of a row reads the same value), in its layout."""
    corrections_at = tl.broadcast_to((corr_head + slot_rows * stride_c_dim)[:, None],
                                     slot_keys.shape)
    rows_ok = (slot_rows < V)[:, None] & slot_key_mask
    for j in range(0, pending):
        row = pending_at + j * (2 * BK) + slot_keys
        decay = tl.load(row, mask=slot_key_mask, other=0.0)
        key = tl.load(row + BK, mask=slot_key_mask, other=0.0)
        u = tl.load(corrections_at + j * stride_c_tok, mask=rows_ok, other=0.0).to(tl.float32)
        state = state * decay + u * key
    return state


@triton.jit
def _row_dot(products, NUM_CHUNKS: tl.constexpr, BV: tl.constexpr, KEY_CHUNK: tl.constexpr):
    """Per-row sums of a chunk-major `[NUM_CHUNKS * BV, KEY_CHUNK]` tile: the
    chunks first (in registers), then the keys of a chunk (across lanes)."""
    return tl.sum(tl.sum(tl.reshape(products, [NUM_CHUNKS, BV, KEY_CHUNK]), axis=0), axis=1)


def verify_launches(config, key_dim, value_dim, spec_len, use_lower_bound, pdl, records=None,
                    deferred=False, tree=False, conv=None):
    """The kernels of one verify launch: {name: (kernel, constexprs, num_warps)},
    for windows (trees with `tree`) of up to `spec_len` tokens and records of
    `records` positions (default spec_len); with `conv` (a FusedConv),
    conv_verify's kernel. tools/kernel_resources.py compiles exactly these."""
    records = spec_len if records is None else records
    BK = triton.next_power_of_2(key_dim)
    BT = triton.next_power_of_2(spec_len)
    shape = dict(K=key_dim, BK=BK, SPEC_LEN=spec_len, BT=BT, RECORDS=records,
                 BR=triton.next_power_of_2(records), DEFERRED=deferred)
    if config.separate_terms:
        link = config.link_on_tensor_cores
        return {
            "window_terms": (window_terms_kernel,
                             dict(shape, TREE=tree, USE_LOWER_BOUND=use_lower_bound,
                                  LINK_MATRIX=link, PDL=pdl), WINDOW_TERMS_WARPS),
            "verify_tensor_cores": (tensor_core_verify_kernel,
                                    dict(shape, V=value_dim, BV=config.block_v,
                                         NP=max(16, 2 * BT), KEY_CHUNK=config.key_chunk,
                                         STAGES=config.stages, LINK_MATRIX=link,
                                         CHEAP_SPLIT=config.cheap_tf32_split, PDL=pdl),
                                    config.num_warps),
        }
    return {"verify": (_verify_kernel, dict(
        shape, TREE=tree, V=value_dim, BV=config.block_v, USE_LOWER_BOUND=use_lower_bound,
        KEY_CHUNK=config.key_chunk, V_TILES=config.v_tiles, UNROLL_TOKENS=config.unroll_tokens,
        CLOSED_FORM=config.closed_form, TENSOR_CORES=config.tensor_cores, NP=max(16, 2 * BT),
        STAGES=config.stages, PREFETCH_STATE=config.prefetch_state and pdl,
        PREFETCH_RECORDS=config.prefetch_records,
        **_fused_conv_constexprs(conv, value_dim, spec_len), PDL=pdl), config.num_warps)}


class FusedConv(NamedTuple):
    """conv_verify's convolution: what its kernel takes beside verify's."""

    x: torch.Tensor
    conv_state: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    silu: bool

    @property
    def width(self):
        return self.weight.shape[1]


def _fused_conv_constexprs(conv, value_dim, spec_len):
    if conv is None:
        return dict(FUSED_CONV=False, WIDTH=2, BH=1, BVH=1, HAS_BIAS=False, SILU=False)
    return dict(FUSED_CONV=True, WIDTH=conv.width,
                BH=triton.next_power_of_2(conv.width - 2 + spec_len),
                BVH=triton.next_power_of_2(value_dim), HAS_BIAS=conv.bias is not None,
                SILU=conv.silu)


def _fused_conv_args(conv, fallback):
    """The kernel's convolution pointers and strides (`fallback`'s, unread,
    without `conv`)."""
    if conv is None:
        return (fallback,) * 4, (0,) * 8
    bias = conv.weight if conv.bias is None else conv.bias
    return ((conv.x, conv.conv_state, conv.weight, bias),
            (*conv.x.stride(), *conv.conv_state.stride(), *conv.weight.stride(),
             bias.stride(0) if conv.bias is not None else 0))


def launch_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                  query_start_loc, state_indices, lower_bound, scale, out, dims, pending=None,
                  spec_len=None, parent=None, config=None, conv=None):
    """`spec_len`: the longest window, T (default: the records' positions);
    `parent`: the windows' tree parents (default: chains); `config`: the
    VerifyConfig (default: the policy's); `conv`: a FusedConv, whose outputs
    q, k and v are (views of one `[tokens, D]` tensor, q first) and which
    `config` runs with one program per request and head."""
    if dims.batch == 0:
        return
    num_heads, K, V = dims.num_heads, dims.key_dim, dims.value_dim
    records = dims.spec_len
    spec_len = records if spec_len is None else spec_len
    deferred = pending is not None
    tree = parent is not None
    if config is None:
        config = verify_config(K, V, dims.batch * num_heads, spec_len,
                               expects_pending(deferred, dims.batch), tree)
    launch = dependent_launch(q, dims.batch)
    kernels = verify_launches(config, K, V, spec_len, lower_bound is not None, launch["PDL"],
                              records, deferred, tree, conv)
    BK = triton.next_power_of_2(K)
    BT = triton.next_power_of_2(spec_len)
    BR = triton.next_power_of_2(records)
    dt_strides = (dt_bias.stride(0), dt_bias.stride(1)) if dt_bias.dim() == 2 else (
        K * dt_bias.stride(0), dt_bias.stride(0))
    # Per (request, head), deferred: the pending records' coefficients `[BR, 2 BT]`
    # (closed forms), or their decays and keys `[BR, 2 BK]` (token loop).
    pending_terms = torch.empty(
        (dims.batch, num_heads, BR * 2 * (BT if config.closed_form else BK)) if deferred else (1,),
        device=q.device, dtype=torch.float32)
    counts = pending if deferred else state_indices  # unread in the immediate schedule
    parents = parent if tree else state_indices  # unread for chains
    index_args = (pending_terms, query_start_loc, state_indices)
    scalars = (dims.num_blocks, float(lower_bound or 0.0), float(scale))
    index_strides = (query_start_loc.stride(0), state_indices.stride(0), counts.stride(0))
    if config.separate_terms:
        # Per (request, head): E k and E q of every token, and the couplings (or,
        # with the link product, the link matrices: the same size).
        terms = torch.empty((dims.batch, num_heads, 2 * BT, BK), device=q.device,
                            dtype=torch.float32)
        coupling = torch.empty((dims.batch, num_heads, 2 * BT * BT), device=q.device,
                               dtype=torch.float32)
        kernel, constexprs, warps = kernels["window_terms"]
        wrap_triton(kernel)[(dims.batch, num_heads)](
            q, k, g, beta, A_log, dt_bias, key_gate, terms, coupling, counts, *index_args,
            parents, *scalars, *_token_strides(q), *_token_strides(k), *_token_strides(g),
            *beta.stride()[-2:], A_log.stride(0), *dt_strides, *key_gate.stride(),
            *index_strides, parents.stride(0), **constexprs, num_warps=warps,
            **launch_options(launch),
        )
        kernel, constexprs, warps = kernels["verify_tensor_cores"]
        wrap_triton(kernel)[(triton.cdiv(V, config.block_v), dims.batch, num_heads)](
            v, beta, state, correction, out, terms, coupling, counts, *index_args,
            dims.num_blocks, *_token_strides(v), *beta.stride()[-2:], *state.stride(),
            *correction.stride(), *_token_strides(out), *index_strides,
            **constexprs, num_warps=warps, **launch_options(launch),
        )
        return
    grid = (triton.cdiv(triton.cdiv(V, config.block_v), config.v_tiles), dims.batch, num_heads)
    closed = config.closed_form
    # Per (request, head, token): decay, key, query and k.q; in closed form
    # E k, E q, key, query, decay and the T x T couplings A and B.
    vectors = torch.empty((dims.batch, num_heads, BT, (5 if closed else 3) * BK),
                          device=q.device, dtype=torch.float32)
    coupling = torch.empty((dims.batch, num_heads, 2 * BT * BT if closed else BT),
                           device=q.device, dtype=torch.float32)
    kernel, constexprs, warps = kernels["verify"]
    conv_tensors, conv_strides = _fused_conv_args(conv, state_indices)
    wrap_triton(kernel)[grid](
        q, k, v, g, beta, A_log, dt_bias,
        state, correction, key_gate, out, vectors, coupling, counts, *index_args, parents,
        *conv_tensors, *scalars,
        *_token_strides(q), *_token_strides(k), *_token_strides(v), *_token_strides(g),
        *beta.stride()[-2:],
        A_log.stride(0), *dt_strides,
        *state.stride(), *correction.stride(), *key_gate.stride(), *_token_strides(out),
        *index_strides, parents.stride(0), *conv_strides,
        **constexprs, num_warps=warps, **launch_options(launch),
    )


def launch_conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state,
                       correction, key_gate, query_start_loc, state_indices, activation,
                       lower_bound, scale, out, dims, pending=None, spec_len=None, parent=None):
    """conv_update into a per-call `[tokens, D]` buffer, then verify of its q | k | v
    split: inside verify's programs where `dispatch.conv_verify_config` gives a
    form with one program per (request, head), else as the two ops' kernels."""
    verify_dims = dims.verify
    H, K, V = verify_dims.num_heads, verify_dims.key_dim, verify_dims.value_dim
    convolved = torch.empty_like(x)
    q, k, v = conv_verify_split(convolved, H, K, V)
    verify_args = (g, beta, A_log, dt_bias, state, correction, key_gate, query_start_loc,
                   state_indices, lower_bound, scale, out, verify_dims, pending, spec_len, parent)
    config = conv_verify_config(K, V, verify_dims.batch * H, spec_len,
                                expects_pending(pending is not None, verify_dims.batch),
                                parent is not None)
    if config is None:
        launch_conv_update(x, conv_state, conv_weight, conv_bias, query_start_loc, state_indices,
                           activation, convolved, dims.conv, parent)
        launch_verify(q, k, v, *verify_args)
        return
    launch_verify(q, k, v, *verify_args, config=config,
                  conv=FusedConv(x, conv_state, conv_weight, conv_bias, activation == "silu"))


VERIFY_KERNELS = (_verify_kernel, window_terms_kernel, tensor_core_verify_kernel)
