"""Opt-in checks of argument values, for debugging an integration.

Shapes, dtypes and strides are always checked (`_validation`). What only the
values can show (windows inside the token tensors, block indices inside the
cache and not shared, accepted counts in range, the same gate parameters in
verify and commit) is checked here, when enabled by the environment variable
`KDA_OPS_CHECK_VALUES=1` (or true, yes, on) or inside `with kda_ops.value_checks():`, by the
public functions (`api.py`) before they call the op. Each check copies small
metadata tensors to the host, so it syncs the device: eager calls only.
torch.compile traces the public functions without the checks, so compiled
graphs hold none; an eager call inside a CUDA graph capture raises, since the
capture cannot read values.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import weakref

import torch
from torch._subclasses.fake_tensor import is_fake

from ._validation import (check_commit, check_conv_update, check_plan,
                          check_stage_spec_decode_metadata, check_verify, fail)

ENV_VAR = "KDA_OPS_CHECK_VALUES"
_setting: contextvars.ContextVar = contextvars.ContextVar("kda_ops_value_checks", default=None)


@contextlib.contextmanager
def value_checks(enabled: bool = True):
    """Turns the value checks on (or, with `enabled=False`, off) inside the
    block, whatever `KDA_OPS_CHECK_VALUES` says. Every violation raises a
    ValueError naming the argument and the offending row."""
    token = _setting.set(bool(enabled))
    try:
        yield
    finally:
        _setting.reset(token)


ENV_ON, ENV_OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def value_checks_enabled() -> bool:
    setting = _setting.get()
    if setting is not None:
        return setting
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value not in ENV_ON + ENV_OFF:
        raise ValueError(f"kda_ops: {ENV_VAR} must be one of {list(ENV_ON + ENV_OFF)} (any "
                         f"case), got {os.environ[ENV_VAR]!r}")
    return value in ENV_ON


def should_check(*tensors) -> bool:
    """Whether this call of a public function runs the value checks: enabled,
    called eagerly (torch.compile traces, and so compiles, no check), on real
    tensors."""
    if torch.compiler.is_compiling() or not value_checks_enabled():
        return False
    if any(is_fake(t) for t in tensors):
        return False
    if any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kda_ops: value checks read tensor values, which a CUDA graph "
                           "capture cannot do; capture outside `kda_ops.value_checks()` and "
                           f"without {ENV_VAR}=1")
    return True


def _host(t):
    return t.detach().to("cpu", torch.int64)


def check_windows(query_start_loc, spec_len, *, num_tokens=None, tokens_name="q",
                  spec_len_from="correction's T"):
    """Windows rise from 0 or more, stay inside the token tensors and hold at
    most `spec_len` tokens. Returns the window lengths (host)."""
    starts = _host(query_start_loc)
    if starts.numel() and starts[0] < 0:
        fail("query_start_loc", f"must start at 0 or more, got query_start_loc[0] = "
              f"{starts[0].item()}")
    lengths = starts[1:] - starts[:-1]
    for row in (lengths < 0).nonzero().flatten().tolist():
        fail("query_start_loc", f"must not decrease: row {row}'s window is "
              f"[{starts[row].item()}, {starts[row + 1].item()})")
    if num_tokens is not None:
        for row in (starts[1:] > num_tokens).nonzero().flatten().tolist():
            fail("query_start_loc", f"row {row}'s window [{starts[row].item()}, "
                  f"{starts[row + 1].item()}) runs past the {num_tokens} tokens of "
                  f"`{tokens_name}`")
    for row in (lengths > spec_len).nonzero().flatten().tolist():
        fail("query_start_loc", f"row {row}'s window holds {lengths[row].item()} tokens, more "
              f"than T = {spec_len} ({spec_len_from})")
    return lengths


def check_blocks(state_indices, num_blocks=None, *, cache_name="state"):
    """Indices inside the cache (<= 0 marks a padding row) and no block shared
    by two live rows. Returns the indices (host)."""
    indices = _host(state_indices)
    if num_blocks is not None:
        for row in (indices >= num_blocks).nonzero().flatten().tolist():
            fail("state_indices", f"row {row}'s block {indices[row].item()} is outside "
                  f"`{cache_name}`'s {num_blocks} blocks (<= 0 marks a padding row)")
    seen = {}
    for row, block in enumerate(indices.tolist()):
        if block > 0:
            if block in seen:
                fail("state_indices", f"rows {seen[block]} and {row} share block {block}: a "
                      f"block serves one live request per call")
            seen[block] = row
    return indices


def check_accepted(num_accepted_tokens, request_indices, indices, lengths):
    """Each live row accepts between 0 and its window's length."""
    accepted = _host(num_accepted_tokens)
    rows = (_host(request_indices) if request_indices is not None
            else torch.arange(indices.numel()))
    for b, (row, block) in enumerate(zip(rows.tolist(), indices.tolist())):
        if block <= 0 or not 0 <= row < accepted.numel():
            continue
        count = accepted[row].item()
        if not 0 <= count <= lengths[b].item():
            fail("num_accepted_tokens", f"[{row}] = {count} (row {b}) must lie in "
                  f"[0, {lengths[b].item()}], the length of row {b}'s window")


# The gate parameters each verify used, by the records it wrote: key
# (id of the records' base tensor, storage offset) -> (weakref to that base, A_log,
# dt_bias, lower_bound), so that commit can compare what it is given.
_gates_by_records: dict = {}


def _records_key(key_gate, offset):
    base = key_gate if key_gate._base is None else key_gate._base
    return (id(base), offset), base


def record_gates(key_gate, A_log, dt_bias, lower_bound):
    for stale in [key for key, seen in _gates_by_records.items() if seen[0]() is None]:
        del _gates_by_records[stale]  # records of freed tensors
    key, base = _records_key(key_gate, key_gate.storage_offset())
    _gates_by_records[key] = (weakref.ref(base), A_log.detach().cpu().clone(),
                              dt_bias.detach().cpu().reshape(-1).clone(), lower_bound)


def check_gates(key_gate, A_log, dt_bias, lower_bound, stacked):
    """The gate parameters given to commit are those verify used for each
    layer's records (layers whose records verify wrote with checks off are not
    compared)."""
    layers = key_gate.shape[0] if stacked else 1
    for layer in range(layers):
        offset = key_gate.storage_offset() + (layer * key_gate.stride(0) if stacked else 0)
        key, base = _records_key(key_gate, offset)
        seen = _gates_by_records.get(key)
        if seen is None or seen[0]() is not base:
            continue
        _, seen_A_log, seen_dt_bias, seen_lower_bound = seen
        where = f" for layer {layer}" if stacked else ""
        for name, value, used in (
                ("A_log", A_log[layer] if stacked else A_log, seen_A_log),
                ("dt_bias", (dt_bias[layer] if stacked else dt_bias).reshape(-1), seen_dt_bias)):
            if not torch.equal(value.detach().cpu(), used):
                fail(name, f"differs{where} from the {name} that verify used to write these "
                      f"records: verify and commit must get the same gate parameters")
        if lower_bound != seen_lower_bound:
            fail("lower_bound", f"is {lower_bound!r}{where}, but verify wrote these records "
                  f"with lower_bound={seen_lower_bound!r}: verify and commit must get the same "
                  f"gate parameters")


def verify_call(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                query_start_loc, state_indices, lower_bound, out, pending, spec_len):
    dims = check_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                        query_start_loc, state_indices, lower_bound, out, pending,
                        spec_len)  # shapes first
    lengths = check_windows(query_start_loc, dims.window_len, num_tokens=dims.num_tokens,
                            spec_len_from="spec_len" if pending is not None else "correction's T")
    indices = check_blocks(state_indices, dims.num_blocks)
    if pending is not None:
        counts = _host(pending)
        for row, block in enumerate(indices.tolist()):
            if 0 < block < dims.num_blocks:
                room = dims.spec_len - min(max(counts[block].item(), 0), dims.spec_len)
                if lengths[row] > room:
                    fail("pending", f"leaves {room} of the records' {dims.spec_len} positions "
                         f"to row {row}'s window of {lengths[row].item()} tokens (block "
                         f"{block} has {counts[block].item()} pending)")
    record_gates(key_gate, A_log, dt_bias, lower_bound)


def conv_update_call(x, conv_state, weight, bias, query_start_loc, state_indices, activation,
                     out):
    dims = check_conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                             activation, out)
    check_windows(query_start_loc, dims.spec_len, num_tokens=dims.num_tokens, tokens_name="x",
                  spec_len_from=f"from conv_state's W-1+T-1 = {dims.width - 1 + dims.spec_len - 1}"
                  f" columns for W = {dims.width}")
    check_blocks(state_indices, dims.num_blocks, cache_name="conv_state")


def _check_plan_values(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                       request_indices, num_blocks=None):
    lengths = check_windows(query_start_loc, spec_len)
    indices = check_blocks(state_indices, num_blocks)
    check_accepted(num_accepted_tokens, request_indices, indices, lengths)


def commit_plan_call(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                     request_indices, block_table, num_computed_tokens, block_size):
    check_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len, request_indices,
               block_table, num_computed_tokens, block_size, state_indices.device)
    _check_plan_values(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                       request_indices)


def commit_call(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                block_table, num_computed_tokens, block_size, pending, spec_len):
    dims, _ = check_commit(num_accepted_tokens, state_indices, query_start_loc, state,
                           conv_state, correction, key_gate, A_log, dt_bias, lower_bound,
                           request_indices, block_table, num_computed_tokens, block_size,
                           pending, spec_len)
    window_len = dims.spec_len if spec_len is None else spec_len  # T, not the records' R
    _check_plan_values(num_accepted_tokens, state_indices, query_start_loc, window_len,
                       request_indices, dims.num_blocks)
    check_gates(key_gate, A_log, dt_bias, lower_bound, dims.stacked)


def stage_call(state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
               staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes):
    count_limit = check_stage_spec_decode_metadata(
        state_indices, query_start_loc, num_accepted_tokens, staged_state_indices,
        staged_query_start_loc, staged_num_accepted_tokens, num_spec_decodes)
    if isinstance(num_spec_decodes, torch.Tensor):
        count = _host(num_spec_decodes).item()
        if not 0 <= count <= count_limit:
            fail("num_spec_decodes", f"holds {count}, outside [0, {count_limit}] (the rows of "
                 f"state_indices and of the staged buffers)")
    check_windows(query_start_loc, spec_len=float("inf"))
