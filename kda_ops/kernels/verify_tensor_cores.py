"""Verify in closed form with the state products on tensor cores, in two kernels.

The closed form (see verify._closed_form_tile) needs, per (request, head), every
token's decayed key E_t k_t and query E_t q_t and the T x T coupling of the
window; these depend on the activations only. The first kernel computes them
for every (request, head) at once and writes the key/gate records; the second
only streams the checkpoint: one `[BV, 2T]` product of a state tile with the
decayed keys and queries (3xTF32 `tl.dot` over key chunks pipelined through
shared memory), then links the tokens (from five tokens by one more product
with two T x T link matrices that the first kernel builds in place of the
coupling). Two kernels, because in one the token-side work sits between a
program's start and its first state load, with nothing to overlap it when two
programs fill an SM: at T = 8, B = 256 on an H200 the product kernel alone
took 219 us against 375 us for one fused kernel.
"""

import triton
import triton.language as tl

from .common import (block_is_valid, link_tokens, live_range, load_window, pending_terms,
                     tree_window_terms, wait_for_previous_kernel, window_after_records,
                     window_vectors)


@triton.jit
def window_terms_kernel(
    q_ptr, k_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr, key_gate_ptr, terms_ptr, coupling_ptr,
    pending_ptr, pending_terms_ptr, query_start_ptr, state_indices_ptr, parent_ptr,
    num_blocks, lower_bound, scale,
    stride_q_tok, stride_q_head, stride_q_dim,
    stride_k_tok, stride_k_head, stride_k_dim,
    stride_g_tok, stride_g_head, stride_g_dim,
    stride_beta_tok, stride_beta_head,
    stride_A_head, stride_dt_head, stride_dt_dim,
    stride_kg_blk, stride_kg_head, stride_kg_tok, stride_kg_dim,
    stride_query_start, stride_state_indices, stride_pending, stride_parent,
    K: tl.constexpr, BK: tl.constexpr, SPEC_LEN: tl.constexpr, BT: tl.constexpr,
    RECORDS: tl.constexpr, BR: tl.constexpr, DEFERRED: tl.constexpr, TREE: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, LINK_MATRIX: tl.constexpr,
    PDL: tl.constexpr,
):
    """Per (request, head): rows t and BT + t of `terms` [2 BT, BK] get E_t k_t
    and E_t q_t, `coupling` [2, BT, BT] gets A[t, s] at [0, s, t] and B[t, s] at
    [1, s, t] (see _coupling), or with LINK_MATRIX the link matrices N and W
    (_link_matrices) at [0, s, t] and [1, s, t], and the key/gate record is
    written. Rows past the window hold zeros (a decay of 1), so their coupling
    is zero. Deferred, the terms are those of the checkpoint folded with the
    pending records, and their coefficients go to `pending_terms`
    (common.pending_terms). With TREE, the terms and couplings follow each
    node's path (common.tree_window_terms)."""
    wait_for_previous_kernel(PDL)
    lower_bound = tl.cast(lower_bound, tl.float32)
    scale = tl.cast(scale, tl.float32)
    b = tl.program_id(0)
    h = tl.program_id(1)
    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    valid = block_is_valid(block, num_blocks)
    if valid:
        # Loaded here, not in a helper, as it addresses stores (see commit_plan_row).
        count = tl.zeros_like(block)
        if DEFERRED:
            count = tl.load(pending_ptr + block * stride_pending).to(tl.int64)
        first, processed = window_after_records(count, tl.maximum(eos - bos, 0), valid,
                                                SPEC_LEN, RECORDS)
        offs_k = tl.arange(0, BK)
        mask_k = offs_k < K
        steps = tl.arange(0, BT)
        tokens = bos + steps[:, None]
        tile_mask = (steps < processed)[:, None] & mask_k[None, :]
        load_mask = (steps < tl.minimum(eos - bos, SPEC_LEN))[:, None] & mask_k[None, :]
        raw_k, raw_g, raw_q = load_window(
            k_ptr, g_ptr, q_ptr, tokens, h, offs_k, load_mask, tile_mask, stride_k_tok,
            stride_k_head, stride_k_dim, stride_g_tok, stride_g_head, stride_g_dim,
            stride_q_tok, stride_q_head, stride_q_dim, DEFERRED)
        # The records first: the raw tiles are then dead, which frees registers
        # (168 against 255 at T = 8, Triton 3.6).
        kg_head = key_gate_ptr + block * stride_kg_blk + h * stride_kg_head
        kg_tile = (kg_head + (first + steps)[:, None] * stride_kg_tok
                   + offs_k[None, :] * stride_kg_dim)
        tl.store(kg_tile, raw_k, mask=tile_mask)
        tl.store(kg_tile + K * stride_kg_dim, raw_g, mask=tile_mask)
        A = tl.exp(tl.load(A_log_ptr + h * stride_A_head).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h * stride_dt_head + offs_k * stride_dt_dim,
                          mask=mask_k, other=0.0).to(tl.float32)
        keys, queries, decays = window_vectors(raw_k, raw_g, raw_q, dt_bias, A, lower_bound,
                                               scale, USE_LOWER_BOUND)
        decays = tl.where(tile_mask, decays, 1.0)
        head_row = (b * tl.num_programs(1) + h).to(tl.int64)  # workspace rows: int64 offsets
        terms_tile = terms_ptr + head_row * (2 * BT * BK) + steps[:, None] * BK + offs_k[None, :]
        if TREE:
            # The walk gathers ancestors' keys and decays from the terms' rows,
            # written first and overwritten by the terms once it is done.
            tl.store(terms_tile, keys)
            tl.store(terms_tile + BT * BK, decays)
            tl.debug_barrier()
            key_terms, query_terms, key_coupling, query_coupling = tree_window_terms(
                keys, queries, decays, terms_ptr + head_row * (2 * BT * BK), BK, BT * BK,
                parent_ptr, stride_parent, bos, processed, steps, offs_k, mask_k, SPEC_LEN)
            tl.debug_barrier()
        else:
            window_decays = tl.cumprod(decays, axis=0)
            key_terms = keys * window_decays
            query_terms = queries * window_decays
        if DEFERRED:
            key_terms, query_terms = pending_terms(
                key_terms, query_terms, steps, kg_head, stride_kg_tok, stride_kg_dim, first,
                dt_bias, A, lower_bound, offs_k, mask_k,
                pending_terms_ptr + head_row * (BR * 2 * BT), K, BK, BR, USE_LOWER_BOUND,
                PREFETCHED=False)
        tl.store(terms_tile, key_terms)
        tl.store(terms_tile + BT * BK, query_terms)
        if not TREE:
            key_coupling, query_coupling = _coupling(keys, queries, decays, steps, SPEC_LEN)
        if LINK_MATRIX:
            beta = tl.load(beta_ptr + (bos + steps) * stride_beta_tok + h * stride_beta_head,
                           mask=steps < processed, other=0.0).to(tl.float32)
            key_coupling, query_coupling = _link_matrices(key_coupling, query_coupling,
                                                          tl.sigmoid(beta), steps, SPEC_LEN)
        coupling_tile = (coupling_ptr + head_row * (2 * BT * BT)
                         + steps[:, None] * BT + steps[None, :])
        tl.store(coupling_tile, key_coupling)
        tl.store(coupling_tile + BT * BT, query_coupling)


@triton.jit
def _coupling(keys, queries, decays, steps, SPEC_LEN: tl.constexpr):
    """The window's couplings as `[s, t]` tiles, from its normalised keys and
    queries and per-channel decays `[BT, BK]` (decay 1 past the window):
    A[t, s] = k_s . (D_{s+1} ... D_t) k_t for s < t and
    B[t, s] = k_s . (D_{s+1} ... D_t) q_t for s <= t, zero elsewhere. Row s of
    `carried` holds k_s decayed by tokens s+1..t, the decays multiplied in
    token by token (exp of differences of cumulative gates would lose digits
    when one gate is large). Token t's rows are taken out of the tiles by a sum
    over the rows: in a one-warp program (WINDOW_TERMS_WARPS) every thread
    holds all rows of its keys, so that sum and the broadcast back stay in
    registers; with more warps each would cross warps."""
    BT: tl.constexpr = keys.shape[0]
    carried = keys
    key_coupling = tl.zeros([BT, BT], dtype=tl.float32)
    query_coupling = tl.zeros([BT, BT], dtype=tl.float32)
    for t in tl.static_range(SPEC_LEN):
        at_t = steps[:, None] == t
        key = tl.sum(tl.where(at_t, keys, 0.0), axis=0)
        query = tl.sum(tl.where(at_t, queries, 0.0), axis=0)
        if t > 0:
            decay = tl.sum(tl.where(at_t, decays, 0.0), axis=0)
            carried = tl.where(steps[:, None] < t, carried * decay[None, :], keys)
        column_t = steps[None, :] == t
        key_coupling = tl.where(column_t & (steps[:, None] < t),
                                tl.sum(carried * key[None, :], axis=1)[:, None], key_coupling)
        query_coupling = tl.where(column_t & (steps[:, None] <= t),
                                  tl.sum(carried * query[None, :], axis=1)[:, None],
                                  query_coupling)
    return key_coupling, query_coupling


@triton.jit
def _link_matrices(key_coupling, query_coupling, gains, steps, SPEC_LEN: tl.constexpr):
    """The closed form's token links as two `[s, t]` matrices: with r_s = v_s -
    S0 (E_s k_s) and p_s = S0 (E_s q_s), u = r N and out = p + r W (link_tokens
    computes the same token by token). Column t of N is gain_t (e_t - sum over
    r < t of A[t, r] N[:, r]), built in token order as link_tokens builds u;
    W = N B^T. `key_coupling` and `query_coupling` hold A[t, s] and B[t, s] at
    [s, t] (_coupling); columns of tokens past SPEC_LEN stay zero."""
    BT: tl.constexpr = steps.shape[0]
    link = tl.zeros([BT, BT], dtype=tl.float32)
    for t in tl.static_range(SPEC_LEN):
        at_t = steps[None, :] == t
        # Row r of A[t, :] as a row over the columns r of `link`.
        couplings = tl.sum(tl.where(at_t, key_coupling, 0.0), axis=1)
        linked = tl.sum(link * tl.reshape(couplings, (1, BT)), axis=1)
        gain = tl.sum(tl.where(steps == t, gains, 0.0), axis=0)
        link = tl.where(at_t, ((steps == t) - linked)[:, None] * gain, link)
    return link, tl.sum(link[:, :, None] * query_coupling[None, :, :], axis=1)


@triton.jit
def tensor_core_tile(state_head, term_cols, outs, corrections, processed, steps, coupling_at,
                     v_rows, offs_v, beta_at, stride_s_v, stride_s_k, stride_v_tok,
                     stride_beta_tok, pending, corr_head, pending_at, stride_c_tok,
                     stride_c_dim, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                     BV: tl.constexpr, BT: tl.constexpr, NP: tl.constexpr,
                     SPEC_LEN: tl.constexpr, BR: tl.constexpr, DEFERRED: tl.constexpr,
                     KEY_CHUNK: tl.constexpr, STAGES: tl.constexpr,
                     CHEAP_SPLIT: tl.constexpr):
    """A state tile's closed form with its 2T products on tensor cores: one
    `[BV, NP]` product of the tile with every token's E k (column t) and E q
    (column BT + t), whose keys start at `term_cols` (`[NP]` pointers; columns
    past 2 BT, NP >= 16 for the tensor cores, multiply zeros), over key chunks
    that Triton pipelines through shared memory; then the tokens are linked.
    The products run in 3xTF32 (each operand split into two TF32 parts, three
    products), which keeps fp32 accuracy: plain TF32 would lose it."""
    products = state_products(state_head, term_cols, offs_v, stride_s_v, stride_s_k, pending,
                              corr_head, pending_at, stride_c_tok, stride_c_dim, K, V, BK,
                              BV, BT, NP, BR, DEFERRED, KEY_CHUNK, STAGES, CHEAP_SPLIT)
    cols = tl.arange(0, NP)
    residuals = ()
    query_dots = ()
    for t in tl.static_range(SPEC_LEN):
        v = tl.load(v_rows + t * stride_v_tok, mask=live_range(offs_v, V, t < processed),
                    other=0.0).to(tl.float32)
        residuals = residuals + (v - tl.sum(tl.where(cols[None, :] == t, products, 0.0), axis=1),)
        query_dots = query_dots + (tl.sum(tl.where(cols[None, :] == BT + t, products, 0.0),
                                          axis=1),)
    return link_tokens(residuals, query_dots, outs, corrections, processed, steps, coupling_at,
                       beta_at, stride_beta_tok, BT, SPEC_LEN)


@triton.jit
def state_products(state_head, term_cols, offs_v, stride_s_v, stride_s_k, pending, corr_head,
                   pending_at, stride_c_tok, stride_c_dim, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                   NP: tl.constexpr, BR: tl.constexpr, DEFERRED: tl.constexpr,
                   KEY_CHUNK: tl.constexpr, STAGES: tl.constexpr, CHEAP_SPLIT: tl.constexpr):
    """The `[BV, NP]` product of a state tile with the columns at `term_cols`
    (see tensor_core_tile). Deferred, the pending records' corrections
    `[BV, records]` times their coefficients `[records, NP]` (at `pending_at`,
    common.pending_terms) are added: the product of the folded state."""
    cols = tl.arange(0, NP)
    chunk = tl.arange(0, KEY_CHUNK)
    w_mask = (cols < 2 * BT)[None, :]
    rows = state_head + offs_v[:, None] * stride_s_v
    rows_ok = (offs_v < V)[:, None]
    products = tl.zeros([BV, NP], dtype=tl.float32)
    for k0 in tl.range(0, BK, KEY_CHUNK, num_stages=STAGES):
        keys = k0 + chunk
        s = tl.load(rows + keys[None, :] * stride_s_k, mask=rows_ok & (keys < K)[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(term_cols[None, :] + keys[:, None], mask=w_mask, other=0.0)
        products = dot_3xtf32(s, w, products, CHEAP_SPLIT)
    if DEFERRED:
        if pending > 0:  # none after a fold: about 1 µs less at B = 64, T = 4 (H100)
            correction_rows = corr_head + offs_v[:, None] * stride_c_dim
            for r0 in tl.static_range(0, BR, KEY_CHUNK):
                records = r0 + chunk
                u = tl.load(correction_rows + records[None, :] * stride_c_tok,
                            mask=rows_ok & (records < pending)[None, :],
                            other=0.0).to(tl.float32)
                coef = tl.load(pending_at + records[:, None] * (2 * BT) + cols[None, :],
                               mask=(records < pending)[:, None] & w_mask, other=0.0)
                products = dot_3xtf32(u, coef, products, CHEAP_SPLIT)
    return products


@triton.jit
def split_tf32(x):
    """x = hi + lo: hi rounded to TF32 (10 mantissa bits; half away from zero,
    by an integer add and a mask), lo = x - hi exactly, with at most 12
    significant bits, of which the tensor cores keep 11. Unlike Triton's
    tf32x3 split it does not guard against NaN payloads that carry into the
    sign (canonical NaNs stay NaN, infinities stay infinite)."""
    hi = ((x.to(tl.int32, bitcast=True) + 0x1000) & -0x2000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def dot_3xtf32(a, b, acc, CHEAP_SPLIT: tl.constexpr):
    """acc + a b in 3xTF32 (hi hi + hi lo + lo hi): Triton's tf32x3, or with
    CHEAP_SPLIT the operands split by split_tf32 (3 instructions an element
    against about 6)."""
    if CHEAP_SPLIT:
        a_hi, a_lo = split_tf32(a)
        b_hi, b_lo = split_tf32(b)
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    return tl.dot(a, b, acc, input_precision="tf32x3")


@triton.jit
def link_on_tensor_cores(products, processed, link_at, v_rows, offs_v, stride_v_tok,
                         V: tl.constexpr, BT: tl.constexpr):
    """Corrections u and outputs `[BV, BT]` from the products (column s: S0 E_s k_s,
    BT + s: S0 E_s q_s) in one more product: with R holding v_s - S0 E_s k_s in
    column s and -S0 E_s q_s in column BT + s, R M has u_t in column t and
    out_t in column BT + t, for M = [[N, W], [0, -I]] (_link_matrices, read
    from `link_at`)."""
    NP: tl.constexpr = products.shape[1]
    cols = tl.arange(0, NP)
    values = tl.load(v_rows[:, None] + cols[None, :] * stride_v_tok,
                     mask=(offs_v < V)[:, None] & (cols < processed)[None, :],
                     other=0.0).to(tl.float32)
    rows = cols[:, None]
    token = cols[None, :] % BT
    link = tl.load(link_at + (cols[None, :] >= BT) * (BT * BT) + rows * BT + token,
                   mask=(rows < BT) & (cols[None, :] < 2 * BT), other=0.0)
    link = tl.where((rows >= BT) & (rows < 2 * BT) & (cols[None, :] == rows), -1.0, link)
    linked = tl.dot(values - products, link, input_precision="tf32x3")
    # Columns a * BT + t: a = 0 u_t, a = 1 out_t, a >= 2 zeros.
    linked = tl.sum(tl.reshape(linked, (linked.shape[0], NP // (2 * BT), 2, BT)), axis=1)
    corrections, outs = tl.split(tl.permute(linked, (0, 2, 1)))
    return outs, corrections


@triton.jit
def tensor_core_verify_kernel(
    v_ptr, beta_ptr, state_ptr, correction_ptr, out_ptr, terms_ptr, coupling_ptr,
    pending_ptr, pending_terms_ptr, query_start_ptr, state_indices_ptr,
    num_blocks,
    stride_v_tok, stride_v_head, stride_v_dim,
    stride_beta_tok, stride_beta_head,
    stride_s_blk, stride_s_head, stride_s_v, stride_s_k,
    stride_c_blk, stride_c_head, stride_c_tok, stride_c_dim,
    stride_o_tok, stride_o_head, stride_o_dim,
    stride_query_start, stride_state_indices, stride_pending,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SPEC_LEN: tl.constexpr, BT: tl.constexpr, RECORDS: tl.constexpr, BR: tl.constexpr,
    DEFERRED: tl.constexpr, NP: tl.constexpr, KEY_CHUNK: tl.constexpr,
    STAGES: tl.constexpr, LINK_MATRIX: tl.constexpr, CHEAP_SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """One `[BV]` tile of a (request, head): the closed form from the checkpoint
    and the window terms (tensor_core_tile; with LINK_MATRIX the tokens are
    linked by link_on_tensor_cores)."""
    wait_for_previous_kernel(PDL)
    tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    valid = block_is_valid(block, num_blocks)
    # The window is recorded after the block's pending records. Their count is
    # loaded here, not in a helper, as it addresses stores (see commit_plan_row).
    count = tl.zeros_like(block)
    if DEFERRED:
        count = tl.load(pending_ptr + tl.where(valid, block, 0) * stride_pending, mask=valid,
                        other=0).to(tl.int64)
    first, processed = window_after_records(count, window, valid, SPEC_LEN, RECORDS)
    offs_v = tile * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    if valid:
        head_row = (b * tl.num_programs(2) + h).to(tl.int64)  # workspace rows: int64 offsets
        steps = tl.arange(0, BT)
        # Column n < BT reads token n's E k, BT <= n < 2 BT token n - BT's E q.
        term_cols = terms_ptr + head_row * (2 * BT * BK) + tl.arange(0, NP) * BK
        state_head = state_ptr + block * stride_s_blk + h * stride_s_head
        corr_head = correction_ptr + block * stride_c_blk + h * stride_c_head
        pending_at = pending_terms_ptr + head_row * (BR * 2 * BT)
        v_rows = v_ptr + bos * stride_v_tok + h * stride_v_head + offs_v * stride_v_dim
        if LINK_MATRIX:
            outs, corrections = link_on_tensor_cores(
                state_products(state_head, term_cols, offs_v, stride_s_v, stride_s_k, first,
                               corr_head, pending_at, stride_c_tok, stride_c_dim, K, V, BK,
                               BV, BT, NP, BR, DEFERRED, KEY_CHUNK, STAGES, CHEAP_SPLIT),
                processed, coupling_ptr + head_row * (2 * BT * BT), v_rows, offs_v,
                stride_v_tok, V, BT)
        else:
            outs, corrections = tensor_core_tile(
                state_head, term_cols,
                tl.zeros([BV, BT], dtype=tl.float32), tl.zeros([BV, BT], dtype=tl.float32),
                processed, steps, coupling_ptr + head_row * (2 * BT * BT), v_rows, offs_v,
                beta_ptr + bos * stride_beta_tok + h * stride_beta_head, stride_s_v, stride_s_k,
                stride_v_tok, stride_beta_tok, first, corr_head, pending_at, stride_c_tok,
                stride_c_dim, K, V, BK, BV, BT, NP, SPEC_LEN, BR, DEFERRED, KEY_CHUNK, STAGES,
                CHEAP_SPLIT)
        step_mask = mask_v[:, None] & (steps < processed)[None, :]
        tl.store(out_ptr + (bos + steps[None, :]) * stride_o_tok + h * stride_o_head
                 + offs_v[:, None] * stride_o_dim, outs, mask=step_mask)
        tl.store(corr_head + (first + steps)[None, :] * stride_c_tok
                 + offs_v[:, None] * stride_c_dim, corrections, mask=step_mask)
    for t in range(processed, window):
        tl.store(out_ptr + (bos + t) * stride_o_tok + h * stride_o_head + offs_v * stride_o_dim,
                 tl.zeros([BV], dtype=tl.float32), mask=mask_v)
