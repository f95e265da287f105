"""Verify: run a speculative window from the checkpoint, record (u, k, g).

The window is computed in chunked form rather than token by token. With
gamma_t = sum_{s<=t} gate_s (per key channel) and D_t = exp(gamma_t):

    pred_t = S0 (D_t * kn_t) + sum_{s<t}  u_s <kn_s * exp(gamma_t - gamma_s), kn_t>
    u_t    = sigmoid(beta_t) (v_t - pred_t)
    out_t  = S0 (D_t * qn_t) + sum_{s<=t} u_s <kn_s * exp(gamma_t - gamma_s), qn_t>

so the state tile meets the window in two small matrix products (S0 against the
2T decayed keys and queries, on tensor cores in 3xTF32, about fp32 accurate),
and everything else is T x T work independent of the state size. The state is
read once and never written.
"""

import triton
import triton.language as tl
from torch.library import wrap_triton

from .common import block_is_valid, kda_gate, l2_normalize


@triton.jit
def _column(x, offs_t, t):
    """Column t of a [R, BT] tile, as a [R] vector."""
    return tl.sum(tl.where((offs_t == t)[None, :], x, 0.0), axis=1)


@triton.jit
def _row(x, offs_t, t):
    """Row t of a [BT, C] tile, as a [C] vector."""
    return tl.sum(tl.where((offs_t == t)[:, None], x, 0.0), axis=0)


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
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
    SPEC_LEN: tl.constexpr, USE_LOWER_BOUND: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)

    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    block = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)

    offs_k = tl.arange(0, BK)
    offs_v = pid_v * BV + tl.arange(0, BV)
    offs_t = tl.arange(0, BT)
    mask_k = offs_k < K
    mask_v = offs_v < V
    out_rows = out_ptr + h * stride_o_head + offs_v * stride_o_dim

    valid = block_is_valid(block, num_blocks)
    # Null rows, and tokens past the record capacity, get zero outputs.
    zero_from = tl.where(valid, SPEC_LEN, 0).to(tl.int64)
    if valid:
        # The state tile is the only large read: issue it first.
        state = tl.load(
            state_ptr + block * stride_s_blk + h * stride_s_head
            + offs_v[:, None] * stride_s_v + offs_k[None, :] * stride_s_k,
            mask=mask_v[:, None] & mask_k[None, :], other=0.0,
        ).to(tl.float32)
        live_t = offs_t < tl.minimum(window, SPEC_LEN)
        tok = bos + offs_t
        tk_mask = live_t[:, None] & mask_k[None, :]                       # [BT, BK]
        vt_mask = mask_v[:, None] & live_t[None, :]                       # [BV, BT]
        raw_k = tl.load(k_ptr + tok[:, None] * stride_k_tok + h * stride_k_head
                        + offs_k[None, :] * stride_k_dim, mask=tk_mask, other=0.0)
        raw_g = tl.load(g_ptr + tok[:, None] * stride_g_tok + h * stride_g_head
                        + offs_k[None, :] * stride_g_dim, mask=tk_mask, other=0.0)
        q = tl.load(q_ptr + tok[:, None] * stride_q_tok + h * stride_q_head
                    + offs_k[None, :] * stride_q_dim, mask=tk_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok[None, :] * stride_v_tok + h * stride_v_head
                    + offs_v[:, None] * stride_v_dim, mask=vt_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * stride_beta_tok + h * stride_beta_head,
                       mask=live_t, other=0.0).to(tl.float32)
        A = tl.exp(tl.load(A_log_ptr + h * stride_A_head).to(tl.float32))
        dt_bias = tl.load(dt_bias_ptr + h * stride_dt_head + offs_k * stride_dt_dim,
                          mask=mask_k, other=0.0).to(tl.float32)

        kn = l2_normalize(raw_k.to(tl.float32), 1.0)                      # [BT, BK]
        qn = l2_normalize(q, scale)
        gate = tl.where(tk_mask, kda_gate(raw_g.to(tl.float32), dt_bias[None, :], A,
                                          lower_bound, USE_LOWER_BOUND), 0.0)
        gamma = tl.cumsum(gate, axis=0)
        from_start = tl.exp(gamma)
        pred_from_state = tl.dot(state, tl.trans(from_start * kn), input_precision=DOT_PRECISION)
        out_from_state = tl.dot(state, tl.trans(from_start * qn), input_precision=DOT_PRECISION)

        # key_weight[t, s] = <kn_s * exp(gamma_t - gamma_s), kn_t> for s < t, and
        # query_weight[t, s] the same with qn_t for s <= t (exponents kept <= 0).
        key_weight = tl.zeros([BT, BT], dtype=tl.float32)
        query_weight = tl.zeros([BT, BT], dtype=tl.float32)
        for s in tl.static_range(SPEC_LEN):
            since_s = tl.exp(tl.where((offs_t >= s)[:, None], gamma - _row(gamma, offs_t, s)[None, :],
                                      float("-inf"))) * _row(kn, offs_t, s)[None, :]
            at_s = (offs_t == s)[None, :]
            key_col = tl.where(offs_t > s, tl.sum(kn * since_s, axis=1), 0.0)
            key_weight = tl.where(at_s, key_col[:, None], key_weight)
            query_weight = tl.where(at_s, tl.sum(qn * since_s, axis=1)[:, None], query_weight)

        # Forward substitution for the corrections, one token column at a time.
        residual = v - pred_from_state                                    # [BV, BT]
        gain = tl.sigmoid(beta)
        u = tl.zeros([BV, BT], dtype=tl.float32)
        for t in tl.static_range(SPEC_LEN):
            from_earlier = tl.sum(u * _row(key_weight, offs_t, t)[None, :], axis=1)
            gain_t = tl.sum(tl.where(offs_t == t, gain, 0.0), axis=0)
            u_t = gain_t * (_column(residual, offs_t, t) - from_earlier)
            u = tl.where((offs_t == t)[None, :], u_t[:, None], u)
        out = out_from_state + tl.dot(u, tl.trans(query_weight), input_precision=DOT_PRECISION)

        tl.store(out_rows[:, None] + tok[None, :] * stride_o_tok, out, mask=vt_mask)
        tl.store(correction_ptr + block * stride_c_blk + h * stride_c_head
                 + offs_t[None, :] * stride_c_tok + offs_v[:, None] * stride_c_dim, u, mask=vt_mask)
        if pid_v == 0:
            kg_rows = (key_gate_ptr + block * stride_kg_blk + h * stride_kg_head
                       + offs_t[:, None] * stride_kg_tok + offs_k[None, :] * stride_kg_dim)
            tl.store(kg_rows, raw_k, mask=tk_mask)
            tl.store(kg_rows + K * stride_kg_dim, raw_g, mask=tk_mask)
    zeros = tl.zeros([BV], dtype=tl.float32)
    for t in range(zero_from, window):
        tl.store(out_rows + (bos + t) * stride_o_tok, zeros, mask=mask_v)


def _token_strides(t):
    """Strides of the (token, head, dim) axes of a `[(1,) tokens, H, D]` tensor."""
    return t.stride()[-3:]


def verify_config(value_dim):
    """(BV, num_warps): V rows per program and warps per program."""
    # tl.dot needs at least 16 rows.
    return max(16, min(triton.next_power_of_2(value_dim), 64)), 4


def launch_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                  query_start_loc, state_indices, lower_bound, scale, out, dims):
    if dims.batch == 0:
        return
    num_heads, K, V = dims.num_heads, dims.key_dim, dims.value_dim
    BK = triton.next_power_of_2(K)
    BV, warps = verify_config(V)
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
        K=K, V=V, BK=BK, BV=BV, BT=max(16, triton.next_power_of_2(dims.spec_len)),
        SPEC_LEN=dims.spec_len, USE_LOWER_BOUND=lower_bound is not None,
        DOT_PRECISION="tf32x3",
        num_warps=warps,
    )
