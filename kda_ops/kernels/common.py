"""Device functions shared by the kernels: waiting on a programmatically
launched predecessor, L2 prefetch, the KDA gate, the closed form's token
linking, the deferred schedule's pending records, and the commit plans. The launch policy is in dispatch.py."""

import triton
import triton.language as tl
from triton import knobs

from ..constants import NULL_BLOCK as NULL_BLOCK_INDEX

# Constexprs, because @triton.jit code may read no other kind of global.
NULL_BLOCK = tl.constexpr(NULL_BLOCK_INDEX)
# Whether the kernels run in Triton's CPU interpreter, read as triton.jit reads
# it when it wraps them: there no inline PTX runs.
INTERPRETED = tl.constexpr(knobs.runtime.interpret)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """First in every kernel, before any load or store and outside any branch:
    waits until the previous kernel has finished and its writes are visible,
    then lets the next one start launching. Every program waits, so a kernel
    never finishes before the one it follows, and a kernel two back is always
    done: no load may move above this, except one whose value only picks the
    lines of a prefetch_to_l2 (a stale value then wastes a prefetch)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_to_l2(ptrs):
    """Asks the L2 for the lines at `ptrs` (one pointer per line is enough,
    each must address memory of a kernel argument): a hint that returns no
    data and holds no register, so a program can start a tile's DRAM traffic
    before it can use the tile. The L2 is where global memory is coherent, so
    a later load can never read stale data through it. Inline PTX: nothing
    in Triton's interpreter."""
    if not INTERPRETED:
        # No backslash anywhere in a kernel's source: Inductor copies it into a
        # string literal, where an escape such as a newline broke the module.
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_block(index_at, num_blocks):
    """Before wait_for_previous_kernel: the block index at `index_at` for
    prefetch_block_rows, clamped into [0, num_blocks). A kernel before this
    one may be writing that index: a stale value costs a prefetch of the wrong
    lines, never a wrong value, and clamped it stays inside the buffers."""
    return tl.minimum(tl.maximum(tl.load(index_at).to(tl.int64), 0), num_blocks - 1)


@triton.jit
def prefetch_block_rows(head_base, stride_blk, block, num_blocks, rows, stride_row, lines):
    """Before wait_for_previous_kernel: asks the L2 for `rows` of block `block`
    (from prefetch_block), each row's lines at element offsets `lines` (one
    per 128 bytes)."""
    if num_blocks > 0:
        prefetch_to_l2(head_base + block * stride_blk + rows[:, None] * stride_row
                       + lines[None, :])


@triton.jit
def line_starts(first, size, stride, BLOCK: tl.constexpr):
    """Offsets of the 32-element lines of elements [first, first + BLOCK) of a
    `size`-element row, kept inside the row (a line is 128 bytes in fp32; in
    16-bit types every line is asked for twice)."""
    return tl.minimum(first + tl.arange(0, (BLOCK + 31) // 32) * 32, size - 1) * stride


@triton.jit
def kda_gate(raw_g, dt_bias, A, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Per-channel log decay (<= 0) from the raw gate, docs/semantics.md#2-the-recurrence."""
    x = raw_g + dt_bias
    if USE_LOWER_BOUND:
        return lower_bound * tl.sigmoid(A * x)
    return -A * softplus(x)


@triton.jit
def softplus(x):
    """log(1 + e^x), x for x > 20, to float32 rounding for every x: with
    e = e^-|x|, max(x, 0) + log1p(e), where log1p(e) = log(u) e / (u - 1) with
    u = 1 + e rounded (a plain log(1 + e^x) loses ~1e-7 / e^x relatively:
    1e-4 at x = -7, where KDA's dt_bias starts)."""
    e = tl.exp(-tl.abs(x))
    u = 1.0 + e
    exact = u == 1.0  # e below half an ulp of 1: log1p(e) = e
    log1p_e = tl.where(exact, e, tl.log(u) * (e / tl.where(exact, 1.0, u - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p_e)


@triton.jit
def l2_normalize(x, scale):
    return x * (tl.rsqrt(tl.sum(x * x, axis=-1, keep_dims=True) + 1e-6) * scale)


@triton.jit
def load_window(k_ptr, g_ptr, q_ptr, tokens, h, offs_k, load_mask, tile_mask, stride_k_tok,
                stride_k_head, stride_k_dim, stride_g_tok, stride_g_head, stride_g_dim,
                stride_q_tok, stride_q_head, stride_q_dim, CUT: tl.constexpr):
    """A window's raw key, gate and query tiles `[BT, BK]` (row t: token
    `tokens[t]`, zero outside `tile_mask`). With CUT, the loads use
    `load_mask`, a superset of `tile_mask` that does not depend on the
    deferred schedule's pending count, so they need not wait for that load;
    what lies outside `tile_mask` is zeroed after."""
    raw_k = tl.load(k_ptr + tokens * stride_k_tok + h * stride_k_head
                    + offs_k[None, :] * stride_k_dim, mask=load_mask, other=0.0)
    raw_g = tl.load(g_ptr + tokens * stride_g_tok + h * stride_g_head
                    + offs_k[None, :] * stride_g_dim, mask=load_mask, other=0.0)
    raw_q = tl.load(q_ptr + tokens * stride_q_tok + h * stride_q_head
                    + offs_k[None, :] * stride_q_dim, mask=load_mask, other=0.0)
    if CUT:  # tokens past the records' room may hold anything, NaN included
        raw_k = tl.where(tile_mask, raw_k, 0.0)
        raw_g = tl.where(tile_mask, raw_g, 0.0)
        raw_q = tl.where(tile_mask, raw_q, 0.0)
    return raw_k, raw_g, raw_q


@triton.jit
def window_vectors(raw_k, raw_g, raw_q, dt_bias, A, lower_bound, scale,
                   USE_LOWER_BOUND: tl.constexpr):
    """The normalised keys and queries and the per-channel decays of a window's
    raw tiles, in fp32."""
    keys = l2_normalize(raw_k.to(tl.float32), 1.0)
    queries = l2_normalize(raw_q.to(tl.float32), scale)
    decays = tl.exp(kda_gate(raw_g.to(tl.float32), dt_bias[None, :], A, lower_bound,
                             USE_LOWER_BOUND))
    return keys, queries, decays


@triton.jit
def pending_count(pending_at, valid, RECORDS: tl.constexpr):
    """The records of a block not yet folded into its checkpoint (the count at
    `pending_at`, read where `valid`), clamped to [0, RECORDS]. For plans
    only: a kernel whose stores the count addresses loads it in its body
    (see commit_plan_row)."""
    count = tl.load(pending_at, mask=valid, other=0).to(tl.int64)
    return tl.minimum(tl.maximum(count, 0), RECORDS)


@triton.jit
def window_after_records(count, window, valid, SPEC_LEN: tl.constexpr, RECORDS: tl.constexpr):
    """(first record position, tokens processed) of a window recorded after
    `count` pending records (clamped to [0, RECORDS]): at most T tokens and the
    records' room; none in a null row, whose tokens get zero outputs."""
    first = tl.minimum(tl.maximum(count, 0), RECORDS)
    return first, tl.where(valid, tl.minimum(tl.minimum(window, SPEC_LEN), RECORDS - first), 0)


@triton.jit
def tree_parents(parent_ptr, stride_parent, bos, nodes, processed):
    """The window parents of `nodes` (window-relative, a vector): -1 for a
    root, a node past `processed`, and a parent outside 0..node-1, which
    makes the node start from the checkpoint (docs/semantics.md#13-tree-drafts)."""
    live = (nodes >= 0) & (nodes < processed)
    parents = tl.load(parent_ptr + (bos + tl.where(live, nodes, 0)) * stride_parent, mask=live,
                      other=-1).to(tl.int64)
    return tl.where((parents >= 0) & (parents < nodes), parents, -1)


@triton.jit
def path_position(path_row, stride_path_col, i, last_node, TREE: tl.constexpr):
    """The record position of a commit's i-th folded token: i in a chain; in a
    tree entry i of the accepted path at `path_row`, clamped into the window's
    nodes 0..last_node (docs/semantics.md#13-tree-drafts)."""
    position = i
    if TREE:  # one return: Triton (3.6, 3.9) types every return, even in a branch not taken
        entry = tl.load(path_row + i * stride_path_col).to(tl.int64)
        position = tl.minimum(tl.maximum(entry, 0), last_node)
    return position


@triton.jit
def tree_window_terms(keys, queries, decays, scratch, row_stride, decay_offset, parent_ptr,
                      stride_parent, bos, processed, steps, offs_k, mask_k,
                      SPEC_LEN: tl.constexpr):
    """A tree window's closed-form terms: (E_t k_t, E_t q_t, A, B) as the
    chain's (A[t, s] at [s, t], B likewise, see verify._closed_form_tile), with
    E_t the decay product along node t's path and the couplings nonzero only
    for s on that path. Each node walks up its ancestors at once: the carried
    key k_t D_t ... meets ancestor a, gives A[t, a] = k_a . carried and
    takes a's decay, so that after the root it is E_t k_t; no per-node state
    and no division by decay products (they may underflow). The ancestors'
    keys and decays are gathered from rows the caller has written: node n's
    at `scratch + n * row_stride` (+ `decay_offset` for the decay)."""
    BT: tl.constexpr = keys.shape[0]
    carried_keys = keys * decays
    carried_queries = queries * decays
    key_coupling = tl.zeros([BT, BT], dtype=tl.float32)
    own = tl.sum(keys * queries, axis=1)
    query_coupling = tl.where(steps[:, None] == steps[None, :], own[None, :], 0.0)
    ancestor = tree_parents(parent_ptr, stride_parent, bos, steps, processed)
    for _ in tl.static_range(SPEC_LEN - 1):  # the deepest node has SPEC_LEN - 1 ancestors
        on_path = ancestor >= 0
        rows = scratch + tl.where(on_path, ancestor, 0)[:, None] * row_stride + offs_k[None, :]
        gathered = on_path[:, None] & mask_k[None, :]
        ancestor_key = tl.load(rows, mask=gathered, other=0.0)
        ancestor_decay = tl.load(rows + decay_offset, mask=gathered, other=1.0)
        at_ancestor = (steps[:, None] == ancestor[None, :]) & on_path[None, :]
        key_coupling = tl.where(at_ancestor,
                                tl.sum(ancestor_key * carried_keys, axis=1)[None, :],
                                key_coupling)
        query_coupling = tl.where(at_ancestor,
                                  tl.sum(ancestor_key * carried_queries, axis=1)[None, :],
                                  query_coupling)
        carried_keys *= ancestor_decay
        carried_queries *= ancestor_decay
        ancestor = tree_parents(parent_ptr, stride_parent, bos, ancestor, processed)
    return carried_keys, carried_queries, key_coupling, query_coupling


@triton.jit
def pending_records(kg_head, stride_kg_tok, stride_kg_dim, pending, dt_bias, A, lower_bound,
                    offs_k, mask_k, K: tl.constexpr, BR: tl.constexpr,
                    USE_LOWER_BOUND: tl.constexpr):
    """The first `pending` records of a (block, head) as `[BR, BK]` tiles: the
    normalised keys (zero past `pending`) and the decays (one past `pending`)."""
    records = tl.arange(0, BR)
    held = (records < pending)[:, None] & mask_k[None, :]
    rows = kg_head + records[:, None] * stride_kg_tok + offs_k[None, :] * stride_kg_dim
    keys = l2_normalize(tl.load(rows, mask=held, other=0.0).to(tl.float32), 1.0)
    gates = tl.load(rows + K * stride_kg_dim, mask=held, other=0.0).to(tl.float32)
    decays = tl.where(held, tl.exp(kda_gate(gates, dt_bias[None, :], A, lower_bound,
                                            USE_LOWER_BOUND)), 1.0)
    return keys, decays


@triton.jit
def _record(kg_head, j, stride_kg_tok, stride_kg_dim, offs_k, K: tl.constexpr):
    """Record j's raw key and gate (zero for j < 0)."""
    live = live_range(offs_k, K, j >= 0)
    row = kg_head + tl.maximum(j, 0) * stride_kg_tok + offs_k * stride_kg_dim
    return (tl.load(row, mask=live, other=0.0),
            tl.load(row + K * stride_kg_dim, mask=live, other=0.0))


@triton.jit
def pending_terms(key_terms, query_terms, steps, kg_head, stride_kg_tok, stride_kg_dim, pending,
                  dt_bias, A, lower_bound, offs_k, mask_k, coef_at, K: tl.constexpr,
                  BK: tl.constexpr, BR: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                  PREFETCHED: tl.constexpr):
    """The checkpoint terms of a window (rows t of `[BT, BK]` tiles: E_t k_t
    and E_t q_t) moved onto a checkpoint with `pending` records not yet folded
    in. With the records' normalised keys k_j, decays d_j and corrections u_j,
    the folded state is S = S0 D + sum_j u_j (k_j d_{j+1} ... d_{p-1})^T with
    D = d_0 ... d_{p-1}, so S x = S0 (D x) + sum_j u_j c_j(x): the state is
    never built, and the programs that stream S0 add the records' corrections
    times the coefficients. Walks the records from the last, decaying the
    terms as it goes (the decays multiplied in one by one, as the commit
    folds); stores c_j of token t's key term at `coef_at + j * 2 BT + t` and of
    its query term at `+ BT + t` for j < pending (readers mask the rest) and
    returns the terms times D. The records' lines are asked of the L2 first
    (unless PREFETCHED: the kernel asked for them before its wait) and each
    record is loaded one step ahead, so a record's latency overlaps the step
    before instead of adding to it. The walk is bound by its arithmetic: four
    records loaded at once, their decay products a scan, took 17-52% longer
    at 4 and 8 pending (H100: window terms at B = 16 and 64, closed form at 1)."""
    BT: tl.constexpr = key_terms.shape[0]
    if not PREFETCHED:
        if pending > 0:  # the later records' loads then find their lines in the L2
            records = tl.minimum(tl.arange(0, BR), pending - 1)
            prefetch_to_l2(kg_head + records[:, None] * stride_kg_tok
                           + line_starts(0, 2 * K, stride_kg_dim, 2 * BK)[None, :])
    raw_key, raw_gate = _record(kg_head, pending - 1, stride_kg_tok, stride_kg_dim, offs_k, K)
    for i in range(0, pending):
        j = pending - 1 - i
        key = l2_normalize(raw_key.to(tl.float32), 1.0)
        decay = tl.where(mask_k, tl.exp(kda_gate(raw_gate.to(tl.float32), dt_bias, A,
                                                 lower_bound, USE_LOWER_BOUND)), 1.0)
        raw_key, raw_gate = _record(kg_head, j - 1, stride_kg_tok, stride_kg_dim, offs_k, K)
        coef_row = coef_at + j * (2 * BT) + steps
        tl.store(coef_row, tl.sum(key_terms * key[None, :], axis=1))
        tl.store(coef_row + BT, tl.sum(query_terms * key[None, :], axis=1))
        key_terms = key_terms * decay[None, :]
        query_terms = query_terms * decay[None, :]
    return key_terms, query_terms


@triton.jit
def live_range(offs, size, live):
    """`(offs < size) & live` for a scalar `live`, written as one comparison: the
    Triton 3.9 interpreter mis-broadcasts a scalar bool and-ed with a vector."""
    return offs < tl.where(live, size, 0)


@triton.jit
def link_tokens(residuals, query_dots, outs, corrections, processed, steps, coupling_at, beta_at,
                 stride_beta_tok, BT: tl.constexpr, SPEC_LEN: tl.constexpr):
    """The closed form's outputs from each token's residual v_t - S0 (E_t k_t)
    and query product S0 (E_t q_t), through the coupling (see verify._closed_form_tile),
    into the `[BV, BT]` output and correction tiles."""
    us = ()
    for t in tl.static_range(SPEC_LEN):
        beta = tl.load(beta_at + t * stride_beta_tok, mask=t < processed, other=0.0)
        u = residuals[t]
        for s in tl.static_range(t):
            u -= tl.load(coupling_at + s * BT + t) * us[s]
        u *= tl.sigmoid(beta.to(tl.float32))
        us = us + (u,)
        out = query_dots[t]
        for s in tl.static_range(t + 1):
            out += tl.load(coupling_at + BT * BT + s * BT + t) * us[s]
        is_t = steps[None, :] == t
        outs = tl.where(is_t, out[:, None], outs)
        corrections = tl.where(is_t, u[:, None], corrections)
    return outs, corrections


@triton.jit
def block_is_valid(block, num_blocks):
    return (block > NULL_BLOCK) & (block < num_blocks)


@triton.jit
def fits_int32(index):
    return (index >= -2**31) & (index < 2**31)


@triton.jit
def int32_or_null(index):
    """An int64 block index as stored in an int32 output: one outside int32,
    null for every cache, becomes NULL_BLOCK instead of wrapping into a real block."""
    return tl.where(fits_int32(index), index, NULL_BLOCK).to(tl.int32)


@triton.jit
def commit_plan_row(
    b,
    accepted_ptr, stride_accepted,
    request_ptr, stride_request,
    state_indices_ptr, stride_state_indices,
    query_start_ptr, stride_query_start,
    computed_ptr, stride_computed,
    num_rows, bt_cols, block_size,
    SPEC_LEN: tl.constexpr,
    HAS_REQUEST_INDICES: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """The commit plan (docs/semantics.md#4-the-commit-plan) of request `b`, up
    to the block-table lookups: (commit_len, row, final column, boundary
    column, recovery), int64. A null plan (source index
    <= NULL_BLOCK, row outside `[0, num_rows)`, nothing accepted) has commit_len
    0 and recovery 0; the boundary column is -1 when the window crosses no block
    boundary. `num_computed_tokens` is clamped at 0 and columns at the table
    width, so no input can index outside the table.

    The caller loads the final and boundary blocks from the table in its own
    body: torch (`triton_kernel_wrap`, used by torch.compile) finds the tensors a
    kernel writes by walking each store address back to the kernel arguments; the
    walk stops at a load, but through a call it takes every pointer the callee
    receives, so a store addressed by a block returned from here would mark the
    metadata tensors as written (copied back as mutated inputs, and CUDA graphs
    skipped under reduce-overhead).
    """
    window, row, row_ok, accepted = _request_row(
        b, query_start_ptr, stride_query_start, request_ptr, stride_request, accepted_ptr,
        stride_accepted, num_rows, HAS_REQUEST_INDICES)
    commit = tl.minimum(tl.minimum(tl.maximum(accepted, 0), window), SPEC_LEN)
    source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    commit = tl.where((source <= NULL_BLOCK) | (fits_int32(source) == 0) | (row_ok == 0), 0,
                      commit)
    final_col = tl.zeros_like(row)
    boundary_col = final_col - 1
    recovery = tl.zeros_like(row)
    if ALIGN:
        computed = _computed_tokens(computed_ptr, row, row_ok, stride_computed)
        final_col, boundary_col, recovery = _align_columns(computed, commit, block_size, bt_cols)
        recovery = tl.where(commit > 0, recovery, 0)
    return commit, row, final_col, boundary_col, recovery


@triton.jit
def _request_row(b, query_start_ptr, stride_query_start, request_ptr, stride_request,
                 accepted_ptr, stride_accepted, num_rows, HAS_REQUEST_INDICES: tl.constexpr):
    """Request `b`'s window length, its row of the accepted counts and block
    table (0 where outside `[0, num_rows)`), whether that row exists, and its
    raw accepted count (0 without a row), int64."""
    bos = tl.load(query_start_ptr + b * stride_query_start).to(tl.int64)
    eos = tl.load(query_start_ptr + (b + 1) * stride_query_start).to(tl.int64)
    window = tl.maximum(eos - bos, 0)
    if HAS_REQUEST_INDICES:
        row = tl.load(request_ptr + b * stride_request).to(tl.int64)
    else:
        row = b.to(tl.int64)
    row_ok = (row >= 0) & (row < num_rows)
    row = tl.where(row_ok, row, 0)
    accepted = tl.load(accepted_ptr + row * stride_accepted, mask=row_ok, other=0).to(tl.int64)
    return window, row, row_ok, accepted


@triton.jit
def _computed_tokens(computed_ptr, row, row_ok, stride_computed):
    """A row's `num_computed_tokens`, clamped at 0; masked, since with no table
    rows even row 0 is outside the tensor."""
    return tl.maximum(tl.load(computed_ptr + row * stride_computed, mask=row_ok,
                              other=0).to(tl.int64), 0)


@triton.jit
def _align_columns(start, count, block_size, bt_cols):
    """Align mode's plan of `count` tokens folded from token position `start`:
    the final column, the boundary column (-1 where the fold crosses no block
    boundary) and the recovery (tokens up to the next boundary), columns
    clamped to the table width."""
    final_col = tl.minimum(tl.maximum(start + count - 1, 0) // block_size, bt_cols - 1)
    next_boundary = (start // block_size + 1) * block_size
    boundary_col = tl.where(start + count >= next_boundary,
                            tl.minimum(next_boundary // block_size - 1, bt_cols - 1), -1)
    return final_col, boundary_col, next_boundary - start


@triton.jit
def deferred_plan_row(
    b,
    accepted_ptr, stride_accepted,
    request_ptr, stride_request,
    state_indices_ptr, stride_state_indices,
    query_start_ptr, stride_query_start,
    computed_ptr, stride_computed,
    pending_ptr, stride_pending,
    num_rows, num_blocks, bt_cols, block_size,
    RECORDS: tl.constexpr,
    HAS_REQUEST_INDICES: tl.constexpr,
    ALIGN: tl.constexpr,
    COUNT_BY_REQUEST: tl.constexpr = False,
):
    """The deferred commit's plan (docs/semantics.md#11-the-deferred-schedule)
    of request `b` for the layer whose pending counts start at `pending_ptr`
    (per block; with COUNT_BY_REQUEST per request, as the commit's copy of
    them holds them), up to the block-table lookups (see commit_plan_row for
    why they stay in the caller): (accepted c, total, row, final column,
    boundary column, recovery, pending before), int64. Align mode plans from
    the checkpoint's position, `num_computed_tokens - pending` clamped at 0;
    the boundary column is -1 where the fold crosses no block boundary."""
    window, row, row_ok, accepted = _request_row(
        b, query_start_ptr, stride_query_start, request_ptr, stride_request, accepted_ptr,
        stride_accepted, num_rows, HAS_REQUEST_INDICES)
    source = tl.load(state_indices_ptr + b * stride_state_indices).to(tl.int64)
    valid = block_is_valid(source, num_blocks)
    if COUNT_BY_REQUEST:
        first = pending_count(pending_ptr + b * stride_pending, valid, RECORDS)
    else:
        first = pending_count(pending_ptr + tl.where(valid, source, 0) * stride_pending, valid,
                              RECORDS)
    ok = row_ok & valid
    accepted_now = tl.where(ok, tl.minimum(tl.minimum(tl.maximum(accepted, 0), window),
                                           RECORDS - first), 0)
    total = tl.where(ok, first + accepted_now, 0)
    final_col = tl.zeros_like(row)
    boundary_col = final_col - 1
    recovery = tl.zeros_like(row)
    if ALIGN:
        # The checkpoint holds the tokens before `start`.
        start = tl.maximum(_computed_tokens(computed_ptr, row, row_ok, stride_computed) - first,
                           0)
        final_col, boundary_col, recovery = _align_columns(start, total, block_size, bt_cols)
    return accepted_now, total, row, final_col, boundary_col, recovery, first
