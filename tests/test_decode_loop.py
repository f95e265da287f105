"""Several decode steps of a two-layer KDA model driven by the planner:
plan -> conv_update and verify per layer -> sample -> commit, checked after
every step against sequential float64 decoding of the accepted tokens, on a
fixed schedule of batches and on random ones.

Rows that the planner sends elsewhere (prefill chunks, plain decodes) are run
by an emulated engine path that reads and writes the blocks the plan names;
zero-length rows are CUDA-graph padding.
"""

import random
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch

import kda_ops
from kda_ops import naive
from kda_ops.planner import SpecDecodeGraphBuffers, plan_batch

from helpers import DEVICES, assert_rel_close, query_start_loc, requires_cuda

LAYERS, HEADS, K, V, CONV_DIM, WIDTH, SPEC_LEN = 2, 2, 16, 8, 8, 4, 3
TABLE_COLS = 12
NUM_REQUESTS = 5
HISTORY = WIDTH - 1

# Per step, the batch rows: (request, kind, tokens), or None for a padding row.
# Kinds: "prefill" (a prompt chunk), "plain" (a decode without speculation),
# "spec" (a speculative window of 1 + drafts tokens; 1 means zero drafts).
SCHEDULE = [
    [(0, "prefill", 4), (1, "prefill", 3), None, (2, "prefill", 2), (3, "prefill", 1)],
    [(0, "spec", 3), (1, "spec", 1), (2, "prefill", 3), (3, "plain", 1), (4, "prefill", 3),
     None, None],
    [(2, "spec", 2), (0, "spec", 3), None, (1, "spec", 2), (3, "plain", 1), (4, "spec", 3)],
    # Only speculative rows, first, then padding: the group is the batch itself.
    [(0, "spec", 3), (1, "spec", 3), (2, "spec", 3), (3, "spec", 1), (4, "spec", 2), None],
    [(4, "spec", 3), (1, "plain", 1), (3, "spec", 2), (0, "spec", 1), (2, "spec", 3), None],
]


@dataclass
class Model:
    """Weights and the paged caches of every layer, stacked `[LAYERS, ...]`."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor
    state: torch.Tensor
    conv_state: torch.Tensor
    correction: torch.Tensor
    key_gate: torch.Tensor


def make_model(device, gen):
    num_blocks = 1 + NUM_REQUESTS * TABLE_COLS

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    # Caches start as garbage: reading a block that was never written shows up.
    return Model(
        A_log=randn(LAYERS, HEADS, scale=0.5), dt_bias=randn(LAYERS, HEADS, K),
        conv_weight=randn(LAYERS, CONV_DIM, WIDTH, scale=0.5), conv_bias=randn(LAYERS, CONV_DIM),
        state=randn(LAYERS, num_blocks, HEADS, V, K),
        conv_state=randn(LAYERS, num_blocks, CONV_DIM, HISTORY + SPEC_LEN - 1),
        correction=randn(LAYERS, num_blocks, HEADS, SPEC_LEN, V),
        key_gate=randn(LAYERS, num_blocks, HEADS, SPEC_LEN, 2 * K))


@dataclass
class Reference:
    """One request decoded sequentially in float64: its state after `folded`
    tokens, its conv history, and (align mode) the snapshots at block ends."""

    state: torch.Tensor = field(
        default_factory=lambda: torch.zeros(LAYERS, HEADS, V, K, dtype=torch.float64))
    history: torch.Tensor = field(
        default_factory=lambda: torch.zeros(LAYERS, CONV_DIM, HISTORY))
    folded: int = 0
    snapshots: dict = field(default_factory=dict)


def run_window(model, ref, tokens):
    """Runs `tokens` (per-layer inputs, CPU) from the reference checkpoint.
    Returns the outputs, conv outputs, and the (state, history) after each token."""
    A_log, dt_bias = model.A_log.cpu(), model.dt_bias.cpu()
    weight, bias = model.conv_weight.cpu(), model.conv_bias.cpu()
    n = tokens["x"].shape[1]
    outputs = torch.zeros(n, LAYERS, HEADS, V, dtype=torch.float64)
    conv_outputs = torch.zeros(n, LAYERS, CONV_DIM, dtype=torch.float64)
    states = torch.zeros(n, LAYERS, HEADS, V, K, dtype=torch.float64)
    histories = torch.zeros(n, LAYERS, CONV_DIM, HISTORY)
    for layer in range(LAYERS):
        conv_outputs[:, layer] = naive.causal_conv(ref.history[layer], tokens["x"][layer],
                                                   weight[layer], bias[layer], "silu")
        sequence = torch.cat([ref.history[layer], tokens["x"][layer].T], dim=1)
        for t in range(n):
            histories[t, layer] = sequence[:, t + 1:t + 1 + HISTORY]
        for h in range(HEADS):
            S = ref.state[layer, h]
            for t in range(n):
                S, _, out = naive.step(
                    S, *(tokens[name][layer, t, h] for name in ("q", "k", "v", "g", "beta")),
                    A_log[layer, h], dt_bias[layer, h], None, K ** -0.5)
                outputs[t, layer, h], states[t, layer, h] = out, S
    return outputs, conv_outputs, states, histories


def fold(ref, states, histories, count, block_size):
    """Advances the reference by the first `count` window tokens, keeping (align
    mode) a snapshot at every block end it passes."""
    for t in range(count):
        if block_size and (ref.folded + t + 1) % block_size == 0:
            col = (ref.folded + t + 1) // block_size - 1
            ref.snapshots[col] = (states[t].clone(), histories[t].clone())
    ref.state, ref.history = states[count - 1], histories[count - 1]
    ref.folded += count


def checkpoint_col(folded, block_size):
    return max(folded - 1, 0) // block_size if block_size else 0


def write_block(model, block, state, history):
    model.state[:, block] = state.to(model.state)
    model.conv_state[:, block, :, :HISTORY] = history.to(model.conv_state)


def check_caches(model, refs, table, block_size, initial_null):
    """Every started request's checkpoint block, and (align) every full block,
    holds the reference state and conv history; the null block is untouched."""
    for rid, ref in refs.items():
        if ref.folded == 0:
            continue
        blocks = {checkpoint_col(ref.folded, block_size): (ref.state, ref.history)}
        blocks.update(ref.snapshots)
        for col, (state, history) in blocks.items():
            block = int(table[rid, col])
            assert_rel_close(model.state[:, block], state, name=f"state r{rid} col {col}")
            assert torch.equal(model.conv_state[:, block, :, :HISTORY].cpu(), history), \
                f"conv history r{rid} col {col}"
    assert torch.equal(model.state[:, 0], initial_null[0])
    assert torch.equal(model.conv_state[:, 0], initial_null[1])


def forward_layers(model, tokens, query_start_loc, state_indices):
    """The speculative group's kda_ops calls of one step's forward pass:
    conv_update and verify in every layer. Returns the verify and conv outputs,
    stacked `[tokens, LAYERS, ...]`."""
    outputs, conv_outputs = [], []
    for layer in range(LAYERS):
        conv_outputs.append(kda_ops.conv_update(
            tokens["x"][layer], model.conv_state[layer], model.conv_weight[layer],
            model.conv_bias[layer], query_start_loc, state_indices))
        outputs.append(kda_ops.verify(
            *(tokens[name][layer] for name in ("q", "k", "v", "g", "beta")),
            model.A_log[layer], model.dt_bias[layer], model.state[layer],
            model.correction[layer], model.key_gate[layer], query_start_loc, state_indices))
    return torch.stack(outputs, 1), torch.stack(conv_outputs, 1)


def commit_layers(model, **plan_arguments):
    """One commit for every layer's caches."""
    kda_ops.commit(**plan_arguments, state=model.state, conv_state=model.conv_state,
                   correction=model.correction, key_gate=model.key_gate, A_log=model.A_log,
                   dt_bias=model.dt_bias)


def random_tokens(gen, num_tokens):
    return dict(
        q=torch.randn(LAYERS, num_tokens, HEADS, K, generator=gen),
        k=torch.randn(LAYERS, num_tokens, HEADS, K, generator=gen),
        v=torch.randn(LAYERS, num_tokens, HEADS, V, generator=gen),
        g=torch.randn(LAYERS, num_tokens, HEADS, K, generator=gen),
        beta=torch.randn(LAYERS, num_tokens, HEADS, generator=gen),
        x=torch.randn(LAYERS, num_tokens, CONV_DIM, generator=gen))


def step_batch(entries, refs, table, device, block_size):
    """Plans one step of the schedule; `block_size=None` is cache mode "none"."""
    lens = [0 if e is None else e[2] for e in entries]
    starts = query_start_loc(lens, "cpu")
    rows = [None if e is None else e[0] for e in entries]
    computed = [0 if r is None else refs[r].folded for r in rows]
    batch_table = torch.stack([torch.zeros(TABLE_COLS, dtype=torch.int32) if r is None
                               else table[r] for r in rows])
    plan = plan_batch(
        starts, starts.to(device),
        torch.tensor([e is not None and e[1] == "prefill" for e in entries]),
        batch_table.to(device), spec_len=SPEC_LEN,
        num_draft_tokens=torch.tensor([e[2] - 1 if e is not None and e[1] == "spec" else -1
                                       for e in entries]),
        num_computed_tokens=torch.tensor(computed),
        cache_mode="align" if block_size else "none", block_size=block_size)
    return plan, starts, rows


def run_engine_path(model, group, tokens, starts, rows, refs, table, block_size):
    """What an engine's own prefill/decode kernels do with a non-speculative
    group: read the state at `state_indices`, write the result (and, in align
    mode, the block-end snapshots) where the plan says."""
    for i, row in enumerate(group.rows_cpu.tolist()):
        ref = refs[rows[row]]
        span = slice(int(starts[row]), int(starts[row + 1]))
        assert group.token_indices.cpu()[group.query_start_loc_cpu[i]:
                                         group.query_start_loc_cpu[i + 1]].tolist() == \
            list(range(span.start, span.stop))
        if ref.folded:
            assert_rel_close(model.state[:, int(group.state_indices[i])], ref.state,
                             name="engine path input")
        window = {name: t[:, span] for name, t in tokens.items()}
        _, _, states, histories = run_window(model, ref, window)
        snapshots_before = set(ref.snapshots)
        fold(ref, states, histories, span.stop - span.start, block_size)
        for col in set(ref.snapshots) - snapshots_before:
            write_block(model, int(table[rows[row], col]), *ref.snapshots[col])
        write_block(model, int(group.final_state_indices[i]), ref.state, ref.history)


# Align-mode block sizes below and above T: two boundaries in one commit, and
# rows whose commit reaches no boundary at all.
BLOCK_SIZES = pytest.mark.parametrize("block_size", [None, 2, 4],
                                      ids=["none", "align-bs2", "align-bs4"])


def random_schedule(seed, steps=8, tokens_per_request=20):
    """A SCHEDULE of `steps` random batches: each request's first row a prompt
    chunk, then any kind, rows in random order among padding rows, at most
    `tokens_per_request` tokens a request (the block table's span at block size 2)."""
    rng = random.Random(seed)
    started, used, schedule = set(), [0] * NUM_REQUESTS, []
    while len(schedule) < steps:
        rows = []
        for request in rng.sample(range(NUM_REQUESTS), rng.randint(1, NUM_REQUESTS)):
            kind = rng.choice(["prefill", "plain", "spec", "spec", "spec"])
            kind = kind if request in started else "prefill"
            tokens = {"prefill": rng.randint(1, 4), "plain": 1,
                      "spec": rng.randint(1, SPEC_LEN)}[kind]
            if used[request] + tokens <= tokens_per_request:
                used[request] += tokens
                started.add(request)
                rows.append((request, kind, tokens))
        for _ in range(rng.randint(0, 2)):
            rows.insert(rng.randint(0, len(rows)), None)
        if any(rows):
            schedule.append(rows)
    return schedule


@pytest.mark.parametrize("device", DEVICES)
@BLOCK_SIZES
@pytest.mark.parametrize("schedule_seed", [None, 1, 2], ids=["fixed", "random1", "random2"])
def test_decode_loop(device, block_size, schedule_seed):
    """SCHEDULE, or a random one (which need not cross a block boundary)."""
    schedule = SCHEDULE if schedule_seed is None else random_schedule(schedule_seed)
    gen = torch.Generator().manual_seed(7 + (block_size or 0))
    model = make_model(device, gen)
    table = (1 + torch.arange(NUM_REQUESTS * TABLE_COLS, dtype=torch.int32)
             ).reshape(NUM_REQUESTS, TABLE_COLS)
    initial_null = (model.state[:, 0].clone(), model.conv_state[:, 0].clone())
    refs = {rid: Reference() for rid in range(NUM_REQUESTS)}
    moved_checkpoints = crossed_boundaries = 0

    for step, entries in enumerate(schedule):
        plan, starts, rows = step_batch(entries, refs, table, device, block_size)
        spec = plan.spec
        spec_rows = [r for r, e in enumerate(entries) if e is not None and e[1] == "spec"]
        assert spec.rows_cpu.tolist() == spec_rows
        assert (spec.request_indices is None) == (spec_rows == list(range(len(spec_rows))))
        tokens = random_tokens(gen, int(starts[-1]))

        for group in (plan.decode, plan.prefill):
            run_engine_path(model, group, tokens, starts, rows, refs, table, block_size)

        moved_checkpoints += plan.checkpoint_copies.num_copies
        plan.copy_checkpoints(model.state, block_dim=1)
        plan.copy_checkpoints(model.conv_state, block_dim=1)
        picked = {name: t[:, spec.token_indices.cpu().long()].to(device)
                  for name, t in tokens.items()}
        outputs, conv_outputs = forward_layers(model, picked, spec.query_start_loc,
                                               spec.state_indices)

        # Sample: accept 1..L tokens of each window; other rows hold junk that
        # commit must not read.
        accepted = torch.full((len(entries),), 7, dtype=torch.int32)
        expected_out, expected_conv, windows = [], [], []
        for row in spec_rows:
            span = slice(int(starts[row]), int(starts[row + 1]))
            window = run_window(model, refs[rows[row]], {n: t[:, span] for n, t in tokens.items()})
            expected_out.append(window[0])
            expected_conv.append(window[1])
            windows.append(window)
            accepted[row] = int(torch.randint(1, span.stop - span.start + 1, (), generator=gen))
        if spec.num_requests:
            assert_rel_close(outputs, torch.cat(expected_out), name=f"verify outputs, step {step}")
            assert_rel_close(conv_outputs, torch.cat(expected_conv),
                             name=f"conv outputs, step {step}")

        commit_layers(model, **plan.commit_arguments(accepted.to(device)))
        for row, (_, _, states, histories) in zip(spec_rows, windows):
            ref = refs[rows[row]]
            snapshots_before = len(ref.snapshots)
            fold(ref, states, histories, int(accepted[row]), block_size)
            crossed_boundaries += len(ref.snapshots) - snapshots_before

        check_caches(model, refs, table, block_size, initial_null)
    if block_size and schedule_seed is None:  # SCHEDULE must exercise what it is meant to
        assert crossed_boundaries > 0 and moved_checkpoints > 0


@requires_cuda
@BLOCK_SIZES
def test_decode_loop_cuda_graph_replay(block_size):
    """A step captured once as a CUDA graph (conv_update, verify per layer and
    commit on staged buffers), replayed for batches of different sizes, matches
    the same step run eagerly on the plan's unpadded tensors."""
    device, max_batch = "cuda", 4
    gen = torch.Generator().manual_seed(11)
    model = make_model(device, gen)
    table = (1 + torch.arange(NUM_REQUESTS * TABLE_COLS, dtype=torch.int32)
             ).reshape(NUM_REQUESTS, TABLE_COLS)
    # Only the folded counts matter here: they place the checkpoints in align mode.
    refs = {rid: Reference(folded=folded) for rid, folded in enumerate([5, 6, 3, 8])}

    buffers = SpecDecodeGraphBuffers(max_batch, device)
    max_tokens = max_batch * SPEC_LEN
    static_tokens = {name: t.to(device) for name, t in random_tokens(gen, max_tokens).items()}
    num_computed = torch.zeros(max_batch, dtype=torch.int32, device=device)
    static_table = torch.zeros(max_batch, TABLE_COLS, dtype=torch.int32, device=device)

    def forward_and_commit(staged):
        forward_layers(model, static_tokens, staged.query_start_loc, staged.state_indices)
        align_args = (dict(block_table=static_table, num_computed_tokens=num_computed,
                           block_size=block_size) if block_size else {})
        commit_layers(model, num_accepted_tokens=staged.num_accepted_tokens,
                      state_indices=staged.state_indices,
                      query_start_loc=staged.query_start_loc, **align_args)

    def plan_step(lens):
        entries = [(rid, "spec", n) for rid, n in enumerate(lens)]
        entries += [None] * (max_batch - len(entries))
        plan, _, _ = step_batch(entries, refs, table, device, block_size)
        if block_size:
            static_table.copy_(plan.align.block_table)
            num_computed.copy_(plan.align.num_computed_tokens)
        return plan

    # Capture with a full batch, after a warm-up that compiles every kernel.
    staged = buffers.stage_plan(plan_step([3, 2, 1, 3]), max_batch)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward_and_commit(staged)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward_and_commit(staged)

    for lens in ([3, 2, 1], [1, 3], [2, 2, 3, 1]):
        plan = plan_step(lens)
        plan.copy_checkpoints(model.state, block_dim=1)
        plan.copy_checkpoints(model.conv_state, block_dim=1)
        accepted = torch.tensor([int(torch.randint(1, n + 1, (), generator=gen)) for n in lens]
                                + [9] * (max_batch - len(lens)), dtype=torch.int32,
                                device=device)
        eager = Model(**{f.name: getattr(model, f.name).clone() for f in fields(Model)})
        spec = plan.spec
        # The speculative rows come first, so their tokens are a prefix.
        picked = {n: t[:, :spec.num_tokens] for n, t in static_tokens.items()}
        forward_layers(eager, picked, spec.query_start_loc, spec.state_indices)
        commit_layers(eager, **plan.commit_arguments(accepted))

        buffers.stage_plan(plan, max_batch, accepted)
        graph.replay()
        torch.cuda.synchronize()
        for name in ("state", "conv_state", "correction", "key_gate"):
            assert torch.equal(getattr(model, name), getattr(eager, name)), (lens, name)
        for rid in range(len(lens)):
            refs[rid].folded += int(accepted[rid])


@requires_cuda
def test_staging_captured_with_a_device_count():
    """The staging op itself inside a graph: each replay reads the current
    count and source values from fixed device buffers."""
    device, max_batch = "cuda", 6
    buffers = SpecDecodeGraphBuffers(max_batch, device)
    source_state = torch.zeros(max_batch, dtype=torch.int32, device=device)
    source_starts = torch.zeros(max_batch + 1, dtype=torch.int32, device=device)
    source_accepted = torch.ones(max_batch, dtype=torch.int32, device=device)
    count = torch.zeros(1, dtype=torch.int32, device=device)

    def stage():
        return buffers.stage(source_state, source_starts, count, max_batch, source_accepted)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        stage()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        staged = stage()

    for n, lens in ((3, [2, 1, 3]), (5, [1, 1, 2, 3, 1]), (0, [])):
        source_state[:n].copy_(torch.arange(10, 10 + n))
        source_starts[:n + 1].copy_(query_start_loc(lens, device))
        source_accepted[:n].copy_(torch.tensor(lens))
        count.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        end = sum(lens)
        assert staged.state_indices.tolist() == list(range(10, 10 + n)) + [0] * (max_batch - n)
        assert staged.query_start_loc.tolist() == (query_start_loc(lens, "cpu").tolist()
                                                   + [end] * (max_batch - n))
        assert staged.num_accepted_tokens.tolist() == lens + [1] * (max_batch - n)


def test_integration_example_runs():
    """The runnable example of docs/integration.md stays runnable."""
    text = (Path(__file__).parents[1] / "docs" / "integration.md").read_text()
    example = text.split("```python\n")[1].split("```")[0]
    exec(compile(example, "docs/integration.md", "exec"), {})
