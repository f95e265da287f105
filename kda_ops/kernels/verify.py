"""Verify: run a speculative window from the checkpoint, record (u, k, g).

One program per (group of V tiles, request, head), in two phases. Phase 1 does the
token-side work of the whole window at once (key and query normalisation, the
gates, k.q) and writes it to a per-call workspace; phase 2 walks the tokens
over the state tile, loading those vectors. The token-side reductions and
exponentials thus stay out of the serial per-token chain, which measured 15-19%
faster at large batch on an H200 than doing them per token. Phase 2 loads each
vector at the state tile's shape, so no layout conversion is left in the token
loop: 5-15% faster again at B >= 32. The state tile is held as
`[BK / KEY_CHUNK * BV, KEY_CHUNK]` (chunk-major): a row's products then reduce
mostly inside a thread, with 3 shuffle rounds instead of 5: 3-29% faster again.
When enough (request, head) pairs are in flight, one program walks two V tiles
after a single phase 1, which halves that work: 4-15% faster again at
B >= 64 (docs/performance.md).
"""

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.library import wrap_triton

from .common import block_is_valid, kda_gate, l2_normalize


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr,
    state_ptr, correction_ptr, key_gate_ptr, out_ptr, vectors_ptr, key_query_ptr,
    query_start_ptr, state_indices_ptr,
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
    stride_query_start, stride_state_indices,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SPEC_LEN: tl.constexpr, BT: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    KEY_CHUNK: tl.constexpr, V_TILES: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars; the arithmetic is fp32.
    lower_bound = tl.cast(lower_bound, tl.float32)
    scale = tl.cast(scale, tl.float32)
    first_tile = tl.program_id(0) * V_TILES
    b = tl.program_id(1)
    h = tl.program_id(2)

    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)

    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K

    valid = block_is_valid(block, num_blocks)
    # Null rows, and tokens past the record capacity, get zero outputs.
    zero_from = tl.where(valid, SPEC_LEN, 0).to(tl.int64)
    if valid:
        processed = tl.minimum(window, SPEC_LEN)
        # Phase 1: every token's normalised key and query and its decay, all
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
        raw_k = tl.load(k_ptr + tokens * stride_k_tok + h * stride_k_head
                        + offs_k[None, :] * stride_k_dim, mask=tile_mask, other=0.0)
        raw_g = tl.load(g_ptr + tokens * stride_g_tok + h * stride_g_head
                        + offs_k[None, :] * stride_g_dim, mask=tile_mask, other=0.0)
        raw_q = tl.load(q_ptr + tokens * stride_q_tok + h * stride_q_head
                        + offs_k[None, :] * stride_q_dim, mask=tile_mask, other=0.0)
        keys = l2_normalize(raw_k.to(tl.float32), 1.0)
        queries = l2_normalize(raw_q.to(tl.float32), scale)
        decays = tl.exp(kda_gate(raw_g.to(tl.float32), dt_bias[None, :], A, lower_bound,
                                 USE_LOWER_BOUND))
        head_row = b * tl.num_programs(2) + h
        vec_base = vectors_ptr + head_row * (BT * 4 * BK)
        vec_tile = vec_base + offs_k[None, :] + steps[:, None] * (4 * BK)
        tl.store(vec_tile, decays * keys, mask=tile_mask)
        tl.store(vec_tile + BK, decays * queries, mask=tile_mask)
        tl.store(vec_tile + 2 * BK, decays, mask=tile_mask)
        tl.store(vec_tile + 3 * BK, keys, mask=tile_mask)
        pair_at = key_query_ptr + head_row * BT
        tl.store(pair_at + steps, tl.sum(keys * queries, axis=1), mask=steps < processed)
        if tl.program_id(0) == 0:
            kg_tile = (key_gate_ptr + block * stride_kg_blk + h * stride_kg_head
                       + steps[:, None] * stride_kg_tok + offs_k[None, :] * stride_kg_dim)
            tl.store(kg_tile, raw_k, mask=tile_mask)
            tl.store(kg_tile + K * stride_kg_dim, raw_g, mask=tile_mask)
        tl.debug_barrier()  # the workspace rows are written before any thread reads them

        # Phase 2: the recurrence over the state tile. With S the state before
        # token t and D its decay:
        #   u = beta (v - S (D k)),  out = (S D + u k^T) q = S (D q) + u (k . q),
        # so both products read S independently; then S <- S D + u k^T.
        # The state tile is split into key chunks stacked chunk-major: slot
        # c * BV + r holds row r's keys [c * KEY_CHUNK, (c + 1) * KEY_CHUNK).
        # With 32-key chunks a warp spans 4 rows x 32 keys and each thread holds
        # all chunks of its rows, so a row's dot product is summed in registers
        # and then over 8 lanes; the [BV, BK] tile spread each row over 32 lanes.
        # A 3-D [BV, chunks, KEY_CHUNK] tile would do it too, but Triton 3.6 and
        # 3.9 lay that one out differently; this 2-D one they lay out alike.
        NUM_CHUNKS: tl.constexpr = BK // KEY_CHUNK
        beta_at = beta_ptr + bos * stride_beta_tok + h * stride_beta_head
        slots = tl.arange(0, NUM_CHUNKS * BV)
        slot_keys = (slots // BV)[:, None] * KEY_CHUNK + tl.arange(0, KEY_CHUNK)[None, :]
        slot_key_mask = slot_keys < K
        # Unrolled over the group, and the zero stores below form their offsets
        # inside their own loop: with one tile the kernel then compiles to the
        # code it had before tiles were grouped (Triton 3.6: 74 registers, the
        # same token loop). A runtime tile loop with the zero-store offsets
        # formed up front took 87-91 registers and was 4-7% slower at B = 1,
        # T = 4 and 8 on the H200.
        for tile_in_group in tl.static_range(V_TILES):
            tile = first_tile + tile_in_group
            offs_v = tile * BV + tl.arange(0, BV)
            mask_v = offs_v < V
            out_row = out_ptr + h * stride_o_head + offs_v * stride_o_dim
            v_rows = v_ptr + bos * stride_v_tok + h * stride_v_head + offs_v * stride_v_dim
            slot_rows = tile * BV + slots % BV
            state = tl.load(
                state_ptr + block * stride_s_blk + h * stride_s_head
                + slot_rows[:, None] * stride_s_v + slot_keys * stride_s_k,
                mask=(slot_rows < V)[:, None] & slot_key_mask, other=0.0,
            ).to(tl.float32)
            corr_row = (correction_ptr + block * stride_c_blk + h * stride_c_head
                        + offs_v * stride_c_dim)
            # The workspace vectors are loaded at the state tile's shape, every
            # row reading the same keys: they then arrive in the tile's layout,
            # where a `[BK]` load would need a layout conversion (shared memory,
            # barriers) per token and vector.
            for t in range(0, processed):
                row = vec_base + t * (4 * BK) + slot_keys
                decayed_key = tl.load(row, mask=slot_key_mask, other=0.0)
                decayed_query = tl.load(row + BK, mask=slot_key_mask, other=0.0)
                decay = tl.load(row + 2 * BK, mask=slot_key_mask, other=0.0)
                key = tl.load(row + 3 * BK, mask=slot_key_mask, other=0.0)
                key_query = tl.load(pair_at + t)
                v = tl.load(v_rows + t * stride_v_tok, mask=mask_v, other=0.0).to(tl.float32)
                beta = tl.load(beta_at + t * stride_beta_tok).to(tl.float32)
                key_dot = _row_dot(state * decayed_key, NUM_CHUNKS, BV, KEY_CHUNK)
                query_dot = _row_dot(state * decayed_query, NUM_CHUNKS, BV, KEY_CHUNK)
                u = (v - key_dot) * tl.sigmoid(beta)
                out = query_dot + u * key_query
                u_slots = tl.reshape(tl.broadcast_to(u[None, :], (NUM_CHUNKS, BV)),
                                     [NUM_CHUNKS * BV])
                state = state * decay + u_slots[:, None] * key
                tl.store(out_row + (bos + t) * stride_o_tok, out, mask=mask_v)
                tl.store(corr_row + t * stride_c_tok, u, mask=mask_v)
    for t in range(zero_from, window):
        # Formed here, in a rarely taken loop, so that nothing of it is held
        # across phase 2 (see the tile loop).
        offs_group = first_tile * BV + tl.arange(0, V_TILES * BV)
        tl.store(out_ptr + (bos + t) * stride_o_tok + h * stride_o_head + offs_group * stride_o_dim,
                 tl.zeros([V_TILES * BV], dtype=tl.float32), mask=offs_group < V)


def _token_strides(t):
    """Strides of the (token, head, dim) axes of a `[(1,) tokens, H, D]` tensor."""
    return t.stride()[-3:]


@triton.jit
def _row_dot(products, NUM_CHUNKS: tl.constexpr, BV: tl.constexpr, KEY_CHUNK: tl.constexpr):
    """Per-row sums of a chunk-major `[NUM_CHUNKS * BV, KEY_CHUNK]` tile: the
    chunks first (in registers), then the keys of a chunk (across lanes)."""
    return tl.sum(tl.sum(tl.reshape(products, [NUM_CHUNKS, BV, KEY_CHUNK]), axis=0), axis=1)


# At or above this many (request, head) pairs a program takes two V tiles: from
# B * H = 256 on an H200 (H = 32) that was faster (B = 8: 5-10%, B >= 64:
# 4-15%), below it the halved number of programs was slower (B = 1: 45-81%).
# A symbolic batch (torch.compile with dynamic shapes, torch.export) takes one
# tile per program unless its range proves the bound: deciding would add a guard.
TWO_TILES_FROM_HEADS = 256


def verify_config(key_dim, value_dim, request_heads):
    """(BV, KEY_CHUNK, V_TILES, num_warps) of the verify kernel (measured best on
    an H200) for `request_heads` = batch * heads."""
    BV = min(triton.next_power_of_2(value_dim), 32)
    two_tiles = value_dim > BV and statically_known_true(request_heads >= TWO_TILES_FROM_HEADS)
    return BV, min(triton.next_power_of_2(key_dim), 32), 2 if two_tiles else 1, 4


def launch_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                  query_start_loc, state_indices, lower_bound, scale, out, dims):
    if dims.batch == 0:
        return
    num_heads, K, V = dims.num_heads, dims.key_dim, dims.value_dim
    BK = triton.next_power_of_2(K)
    BV, key_chunk, v_tiles, num_warps = verify_config(K, V, dims.batch * num_heads)
    dt_strides = (dt_bias.stride(0), dt_bias.stride(1)) if dt_bias.dim() == 2 else (
        K * dt_bias.stride(0), dt_bias.stride(0))
    grid = (triton.cdiv(triton.cdiv(V, BV), v_tiles), dims.batch, num_heads)
    # Per (request, head, token): decayed key, decayed query, decay, key; and k.q.
    BT = triton.next_power_of_2(dims.spec_len)
    vectors = torch.empty((dims.batch, num_heads, BT, 4 * BK), device=q.device,
                          dtype=torch.float32)
    key_query = torch.empty((dims.batch, num_heads, BT), device=q.device, dtype=torch.float32)
    wrap_triton(_verify_kernel)[grid](
        q, k, v, g, beta, A_log, dt_bias,
        state, correction, key_gate, out, vectors, key_query,
        query_start_loc, state_indices,
        dims.num_blocks, float(lower_bound or 0.0), float(scale),
        *_token_strides(q), *_token_strides(k), *_token_strides(v), *_token_strides(g),
        *beta.stride()[-2:],
        A_log.stride(0), *dt_strides,
        *state.stride(), *correction.stride(), *key_gate.stride(), *_token_strides(out),
        query_start_loc.stride(0), state_indices.stride(0),
        K=K, V=V, BK=BK, BV=BV, SPEC_LEN=dims.spec_len, BT=BT,
        USE_LOWER_BOUND=lower_bound is not None, KEY_CHUNK=key_chunk, V_TILES=v_tiles,
        num_warps=num_warps,
    )
