"""Verify: run a speculative window from the checkpoint, record (u, k, g)."""

import triton
import triton.language as tl
from torch.library import wrap_triton

from .common import block_is_valid, kda_gate, l2_normalize, live_range


@triton.jit
def _token_inputs(t, processed, k_rows, g_rows, q_rows, v_rows, beta_at, offs_k, offs_v, K, V,
                  stride_k_tok, stride_g_tok, stride_q_tok, stride_v_tok, stride_beta_tok):
    """(k, g, q, v, beta) of window token t; zeros past the processed tokens."""
    live = t < processed
    live_k = live_range(offs_k, K, live)
    raw_k = tl.load(k_rows + t * stride_k_tok, mask=live_k, other=0.0)
    raw_g = tl.load(g_rows + t * stride_g_tok, mask=live_k, other=0.0)
    q = tl.load(q_rows + t * stride_q_tok, mask=live_k, other=0.0).to(tl.float32)
    v = tl.load(v_rows + t * stride_v_tok, mask=live_range(offs_v, V, live),
                other=0.0).to(tl.float32)
    beta = tl.load(beta_at + t * stride_beta_tok, mask=live, other=0.0).to(tl.float32)
    return raw_k, raw_g, q, v, beta


@triton.jit
def _verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, A_log_ptr, dt_bias_ptr,
    state_ptr, correction_ptr, key_gate_ptr, out_ptr,
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
    SPEC_LEN: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    # Inductor passes Python floats as fp64 scalars; the arithmetic is fp32.
    lower_bound = tl.cast(lower_bound, tl.float32)
    scale = tl.cast(scale, tl.float32)
    pid_v = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)

    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    mask_k = offs_k < K
    mask_v = offs_v < V
    out_row = out_ptr + h * stride_o_head + offs_v * stride_o_dim

    valid = block_is_valid(block, num_blocks)
    # Null rows, and tokens past the record capacity, get zero outputs.
    zero_from = tl.where(valid, SPEC_LEN, 0).to(tl.int64)
    if valid:
        processed = tl.minimum(window, SPEC_LEN)
        k_rows = k_ptr + bos * stride_k_tok + h * stride_k_head + offs_k * stride_k_dim
        g_rows = g_ptr + bos * stride_g_tok + h * stride_g_head + offs_k * stride_g_dim
        q_rows = q_ptr + bos * stride_q_tok + h * stride_q_head + offs_k * stride_q_dim
        v_rows = v_ptr + bos * stride_v_tok + h * stride_v_head + offs_v * stride_v_dim
        beta_at = beta_ptr + bos * stride_beta_tok + h * stride_beta_head
        state = tl.load(
            state_ptr + block * stride_s_blk + h * stride_s_head
            + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k,
            mask=mask_v[:, None] & mask_k[None, :], other=0.0,
        ).to(tl.float32)
        A = tl.exp(tl.load(A_log_ptr + h * stride_A_head).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h * stride_dt_head + offs_k * stride_dt_dim,
                          mask=mask_k, other=0.0).to(tl.float32)
        corr_row = correction_ptr + block * stride_c_blk + h * stride_c_head + offs_v * stride_c_dim
        kg_row = key_gate_ptr + block * stride_kg_blk + h * stride_kg_head + offs_k * stride_kg_dim
        # Token t+1's inputs are requested before token t's stores and layout
        # conversions (barriers), which the loads could not otherwise pass.
        next_inputs = _token_inputs(0, processed, k_rows, g_rows, q_rows, v_rows, beta_at,
                                    offs_k, offs_v, K, V, stride_k_tok, stride_g_tok,
                                    stride_q_tok, stride_v_tok, stride_beta_tok)
        for t in range(0, processed):
            raw_k, raw_g, q, v, beta = next_inputs
            next_inputs = _token_inputs(t + 1, processed, k_rows, g_rows, q_rows, v_rows,
                                        beta_at, offs_k, offs_v, K, V, stride_k_tok,
                                        stride_g_tok, stride_q_tok, stride_v_tok, stride_beta_tok)
            kn = l2_normalize(raw_k.to(tl.float32), 1.0)
            qn = l2_normalize(q, scale)
            decay = tl.exp(kda_gate(raw_g.to(tl.float32), dt_bias, A, lower_bound, USE_LOWER_BOUND))
            # With S the state before token t and D its decay:
            #   u = beta (v - (S D) k),  out = (S D + u k^T) q = S (D q) + u (k . q),
            # so both products read the undecayed S, independently of each other.
            key_dot = tl.sum(state * (decay * kn)[None, :], axis=1)
            query_dot = tl.sum(state * (decay * qn)[None, :], axis=1)
            u = (v - key_dot) * tl.sigmoid(beta)
            out = query_dot + u * tl.sum(kn * qn)
            state = state * decay[None, :] + u[:, None] * kn[None, :]

            tl.store(out_row + (bos + t) * stride_o_tok, out, mask=mask_v)
            tl.store(corr_row + t * stride_c_tok, u, mask=mask_v)
            if pid_v == 0:
                tl.store(kg_row + t * stride_kg_tok, raw_k, mask=mask_k)
                tl.store(kg_row + t * stride_kg_tok + K * stride_kg_dim, raw_g, mask=mask_k)
    zeros = tl.zeros([BV], dtype=tl.float32)
    for t in range(zero_from, window):
        tl.store(out_row + (bos + t) * stride_o_tok, zeros, mask=mask_v)


def _token_strides(t):
    """Strides of the (token, head, dim) axes of a `[(1,) tokens, H, D]` tensor."""
    return t.stride()[-3:]


def verify_config(value_dim):
    """(BV, num_warps) of the verify kernel (measured best on an H200)."""
    return min(triton.next_power_of_2(value_dim), 32), 4


def launch_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                  query_start_loc, state_indices, lower_bound, scale, out, dims):
    if dims.batch == 0:
        return
    num_heads, K, V = dims.num_heads, dims.key_dim, dims.value_dim
    BK = triton.next_power_of_2(K)
    BV, num_warps = verify_config(V)
    dt_strides = (dt_bias.stride(0), dt_bias.stride(1)) if dt_bias.dim() == 2 else (
        K * dt_bias.stride(0), dt_bias.stride(0))
    grid = (triton.cdiv(V, BV), dims.batch, num_heads)
    wrap_triton(_verify_kernel)[grid](
        q, k, v, g, beta, A_log, dt_bias,
        state, correction, key_gate, out,
        query_start_loc, state_indices,
        dims.num_blocks, float(lower_bound or 0.0), float(scale),
        *_token_strides(q), *_token_strides(k), *_token_strides(v), *_token_strides(g),
        *beta.stride()[-2:],
        A_log.stride(0), *dt_strides,
        *state.stride(), *correction.stride(), *key_gate.stride(), *_token_strides(out),
        query_start_loc.stride(0), state_indices.stride(0),
        K=K, V=V, BK=BK, BV=BV, SPEC_LEN=dims.spec_len,
        USE_LOWER_BOUND=lower_bound is not None,
        num_warps=num_warps,
    )
