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

from . import torch_impl
from ._validation import (check_commit, check_conv_update, check_conv_verify, check_flush,
                          check_plan, check_stage_spec_decode_metadata, check_verify,
                          conv_verify_split, fail)
from .constants import NULL_BLOCK

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


def check_accepted(num_accepted_tokens, request_indices, indices, lengths, table_rows=None):
    """Each live row accepts between 0 and its window's length (in align mode
    a row past the block table's `table_rows` is null)."""
    accepted = _host(num_accepted_tokens)
    rows = (_host(request_indices) if request_indices is not None
            else torch.arange(indices.numel()))
    limit = accepted.numel() if table_rows is None else min(accepted.numel(), table_rows)
    for b, (row, block) in enumerate(zip(rows.tolist(), indices.tolist())):
        if block <= 0 or not 0 <= row < limit:
            continue
        count = accepted[row].item()
        if not 0 <= count <= lengths[b].item():
            fail("num_accepted_tokens", f"[{row}] = {count} (row {b}) must lie in "
                  f"[0, {lengths[b].item()}], the length of row {b}'s window")


class SeenTensors:
    """What checked calls saw of a tensor they wrote, for later calls to
    compare: keyed by the tensor's base and storage offset (a layer's slice of
    stacked caches has its own), dropped once the base is freed."""

    def __init__(self):
        self._seen = {}  # (id of the base, storage offset) -> (weakref to the base, value)

    @staticmethod
    def _key(t, offset):
        base = t if t._base is None else t._base
        return (id(base), offset), base

    def record(self, t, value):
        for stale in [key for key, (ref, _) in self._seen.items() if ref() is None]:
            del self._seen[stale]
        key, base = self._key(t, t.storage_offset())
        self._seen[key] = (weakref.ref(base), value)

    def per_layer(self, t, stacked):
        """(layer, value) for each layer of `t` (`[L, ...]` if stacked) that a
        checked call recorded."""
        for layer in range(t.shape[0] if stacked else 1):
            offset = t.storage_offset() + (layer * t.stride(0) if stacked else 0)
            key, base = self._key(t, offset)
            seen = self._seen.get(key)
            if seen is not None and seen[0]() is base:
                yield layer, seen[1]


# The gate parameters each verify used, by the records it wrote, so that
# commit can compare what it is given.
_gates_by_records = SeenTensors()


def record_gates(key_gate, A_log, dt_bias, lower_bound):
    _gates_by_records.record(key_gate, (A_log.detach().cpu().clone(),
                                        dt_bias.detach().cpu().reshape(-1).clone(), lower_bound))


def check_gates(key_gate, A_log, dt_bias, lower_bound, stacked):
    """The gate parameters given to commit are those verify used for each
    layer's records (layers whose records verify wrote with checks off are not
    compared)."""
    for layer, (seen_A_log, seen_dt_bias, seen_lower_bound) in _gates_by_records.per_layer(
            key_gate, stacked):
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


# ------------------------------------------------------------ finite values
def _window_tokens(query_start_loc, indices, num_blocks, spec_len):
    """(token, row) of every token that a call reads: the first min(L, T)
    tokens of each live row's window."""
    starts = _host(query_start_loc)
    pairs = []
    for row, block in enumerate(indices.tolist()):
        if 0 < block < num_blocks:
            length = max(0, min(starts[row + 1].item() - starts[row].item(), spec_len))
            pairs += [(starts[row].item() + t, row) for t in range(length)]
    return pairs


def _first_non_finite(t):
    """The index (tuple) of `t`'s first non-finite element, or None."""
    bad = ~torch.isfinite(t.detach())
    return None if not bad.any() else tuple(bad.nonzero()[0].tolist())


def check_token_values(op, stage, ndim, pairs, **tensors):
    """Each named `[tokens, ...]` tensor of `ndim` dims (or a leading 1 more)
    is finite at the tokens `pairs` lists; else a ValueError naming the op,
    the argument, the token and its row."""
    if not pairs:
        return
    index = torch.tensor([token for token, _ in pairs])
    for name, t in tensors.items():
        values = (t[0] if t.dim() == ndim + 1 else t)[index.to(t.device)]
        where = _first_non_finite(values)
        if where is not None:
            token, row = pairs[where[0]]
            fail(name, f"holds {values[where].item()} at token {token} (row {row}) "
                 f"{stage} {op}: the value checks want finite values")


def check_cache_values(op, stage, name, t, stacked, entries, dim=None):
    """Cache `t` (`[(L,) N, ...]`) is finite in each listed block: `entries`
    holds (row, block, count); with `dim` (counted from the end), only the
    first `count` positions of the block along it are read."""
    for row, block, count in entries:
        values = t[:, block] if stacked else t[block]
        if dim is not None:
            values = values.narrow(dim, 0, min(count, values.shape[dim]))
        where = _first_non_finite(values)
        if where is not None:
            layer = f" layer {where[0]}," if stacked else ""
            fail(name, f"holds {values[where].item()} in{layer} block {block} (row {row}) "
                 f"{stage} {op}: the value checks want finite values")


def check_read_caches(op, records_stage, state, correction, key_gate, stacked, live):
    """The state and the records (their first `count` positions) an op reads
    from each live (row, block, count) are finite."""
    check_cache_values(op, "given to", "state", state, stacked, live)
    for name, records in (("correction", correction), ("key_gate", key_gate)):
        check_cache_values(op, records_stage, name, records, stacked, live, dim=-2)


def check_parameter_values(op, **tensors):
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            where = _first_non_finite(t)
            if where is not None:
                fail(name, f"holds {t[where].item()} at {where} in {op}: the value checks "
                     f"want finite values")
        elif t is not None and not torch.isfinite(torch.tensor(float(t))):
            fail(name, f"is {t!r} in {op}: the value checks want finite values")


# ------------------------------------------------------- align-mode blocks
def check_written_blocks(source, commit_len, final, boundary, num_blocks):
    """The blocks a commit writes, per row (host int64 tensors [B]): inside
    the cache and not the null block, no block written by two rows, and no
    block written by one row and read as the source of another live row."""
    readers = {block: row for row, block in enumerate(source.tolist())
               if 0 < block < num_blocks}
    writers = {}
    for row, count in enumerate(commit_len.tolist()):
        if count <= 0:
            continue
        for kind, blocks in (("final", final), ("boundary", boundary)):
            block = blocks[row].item()
            if kind == "boundary" and block == NULL_BLOCK:
                continue
            if not 0 < block < num_blocks:
                fail("block_table", f"gives row {row} the {kind} block {block}, outside "
                     f"the {num_blocks} blocks of the cache (or the null block): its fold "
                     f"would be dropped")
            other = writers.get(block)
            if other is not None and other[0] != row:
                fail("block_table", f"gives rows {other[0]} and {row} the same block {block} "
                     f"({other[1]} of row {other[0]}, {kind} of row {row}): a block takes "
                     f"one request's state per commit")
            if readers.get(block, row) != row:
                fail("block_table", f"gives row {row} the {kind} block {block}, which row "
                     f"{readers[block]} reads as its source (`state_indices`)")
            writers[block] = (row, kind)


# The convolution width each conv_update used, by the conv state it wrote.
_widths_by_conv_state = SeenTensors()


def check_conv_width(conv_state, window_len, stacked, window_from):
    """commit reads the history at columns 0..W-2 of a `W-1+T-1` buffer: the
    width conv_update convolved each layer's conv state with must match T."""
    for layer, width in _widths_by_conv_state.per_layer(conv_state, stacked):
        columns = conv_state.shape[-1]
        if columns != width - 1 + window_len - 1:
            where = f" layer {layer}'s" if stacked else ""
            fail("conv_state", f"has {columns} columns in{where} blocks, but conv_update "
                 f"convolved it with W = {width}: commit needs W-1+T-1 = "
                 f"{width - 2 + window_len} for T = {window_len} ({window_from})")


def _live(indices, num_blocks):
    return [(row, block) for row, block in enumerate(indices.tolist()) if 0 < block < num_blocks]


# ---------------------------------------------------------------- trees
# The parents each verify ran its tree windows with ({block: window parents}),
# by the records it wrote, so that commit can check its paths.
_parents_by_records = SeenTensors()


def check_parents(parent, query_start_loc, indices, num_blocks, spec_len):
    """Each live tree window has its root first (-1) and every other node's
    parent an earlier node. Returns {block: the window's parents} (a chain's,
    t - 1, without `parent`)."""
    starts, parents = _host(query_start_loc), None if parent is None else _host(parent)
    windows = {}
    for row, block in _live(indices, num_blocks):
        bos = starts[row].item()
        length = max(0, min(starts[row + 1].item() - bos, spec_len))
        if parents is None:
            windows[block] = list(range(-1, length - 1))
            continue
        nodes = parents[bos:bos + length].tolist()
        for t, p in enumerate(nodes):
            if (t == 0 and p != -1) or (t > 0 and not 0 <= p < t):
                want = "-1 (the root)" if t == 0 else f"in 0..{t - 1}"
                fail("parent", f"[{bos + t}] = {p} (row {row}'s node {t}) must be {want}: "
                     f"nodes come in topological order, the root first")
        windows[block] = nodes
    return windows


def check_accepted_path(accepted_path, key_gate, request_indices, indices, lengths, accepted,
                        num_blocks, spec_len):
    """Each live row's accepted path (without `accepted_path`, the chain 0, 1,
    ...) starts at the root 0, stays inside its window and, where verify's
    parents are known (the checks were on), follows them. Returns {row: the
    record positions a given path reads}."""
    paths = None if accepted_path is None else _host(accepted_path)
    rows = (_host(request_indices) if request_indices is not None
            else torch.arange(indices.numel()))
    # Every layer of stacked records ran the same windows: layer 0's stand for them.
    windows = next((seen for _, seen in _parents_by_records.per_layer(key_gate, False)), {})
    extents = {}
    for b, block in _live(indices, num_blocks):
        row = rows[b].item()
        if not 0 <= row < accepted.numel():
            continue
        count = min(max(accepted[row].item(), 0), lengths[b].item(), spec_len)
        path = list(range(count)) if paths is None else paths[row, :count].tolist()
        window = min(lengths[b].item(), spec_len)
        parents = windows.get(block)
        if paths is not None:
            extents[b] = max(path, default=-1) + 1
        for i, node in enumerate(path):
            if i == 0 and node != 0:
                fail("accepted_path", f"[{row}, 0] = {node} (row {b}) must be 0, the root")
            if not 0 <= node < window:
                fail("accepted_path", f"[{row}, {i}] = {node} (row {b}) lies outside its "
                     f"window's {window} nodes")
            if i > 0 and parents is not None and parents[node] != path[i - 1]:
                if paths is None:
                    fail("accepted_path", f"is not given, so row {b}'s first {count} nodes "
                         f"fold as a chain, but verify ran its window as a tree: node {node}'s "
                         f"parent is {parents[node]}; give the accepted path")
                fail("accepted_path", f"[{row}, {i}] = {node} (row {b}) is a child of node "
                     f"{parents[node]}, not of the path's previous node {path[i - 1]}")
            if i > 0 and node <= path[i - 1]:
                fail("accepted_path", f"[{row}, {i}] = {node} (row {b}) must come after the "
                     f"path's previous node {path[i - 1]}")
    return extents


def verify_call(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                query_start_loc, state_indices, lower_bound, scale, out, pending, spec_len,
                parent=None, op="verify"):
    """Checks before verify (or `op`, which runs it); returns what
    `verify_done` checks after it."""
    dims = check_verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                        query_start_loc, state_indices, lower_bound, out, pending,
                        spec_len, parent)  # shapes first
    lengths = check_windows(query_start_loc, dims.window_len, num_tokens=dims.num_tokens,
                            spec_len_from="spec_len" if pending is not None else "correction's T")
    indices = check_blocks(state_indices, dims.num_blocks)
    counts = _host(pending) if pending is not None else torch.zeros(dims.num_blocks,
                                                                    dtype=torch.int64)
    _check_room(counts[None], dims.spec_len, indices, lengths, dims.num_blocks, False)
    live = [(row, block, min(max(counts[block].item(), 0), dims.spec_len))
            for row, block in _live(indices, dims.num_blocks)]
    tokens = _window_tokens(query_start_loc, indices, dims.num_blocks, dims.window_len)
    check_token_values(op, "given to", 3, tokens, q=q, k=k, v=v, g=g)
    check_token_values(op, "given to", 2, tokens, beta=beta)
    check_parameter_values(op, A_log=A_log, dt_bias=dt_bias, scale=scale)
    check_read_caches(op, "pending in", state, correction, key_gate, False, live)
    record_gates(key_gate, A_log, dt_bias, lower_bound)
    _parents_by_records.record(key_gate, check_parents(
        parent, query_start_loc, indices, dims.num_blocks, dims.window_len))
    windows = [(row, block, first, sum(1 for _, r in tokens if r == row))
               for row, block, first in live]
    return tokens, windows, op


def verify_done(checked, out, correction):
    """After verify: the outputs of the tokens it ran and the corrections it
    recorded are finite."""
    tokens, windows, op = checked
    check_token_values(op, "written by", 3, tokens, out=out)
    for row, block, first, length in windows:
        check_cache_values(op, "written by", "correction",
                           correction[:, :, first:first + length], False, [(row, block, 0)])


def conv_update_call(x, conv_state, weight, bias, query_start_loc, state_indices, activation,
                     out, parent=None, op="conv_update"):
    """Checks before conv_update (or `op`, which runs it); returns what
    `conv_update_done` checks after it."""
    dims = check_conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                             activation, out, parent)
    check_windows(query_start_loc, dims.spec_len, num_tokens=dims.num_tokens, tokens_name="x",
                  spec_len_from=f"from conv_state's W-1+T-1 = {dims.width - 1 + dims.spec_len - 1}"
                  f" columns for W = {dims.width}")
    indices = check_blocks(state_indices, dims.num_blocks, cache_name="conv_state")
    if parent is not None:
        check_parents(parent, query_start_loc, indices, dims.num_blocks, dims.spec_len)
    tokens = _window_tokens(query_start_loc, indices, dims.num_blocks, dims.spec_len)
    check_token_values(op, "given to", 2, tokens, x=x)
    check_parameter_values(op, weight=weight, bias=bias)
    history = [(row, block, dims.width - 1) for row, block in _live(indices, dims.num_blocks)]
    check_cache_values(op, "given to", "conv_state", conv_state, False, history,
                       dim=-1)
    _widths_by_conv_state.record(conv_state, dims.width)
    return tokens


def conv_update_done(tokens, out):
    check_token_values("conv_update", "written by", 2, tokens, out=out)


def conv_verify_call(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state,
                     correction, key_gate, query_start_loc, state_indices, activation,
                     lower_bound, scale, out, pending, spec_len, parent=None):
    """Checks before conv_verify: conv_update's on the convolution's arguments,
    then verify's on the rest (its q, k and v: x's channels, already checked);
    returns what `verify_done` checks after it."""
    dims = check_conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias,
                             state, correction, key_gate, query_start_loc, state_indices,
                             activation, lower_bound, out, pending, spec_len, parent)
    conv_update_call(x, conv_state, conv_weight, conv_bias, query_start_loc, state_indices,
                     activation, None, parent, op="conv_verify")
    q, k, v = conv_verify_split(x, dims.verify.num_heads, dims.verify.key_dim,
                                dims.verify.value_dim)
    return verify_call(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                       query_start_loc, state_indices, lower_bound, scale, out, pending,
                       spec_len, parent, op="conv_verify")


def _check_plan_values(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                       request_indices, block_table, num_blocks=None):
    lengths = check_windows(query_start_loc, spec_len)
    indices = check_blocks(state_indices, num_blocks)
    check_accepted(num_accepted_tokens, request_indices, indices, lengths,
                   None if block_table is None else block_table.shape[0])
    return indices, lengths


def commit_plan_call(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                     request_indices, block_table, num_computed_tokens, block_size):
    check_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len, request_indices,
               block_table, num_computed_tokens, block_size, state_indices.device)
    _check_plan_values(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                       request_indices, block_table)


def _layer_plans(dims, window_len, metadata, block_size, counts, accepted_path):
    """Per layer (one without pending counts, whose plan every layer shares):
    (records folded, fold, final, boundary), host int64/bool [B] each."""
    accepted, source, starts, requests, table, computed = metadata
    if counts is None:
        commit_len, final, boundary, _ = torch_impl.commit_plan(
            accepted, source, starts, window_len, requests, table, computed, block_size)
        return [(commit_len, commit_len > 0, final, boundary)]
    safe_source = torch.where((source > 0) & (source < dims.num_blocks), source, 0)
    eager = source.shape[0] < dims.eager_fold_below
    plans = []
    for layer_counts in counts:
        _, total, fold, final, boundary, _, _ = torch_impl.deferred_plan(
            accepted, source, starts, layer_counts[safe_source], dims.spec_len, window_len,
            requests, table, computed, block_size, dims.num_blocks, eager, accepted_path)
        plans.append((total, fold, final, boundary))
    return plans


def commit_call(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                block_table, num_computed_tokens, block_size, pending, spec_len,
                accepted_path=None, eager_fold=None):
    """Checks before commit; returns what `commit_done` checks after it."""
    dims, plan = check_commit(num_accepted_tokens, state_indices, query_start_loc, state,
                              conv_state, correction, key_gate, A_log, dt_bias, lower_bound,
                              request_indices, block_table, num_computed_tokens, block_size,
                              pending, spec_len, accepted_path, eager_fold)
    window_len = dims.spec_len if spec_len is None else spec_len  # T, not the records' R
    indices, lengths = _check_plan_values(num_accepted_tokens, state_indices, query_start_loc,
                                          window_len, request_indices, block_table,
                                          dims.num_blocks)
    extents = check_accepted_path(accepted_path, key_gate, request_indices, indices, lengths,
                                     _host(num_accepted_tokens), dims.num_blocks, window_len)
    check_gates(key_gate, A_log, dt_bias, lower_bound, dims.stacked)
    if conv_state is not None:
        check_conv_width(conv_state, window_len, dims.stacked,
                         "spec_len" if spec_len is not None else "the records' T")
    check_parameter_values("commit", A_log=A_log, dt_bias=dt_bias)
    metadata = [None if t is None else _host(t) for t in (
        num_accepted_tokens, state_indices, query_start_loc, request_indices, block_table,
        num_computed_tokens)]
    counts = (None if pending is None else
              _host(pending).reshape(dims.num_layers if dims.stacked else 1, dims.num_blocks))
    if counts is not None:
        _check_room(counts, dims.spec_len, indices, lengths, dims.num_blocks, dims.stacked)
    plans = _layer_plans(dims, window_len, metadata, block_size, counts,
                         None if accepted_path is None else _host(accepted_path))
    if plan.align:
        for folded, fold, final, boundary in plans:
            check_written_blocks(indices, torch.where(fold, folded, 0), final, boundary,
                                 dims.num_blocks)
    # What the commit reads: each live row's state, its records up to the
    # tokens it folds (every layer's most, under the deferred schedule; for a
    # tree, up to its path's last node after the pending records) and its
    # history and window's inputs.
    reads = torch.stack([folded for folded, _, _, _ in plans]).amax(0) if plans else \
        torch.zeros_like(indices)
    # A tree's path follows the pending records.
    live = [(row, block, _most_pending(counts, block, dims.spec_len) + extents[row]
             if row in extents else reads[row].item())
            for row, block in _live(indices, dims.num_blocks) if reads[row] > 0]
    check_read_caches("commit", "given to", state, correction, key_gate, dims.stacked, live)
    if conv_state is not None:
        first_token = conv_state.shape[-1] - window_len  # W-2 history columns, then the window
        inputs = [(row, block, first_token + min(lengths[row].item(), window_len))
                  for row, block, _ in live]
        check_cache_values("commit", "given to", "conv_state", conv_state, dims.stacked, inputs,
                           dim=-1)
    return dims, plans


def _most_pending(counts, block, positions):
    """The most records pending in `block` over the layers of `counts`
    (`[layers, N]`, None: none), clamped into the `positions` records."""
    if counts is None:
        return 0
    return max((min(max(count, 0), positions) for count in counts[:, block].tolist()),
               default=0)


def _check_room(counts, positions, indices, lengths, num_blocks, stacked):
    """Under the deferred schedule each live row's window fits in the record
    positions its block's pending records leave, in every layer (`counts`
    `[layers, N]`)."""
    for row, block in _live(indices, num_blocks):
        for layer, count in enumerate(counts[:, block].tolist()):
            room = positions - min(max(count, 0), positions)
            if lengths[row] > room:
                where = f" in layer {layer}" if stacked else ""
                fail("pending", f"leaves {room} of the records' {positions} positions to row "
                     f"{row}'s window of {lengths[row].item()} tokens (block {block} has "
                     f"{count} pending{where})")


def commit_done(checked, state):
    """After commit: every state it wrote is finite."""
    dims, plans = checked
    for _, fold, final, boundary in plans:
        for blocks in (final, boundary):
            written = [(row, blocks[row].item(), 0) for row in fold.nonzero().flatten().tolist()
                       if 0 < blocks[row].item() < dims.num_blocks]
            check_cache_values("commit", "written by", "state", state, dims.stacked, written)


def flush_call(state_indices, state, correction, key_gate, pending, A_log, dt_bias,
               lower_bound):
    """Checks before flush: blocks inside the cache and none listed twice (the
    kernels would fold it twice), finite values; returns what `flush_done`
    checks after it."""
    dims = check_flush(state_indices, state, correction, key_gate, pending, A_log, dt_bias,
                       lower_bound)
    indices = check_blocks(state_indices, dims.num_blocks)
    check_parameter_values("flush", A_log=A_log, dt_bias=dt_bias)
    check_gates(key_gate, A_log, dt_bias, lower_bound, dims.stacked)
    counts = _host(pending).reshape(-1, dims.num_blocks)
    live = [(row, block, _most_pending(counts, block, dims.spec_len))
            for row, block in _live(indices, dims.num_blocks)]
    check_read_caches("flush", "pending in", state, correction, key_gate, dims.stacked, live)
    return dims, live


def flush_done(checked, state):
    dims, live = checked
    check_cache_values("flush", "written by", "state", state, dims.stacked, live)


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
