"""Plain float64 reference of docs/semantics.md, written for clarity, token by token.

Independent of `torch_impl` and the kernels: Python loops over requests, heads
and tokens, reading values with `.item()`. The tests and the main job compare
every op against it. Inputs are never modified; results are new float64 tensors.
"""

import math

import torch

from .constants import DEFERRED_EAGER_FOLD_BELOW_BATCH, NULL_BLOCK


def gate(raw_g, dt_bias, A_log, lower_bound):
    """Log decay per channel for one head: raw_g, dt_bias [K]; A_log scalar."""
    x = raw_g.double() + dt_bias.double()
    a = math.exp(float(A_log))
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    return -a * softplus


def normalize(x):
    x = x.double()
    return x / torch.sqrt((x * x).sum() + 1e-6)


def step(S, q, k, v, g, beta, A_log, dt_bias, lower_bound, scale):
    """One token of one head. S [V, K] float64. Returns (new S, u, out)."""
    kn = normalize(k)
    S = S * torch.exp(gate(g, dt_bias, A_log, lower_bound))[None, :]
    u = (v.double() - S @ kn) * torch.sigmoid(torch.tensor(float(beta), dtype=torch.float64))
    S = S + u[:, None] * kn[None, :]
    out = S @ (normalize(q) * scale)
    return S, u, out


def fold(S, records_u, records_kg, A_log, dt_bias, lower_bound, count):
    """The state after the first `count` recorded tokens (commit of one head)."""
    K = S.shape[1]
    for t in range(count):
        kn = normalize(records_kg[t, :K])
        S = S * torch.exp(gate(records_kg[t, K:], dt_bias, A_log, lower_bound))[None, :]
        S = S + records_u[t].double()[:, None] * kn[None, :]
    return S


def _valid(index, num_blocks):
    return NULL_BLOCK < index < num_blocks


def tree_path(parents, t):
    """Window node t's path from its root, as window positions root first;
    `parents` are the window's parent entries. A parent outside 0..t-1 (the
    root's -1) ends the path: that node starts from the checkpoint."""
    path = [t]
    while 0 <= int(parents[path[-1]]) < path[-1]:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def accepted_positions(accepted_path, row, count, window):
    """The record positions of the first `count` accepted nodes of row `row`
    (0, 1, 2, ... without `accepted_path`); entries are read clamped into the
    window's `window` nodes."""
    if accepted_path is None:
        return list(range(count))
    return [min(max(int(accepted_path[row, i]), 0), window - 1) for i in range(count)]


def _tokens(t):
    return t[0] if t.dim() == 4 else t


def verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
           query_start_loc, state_indices, lower_bound=None, scale=None, out=None,
           pending=None, spec_len=None, parent=None):
    """Returns (out, correction, key_gate) as verify must leave them. `out`, if
    given, supplies the values of tokens outside every window. With `pending`
    ([N] counts), each window starts from the checkpoint folded with its
    block's first `pending` records, and records its tokens after them; tokens
    past `spec_len` (default: the records' length) get zero outputs. With
    `parent` ([num_tokens], window-relative), each node runs along its own
    path from the checkpoint (docs/semantics.md#13-tree-drafts)."""
    q, k, v, g = (_tokens(t) for t in (q, k, v, g))
    beta = beta[0] if beta.dim() == 3 else beta
    num_tokens, H, K = q.shape
    V = v.shape[-1]
    T = correction.shape[2]
    scale = K ** -0.5 if scale is None else scale
    dt_bias = dt_bias.reshape(H, K)
    result = (torch.full((num_tokens, H, V), float("nan"), dtype=torch.float64) if out is None
              else _tokens(out).double().clone())
    correction = correction.double().clone()
    key_gate = key_gate.clone()
    for b in range(state_indices.shape[0]):
        bos, eos = int(query_start_loc[b]), int(query_start_loc[b + 1])
        block = int(state_indices[b])
        for t in range(max(eos - bos, 0)):
            result[bos + t] = 0.0
        if not _valid(block, state.shape[0]):
            continue
        first = 0 if pending is None else min(max(int(pending[block]), 0), T)
        nodes = min(max(eos - bos, 0), T - first, T if spec_len is None else spec_len)
        for h in range(H):
            checkpoint = fold(state[block, h].double(), correction[block, h], key_gate[block, h],
                              A_log[h], dt_bias[h], lower_bound, first)
            if parent is not None:
                for t in range(nodes):
                    S = checkpoint
                    for node in tree_path(parent[bos:bos + nodes], t):
                        n = bos + node
                        S, u, o = step(S, q[n, h], k[n, h], v[n, h], g[n, h], beta[n, h],
                                       A_log[h], dt_bias[h], lower_bound, scale)
                    result[bos + t, h] = o
                    correction[block, h, first + t] = u
                    key_gate[block, h, first + t] = torch.cat([k[bos + t, h], g[bos + t, h]])
                continue
            S = checkpoint
            for t in range(nodes):
                n = bos + t
                S, u, o = step(S, q[n, h], k[n, h], v[n, h], g[n, h], beta[n, h],
                               A_log[h], dt_bias[h], lower_bound, scale)
                result[n, h] = o
                correction[block, h, first + t] = u
                key_gate[block, h, first + t] = torch.cat([k[n, h], g[n, h]])
    return result, correction, key_gate


def _fits_int32(index):
    return -2**31 <= index < 2**31


def commit_plan(num_accepted_tokens, state_indices, query_start_loc, spec_len,
                request_indices=None, block_table=None, num_computed_tokens=None,
                block_size=None):
    """docs/semantics.md#4-the-commit-plan in plain Python. Returns four lists of ints."""
    plans = []
    for b in range(state_indices.shape[0]):
        r = b if request_indices is None else int(request_indices[b])
        window = max(int(query_start_loc[b + 1]) - int(query_start_loc[b]), 0)
        rows = len(num_accepted_tokens) if block_table is None else min(
            len(num_accepted_tokens), block_table.shape[0])
        src = int(state_indices[b])
        if not 0 <= r < rows:
            plans.append((0, NULL_BLOCK, NULL_BLOCK, 0))
            continue
        commit = min(max(int(num_accepted_tokens[r]), 0), window, spec_len)
        final, boundary, recovery = src, NULL_BLOCK, 0
        if block_table is not None:
            width = block_table.shape[1]
            nc = max(int(num_computed_tokens[r]), 0)
            final = int(block_table[r, min(max(nc + commit - 1, 0) // block_size, width - 1)])
            nb = (nc // block_size + 1) * block_size
            recovery = nb - nc
            if nc + commit >= nb:
                boundary = int(block_table[r, min(nb // block_size - 1, width - 1)])
        if src <= NULL_BLOCK or not _fits_int32(src) or commit == 0:
            commit, final, boundary, recovery = 0, NULL_BLOCK, NULL_BLOCK, 0
        # The plan is int32: a block outside it (null for every cache) is planned as null.
        final, boundary = (b if _fits_int32(b) else NULL_BLOCK for b in (final, boundary))
        plans.append((commit, final, boundary, recovery))
    return [list(column) for column in zip(*plans)] if plans else [[], [], [], []]


def commit(num_accepted_tokens, state_indices, query_start_loc, *, state, conv_state,
           correction, key_gate, A_log, dt_bias, lower_bound=None, request_indices=None,
           block_table=None, num_computed_tokens=None, block_size=None, pending=None,
           spec_len=None, accepted_path=None, eager_fold=None):
    """Returns (state, conv_state) as commit must leave them (float64 state);
    with `pending`, the deferred schedule: (state, conv_state, pending),
    folding whatever is pending with `eager_fold` (None: below
    DEFERRED_EAGER_FOLD_BELOW_BATCH requests). With
    `accepted_path` ([rows, *] window positions), the records of the path's
    nodes are folded in its order (with `pending`, after the pending records,
    at once where the path leaves the chain 0, 1, ...) and the history follows
    the path (docs/semantics.md#13-tree-drafts)."""
    if pending is not None:
        eager = (len(state_indices) < DEFERRED_EAGER_FOLD_BELOW_BATCH if eager_fold is None
                 else eager_fold)
        return _commit_deferred(
            num_accepted_tokens, state_indices, query_start_loc, state, conv_state, correction,
            key_gate, A_log, dt_bias, lower_bound, request_indices, block_table,
            num_computed_tokens, block_size, pending, spec_len, eager, accepted_path)
    stacked = state.dim() == 5
    states = state.double().clone() if stacked else state.double().clone()[None]
    corr = correction if stacked else correction[None]
    kg = key_gate if stacked else key_gate[None]
    convs = None
    if conv_state is not None:
        convs = conv_state.clone() if stacked else conv_state.clone()[None]
    A = A_log.reshape(states.shape[0], -1)
    T = corr.shape[-2]
    H, K = states.shape[2], states.shape[-1]
    dt = dt_bias.reshape(states.shape[0], H, K)
    commits, finals, boundaries, recoveries = commit_plan(
        num_accepted_tokens, state_indices, query_start_loc, T, request_indices, block_table,
        num_computed_tokens, block_size)
    originals = states.clone()
    conv_originals = None if convs is None else convs.clone()
    N = states.shape[1]
    for b, src in enumerate(int(s) for s in state_indices):
        c, final, boundary, r = commits[b], finals[b], boundaries[b], recoveries[b]
        if c == 0 or not _valid(src, N):
            continue
        row = b if request_indices is None else int(request_indices[b])
        window_len = min(int(query_start_loc[b + 1]) - int(query_start_loc[b]), T)
        path = accepted_positions(accepted_path, row, c, window_len)
        for layer in range(states.shape[0]):
            for h in range(H):
                S0 = originals[layer, src, h]
                args = (corr[layer, src, h][path], kg[layer, src, h][path], A[layer, h],
                        dt[layer, h], lower_bound)
                if _valid(boundary, N):
                    states[layer, boundary, h] = fold(S0, *args, r)
                if _valid(final, N):
                    states[layer, final, h] = fold(S0, *args, c)
            if convs is not None:
                history = convs.shape[-1] - (T - 1)
                window = conv_originals[layer, src]
                # [h_1 .. h_{W-2}] then the path's inputs: the last W-1 after n nodes.
                sequence = window[:, list(range(history - 1)) + [history - 1 + p for p in path]]
                if _valid(boundary, N):
                    convs[layer, boundary, :, :history] = sequence[:, r - 1:r - 1 + history]
                if _valid(final, N):
                    convs[layer, final, :, :history] = sequence[:, c - 1:c - 1 + history]
    if not stacked:
        states = states[0]
        convs = None if convs is None else convs[0]
    return states, convs


def _with_layers(t, stacked):
    return t if stacked else t[None]


def _without_layers(t, stacked):
    return t if stacked else t[0]


def _deferred_plan(p, accepted, window, capacity, spec_len, src, table, computed, block_size,
                   eager):
    """For one request and layer with `p` pending tokens: (total, fold_now,
    final, boundary, recovery), recovery counted from the checkpoint; `eager`
    folds whatever is pending."""
    c = min(max(accepted, 0), window, capacity - p)
    total = p + c
    final, boundary, recovery, crosses = src, NULL_BLOCK, 0, False
    if table is not None:
        # The checkpoint holds the tokens before `start` (clamped like num_computed_tokens).
        start = max(max(computed, 0) - p, 0)
        width = table.shape[0]
        final = int(table[min(max(start + total - 1, 0) // block_size, width - 1)])
        next_boundary = (start // block_size + 1) * block_size
        recovery = next_boundary - start
        crosses = start + total >= next_boundary
        if crosses:
            boundary = int(table[min(next_boundary // block_size - 1, width - 1)])
    fold_now = total > 0 and (eager or total + spec_len > capacity or crosses or final != src)
    return c, total, fold_now, final, boundary, recovery


def _commit_deferred(num_accepted_tokens, state_indices, query_start_loc, state, conv_state,
                     correction, key_gate, A_log, dt_bias, lower_bound, request_indices,
                     block_table, num_computed_tokens, block_size, pending, spec_len, eager,
                     accepted_path=None):
    stacked = state.dim() == 5
    states, corr, kg = (_with_layers(t, stacked)
                        for t in (state.double().clone(), correction, key_gate))
    counts = _with_layers(pending.clone(), stacked)
    convs = None if conv_state is None else _with_layers(conv_state.clone(), stacked)
    originals, original_counts = states.clone(), counts.clone()
    conv_originals = None if convs is None else convs.clone()
    num_layers, N, H = states.shape[0], states.shape[1], states.shape[2]
    K, R = states.shape[-1], corr.shape[-2]
    A = A_log.reshape(num_layers, -1)
    dt = dt_bias.reshape(num_layers, H, K)
    rows = len(num_accepted_tokens) if block_table is None else min(
        len(num_accepted_tokens), block_table.shape[0])
    for b, src in enumerate(int(x) for x in state_indices):
        r = b if request_indices is None else int(request_indices[b])
        if not (_valid(src, N) and _fits_int32(src) and 0 <= r < rows):
            continue
        window = max(int(query_start_loc[b + 1]) - int(query_start_loc[b]), 0)
        table = None if block_table is None else block_table[r]
        computed = 0 if block_table is None else int(num_computed_tokens[r])
        for layer in range(num_layers):
            p = min(max(int(original_counts[layer, src]), 0), R)
            c, total, fold_now, final, boundary, recovery = _deferred_plan(
                p, int(num_accepted_tokens[r]), window, R, spec_len, src, table, computed,
                block_size, eager)
            if total == 0:
                continue
            # The pending records, then the window's accepted nodes after them.
            recorded = max(min(window, spec_len, R - p), 1)
            path = accepted_positions(accepted_path, r, c, recorded)
            records = list(range(p)) + [p + node for node in path]
            # A path off the chain 0, 1, ... leaves records that cannot stay pending.
            fold_now = fold_now or (total > 0 and path != list(range(c)))
            if not fold_now:
                counts[layer, src] = total
            else:
                for h in range(H):
                    args = (corr[layer, src, h][records], kg[layer, src, h][records], A[layer, h],
                            dt[layer, h], lower_bound)
                    if boundary != NULL_BLOCK and _valid(boundary, N):
                        states[layer, boundary, h] = fold(originals[layer, src, h], *args,
                                                          recovery)
                    if _valid(final, N):
                        states[layer, final, h] = fold(originals[layer, src, h], *args, total)
                for block in (src, boundary, final):
                    if _valid(block, N):
                        counts[layer, block] = 0
            if convs is not None and c > 0:
                history = convs.shape[-1] - (spec_len - 1)
                # [h_1 .. h_{W-2}] then the accepted nodes' inputs (a chain's: in order).
                window_columns = conv_originals[layer, src][
                    :, list(range(history - 1)) + [history - 1 + node for node in path]]
                # This window's tokens: the boundary lies `recovery - p` tokens into it.
                if fold_now and boundary != NULL_BLOCK and _valid(boundary, N):
                    # Pending tokens lie before the boundary; clamped like the kernels
                    # when the counts disagree with num_computed_tokens.
                    n = min(max(recovery - p, 1), spec_len)
                    convs[layer, boundary, :, :history] = window_columns[:, n - 1:n - 1 + history]
                destination = final if fold_now else src
                if _valid(destination, N):
                    convs[layer, destination, :, :history] = window_columns[:, c - 1:c - 1 + history]
    return (_without_layers(states, stacked),
            None if convs is None else _without_layers(convs, stacked),
            _without_layers(counts, stacked))


def flush(state_indices, *, state, correction, key_gate, pending, A_log, dt_bias,
          lower_bound=None):
    """Folds each listed block's pending records into its checkpoint. Returns
    (state float64, pending) as flush must leave them."""
    stacked = state.dim() == 5
    states, corr, kg = (_with_layers(t, stacked)
                        for t in (state.double().clone(), correction, key_gate))
    counts = _with_layers(pending.clone(), stacked)
    num_layers, N, H, K, R = (states.shape[0], states.shape[1], states.shape[2],
                              states.shape[-1], corr.shape[-2])
    A = A_log.reshape(num_layers, -1)
    dt = dt_bias.reshape(num_layers, H, K)
    for block in (int(x) for x in state_indices):
        if not _valid(block, N):
            continue
        for layer in range(num_layers):
            p = min(max(int(counts[layer, block]), 0), R)
            for h in range(H):
                states[layer, block, h] = fold(states[layer, block, h], corr[layer, block, h],
                                               kg[layer, block, h], A[layer, h], dt[layer, h],
                                               lower_bound, p)
            counts[layer, block] = 0
    return _without_layers(states, stacked), _without_layers(counts, stacked)


def _activate(y, activation):
    return y * torch.sigmoid(y) if activation == "silu" else y


def causal_conv(history, tokens, weight, bias=None, activation="silu"):
    """Depthwise causal convolution of a whole sequence `tokens [n, D]` that
    follows `history [D, W-1]` (oldest first). Returns float64 `[n, D]`."""
    W = weight.shape[1]
    seq = torch.cat([history.double().T, tokens.double()])                      # [W-1+n, D]
    outputs = []
    for t in range(tokens.shape[0]):
        y = torch.zeros(tokens.shape[1], dtype=torch.float64) if bias is None else bias.double()
        for j in range(W):
            y = y + weight[:, j].double() * seq[t + j]
        outputs.append(_activate(y, activation))
    return torch.stack(outputs) if outputs else torch.zeros(0, tokens.shape[1], dtype=torch.float64)


def conv_update(x, conv_state, weight, bias, query_start_loc, state_indices,
                activation="silu", out=None, parent=None):
    """Returns (out, conv_state) as conv update must leave them (float64 out,
    conv_state in its dtype). Per request: the first min(L, T) tokens are
    convolved and shifted into the history; tokens past T and tokens of null
    rows get zeros. `out`, if given, supplies the tokens outside every window.
    With `parent`, each node convolves its path's inputs after the history."""
    W = weight.shape[1]
    T = conv_state.shape[-1] - (W - 1) + 1
    result = (torch.full(x.shape, float("nan"), dtype=torch.float64) if out is None
              else out.double().clone())
    new_state = conv_state.clone()
    for b in range(state_indices.shape[0]):
        bos, eos = int(query_start_loc[b]), int(query_start_loc[b + 1])
        block = int(state_indices[b])
        for t in range(max(eos - bos, 0)):
            result[bos + t] = 0.0
        processed = min(max(eos - bos, 0), T)
        if not _valid(block, conv_state.shape[0]) or processed == 0:
            continue
        history = conv_state[block, :, :W - 1]
        tokens = x[bos:bos + processed]
        if parent is None:
            result[bos:bos + processed] = causal_conv(history, tokens, weight, bias, activation)
        else:
            for t in range(processed):
                path = tree_path(parent[bos:bos + processed], t)
                result[bos + t] = causal_conv(history, tokens[path], weight, bias,
                                              activation)[-1]
        new_state[block, :, :W - 2 + processed] = torch.cat(
            [history[:, 1:], tokens.T.to(conv_state.dtype)], dim=1)
    return result, new_state


def conv_verify(x, conv_state, conv_weight, conv_bias, g, beta, A_log, dt_bias, state,
                correction, key_gate, query_start_loc, state_indices, activation="silu",
                lower_bound=None, scale=None, out=None, pending=None, spec_len=None,
                parent=None):
    """Returns (out, conv_state, correction, key_gate) as conv_verify must
    leave them: conv_update's outputs, rounded to x's dtype, are verify's
    q | k | v (H K, H K and H V channels)."""
    H, K, V = g.shape[1], g.shape[2], state.shape[2]
    convolved, new_conv_state = conv_update(x, conv_state, conv_weight, conv_bias,
                                            query_start_loc, state_indices, activation,
                                            parent=parent)
    convolved = convolved.nan_to_num().to(x.dtype)  # tokens outside every window: unread
    q, k, v = (part.unflatten(-1, (H, -1))
               for part in convolved.split([H * K, H * K, H * V], dim=-1))
    result, correction, key_gate = verify(q, k, v, g, beta, A_log, dt_bias, state, correction,
                                          key_gate, query_start_loc, state_indices,
                                          lower_bound, scale, out, pending, spec_len, parent)
    return result, new_conv_state, correction, key_gate
