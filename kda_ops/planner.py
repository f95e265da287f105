"""Batch planning and CUDA-graph staging for engines that call kda_ops.

`plan_batch` splits a mixed batch, described by plain tensors, into the groups
that take different paths, and builds what `conv_update`, `verify` and `commit`
need for the speculative group. It runs on the host before the forward pass,
reads only CPU tensors and never waits for the device: every device tensor it
returns is a slice of an input or comes from asynchronous copies and kernels.

`SpecDecodeGraphBuffers` owns the fixed-size index buffers that a captured CUDA
graph reads, and refills them each step with `stage_spec_decode_metadata`.

See docs/integration.md for the step-by-step mapping of an engine's metadata.
"""

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from .api import aligned_state_indices, stage_spec_decode_metadata
from .constants import NULL_BLOCK
from ._validation import INDEX_DTYPES, fail, check_tensor

CACHE_MODES = ("none", "align")


@dataclass
class RequestGroup:
    """Requests of one path, in batch order, with their tokens packed in order.

    A group's tokens are `x[token_indices]` for a packed batch input `x`, and
    `query_start_loc` indexes that packed selection, so the group can be passed
    to a varlen kernel on its own.
    """

    rows_cpu: Tensor
    """int64 `[n]` on the CPU: the group's rows of the batch, ascending."""
    request_indices: Optional[Tensor]
    """int32 `[n]` on the device: the same rows, or None when they are exactly
    `0..n-1` and the batch's `query_start_loc` starts at 0 (the convention of
    `commit`'s `request_indices`)."""
    num_tokens: int
    token_indices: Tensor
    """int32 `[num_tokens]` on the device: packed positions of the group's tokens."""
    query_start_loc: Tensor
    """`[n+1]` on the device, starting at 0, over the group's packed tokens."""
    query_start_loc_cpu: Tensor
    """int32 `[n+1]`: the same on the CPU."""
    state_indices: Tensor
    """`[n]` on the device: the block each request's state is read from. For
    the speculative group in align mode this is the block of the window's
    first token, which may first need `BatchPlan.copy_checkpoints`."""
    final_state_indices: Optional[Tensor]
    """`[n]` on the device: the block where the state after this step's tokens
    belongs (equal to `state_indices` unless in align mode). None for the
    speculative group, whose destination `commit` derives from the accepted count."""

    @property
    def num_requests(self) -> int:
        return self.rows_cpu.numel()


@dataclass
class AlignArguments:
    """The align-mode arguments of `kda_ops.commit`
    (docs/semantics.md#4-the-commit-plan), rows indexed by batch row."""

    block_table: Tensor
    num_computed_tokens: Tensor
    """int32 `[R]` on the device."""
    block_size: int


@dataclass
class BlockCopies:
    """State blocks to copy before the step: `cache[destinations] = cache[sources]`."""

    sources: Tensor
    destinations: Tensor

    @property
    def num_copies(self) -> int:
        return self.sources.numel()


@dataclass
class BatchPlan:
    """How one batch maps onto kda_ops.

    - `spec`: every active decode that runs speculatively (even with zero
      drafts, so the extended conv window convention holds): `conv_update`,
      `verify` per layer, then `commit`, with `spec.query_start_loc` and
      `spec.state_indices`.
    - `decode`: active, non-speculative one-token decodes (the engine's plain
      decode path).
    - `prefill`: every other active request (prefilling, or a non-speculative
      window of more than one token): the engine's prefill path.

    Zero-length rows (CUDA-graph padding) belong to no group.
    """

    spec: RequestGroup
    decode: RequestGroup
    prefill: RequestGroup
    spec_len: int
    """T, the most tokens a speculative window holds."""
    align: Optional[AlignArguments]
    """None in cache mode "none"."""
    checkpoint_copies: BlockCopies
    """Align mode: speculative requests whose checkpoint fills its block
    (`num_computed_tokens % block_size == 0`) work in the next block, because
    `conv_update` shifts the history of the block it works in and a full block
    must keep its boundary state for prefix caching. Empty otherwise."""
    spec_parent: Optional[Tensor] = None
    """Tree drafts: the speculative group's window parents `[spec.num_tokens]`
    (`verify` and `conv_update`'s `parent`); None for chains."""

    def copy_checkpoints(self, cache: Tensor, block_dim: int = 0) -> None:
        """Copies the moved checkpoints within one cache (recurrent state, conv
        state; blocks along `block_dim`, 1 for a stacked `[L, N, ...]` cache).
        Call it for every such cache before the step's `conv_update`/`verify`.
        Runs on the device without a host sync; nothing to do when no
        checkpoint moved."""
        copies = self.checkpoint_copies
        if copies.num_copies:
            cache.index_copy_(block_dim, copies.destinations.long(),
                              cache.index_select(block_dim, copies.sources))

    def spec_accepted(self, num_accepted_tokens: Tensor) -> Tensor:
        """Per-row accepted counts `[R]` (the sampler's output) in the order of
        the speculative group `[n]`."""
        rows = self.spec.request_indices
        if rows is None:
            return num_accepted_tokens[:self.spec.num_requests]
        return num_accepted_tokens.index_select(0, rows)

    def commit_arguments(self, num_accepted_tokens: Tensor,
                         accepted_path: Optional[Tensor] = None) -> dict:
        """Keyword arguments of `kda_ops.commit` except the cache buffers and
        gate parameters, for per-row accepted counts `[R]` (and, for trees,
        per-row accepted paths `[R, T]`)."""
        align = self.align
        tree = {} if accepted_path is None else dict(accepted_path=accepted_path)
        return dict(**tree,
            num_accepted_tokens=num_accepted_tokens,
            state_indices=self.spec.state_indices,
            query_start_loc=self.spec.query_start_loc,
            request_indices=self.spec.request_indices,
            block_table=None if align is None else align.block_table,
            num_computed_tokens=None if align is None else align.num_computed_tokens,
            block_size=None if align is None else align.block_size,
        )


def plan_batch(
    query_start_loc_cpu: Tensor,
    query_start_loc: Tensor,
    is_prefilling: Tensor,
    block_table: Tensor,
    *,
    spec_len: int,
    num_draft_tokens: Optional[Tensor] = None,
    num_computed_tokens: Optional[Tensor] = None,
    cache_mode: str = "none",
    block_size: Optional[int] = None,
    parent: Optional[Tensor] = None,
) -> BatchPlan:
    """Splits a batch of R rows into speculative, decode and prefill groups.

    Args:
        query_start_loc_cpu: `[R+1]` CPU: packed token offsets of each row.
        query_start_loc: the same on the device (sliced, never read, when a
            group is a prefix of the batch).
        is_prefilling: `[R]` CPU bool: the row is still in its prompt.
        block_table: `[R, W]` on the device: each row's state blocks.
        spec_len: T; speculative windows longer than T raise ValueError.
        num_draft_tokens: `[R]` CPU int: draft tokens of each row, -1 for a row
            without speculative decoding; None when no row decodes speculatively.
        num_computed_tokens: `[R]` CPU int (align mode): tokens folded into each
            row's state before this step. The host needs them to decide which
            checkpoints move; the sequence length after the step is
            `num_computed_tokens + query length`.
        cache_mode: "none" (each row's state lives in `block_table[r, 0]`) or
            "align" (the state after `n` tokens lives in the block holding token
            `n - 1`, so every full block keeps the state at its boundary).
        block_size: tokens per block (align mode), at least `spec_len - 1`:
            commit writes one boundary state per request, so a window must not
            fill a block and complete another before its last one.
        parent: `[num_tokens]` on the device, packed like the batch's tokens:
            tree drafts' window parents (docs/semantics.md#13-tree-drafts; see
            `parents_from_lists`, `parents_from_retrieve`); the plan's
            `spec_parent` holds the speculative group's.
    """
    device = _check_plan_inputs(query_start_loc_cpu, query_start_loc, is_prefilling,
                                block_table, spec_len, num_draft_tokens,
                                num_computed_tokens, cache_mode, block_size)
    starts = query_start_loc_cpu[:-1].long()
    query_lens = query_start_loc_cpu[1:].long() - starts
    if (query_lens < 0).any():
        fail("query_start_loc_cpu", "must be non-decreasing")
    active = query_lens > 0
    drafting = (torch.zeros_like(active) if num_draft_tokens is None
                else num_draft_tokens >= 0)
    is_spec = active & drafting & ~is_prefilling
    too_long = is_spec & (query_lens > spec_len)
    if too_long.any():
        rows = too_long.nonzero()[:, 0]
        raise ValueError(f"kda_ops: speculative windows hold at most spec_len={spec_len} "
                         f"tokens; rows {rows.tolist()} have {query_lens[rows].tolist()}")
    is_decode = active & ~is_spec & ~is_prefilling & (query_lens == 1)
    is_prefill = active & ~is_spec & ~is_decode

    upload = _Upload()
    align = cache_mode == "align"
    if align:
        computed = num_computed_tokens.long()
        last_col = (computed + query_lens - 1).clamp(min=0) // block_size
        short = active & (last_col >= block_table.shape[1])
        if short.any():
            fail("block_table", f"has {block_table.shape[1]} columns, too few for rows "
                  f"{short.nonzero()[:, 0].tolist()} at block_size={block_size}")
        # A checkpoint that fills its block moves on with the next token.
        moves = is_spec & (computed > 0) & (computed % block_size == 0)
        align_handles = (upload.add(computed), upload.add(computed + query_lens),
                         upload.add(moves.nonzero()[:, 0]))
    layouts = [_GroupLayout(mask.nonzero()[:, 0], starts, query_lens,
                            bool(query_start_loc_cpu[0] == 0), upload)
               for mask in (is_spec, is_decode, is_prefill)]
    uploaded = upload.run(device)

    checkpoint_blocks = work_blocks = final_blocks = block_table[:, 0]
    align_arguments = None
    no_blocks = torch.zeros(0, dtype=torch.int32, device=device)
    copies = BlockCopies(no_blocks, no_blocks)
    if align:
        computed_dev, seq_lens_dev, moved_rows = (uploaded[h] for h in align_handles)
        align_arguments = AlignArguments(block_table, computed_dev, block_size)

        def block_of_token(count):  # the block holding token `count - 1`
            return aligned_state_indices(block_table, count, block_size, 1)[:, 0]

        checkpoint_blocks = block_of_token(computed_dev)
        work_blocks = block_of_token(computed_dev + 1)
        final_blocks = block_of_token(seq_lens_dev)
        copies = BlockCopies(checkpoint_blocks.index_select(0, moved_rows),
                             work_blocks.index_select(0, moved_rows))

    spec, decode, prefill = layouts
    spec_group = spec.build(uploaded, query_start_loc, work_blocks, None)
    spec_parent = None
    if parent is not None:
        check_tensor("parent", parent, shape=(int(query_start_loc_cpu[-1]),),
                     dtypes=INDEX_DTYPES, device=device)
        spec_parent = (parent[int(query_start_loc_cpu[0]):][:spec_group.num_tokens]
                       if spec.is_prefix else parent.index_select(0, spec_group.token_indices))
    return BatchPlan(
        spec=spec_group,
        decode=decode.build(uploaded, query_start_loc, checkpoint_blocks, final_blocks),
        prefill=prefill.build(uploaded, query_start_loc, checkpoint_blocks, final_blocks),
        spec_len=spec_len, align=align_arguments, checkpoint_copies=copies,
        spec_parent=spec_parent)


class _Upload:
    """Collects CPU integer tensors and copies them to the device as int32 in
    one asynchronous transfer."""

    def __init__(self):
        self.arrays = []

    def add(self, array: Tensor) -> int:
        self.arrays.append(array)
        return len(self.arrays) - 1

    def run(self, device) -> list:
        if not self.arrays:
            return []
        packed = torch.cat([a.to(torch.int32) for a in self.arrays])
        if device.type == "cuda":
            # Pinned memory lets the copy run asynchronously; the host does not wait.
            packed = packed.pin_memory().to(device, non_blocking=True)
        else:
            packed = packed.to(device)
        return list(packed.split([a.numel() for a in self.arrays]))


class _GroupLayout:
    """The host-side part of a RequestGroup."""

    def __init__(self, rows, starts, query_lens, batch_starts_at_zero, upload):
        self.rows = rows
        lens = query_lens[rows]
        self.query_start_loc = torch.zeros(rows.numel() + 1, dtype=torch.int32)
        self.query_start_loc[1:] = lens.cumsum(0)
        self.num_tokens = int(self.query_start_loc[-1])
        # Rows 0..n-1 of a batch packed from token 0: the batch's own tensors,
        # sliced, serve the group (no copy, and the same storage every step).
        self.is_prefix = batch_starts_at_zero and (
            rows.numel() == 0 or int(rows[-1]) == rows.numel() - 1)
        if not self.is_prefix:
            token_offsets = torch.arange(self.num_tokens) - torch.repeat_interleave(
                self.query_start_loc[:-1].long(), lens)
            token_indices = torch.repeat_interleave(starts[rows], lens) + token_offsets
            self.handles = [upload.add(a) for a in (rows, token_indices, self.query_start_loc)]

    def build(self, uploaded, query_start_loc, read_blocks, final_blocks) -> RequestGroup:
        n = self.rows.numel()
        if self.is_prefix:
            request_indices = None
            token_indices = torch.arange(self.num_tokens, dtype=torch.int32,
                                         device=read_blocks.device)
            group_start_loc = query_start_loc[:n + 1]
            state_indices = read_blocks[:n]
            final_state_indices = None if final_blocks is None else final_blocks[:n]
        else:
            request_indices, token_indices, group_start_loc = (uploaded[h] for h in self.handles)
            state_indices = read_blocks.index_select(0, request_indices)
            final_state_indices = (None if final_blocks is None
                                   else final_blocks.index_select(0, request_indices))
        return RequestGroup(self.rows, request_indices, self.num_tokens, token_indices,
                            group_start_loc, self.query_start_loc, state_indices,
                            final_state_indices)


def _check_plan_inputs(query_start_loc_cpu, query_start_loc, is_prefilling, block_table,
                       spec_len, num_draft_tokens, num_computed_tokens, cache_mode,
                       block_size) -> torch.device:
    cpu = torch.device("cpu")
    check_tensor("query_start_loc_cpu", query_start_loc_cpu, ndim=1, dtypes=INDEX_DTYPES,
                 device=cpu)
    if query_start_loc_cpu.shape[0] < 1:
        fail("query_start_loc_cpu", "must have R+1 >= 1 entries")
    rows = query_start_loc_cpu.shape[0] - 1
    check_tensor("query_start_loc", query_start_loc, shape=(rows + 1,), dtypes=INDEX_DTYPES)
    device = query_start_loc.device
    check_tensor("is_prefilling", is_prefilling, shape=(rows,), dtypes=(torch.bool,),
                 device=cpu)
    if num_draft_tokens is not None:
        check_tensor("num_draft_tokens", num_draft_tokens, shape=(rows,), dtypes=INDEX_DTYPES,
                     device=cpu)
    check_tensor("block_table", block_table, shape=(rows, None), dtypes=INDEX_DTYPES,
                 device=device)
    if block_table.shape[1] < 1:
        fail("block_table", f"must have at least one column, got shape "
              f"{tuple(block_table.shape)}")
    if isinstance(spec_len, bool) or not isinstance(spec_len, int) or spec_len < 1:
        fail("spec_len", f"must be a positive int, got {spec_len!r}")
    if cache_mode not in CACHE_MODES:
        fail("cache_mode", f"must be one of {list(CACHE_MODES)}, got {cache_mode!r}")
    if cache_mode == "align":
        if num_computed_tokens is None:
            fail("num_computed_tokens", 'is required in cache mode "align"')
        check_tensor("num_computed_tokens", num_computed_tokens, shape=(rows,),
                     dtypes=INDEX_DTYPES, device=cpu)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            fail("block_size", f'must be a positive int in cache mode "align", got '
                  f"{block_size!r}")
        # commit writes one boundary state per request: a window of T tokens
        # must not fill a block and then complete another before its last one.
        if block_size < spec_len - 1:
            fail("block_size", f'must be at least spec_len - 1 = {spec_len - 1} in cache mode '
                  f'"align" (commit writes one boundary state per request), got {block_size}')
    return device


@dataclass
class StagedSpecDecodeMetadata:
    """Views of `SpecDecodeGraphBuffers` for a captured batch of B rows: pass
    them to the captured `conv_update` / `verify` / `commit` calls."""

    state_indices: Tensor
    """`[B]` (or `[B, slots]`): real rows first, then NULL_BLOCK."""
    query_start_loc: Tensor
    """`[B+1]`: padding rows repeat the last real start (empty windows)."""
    num_accepted_tokens: Tensor
    """`[B]`: padding rows hold 1."""
    parent: Optional[Tensor] = None
    """Tree drafts (buffers made with `spec_len`): `[B * T]` window parents,
    the real tokens' first; None otherwise."""
    accepted_path: Optional[Tensor] = None
    """Tree drafts: `[B, T]` accepted paths, real rows first; the padding rows
    after them are never read (0 until a larger batch is staged)."""


class SpecDecodeGraphBuffers:
    """Fixed device buffers of the speculative group's metadata, for CUDA graphs
    captured at batch sizes up to `max_batch_size` (docs/integration.md#5-cuda-graphs).

    Capture once per batch size B with the views of `views(B)`; before each
    replay, `stage(...)` (or `stage_plan(...)`) writes the step's n <= B real
    requests into the same storage and pads rows n..B-1: NULL_BLOCK state
    (ops skip the row), an empty window, and 1 accepted token.
    """

    def __init__(self, max_batch_size: int, device, *, num_state_slots: Optional[int] = None,
                 dtype: torch.dtype = torch.int32, spec_len: Optional[int] = None):
        """`spec_len` (T) adds the buffers of tree drafts: parents and accepted paths."""
        slots = () if num_state_slots is None else (num_state_slots,)
        self.spec_len = spec_len
        self.parent = self.accepted_path = None
        if spec_len is not None:
            self.parent = torch.full((max_batch_size * spec_len,), -1, dtype=dtype, device=device)
            self.accepted_path = torch.zeros(max_batch_size, spec_len, dtype=dtype,
                                             device=device)
        self.max_batch_size = max_batch_size
        self.state_indices = torch.full((max_batch_size,) + slots, NULL_BLOCK, dtype=dtype,
                                        device=device)
        self.query_start_loc = torch.zeros(max_batch_size + 1, dtype=dtype, device=device)
        self.num_accepted_tokens = torch.ones(max_batch_size, dtype=dtype, device=device)
        # Staged when no accepted counts are known yet (before sampling).
        self._ones = torch.ones(max_batch_size, dtype=dtype, device=device)

    def views(self, batch_size: Optional[int] = None) -> StagedSpecDecodeMetadata:
        batch = self.max_batch_size if batch_size is None else batch_size
        if not 0 <= batch <= self.max_batch_size:
            fail("batch_size", f"must be in [0, {self.max_batch_size}], got {batch}")
        tree = {} if self.spec_len is None else dict(
            parent=self.parent[:batch * self.spec_len], accepted_path=self.accepted_path[:batch])
        return StagedSpecDecodeMetadata(self.state_indices[:batch],
                                        self.query_start_loc[:batch + 1],
                                        self.num_accepted_tokens[:batch], **tree)

    def stage(self, state_indices: Tensor, query_start_loc: Tensor,
              num_spec_decodes: Union[int, Tensor], batch_size: Optional[int] = None,
              num_accepted_tokens: Optional[Tensor] = None, *, parent: Optional[Tensor] = None,
              accepted_path: Optional[Tensor] = None) -> StagedSpecDecodeMetadata:
        """Writes the first `num_spec_decodes` requests into the views of
        `batch_size` rows and returns them. `num_spec_decodes` may be a device
        tensor (see `kda_ops.stage_spec_decode_metadata`), so this call can
        itself be captured. Without `num_accepted_tokens`, every row gets 1.
        Tree drafts (buffers made with `spec_len`): `parent` (the real tokens'
        window parents) and `accepted_path` (the real rows') are copied in
        first; the tokens and rows after them are outside every window or
        padding, which no op reads."""
        staged = self.views(batch_size)
        for name, given, buffer in (("parent", parent, staged.parent),
                                    ("accepted_path", accepted_path, staged.accepted_path)):
            if given is None:
                continue
            if buffer is None:
                fail(name, "needs buffers made with spec_len (SpecDecodeGraphBuffers("
                     "..., spec_len=T))")
            check_tensor(name, given, ndim=buffer.dim(), dtypes=INDEX_DTYPES,
                         device=buffer.device)
            if given.shape[0] > buffer.shape[0] or given.shape[1:] != buffer.shape[1:]:
                fail(name, f"must fit the staged {tuple(buffer.shape)}, got {tuple(given.shape)}")
            buffer[:given.shape[0]].copy_(given)
        accepted = self._ones if num_accepted_tokens is None else num_accepted_tokens
        stage_spec_decode_metadata(state_indices, query_start_loc, accepted,
                                   staged.state_indices, staged.query_start_loc,
                                   staged.num_accepted_tokens, num_spec_decodes)
        return staged

    def stage_plan(self, plan: BatchPlan, batch_size: Optional[int] = None,
                   num_accepted_tokens: Optional[Tensor] = None,
                   accepted_path: Optional[Tensor] = None) -> StagedSpecDecodeMetadata:
        """`stage` for a plan whose active rows are all speculative and come
        first (the batches a graph is captured for). `num_accepted_tokens` are
        per-row counts `[R]` and `accepted_path` per-row paths `[R, T]`, as
        `commit` takes them; the plan's `spec_parent` is staged too."""
        spec = plan.spec
        others = plan.decode.num_requests + plan.prefill.num_requests
        if others or spec.request_indices is not None:
            fail("plan", "must hold only speculative decodes, first in the batch, to be staged "
                  f"(got {plan.decode.num_requests} decodes, {plan.prefill.num_requests} "
                  "prefills)")
        batch = self.max_batch_size if batch_size is None else batch_size
        if spec.num_requests > batch:
            fail("batch_size", f"must hold the plan's {spec.num_requests} speculative requests, "
                  f"got {batch}")
        accepted = (None if num_accepted_tokens is None
                    else plan.spec_accepted(num_accepted_tokens))
        path = None if accepted_path is None else accepted_path[:spec.num_requests]
        return self.stage(spec.state_indices, spec.query_start_loc, spec.num_requests,
                          batch_size, accepted, parent=plan.spec_parent, accepted_path=path)


# ------------------------------------------------------------- tree drafts
def parents_from_lists(trees, device=None) -> Tensor:
    """Packs per-request parent lists (window-relative, the root's -1) into
    `verify`'s `parent` `[num_tokens]` int32 (docs/semantics.md#13-tree-drafts)."""
    flat = [int(p) for tree in trees for p in tree]
    return torch.tensor(flat, dtype=torch.int32, device=device)


def parents_from_retrieve(retrieve_next_token: Tensor, retrieve_next_sibling: Tensor) -> Tensor:
    """SGLang-style trees `[B, T]` (each node's first child, and its next
    sibling, window-relative; -1 for none) to `verify`'s `parent`, packed for
    windows of T nodes each: `[B * T]` int32, on their device, no host sync."""
    check_tensor("retrieve_next_token", retrieve_next_token, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("retrieve_next_sibling", retrieve_next_sibling,
                 shape=tuple(retrieve_next_token.shape), dtypes=INDEX_DTYPES,
                 device=retrieve_next_token.device)
    batch, nodes = retrieve_next_token.shape
    child, sibling = retrieve_next_token.long(), retrieve_next_sibling.long()
    node = torch.arange(nodes, device=child.device).expand(batch, nodes)
    parent = torch.full((batch, nodes + 1), -1, dtype=torch.long, device=child.device)
    # A first child's parent is its node; -1 entries land in the spare column.
    parent.scatter_(1, torch.where(child >= 0, child, nodes), node)
    younger = torch.where(sibling >= 0, sibling, nodes)
    for _ in range(nodes - 1):  # a sibling shares its elder sibling's parent
        # Out of place: the source must not alias what the scatter writes.
        parent = parent.scatter(1, younger, parent[:, :nodes])
    return parent[:, :nodes].reshape(-1).to(torch.int32)


def accepted_path_from_indices(accept_index: Tensor, query_start_loc: Tensor, *,
                               spec_len: Optional[int] = None) -> tuple:
    """SGLang-style accepted nodes `[B, P]` (packed token indices in path
    order, -1 after the last; SGLang's `accept_index` has P = draft steps + 1)
    to `commit`'s `(num_accepted_tokens [B], accepted_path [B, T])`, int32,
    window-relative, on their device. `spec_len` (T, at least P) pads the
    paths with 0 to T columns, as `commit` takes them; default P."""
    check_tensor("accept_index", accept_index, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor("query_start_loc", query_start_loc, shape=(accept_index.shape[0] + 1,),
                 dtypes=INDEX_DTYPES, device=accept_index.device)
    width = accept_index.shape[1]
    if spec_len is not None and (isinstance(spec_len, bool) or not isinstance(spec_len, int)
                                 or spec_len < width):
        fail("spec_len", f"must be an int of at least accept_index's {width} columns, got "
             f"{spec_len!r}")
    taken = accept_index >= 0
    path = torch.where(taken, accept_index.long() - query_start_loc[:-1, None].long(), 0)
    if spec_len is not None:
        path = torch.nn.functional.pad(path, (0, spec_len - width))
    return taken.sum(1).to(torch.int32), path.to(torch.int32)
