"""kda_ops: speculative decoding kernels for Kimi Delta Attention (KDA).

Every op is a `torch.library.triton_op` in the `kda_ops` namespace
(`torch.ops.kda_ops.<name>`); the functions here are the public entry points,
with the argument order of SPEC §6.
"""

from typing import Optional

import torch
from torch import Tensor

from . import ops as _ops

__all__ = ["verify", "commit", "commit_plan", "NULL_BLOCK"]

NULL_BLOCK = 0


def verify(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, A_log: Tensor,
           dt_bias: Tensor, state: Tensor, correction: Tensor, key_gate: Tensor,
           query_start_loc: Tensor, state_indices: Tensor, *,
           lower_bound: Optional[float] = None, scale: Optional[float] = None,
           out: Optional[Tensor] = None) -> Tensor:
    """Runs each request's window from its checkpoint `state[state_indices[b]]`
    (left unchanged) and returns the outputs (like `v`).

    Records, per window token t < min(L, T), the correction `u_t` into
    `correction[block, :, t]` and the raw key and gate into `key_gate[block, :, t]`.
    Tokens of null rows (index <= 0 or >= num_blocks) and tokens past T get zero
    outputs; tokens outside every window are not written.
    """
    if out is None:
        out = torch.empty_like(v)
    _ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                query_start_loc, state_indices, lower_bound=lower_bound, scale=scale, out=out)
    return out


def commit(num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor, *,
           state: Tensor, conv_state: Optional[Tensor], correction: Tensor, key_gate: Tensor,
           A_log: Tensor, dt_bias: Tensor, lower_bound: Optional[float] = None,
           request_indices: Optional[Tensor] = None, block_table: Optional[Tensor] = None,
           num_computed_tokens: Optional[Tensor] = None,
           block_size: Optional[int] = None) -> None:
    """Folds each request's accepted prefix into its checkpoint, for every layer
    (buffers stacked `[num_layers, N, ...]`, or one layer's 4-D buffers), and
    compacts the convolution history (`conv_state=None` skips it). SPEC §2, §4."""
    _ops.commit(num_accepted_tokens, state_indices, query_start_loc, state=state,
                conv_state=conv_state, correction=correction, key_gate=key_gate, A_log=A_log,
                dt_bias=dt_bias, lower_bound=lower_bound, request_indices=request_indices,
                block_table=block_table, num_computed_tokens=num_computed_tokens,
                block_size=block_size)


def commit_plan(num_accepted_tokens: Tensor, state_indices: Tensor, query_start_loc: Tensor, *,
                spec_len: int, request_indices: Optional[Tensor] = None,
                block_table: Optional[Tensor] = None,
                num_computed_tokens: Optional[Tensor] = None,
                block_size: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per request: (commit_lens, final_state_indices, boundary_state_indices,
    boundary_recovery_lens), int32 `[B]` each, by the formula of SPEC §4. This is
    what `commit` computes inline; it is exposed for engines and tests."""
    return _ops.commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                            request_indices, block_table, num_computed_tokens, block_size)
