"""The same semantics as the Triton kernels, in vectorised PyTorch.

Used for CPU tensors. Tensor ops only: no host reads and no Python decisions on
tensor values, so it traces with fake tensors and compiles with Inductor. Rows
that must stay untouched are written back with their old values (bit-identical).
"""

import torch
import torch.nn.functional as F

from ._validation import conv_verify_split
from .constants import NULL_BLOCK


def precision(t):
    """The arithmetic dtype of a call whose state (or conv input) is `t`:
    float64 for float64 (docs/semantics.md#12-float64), float32 otherwise."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def kda_gate(raw_g, dt_bias, A_log, lower_bound):
    dtype = precision(raw_g)
    x = raw_g.to(dtype) + dt_bias.to(dtype)
    a = torch.exp(A_log.to(dtype))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, threshold=20.0)


def l2_normalize(x, scale=1.0):
    return x * (torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) * scale)


def _valid_block(index, num_blocks):
    return (index > NULL_BLOCK) & (index < num_blocks)


def _tokens(t):
    """`[(1,) tokens, H, D]` -> `[tokens, H, D]` view."""
    return t[0] if t.dim() == 4 else t


def _pad_token(t):
    """Appends one zero token so that masked-off gathers have a safe target."""
    return torch.cat([t, t.new_zeros((1,) + tuple(t.shape[1:]))])


def _fold_records(S, correction_rows, key_gate_rows, A_log, dt_bias, lower_bound, counts,
                  boundary_counts=None):
    """S [B, H, V, K] advanced by each row's first `counts[b]` records
    (correction_rows [B, H, R, V], key_gate_rows [B, H, R, 2K]) of one layer,
    and the state after `boundary_counts[b]` of them (S itself when None)."""
    key_dim = S.shape[-1]
    kn = l2_normalize(key_gate_rows[..., :key_dim].to(S.dtype))
    decay = torch.exp(kda_gate(key_gate_rows[..., key_dim:], dt_bias[:, None],
                               A_log[:, None, None], lower_bound))
    at_boundary = S
    for j in range(correction_rows.shape[2]):
        step = (S * decay[:, :, j, None, :]
                + correction_rows[:, :, j, :, None].to(S.dtype) * kn[:, :, j, None, :])
        S = torch.where((j < counts).view(-1, 1, 1, 1), step, S)
        if boundary_counts is not None:
            at_boundary = torch.where((j + 1 == boundary_counts).view(-1, 1, 1, 1), S,
                                      at_boundary)
    return S, at_boundary


def _window_parents(parent, token, positions):
    """Each window position's parent (window-relative; `token [B, T]` its
    packed token, padding at the end), -1 where it starts from the checkpoint:
    the root's -1, and any parent outside 0..t-1."""
    padded = torch.cat([parent.long(), parent.new_full((1,), -1).long()])[token]
    return torch.where((padded >= 0) & (padded < positions[None, :]), padded, -1)


def _along_paths(parents, own):
    """For window parents `[B, T]` and per-node terms `own [B, T, ...]`: each
    node's sum of `own` over its path (itself and its ancestors)."""
    sums = []
    for t in range(parents.shape[1]):
        p = parents[:, t]
        above = (torch.stack(sums, 1)[torch.arange(p.shape[0], device=p.device), p.clamp(min=0)]
                 if t else torch.zeros_like(own[:, 0]))
        has = (p >= 0).view((-1,) + (1,) * (own.dim() - 2))
        sums.append(own[:, t] + torch.where(has, above, torch.zeros_like(above)))
    return torch.stack(sums, 1)


def _ancestors(parents):
    """The ancestor-or-self mask `[B, T, T]` (row t: the nodes on t's path) and
    each node's depth `[B, T]` (the root's 0)."""
    batch, width = parents.shape
    eye = torch.eye(width, dtype=torch.int64, device=parents.device).expand(batch, width, width)
    on_path = _along_paths(parents, eye) > 0
    return on_path, on_path.sum(-1) - 1


def _tree_window(S, kn, qn, log_decay, values, gain, live, parents):
    """Every node of each window along its own path from the checkpoint S
    `[B, H, V, K]`, in closed form (docs/semantics.md#13-tree-drafts): with
    G_t the log decays summed along t's path, the decay between an ancestor
    j and t is exp(G_t - G_j), so no per-node state is built. Token inputs
    `[B, T, H, *]`; returns (corrections, outputs), lists over t of [B, H, V]."""
    width = kn.shape[1]
    ancestors, _ = _ancestors(parents)                                        # [B, T, T]
    G = _along_paths(parents, log_decay)                                      # [B, T, H, K]
    from_checkpoint = torch.exp(G)
    key_terms = torch.einsum("bhvk,bthk->bthv", S, from_checkpoint * kn)
    query_terms = torch.einsum("bhvk,bthk->bthv", S, from_checkpoint * qn)
    gap = G[:, :, None] - G[:, None, :]                                       # [B, t, j, H, K]
    coupling = torch.exp(torch.where(ancestors[..., None, None], gap, -torch.inf))
    key_coupling = torch.einsum("btjhk,bjhk,bthk->bhtj", coupling, kn, kn)
    query_coupling = torch.einsum("btjhk,bjhk,bthk->bhtj", coupling, kn, qn)
    corrections = []
    for t in range(width):
        earlier = sum((key_coupling[:, :, t, j, None] * corrections[j] for j in range(t)),
                      torch.zeros_like(key_terms[:, t]))
        u = gain[:, t, :, None] * (values[:, t] - key_terms[:, t] - earlier)
        corrections.append(torch.where(live[:, t, None, None], u, 0.0))
    U = torch.stack(corrections, 2)                                           # [B, H, T, V]
    outputs = query_terms.transpose(1, 2) + torch.einsum("bhtj,bhjv->bhtv", query_coupling, U)
    return corrections, list(outputs.unbind(2))


def _chain_window(S, kn, qn, decay, values, gain, live, spec_len):
    """The first `spec_len` tokens of each window from S `[B, H, V, K]`, token
    by token; returns (corrections, outputs), lists over t of [B, H, V]."""
    corrections, outputs = [], []
    for t in range(spec_len):
        decayed = S * decay[:, t, :, None, :]
        u = (values[:, t] - torch.einsum("bhvk,bhk->bhv", decayed, kn[:, t])) * gain[:, t, :, None]
        updated = decayed + u[..., None] * kn[:, t, :, None, :]
        S = torch.where(live[:, t, None, None, None], updated, S)
        corrections.append(u)
        outputs.append(torch.einsum("bhvk,bhk->bhv", S, qn[:, t]))
    return corrections, outputs


def verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
           query_start_loc, state_indices, lower_bound, scale, out, dims, pending=None,
           spec_len=None, parent=None):
    batch, capacity = dims.batch, dims.spec_len  # record positions per block
    spec_len = capacity if spec_len is None else spec_len  # the longest window
    if batch == 0:
        return
    q, k, v, g, out = (_tokens(t) for t in (q, k, v, g, out))
    beta = beta[0] if beta.dim() == 3 else beta
    num_tokens = q.shape[0]
    dt_bias = dt_bias.reshape(dims.num_heads, dims.key_dim)

    starts = query_start_loc[:-1].long()
    window = (query_start_loc[1:].long() - starts).clamp(min=0)
    block = state_indices.long()
    valid = _valid_block(block, dims.num_blocks)
    safe_block = torch.where(valid, block, 0)
    # Records already pending in the block: the window starts after them.
    first = (torch.zeros_like(block) if pending is None
             else pending.long()[safe_block].clamp(0, capacity))
    positions = torch.arange(capacity, device=q.device)
    live = (valid[:, None] & (positions[None, :] < window[:, None].clamp(max=spec_len))
            & (positions[None, :] < capacity - first[:, None]))                 # [B, R]
    token = torch.where(live, starts[:, None] + positions[None, :], num_tokens)

    def gather(x):
        return _pad_token(x)[token]                                           # [B, R, H, D]

    acc = precision(state)
    raw_k, raw_g = gather(k), gather(g)
    kn = l2_normalize(raw_k.to(acc))
    qn = l2_normalize(gather(q).to(acc), scale)
    log_decay = kda_gate(raw_g, dt_bias, A_log[:, None], lower_bound)
    decay = torch.exp(log_decay)
    values = gather(v).to(acc)
    gain = torch.sigmoid(_pad_token(beta)[token].to(acc))                     # [B, R, H]

    S = state[safe_block].to(acc)                                             # [B, H, V, K]
    old_correction, old_key_gate = correction[safe_block], key_gate[safe_block]
    if pending is not None:
        S, _ = _fold_records(S, old_correction, old_key_gate, A_log, dt_bias, lower_bound, first)
    if parent is not None:  # a tree of up to T nodes
        window = slice(0, spec_len)
        corrections, outputs = _tree_window(
            S, kn[:, window], qn[:, window], log_decay[:, window], values[:, window],
            gain[:, window], live[:, window],
            _window_parents(parent, token, positions)[:, window])
    else:
        corrections, outputs = _chain_window(S, kn, qn, decay, values, gain, live, spec_len)
    # Positions past T are never live: nothing of theirs is recorded or output.
    corrections += [torch.zeros_like(corrections[0])] * (capacity - spec_len)
    outputs += [torch.zeros_like(outputs[0])] * (capacity - spec_len)

    # Window token t goes to record position first + t.
    slot_token = positions[None, :] - first[:, None]                          # [B, R]
    slot_live = (slot_token >= 0) & live.gather(1, slot_token.clamp(0, capacity - 1))
    slot_index = slot_token.clamp(0, capacity - 1)
    record_live = slot_live[:, None, :, None]                                 # [B, 1, R, 1]
    new_correction = torch.stack(corrections, dim=2)                          # [B, H, R, V]
    new_correction = new_correction.gather(
        2, slot_index[:, None, :, None].expand_as(new_correction))
    correction[safe_block] = torch.where(record_live, new_correction, old_correction)
    new_key_gate = torch.cat([raw_k, raw_g], dim=-1).transpose(1, 2)          # [B, H, R, 2K]
    new_key_gate = new_key_gate.gather(2, slot_index[:, None, :, None].expand_as(new_key_gate))
    key_gate[safe_block] = torch.where(record_live, new_key_gate, old_key_gate)

    # Each packed token takes the output of its (request, position); tokens past
    # the record capacity and tokens of null rows get zeros; tokens outside every
    # window keep what `out` held.
    result = torch.stack(outputs, dim=1)                                      # [B, R, H, V]
    n = torch.arange(num_tokens, device=q.device)
    request = torch.searchsorted(query_start_loc[1:].long().contiguous(), n, right=True)
    in_window = (n >= query_start_loc[0].long()) & (request < batch)
    request = request.clamp(max=batch - 1)
    position = n - starts[request]
    keep = live[request, position.clamp(min=0, max=capacity - 1)] & (position < capacity)
    per_token = torch.where(keep[:, None, None], result[request, position.clamp(0, capacity - 1)], 0.0)
    out.copy_(torch.where(in_window[:, None, None], per_token.to(out.dtype), out))


def commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                request_indices, block_table, num_computed_tokens, block_size):
    """docs/semantics.md#4-the-commit-plan, int64 tensors [B] each; see
    `kernels.common.commit_plan_row`."""
    window, row, row_ok, accepted = _request_rows(num_accepted_tokens, state_indices,
                                                  query_start_loc, request_indices, block_table)
    commit = accepted.clamp(min=0).minimum(window).clamp(max=spec_len)
    source = state_indices.long()
    final = source
    boundary = torch.zeros_like(source)
    recovery = torch.zeros_like(source)
    if block_table is not None:
        table, computed = _table_rows(block_table, num_computed_tokens, row)
        final, boundary, recovery, _ = _align_plan(table, computed, commit, block_size)
    null = (source <= NULL_BLOCK) | ~fits_int32(source) | (commit == 0) | ~row_ok
    zero = torch.zeros_like(source)
    # Blocks outside int32 (null for every cache) are planned as NULL_BLOCK, so
    # that the int32 plan cannot wrap them into real blocks.
    return (torch.where(null, zero, commit), torch.where(null | ~fits_int32(final), zero, final),
            torch.where(null | ~fits_int32(boundary), zero, boundary),
            torch.where(null, zero, recovery))


def _request_rows(num_accepted_tokens, state_indices, query_start_loc, request_indices,
                  block_table):
    """Per request: its window length, its row of `num_accepted_tokens` and of
    the block table (0 where outside them), whether that row exists, and its
    raw accepted count (0 without a row), int64 / bool [B] each."""
    batch = state_indices.shape[0]
    window = (query_start_loc[1:].long() - query_start_loc[:-1].long()).clamp(min=0)
    row = (request_indices.long() if request_indices is not None
           else torch.arange(batch, device=state_indices.device))
    num_rows = num_accepted_tokens.shape[0]
    if block_table is not None:
        num_rows = min(num_rows, block_table.shape[0])
    row_ok = (row >= 0) & (row < num_rows)
    row = torch.where(row_ok, row, 0)
    accepted = num_accepted_tokens.long()[row] if num_rows > 0 else torch.zeros_like(row)
    return window, row, row_ok, accepted


def _table_rows(block_table, num_computed_tokens, row):
    """Each request's block-table row `[B, columns]` and its computed tokens
    (clamped at 0), for rows from `_request_rows`; zeros from an empty table."""
    if block_table.shape[0] == 0:
        return row.new_zeros(row.shape[0], block_table.shape[1]), torch.zeros_like(row)
    return block_table.long()[row], num_computed_tokens.long()[row].clamp(min=0)


def _align_plan(table, start, count, block_size):
    """Align mode's plan of `count` tokens folded from token position `start`
    (docs/semantics.md#4-the-commit-plan): final block, boundary block
    (NULL_BLOCK where the fold crosses no block boundary), recovery (tokens
    up to the next boundary) and whether it crosses, columns clamped to the
    table width."""
    last_col = table.shape[1] - 1
    final_col = ((start + count - 1).clamp(min=0) // block_size).clamp(max=last_col)
    next_boundary = (start // block_size + 1) * block_size
    boundary_col = (next_boundary // block_size - 1).clamp(max=last_col)
    crosses = start + count >= next_boundary
    boundary = torch.where(crosses, table.gather(1, boundary_col[:, None])[:, 0], NULL_BLOCK)
    return table.gather(1, final_col[:, None])[:, 0], boundary, next_boundary - start, crosses


def fits_int32(index):
    return (index >= -2**31) & (index < 2**31)


def _layered(t, stacked):
    return t if stacked else t.unsqueeze(0)


def _history_after(rows, n, spec_len, history):
    """The conv history after `n[b]` window tokens: columns n-1 .. n-1+history-1
    of each request's window buffer `rows [..., B, D, W-1+T-1]`. `n` is clamped
    to [1, T], so that rows whose value is discarded (no boundary, nothing
    moved) still gather inside the window."""
    first = n.clamp(min=1, max=spec_len) - 1
    columns = first[:, None] + torch.arange(history, device=rows.device)     # [B, W-1]
    return rows.gather(-1, columns[:, None, :].expand(rows.shape[:-1] + (history,)))


def _write_rows(buffer, rows, ok, values):
    """buffer[:, rows] = values where ok, else unchanged (rows clamped to 0 when not ok)."""
    safe = torch.where(ok, rows, 0)
    mask = ok.view((1, -1) + (1,) * (values.dim() - 2))
    buffer[:, safe] = torch.where(mask, values.to(buffer.dtype), buffer[:, safe])


def path_positions(accepted_path, row, query_start_loc, spec_len):
    """Each request's record positions in fold order, `[B, T]`: its accepted
    path's entries clamped into its window's first min(L, T) nodes."""
    positions = torch.arange(spec_len, device=query_start_loc.device)
    if accepted_path.shape[0] == 0:  # no row: nothing is folded
        return positions.expand(row.shape[0], spec_len)
    window = (query_start_loc[1:].long() - query_start_loc[:-1].long()).clamp(1, spec_len)
    picked = accepted_path.long()[row.clamp(0, accepted_path.shape[0] - 1)]  # [B, T]
    return torch.minimum(picked.clamp(min=0), window[:, None] - 1)


def _path_sequence(rows, positions, history):
    """The conv buffer's columns `[..., B, D, W-1+T-1]` in path order: the
    W-2 kept history columns, then the inputs of the path's nodes."""
    columns = torch.cat([torch.arange(history - 1, device=rows.device).expand(
        positions.shape[0], history - 1), history - 1 + positions], dim=1)  # [B, W-2+T]
    return rows.gather(-1, columns[:, None, :].expand(rows.shape[:-1] + (columns.shape[1],)))


def commit(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
           correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
           block_table, num_computed_tokens, block_size, dims, plan, accepted_path=None):
    if plan.batch == 0:
        return
    commit_len, final, boundary, recovery = commit_plan(
        num_accepted_tokens, state_indices, query_start_loc, dims.spec_len,
        request_indices, block_table, num_computed_tokens, block_size)
    L, H, K = dims.num_layers, dims.num_heads, dims.key_dim
    source = state_indices.long()
    source_ok = _valid_block(source, dims.num_blocks) & (commit_len > 0)
    final_ok = source_ok & _valid_block(final, dims.num_blocks)
    boundary_ok = source_ok & _valid_block(boundary, dims.num_blocks)
    safe_source = torch.where(source_ok, source, 0)

    state5 = _layered(state, dims.stacked)
    corr = _layered(correction, dims.stacked)[:, safe_source]                 # [L, B, H, T, V]
    key_gate_rows = _layered(key_gate, dims.stacked)[:, safe_source]          # [L, B, H, T, 2K]
    if accepted_path is not None:  # the records in path order
        _, row, _, _ = _request_rows(num_accepted_tokens, state_indices, query_start_loc,
                                     request_indices, block_table)
        positions = path_positions(accepted_path, row, query_start_loc, dims.spec_len)
        along = positions[None, :, None, :, None]
        corr = corr.gather(3, along.expand_as(corr))
        key_gate_rows = key_gate_rows.gather(3, along.expand_as(key_gate_rows))
    acc = precision(state)
    kn = l2_normalize(key_gate_rows[..., :K].to(acc))
    dt = dt_bias.reshape(L, 1, H, 1, K)
    A = A_log.reshape(L, 1, H, 1, 1)
    decay = torch.exp(kda_gate(key_gate_rows[..., K:], dt, A, lower_bound))  # [L, B, H, T, K]

    S = state5[:, safe_source].to(acc)                                        # [L, B, H, V, K]
    at_boundary = S
    for t in range(dims.spec_len):
        step = S * decay[:, :, :, t, None, :] + corr[:, :, :, t, :, None] * kn[:, :, :, t, None, :]
        S = torch.where((t < commit_len).view(1, -1, 1, 1, 1), step, S)
        at_boundary = torch.where((t + 1 == recovery).view(1, -1, 1, 1, 1), S, at_boundary)
    # Boundary first, then final, as the kernel stores them.
    if plan.align:
        _write_rows(state5, boundary, boundary_ok, at_boundary)
    _write_rows(state5, final, final_ok, S)

    if conv_state is not None:
        conv = _layered(conv_state, dims.stacked)                             # [L, N, D, W-1+T-1]
        rows = conv[:, safe_source]                                           # [L, B, D, cols]
        if accepted_path is not None:
            rows = _path_sequence(rows, positions, dims.conv_history)
        final_history = _history_after(rows, commit_len, dims.spec_len, dims.conv_history)
        if plan.align:
            boundary_history = _history_after(rows, recovery, dims.spec_len, dims.conv_history)
            _write_rows(conv[..., :dims.conv_history], boundary, boundary_ok, boundary_history)
        _write_rows(conv[..., :dims.conv_history], final, final_ok, final_history)


def accepted_nodes(accepted_path, row, query_start_loc, spec_len, first, capacity):
    """Each request's accepted path `[B, T]` as window nodes, clamped into the
    window's nodes recorded after its `first` pending records."""
    nodes = path_positions(accepted_path, row, query_start_loc, spec_len)
    return nodes.minimum((capacity - first).clamp(min=1)[:, None] - 1)


def leaves_chain(nodes, count):
    """Whether each request's first `count` accepted nodes leave the chain 0, 1, ..."""
    steps = torch.arange(nodes.shape[1], device=nodes.device)
    return ((nodes != steps) & (steps < count[:, None])).any(1)


def deferred_plan(num_accepted_tokens, state_indices, query_start_loc, pending_rows, capacity,
                  spec_len, request_indices, block_table, num_computed_tokens, block_size,
                  num_blocks, eager, accepted_path=None):
    """docs/semantics.md#11-the-deferred-schedule per request, for one layer's
    pending counts `pending_rows [B]` (int64), folding whatever is pending where
    `eager` (a bool or a bool tensor) or where a tree's `accepted_path` leaves
    the chain: (accepted c, total, fold_now, final, boundary, recovery from the
    checkpoint), int64 / bool [B] each, and the path's window nodes `[B, T]`
    (accepted_nodes; None for chains)."""
    window, row, row_ok, accepted = _request_rows(num_accepted_tokens, state_indices,
                                                  query_start_loc, request_indices, block_table)
    source = state_indices.long()
    ok = row_ok & _valid_block(source, num_blocks)
    first = pending_rows.clamp(0, capacity)
    c = torch.where(ok, accepted.clamp(min=0).minimum(window).minimum(capacity - first), 0)
    total = torch.where(ok, first + c, 0)
    final, boundary = source, torch.zeros_like(source)
    recovery = torch.zeros_like(source)
    crosses = torch.zeros_like(ok)
    if block_table is not None:
        table, computed = _table_rows(block_table, num_computed_tokens, row)
        start = (computed - first).clamp(min=0)  # the checkpoint holds the tokens before it
        final, boundary, recovery, crosses = _align_plan(table, start, total, block_size)
    fold_now = (total > 0) & ((total + spec_len > capacity) | crosses | (final != source)
                              | eager)
    nodes = None
    if accepted_path is not None:  # records off the chain cannot stay pending
        nodes = accepted_nodes(accepted_path, row, query_start_loc, spec_len, first, capacity)
        fold_now = fold_now | ((total > 0) & leaves_chain(nodes, c))
    return c, total, fold_now, final, boundary, recovery, nodes


def _deferred_record_order(positions, first, capacity):
    """Each request's record positions in fold order, `[B, R]`: its `first`
    pending records, then its window's accepted nodes `positions [B, T]`
    after them, clamped into the records (reads past the fold are unused)."""
    index = torch.arange(capacity, device=positions.device)[None, :]          # [1, R]
    along = positions.gather(1, (index - first[:, None]).clamp(0, positions.shape[1] - 1))
    order = torch.where(index < first[:, None], index, first[:, None] + along)
    return order.clamp(max=capacity - 1)


def commit_deferred(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                    correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                    block_table, num_computed_tokens, block_size, pending, spec_len, dims,
                    accepted_path=None):
    """The deferred commit: per layer and request, count the accepted tokens
    as pending, or fold every pending token into the checkpoint when the next
    window would not fit, in align mode also when the fold crosses a block or
    leaves the checkpoint's block, where a tree's `accepted_path` leaves the
    chain 0, 1, ... (its records cannot stay pending), and always below
    dims.eager_fold_below requests (docs/semantics.md#11-the-deferred-schedule)."""
    if state_indices.shape[0] == 0:
        return
    capacity = dims.spec_len
    K = dims.key_dim
    source = state_indices.long()
    safe_source = torch.where(_valid_block(source, dims.num_blocks), source, 0)
    state5, corr5, key_gate5 = (_layered(t, dims.stacked) for t in (state, correction, key_gate))
    counts = _layered(pending, dims.stacked)
    conv = None if conv_state is None else _layered(conv_state, dims.stacked)
    A5 = A_log.reshape(dims.num_layers, dims.num_heads)
    dt5 = dt_bias.reshape(dims.num_layers, dims.num_heads, K)
    history = dims.conv_history
    # The batch compared as a tensor: a traced batch gains no guard.
    eager = source.new_ones(source.shape).sum() < dims.eager_fold_below
    for layer in range(dims.num_layers):
        first = counts[layer].long()[safe_source].clamp(0, capacity)
        c, total, fold_now, final, boundary, recovery, nodes = deferred_plan(
            num_accepted_tokens, state_indices, query_start_loc, first, capacity, spec_len,
            request_indices, block_table, num_computed_tokens, block_size, dims.num_blocks, eager,
            accepted_path)
        corr_rows, key_gate_rows = corr5[layer, safe_source], key_gate5[layer, safe_source]
        if nodes is not None:
            along = _deferred_record_order(nodes, first, capacity)[:, None, :, None]
            corr_rows = corr_rows.gather(2, along.expand_as(corr_rows))
            key_gate_rows = key_gate_rows.gather(2, along.expand_as(key_gate_rows))
        S, at_boundary = _fold_records(
            state5[layer, safe_source].to(precision(state)), corr_rows, key_gate_rows, A5[layer],
            dt5[layer], lower_bound, total, recovery)
        layer_state = state5[layer:layer + 1]
        final_ok = fold_now & _valid_block(final, dims.num_blocks)
        boundary_ok = fold_now & _valid_block(boundary, dims.num_blocks)
        _write_rows(layer_state, boundary, boundary_ok, at_boundary[None])
        _write_rows(layer_state, final, final_ok, S[None])
        if conv is not None:
            rows = conv[layer, safe_source]                                    # [B, D, cols]
            if nodes is not None:
                rows = _path_sequence(rows, nodes, history)
            layer_conv = conv[layer:layer + 1, ..., :history]
            destination = torch.where(fold_now, final, source)
            moved = (c > 0) & _valid_block(destination, dims.num_blocks)
            _write_rows(layer_conv, boundary, boundary_ok & (c > 0),
                        _history_after(rows, recovery - first, spec_len, history)[None])
            _write_rows(layer_conv, destination, moved,
                        _history_after(rows, c, spec_len, history)[None])
        # Pending counts last: every read of them above is done.
        layer_counts = counts[layer:layer + 1, :, None]
        deferred = (total > 0) & ~fold_now
        _write_rows(layer_counts, source, deferred, total[None, :, None])
        for block, ok in ((source, fold_now), (boundary, boundary_ok), (final, final_ok)):
            _write_rows(layer_counts, block, ok & _valid_block(block, dims.num_blocks),
                        torch.zeros_like(total)[None, :, None])


def flush(state_indices, state, correction, key_gate, pending, A_log, dt_bias, lower_bound,
          dims):
    """Folds each listed block's pending records into its checkpoint and
    zeroes its count."""
    if state_indices.shape[0] == 0:
        return
    source = state_indices.long()
    ok = _valid_block(source, dims.num_blocks)
    safe_source = torch.where(ok, source, 0)
    state5, corr5, key_gate5 = (_layered(t, dims.stacked) for t in (state, correction, key_gate))
    counts = _layered(pending, dims.stacked)
    A5 = A_log.reshape(dims.num_layers, dims.num_heads)
    dt5 = dt_bias.reshape(dims.num_layers, dims.num_heads, dims.key_dim)
    for layer in range(dims.num_layers):
        first = counts[layer].long()[safe_source].clamp(0, dims.spec_len)
        S, _ = _fold_records(state5[layer, safe_source].to(precision(state)),
                             corr5[layer, safe_source],
                             key_gate5[layer, safe_source], A5[layer], dt5[layer], lower_bound,
                             first)
        _write_rows(state5[layer:layer + 1], source, ok, S[None])
        _write_rows(counts[layer:layer + 1, :, None], source, ok,
                    torch.zeros_like(first)[None, :, None])


def _tree_taps(parents, history):
    """For window parents `[B, T]`: the column of `[history (W-1) | window (T)]`
    that each node's tap j reads, `[B, T, W]`: its (W-1-j)-th ancestor's
    input, continuing into the history past its root."""
    batch, width = parents.shape
    _, depth = _ancestors(parents)
    node = torch.arange(width, device=parents.device).expand(batch, width)
    taps = []
    for back in range(history + 1):                       # back = W-1-j
        taps.append(torch.where(node >= 0, history + node, history - back + depth))
        node = torch.where(node >= 0, parents.gather(1, node.clamp(min=0)), -1)
    return torch.stack(taps[::-1], dim=-1)


def conv_update(x, conv_state, weight, bias, query_start_loc, state_indices, activation, out,
                dims, parent=None):
    """docs/semantics.md#6-conv_update, with the conventions of `kernels.conv`:
    null rows and tokens past T get zero outputs; only the first min(L, T)
    tokens reach the state."""
    batch, spec_len, history = dims.batch, dims.spec_len, dims.width - 1
    if batch == 0:
        return
    starts = query_start_loc[:-1].long()
    window = (query_start_loc[1:].long() - starts).clamp(min=0)
    block = state_indices.long()
    valid = _valid_block(block, dims.num_blocks)
    safe_block = torch.where(valid, block, 0)
    processed = torch.where(valid, window.clamp(max=spec_len), 0)                # [B]
    positions = torch.arange(spec_len, device=x.device)
    live = positions[None, :] < processed[:, None]                               # [B, T]
    token = torch.where(live, starts[:, None] + positions[None, :], dims.num_tokens)
    windows = _pad_token(x)[token].transpose(1, 2)                               # [B, D, T]
    rows = conv_state[safe_block]                                                # [B, D, W-2+T]

    # Depthwise cross-correlation over [history, window]: y_t = sum_j w_j seq[t + j].
    acc = precision(x)
    seq = torch.cat([rows[..., :history].to(acc), windows.to(acc)], dim=-1)
    # A sum over the W taps, not F.conv1d: conv1d's fake implementation picks a
    # CPU backend by batch size and so guards on it (a recompile under dynamic shapes).
    w = weight.to(acc)
    if parent is None:
        y = sum(w[:, j, None] * seq[..., j:j + spec_len] for j in range(dims.width))  # [B, D, T]
    else:  # each node convolves its path's inputs after the history
        taps = _tree_taps(_window_parents(parent, token, positions), history)     # [B, T, W]
        y = sum(w[:, j, None] * seq.gather(-1, taps[:, None, :, j].expand(
            -1, seq.shape[1], -1)) for j in range(dims.width))
    if bias is not None:
        y = y + bias.to(acc)[:, None]
    if activation == "silu":
        y = F.silu(y)

    # Column c takes seq[c + 1] for c < W-2 + processed; other columns keep their bits.
    shifted = torch.cat([rows[..., 1:history], windows.to(conv_state.dtype)], dim=-1)
    columns = torch.arange(shifted.shape[-1], device=x.device)
    written = (columns[None, :] < history - 1 + processed[:, None]) & (processed > 0)[:, None]
    conv_state[safe_block] = torch.where(written[:, None, :], shifted, rows)

    n = torch.arange(dims.num_tokens, device=x.device)
    request = torch.searchsorted(query_start_loc[1:].long().contiguous(), n, right=True)
    in_window = (n >= query_start_loc[0].long()) & (request < batch)
    request = request.clamp(max=batch - 1)
    position = n - starts[request]
    keep = position < processed[request]
    per_token = torch.where(keep[:, None], y[request, :, position.clamp(0, spec_len - 1)], 0.0)
    out.copy_(torch.where(in_window[:, None], per_token.to(out.dtype), out))


def conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state,
                correction, key_gate, query_start_loc, state_indices, activation, lower_bound,
                scale, out, dims, pending=None, spec_len=None, parent=None):
    """docs/semantics.md#14-conv_verify: conv_update into a buffer like x, then
    verify of its q | k | v split."""
    convolved = torch.zeros_like(x)
    conv_update(x, conv_state, conv_weight, conv_bias, query_start_loc, state_indices,
                activation, convolved, dims.conv, parent)
    v_dims = dims.verify
    q, k, v = conv_verify_split(convolved, v_dims.num_heads, v_dims.key_dim, v_dims.value_dim)
    verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate, query_start_loc,
           state_indices, lower_bound, scale, out, v_dims, pending, spec_len, parent)


def aligned_state_indices(block_table, seq_lens, block_size, num_state_slots):
    """docs/semantics.md#8-metadata-helpers; columns past the table give NULL_BLOCK."""
    table_cols = block_table.shape[1]
    first_col = (seq_lens.long() - 1).clamp(min=0) // block_size
    cols = first_col[:, None] + torch.arange(num_state_slots, device=block_table.device)
    in_table = cols < table_cols
    # One null column gives the gather a safe target for columns past the table.
    null_column = block_table.new_full((block_table.shape[0], 1), NULL_BLOCK)
    padded = torch.cat([block_table, null_column], dim=1)
    return padded.gather(1, torch.where(in_table, cols, table_cols))


def stage_spec_decode_metadata(state_indices, query_start_loc, num_accepted_tokens,
                               staged_state_indices, staged_query_start_loc,
                               staged_num_accepted_tokens, num_spec_decodes, count_limit):
    """docs/semantics.md#8-metadata-helpers. `num_spec_decodes` is an int or a
    one-element tensor, clamped to [0, count_limit] like the kernel does."""
    batch = staged_state_indices.shape[0]
    source_rows = state_indices.shape[0]
    if isinstance(num_spec_decodes, torch.Tensor):
        num_real = num_spec_decodes.reshape(()).long().clamp(0, count_limit)
    else:
        num_real = num_spec_decodes
    rows = torch.arange(batch, device=state_indices.device)
    real = rows < num_real
    # Padding rows read an appended row that holds the padding value.
    source_row = torch.where(real, rows, source_rows)
    null_row = state_indices.new_full((1,) + tuple(state_indices.shape[1:]), NULL_BLOCK)
    picked = torch.cat([state_indices, null_row])[source_row]
    # As the kernel: indices past int32 (null anyway) become NULL_BLOCK, so that
    # an int32 buffer cannot wrap them into real blocks.
    wide = picked.long()
    staged_state_indices.copy_(torch.where(fits_int32(wide), picked, NULL_BLOCK))
    accepted = torch.cat([num_accepted_tokens[:source_rows], num_accepted_tokens.new_ones(1)])
    staged_num_accepted_tokens.copy_(accepted[source_row])
    starts = torch.arange(batch + 1, device=state_indices.device).clamp(max=num_real)
    staged_query_start_loc.copy_(query_start_loc[starts])
