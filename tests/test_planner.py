"""Metadata ops (aligned_state_indices, stage_spec_decode_metadata), the batch
planner and the CUDA-graph buffers, against plain Python."""

import pytest
import torch
import torch._dynamo.testing

import kda_ops
from kda_ops import NULL_BLOCK, torch_impl
from kda_ops.planner import SpecDecodeGraphBuffers, plan_batch

from helpers import DEVICES, query_start_loc, requires_cuda

# "op" goes through kda_ops (the kernels on CUDA and under the interpreter);
# "torch_impl" calls the CPU path directly, so every run checks both.
IMPLS = ["op", "torch_impl"]


# --- aligned_state_indices ------------------------------------------------------

def aligned_reference(block_table, seq_lens, block_size, num_state_slots):
    rows = []
    for r in range(block_table.shape[0]):
        first = max((int(seq_lens[r]) - 1) // block_size, 0)
        rows.append([int(block_table[r, first + j]) if first + j < block_table.shape[1]
                     else NULL_BLOCK for j in range(num_state_slots)])
    return rows


def call_aligned(impl, *args):
    if impl == "op":
        return kda_ops.aligned_state_indices(*args)
    return torch_impl.aligned_state_indices(*args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_size,num_state_slots", [(1, 1), (3, 1), (3, 3), (16, 2)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_aligned_state_indices(device, impl, block_size, num_state_slots, dtype):
    gen = torch.Generator().manual_seed(block_size * 10 + num_state_slots)
    rows, cols = 37, 5  # more rows than one program covers
    # A transposed table: any strides are accepted.
    block_table = torch.randint(1, 1000, (cols, rows), generator=gen, dtype=dtype).T
    # Empty, negative, exact block multiples, and columns past the table.
    seq_lens = torch.randint(-3, block_size * cols + 4, (rows,), generator=gen)
    seq_lens[:4] = torch.tensor([0, -5, block_size, block_size * cols])
    out = call_aligned(impl, block_table.to(device), seq_lens.to(device), block_size,
                       num_state_slots)
    assert out.dtype == dtype and out.shape == (rows, num_state_slots)
    assert out.cpu().tolist() == aligned_reference(block_table, seq_lens, block_size,
                                                   num_state_slots)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_aligned_state_indices_empty_batch(device, impl):
    table = torch.zeros(0, 4, dtype=torch.int32, device=device)
    out = call_aligned(impl, table, torch.zeros(0, dtype=torch.int32, device=device), 4, 2)
    assert out.shape == (0, 2)


def test_aligned_state_indices_rejects_bad_arguments():
    table = torch.ones(3, 4, dtype=torch.int32)
    lens = torch.ones(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="`seq_lens`"):
        kda_ops.aligned_state_indices(table, lens[:2], 4, 1)
    with pytest.raises(ValueError, match="`block_table`"):
        kda_ops.aligned_state_indices(table.float(), lens, 4, 1)
    for bad in (0, 4.0, True):
        with pytest.raises(ValueError, match="`block_size`"):
            kda_ops.aligned_state_indices(table, lens, bad, 1)
        with pytest.raises(ValueError, match="`num_state_slots`"):
            kda_ops.aligned_state_indices(table, lens, 4, bad)


# --- stage_spec_decode_metadata -----------------------------------------------------

def stage_reference(state_indices, query_start_loc, accepted, batch, count):
    count = min(max(count, 0), state_indices.shape[0], batch)
    null = [NULL_BLOCK] * state_indices.shape[1] if state_indices.dim() == 2 else NULL_BLOCK
    staged_state = [state_indices[i].tolist() if i < count else null for i in range(batch)]
    staged_starts = [int(query_start_loc[min(i, count)]) for i in range(batch + 1)]
    staged_accepted = [int(accepted[i]) if i < count else 1 for i in range(batch)]
    return staged_state, staged_starts, staged_accepted


def make_stage_problem(device, source_rows, batch, slots, gen):
    """Sources (strided where possible) and staged buffers full of junk."""
    shape = (source_rows,) + ((slots,) if slots else ())
    state_indices = torch.randint(1, 100, (2,) + shape, generator=gen, dtype=torch.int32)[1]
    lens = torch.randint(1, 5, (source_rows,), generator=gen).tolist()
    starts = query_start_loc(lens, "cpu") + 3  # a batch that does not start at token 0
    accepted = torch.randint(1, 5, (source_rows + 2,), generator=gen, dtype=torch.int64)
    staged = (torch.full((batch,) + shape[1:], -7, dtype=torch.int32),
              torch.full((batch + 1,), -7, dtype=torch.int64),
              torch.full((batch,), -7, dtype=torch.int32))
    sources = (state_indices, starts, accepted)
    return tuple(t.to(device) for t in sources), tuple(t.to(device) for t in staged)


def call_stage(impl, sources, staged, count):
    if impl == "op":
        kda_ops.stage_spec_decode_metadata(*sources, *staged, count)
    else:
        limit = min(sources[0].shape[0], staged[0].shape[0])
        torch_impl.stage_spec_decode_metadata(*sources, *staged, count, limit)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slots", [None, 3])
@pytest.mark.parametrize("source_rows,batch", [(5, 8), (40, 36), (0, 3)])
def test_stage_int_count(device, impl, slots, source_rows, batch):
    gen = torch.Generator().manual_seed(source_rows + batch)
    limit = min(source_rows, batch)
    for count in sorted({0, min(1, limit), limit // 2, limit}):
        sources, staged = make_stage_problem(device, source_rows, batch, slots, gen)
        call_stage(impl, sources, staged, count)
        expected = stage_reference(*(t.cpu() for t in sources), batch, count)
        assert [t.cpu().tolist() for t in staged] == list(expected), f"count={count}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("slots", [None, 2])
@pytest.mark.parametrize("count_shape", [(), (1,)])
def test_stage_tensor_count(device, impl, slots, count_shape):
    """A device count is read by the kernel and clamped to the rows that exist."""
    gen = torch.Generator().manual_seed(1)
    source_rows, batch = 6, 9
    for count in (-2, 0, 4, 6, 50):
        sources, staged = make_stage_problem(device, source_rows, batch, slots, gen)
        count_tensor = torch.full(count_shape, count, dtype=torch.int32, device=device)
        call_stage(impl, sources, staged, count_tensor)
        expected = stage_reference(*(t.cpu() for t in sources), batch, count)
        assert [t.cpu().tolist() for t in staged] == list(expected), f"count={count}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("impl", IMPLS)
def test_stage_int64_indices_into_int32(device, impl):
    """int64 state indices past int32 are null; staged into int32 buffers they
    must stay null, not wrap into real blocks."""
    state_indices = torch.tensor([2**32 + 3, -(2**32) + 2, 5, 2**31 - 1, -(2**31)],
                                 dtype=torch.int64, device=device)
    starts = query_start_loc([1] * 5, device)
    accepted = torch.ones(5, dtype=torch.int32, device=device)
    staged = (torch.full((6,), -7, dtype=torch.int32, device=device),
              torch.full((7,), -7, dtype=torch.int32, device=device),
              torch.full((6,), -7, dtype=torch.int32, device=device))
    call_stage(impl, (state_indices, starts, accepted), staged, 5)
    assert staged[0].cpu().tolist() == [NULL_BLOCK, NULL_BLOCK, 5, 2**31 - 1, -(2**31), NULL_BLOCK]


def test_stage_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(2)
    sources, staged = make_stage_problem("cpu", 4, 6, None, gen)
    stage = kda_ops.stage_spec_decode_metadata
    for bad in (5, -1, True, 2.0):
        with pytest.raises(ValueError, match="`num_spec_decodes`"):
            stage(*sources, *staged, bad)
    with pytest.raises(ValueError, match="`num_spec_decodes`"):
        stage(*sources, *staged, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="`num_spec_decodes`"):
        stage(*sources, *staged, torch.tensor(1.0))
    with pytest.raises(ValueError, match="`query_start_loc`"):
        stage(sources[0], sources[1][:-1], sources[2], *staged, 1)
    with pytest.raises(ValueError, match="`num_accepted_tokens`"):
        stage(sources[0], sources[1], sources[2][:3], *staged, 1)
    with pytest.raises(ValueError, match="`staged_state_indices`"):
        stage(*sources, staged[0][:, None], *staged[1:], 1)
    with pytest.raises(ValueError, match="`staged_state_indices`"):
        stage(*sources, staged[0][:1].expand_as(staged[0]), *staged[1:], 1)
    with pytest.raises(ValueError, match="`staged_query_start_loc`"):
        stage(*sources, staged[0], staged[1][:-1], staged[2], 1)
    with pytest.raises(ValueError, match="`staged_num_accepted_tokens`"):
        stage(*sources, *staged[:2], staged[2][:-1], 1)
    with pytest.raises(ValueError, match="`state_indices` must hold at least one slot"):
        stage(sources[0][:, None][:, :0], *sources[1:], staged[0][:, None][:, :0], *staged[1:], 1)


# --- opcheck and compile ------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_metadata_opcheck(device):
    gen = torch.Generator().manual_seed(3)
    table = torch.randint(1, 50, (6, 4), generator=gen, dtype=torch.int32).to(device)
    lens = torch.randint(0, 20, (6,), generator=gen, dtype=torch.int32).to(device)
    torch.library.opcheck(torch.ops.kda_ops.aligned_state_indices.default, (table, lens, 5, 2))
    for slots in (None, 2):
        sources, staged = make_stage_problem(device, 5, 7, slots, gen)
        torch.library.opcheck(torch.ops.kda_ops.stage_spec_decode_metadata.default,
                              sources + staged + (3,))
        count = torch.tensor([4], dtype=torch.int32, device=device)
        torch.library.opcheck(torch.ops.kda_ops.stage_spec_decode_metadata_tensor_count.default,
                              sources + staged + (count,))


def test_stage_compiles_without_graph_breaks():
    """The tensor count traces as data: one graph serves every count."""
    gen = torch.Generator().manual_seed(4)
    sources, staged = make_stage_problem("cpu", 5, 7, None, gen)
    count = torch.tensor([2], dtype=torch.int32)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def stage_and_lookup(table, lens, count):
        kda_ops.stage_spec_decode_metadata(*sources, *staged, count)
        return kda_ops.aligned_state_indices(table, lens, 4, 1)

    table = torch.arange(1, 13, dtype=torch.int32).reshape(3, 4)
    lens = torch.tensor([0, 5, 16], dtype=torch.int32)
    for n in (2, 5, 0):
        count.fill_(n)
        assert stage_and_lookup(table, lens, count).tolist() == [[1], [6], [12]]
        assert [t.tolist() for t in staged] == list(stage_reference(*sources, 7, n))


def test_stage_int_count_under_compile():
    """An int count is specialised, then made dynamic once it changes: at most
    two graphs for any number of counts."""
    gen = torch.Generator().manual_seed(6)
    sources, staged = make_stage_problem("cpu", 6, 8, None, gen)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")

    @torch.compile(fullgraph=True, backend=counter)
    def stage(count):
        kda_ops.stage_spec_decode_metadata(*sources, *staged, count)

    for n in (1, 2, 3, 6, 0):
        stage(n)
        assert [t.tolist() for t in staged] == list(stage_reference(*sources, 8, n))
    assert counter.frame_count <= 2


# --- plan_batch ---------------------------------------------------------------------

def plan_reference(lens, is_prefilling, drafts, table, align, computed, block_size):
    """Groups of rows, token indices, the read/final state blocks and the moved
    checkpoints, in plain Python."""
    starts = [sum(lens[:r]) for r in range(len(lens))]
    groups = {"spec": [], "decode": [], "prefill": []}
    for r, length in enumerate(lens):
        if length == 0:
            continue
        if drafts is not None and drafts[r] >= 0 and not is_prefilling[r]:
            groups["spec"].append(r)
        elif not is_prefilling[r] and length == 1:
            groups["decode"].append(r)
        else:
            groups["prefill"].append(r)

    def block_of(r, tokens):
        if not align:
            return int(table[r][0])
        return int(table[r][max(tokens - 1, 0) // block_size])

    result = {}
    for name, rows in groups.items():
        # Speculative rows work in the block of their first new token.
        read = [block_of(r, computed[r] + (name == "spec")) for r in rows]
        result[name] = dict(
            rows=rows,
            tokens=[starts[r] + t for r in rows for t in range(lens[r])],
            query_start_loc=[sum(lens[r] for r in rows[:i]) for i in range(len(rows) + 1)],
            state=read,
            final=[block_of(r, computed[r] + lens[r]) for r in rows],
        )
    moved = [r for r in groups["spec"]
             if align and computed[r] > 0 and computed[r] % block_size == 0]
    result["copies"] = ([block_of(r, computed[r]) for r in moved],
                        [block_of(r, computed[r] + 1) for r in moved])
    return result


def random_batch(gen, rows, spec_len, block_size, table_cols, with_drafts=True):
    lens, is_prefilling, drafts = [], [], []
    for _ in range(rows):
        kind = int(torch.randint(0, 5, (), generator=gen))
        if kind == 0:                                  # zero-length padding row
            lens.append(0), is_prefilling.append(False), drafts.append(-1)
        elif kind == 1:                                # prefill chunk
            lens.append(int(torch.randint(1, 7, (), generator=gen)))
            is_prefilling.append(True), drafts.append(-1)
        elif kind == 2:                                # plain decode
            lens.append(1), is_prefilling.append(False), drafts.append(-1)
        else:                                          # speculative decode, maybe 0 drafts
            lens.append(int(torch.randint(1, spec_len + 1, (), generator=gen)))
            is_prefilling.append(False), drafts.append(lens[-1] - 1)
    capacity = block_size * table_cols
    computed = [int(torch.randint(0, capacity - 6, (), generator=gen)) for _ in range(rows)]
    # Every other checkpoint fills its block exactly.
    computed[::2] = [c // block_size * block_size for c in computed[::2]]
    table = torch.randperm(rows * table_cols, generator=gen).reshape(rows, table_cols) + 1
    return lens, is_prefilling, drafts if with_drafts else None, table, computed


def run_plan(device, lens, is_prefilling, drafts, table, computed, spec_len, align,
             block_size):
    starts = query_start_loc(lens, "cpu")
    return plan_batch(
        starts, starts.to(device), torch.tensor(is_prefilling, dtype=torch.bool),
        table.to(dtype=torch.int32, device=device), spec_len=spec_len,
        num_draft_tokens=None if drafts is None else torch.tensor(drafts),
        num_computed_tokens=torch.tensor(computed) if align else None,
        cache_mode="align" if align else "none", block_size=block_size if align else None)


def check_group(group, expected, name):
    assert group.rows_cpu.tolist() == expected["rows"], name
    assert group.num_requests == len(expected["rows"]), name
    assert group.num_tokens == len(expected["tokens"]), name
    assert group.token_indices.cpu().tolist() == expected["tokens"], name
    assert group.query_start_loc.cpu().tolist() == expected["query_start_loc"], name
    assert group.query_start_loc_cpu.tolist() == expected["query_start_loc"], name
    assert group.state_indices.cpu().tolist() == expected["state"], name
    if name == "spec":
        assert group.final_state_indices is None
    else:
        assert group.final_state_indices.cpu().tolist() == expected["final"], name
    identity = expected["rows"] == list(range(len(expected["rows"])))
    if identity:
        assert group.request_indices is None, name
    else:
        assert group.request_indices.cpu().tolist() == expected["rows"], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("with_drafts", [True, False])
def test_plan_batch_matches_reference(device, align, with_drafts):
    spec_len, block_size, table_cols = 4, 3, 8
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed)
        batch = random_batch(gen, 9, spec_len, block_size, table_cols, with_drafts)
        lens, is_prefilling, drafts, table, computed = batch
        plan = run_plan(device, *batch, spec_len, align, block_size)
        expected = plan_reference(lens, is_prefilling, drafts, table.tolist(), align,
                                  computed, block_size)
        for name in ("spec", "decode", "prefill"):
            check_group(getattr(plan, name), expected[name], name)
        copies = plan.checkpoint_copies
        assert (copies.sources.cpu().tolist(), copies.destinations.cpu().tolist()) == \
            expected["copies"]
        assert plan.spec_len == spec_len
        assert (plan.align is not None) == align
        if align:
            assert plan.align.num_computed_tokens.cpu().tolist() == computed
            assert plan.align.block_size == block_size


@pytest.mark.parametrize("device", DEVICES)
def test_plan_spec_prefix_uses_the_batch_tensors(device):
    """Speculative rows first, then zero-length padding: the group is the batch."""
    lens = [3, 1, 2, 0, 0]
    starts = query_start_loc(lens, "cpu")
    starts_device = starts.to(device)
    table = torch.arange(1, 11, dtype=torch.int32).reshape(5, 2).to(device)
    plan = plan_batch(starts, starts_device, torch.zeros(5, dtype=torch.bool), table,
                      spec_len=3, num_draft_tokens=torch.tensor([2, 0, 1, -1, -1]))
    spec = plan.spec
    assert spec.request_indices is None
    assert spec.query_start_loc.data_ptr() == starts_device.data_ptr()
    assert spec.query_start_loc.cpu().tolist() == [0, 3, 4, 6]
    assert spec.state_indices.cpu().tolist() == [1, 3, 5]
    assert plan.decode.num_requests == plan.prefill.num_requests == 0

    accepted = torch.tensor([2, 1, 2, 9, 9], dtype=torch.int32, device=device)
    assert plan.spec_accepted(accepted).cpu().tolist() == [2, 1, 2]
    args = plan.commit_arguments(accepted)
    assert args["num_accepted_tokens"] is accepted and args["request_indices"] is None
    assert args["block_table"] is None and args["block_size"] is None


@pytest.mark.parametrize("device", DEVICES)
def test_plan_accepted_and_commit_arguments_follow_request_rows(device):
    lens = [2, 5, 1, 3]
    starts = query_start_loc(lens, "cpu")
    table = torch.arange(1, 17, dtype=torch.int32).reshape(4, 4).to(device)
    plan = plan_batch(starts, starts.to(device), torch.tensor([False, True, False, False]),
                      table, spec_len=3, num_draft_tokens=torch.tensor([1, -1, -1, 2]),
                      num_computed_tokens=torch.tensor([4, 0, 7, 6]), cache_mode="align",
                      block_size=4)
    accepted = torch.tensor([2, 9, 9, 3], dtype=torch.int32, device=device)
    assert plan.spec_accepted(accepted).cpu().tolist() == [2, 3]
    args = plan.commit_arguments(accepted)
    assert args["request_indices"].cpu().tolist() == [0, 3]
    assert args["block_table"] is table and args["block_size"] == 4
    assert args["num_computed_tokens"].cpu().tolist() == [4, 0, 7, 6]
    # Row 0's checkpoint fills column 0, so the step works in column 1; row 3
    # stays in column 1.
    assert args["state_indices"].cpu().tolist() == [2, 14]
    assert plan.checkpoint_copies.sources.cpu().tolist() == [1]
    assert plan.checkpoint_copies.destinations.cpu().tolist() == [2]

    stacked = torch.arange(2 * 17, dtype=torch.float32, device=device).reshape(2, 17)
    expected = stacked.clone()
    expected[:, 2] = expected[:, 1]
    plan.copy_checkpoints(stacked, block_dim=1)
    assert torch.equal(stacked, expected)


def test_plan_rejects_bad_batches():
    lens = [2, 4]
    starts = query_start_loc(lens, "cpu")
    table = torch.ones(2, 3, dtype=torch.int32)
    flags = torch.zeros(2, dtype=torch.bool)
    drafts = torch.tensor([1, 3])

    def plan(**kwargs):
        args = dict(spec_len=4, num_draft_tokens=drafts)
        args.update(kwargs)
        return plan_batch(starts, starts, flags, table, **args)

    with pytest.raises(ValueError, match="spec_len=3"):
        plan(spec_len=3)
    plan(spec_len=3, num_draft_tokens=torch.tensor([1, -1]))  # not speculative: no limit
    with pytest.raises(ValueError, match="`cache_mode`"):
        plan(cache_mode="all")
    with pytest.raises(ValueError, match="`num_computed_tokens`"):
        plan(cache_mode="align", block_size=4)
    with pytest.raises(ValueError, match="`block_size`"):
        plan(cache_mode="align", num_computed_tokens=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="`block_size` must be at least spec_len - 1 = 3"):
        plan(cache_mode="align", block_size=2, num_computed_tokens=torch.tensor([1, 3]))
    with pytest.raises(ValueError, match="`block_table` has 3 columns"):
        plan(cache_mode="align", block_size=3, num_computed_tokens=torch.tensor([1, 6]))
    with pytest.raises(ValueError, match="`num_draft_tokens`"):
        plan(num_draft_tokens=torch.tensor([1]))
    with pytest.raises(ValueError, match="`query_start_loc_cpu`"):
        plan_batch(torch.tensor([0, 3, 2], dtype=torch.int32),
                   torch.tensor([0, 3, 2], dtype=torch.int32), flags, table, spec_len=4)
    with pytest.raises(ValueError, match="`block_table`"):
        plan_batch(starts, starts, flags, table[:1], spec_len=4)


# --- SpecDecodeGraphBuffers ---------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_graph_buffers_stage_plan(device):
    buffers = SpecDecodeGraphBuffers(6, device)
    storage = [buffers.state_indices.data_ptr(), buffers.query_start_loc.data_ptr(),
               buffers.num_accepted_tokens.data_ptr()]
    lens = [3, 1, 2, 0]
    starts = query_start_loc(lens, "cpu")
    table = torch.tensor([[4, 9], [5, 9], [6, 9], [0, 0]], dtype=torch.int32, device=device)
    plan = plan_batch(starts, starts.to(device), torch.zeros(4, dtype=torch.bool), table,
                      spec_len=3, num_draft_tokens=torch.tensor([2, 0, 1, -1]))

    staged = buffers.stage_plan(plan, batch_size=5)
    assert [staged.state_indices.data_ptr(), staged.query_start_loc.data_ptr(),
            staged.num_accepted_tokens.data_ptr()] == storage
    assert staged.state_indices.cpu().tolist() == [4, 5, 6, 0, 0]
    assert staged.query_start_loc.cpu().tolist() == [0, 3, 4, 6, 6, 6]
    assert staged.num_accepted_tokens.cpu().tolist() == [1] * 5

    accepted = torch.tensor([2, 1, 2, 7], dtype=torch.int32, device=device)
    staged = buffers.stage_plan(plan, batch_size=4, num_accepted_tokens=accepted)
    assert staged.num_accepted_tokens.cpu().tolist() == [2, 1, 2, 1]

    count = torch.tensor(2, device=device)
    staged = buffers.stage(plan.spec.state_indices, plan.spec.query_start_loc, count)
    assert staged.state_indices.cpu().tolist() == [4, 5, 0, 0, 0, 0]
    assert staged.query_start_loc.cpu().tolist() == [0, 3, 4, 4, 4, 4, 4]

    with pytest.raises(ValueError, match="`batch_size`"):
        buffers.views(7)
    with pytest.raises(ValueError, match="`batch_size` must hold the plan's 3"):
        buffers.stage_plan(plan, batch_size=2)
    mixed = plan_batch(starts, starts.to(device), torch.tensor([False, True, False, False]),
                       table, spec_len=3, num_draft_tokens=torch.tensor([2, -1, 1, -1]))
    with pytest.raises(ValueError, match="`plan`"):
        buffers.stage_plan(mixed)


@requires_cuda
def test_plan_and_stage_do_not_sync():
    gen = torch.Generator().manual_seed(5)
    lens, is_prefilling, drafts, table, computed = random_batch(gen, 12, 4, 3, 8)
    starts = query_start_loc(lens, "cpu")
    args = (starts, starts.cuda(), torch.tensor(is_prefilling), table.int().cuda())
    kwargs = dict(spec_len=4, num_draft_tokens=torch.tensor(drafts),
                  num_computed_tokens=torch.tensor(computed), cache_mode="align", block_size=3)
    accepted = torch.ones(12, dtype=torch.int32, device="cuda")
    buffers = SpecDecodeGraphBuffers(16, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = plan_batch(*args, **kwargs)
        buffers.stage(plan.spec.state_indices, plan.spec.query_start_loc,
                      plan.spec.num_requests, num_accepted_tokens=plan.spec_accepted(accepted))
    finally:
        torch.cuda.set_sync_debug_mode("default")
