"""Benchmark: every op through one runner, against the copy bandwidth.

    python -m kda_ops.bench [--ops verify,commit,commit_align,conv_update,verify_commit,step,
                                   step_compiled,verify_tree,commit_tree]
                            [--batches 1,8,32,...] [--spec-lens 2,4,8]
                            [--record-lens 12,16] [--eager-fold default,off]
                            [--acceptance 0.7,1]
                            [--state-dtypes float32,bfloat16]
                            [--layers 16] [--save runs.csv] [--run NAME] [--plot out.png]
    python -m kda_ops.bench --table runs.csv [--runs NAME,...] [--plot out.png]

Ops: verify and conv_update (one layer), commit (all layers; commit_align: in
align mode, every window crossing a block boundary), verify_commit (every
layer's verify, then the commit), step (every layer's conv_verify, then the
commit: `kda_ops.models.KDADecodeStep`), step_compiled (the same step through
`torch.compile(fullgraph=True)`), verify_tree and commit_tree (verify
of tree windows, commit of an accepted path: docs/semantics.md#13-tree-drafts,
each window a balanced binary tree of T nodes, accepting its deepest path, and
a chain given as a tree, accepting all T). verify_commit and the step ops
also run the deferred
schedule with records of each R in `--record-lens` (with each `--eager-fold`
choice of commit's `eager_fold`: default, on, off), and with each draft token
accepted with each probability in `--acceptance`; their bytes follow the
schedule (schedule_bytes), so each row has its own floor. For each op and shape:
the median time of one call from CUDA-graph replays of every rotation set's
calls (one per set, more for the schedule rows: calls_per_index_set), the bytes
that must move (each input read once, each output written once), and the
effective bandwidth as a fraction of the device-to-device copy bandwidth
measured in the same run. Inputs rotate over up to 64 index sets, so that the
state blocks (conv_update: history blocks) touched reach ROTATION_BYTES, about
8x the L2 cache, where 64 sets allow it; docs/performance.md names the small
batches where they do not. `--save` appends each row, as it is measured, to a
long-format table (a CSV file, a row per op and shape: SAVED_COLUMNS); `--table` prints
saved runs from one as markdown tables (no GPU needed): docs/performance.md's
tables are that output of docs/bench_runs.csv.
"""

import argparse
import csv
import dataclasses
import functools
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch

import kda_ops
from kda_ops._cli import exit_unless_cuda_runs, positive_int
from kda_ops.constants import DEFERRED_EAGER_FOLD_BELOW_BATCH


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    spec_len: int
    layers: int = 16
    heads: int = 32
    key_dim: int = 128
    value_dim: int = 128
    conv_width: int = 4
    act_dtype: torch.dtype = torch.bfloat16
    state_dtype: torch.dtype = torch.float32
    # The deferred schedule's record positions R > T (None: the immediate schedule).
    record_len: Optional[int] = None
    # The deferred commit's eager_fold (None: its default).
    eager_fold: Optional[bool] = None
    # Each draft token accepted with this probability: a request commits its
    # first token and the run of accepted drafts after it (1: all T tokens).
    acceptance: float = 1.0
    # Tree windows: "balanced" (node t's parent (t - 1) // 2) or "chain" (t - 1),
    # passed as `parent`; None: a chain without tree arguments.
    tree: Optional[str] = None

    @property
    def tokens(self):
        return self.batch * self.spec_len

    @property
    def records(self):
        """Record positions per block: R, or T in the immediate schedule."""
        return self.spec_len if self.record_len is None else self.record_len

    @property
    def conv_dim(self):
        return self.heads * (2 * self.key_dim + self.value_dim)

    @property
    def folds_eagerly(self):
        """Whether each deferred commit folds whatever is pending."""
        if self.eager_fold is None:
            return self.batch < DEFERRED_EAGER_FOLD_BELOW_BATCH
        return self.eager_fold


ROTATION_BYTES = 512 << 20  # touched per rotation: well above the 60 MB L2 of an H200
MAX_ROTATION_SETS = 64


def _block_pool(shape, bytes_per_request):
    """Number of index sets to rotate over and the blocks needed (block 0 is null)."""
    sets = max(1, min(MAX_ROTATION_SETS,
                      math.ceil(ROTATION_BYTES / (bytes_per_request * shape.batch))))
    return sets, sets * shape.batch + 1


def _index_sets(sets, batch, device):
    blocks = torch.randperm(sets * batch, device=device).to(torch.int32) + 1
    return [blocks[i * batch:(i + 1) * batch] for i in range(sets)]


def _window_starts(shape, device):
    """query_start_loc of `batch` full windows of T tokens."""
    return torch.arange(shape.batch + 1, device=device, dtype=torch.int32) * shape.spec_len


def _token_inputs(shape, device, lead=()):
    """Random q, k, g `[*lead, tokens, H, K]`, v `[*lead, tokens, H, V]`, beta."""
    n, H, act = shape.tokens, shape.heads, shape.act_dtype
    q, k, g = (torch.randn(*lead, n, H, shape.key_dim, device=device, dtype=act)
               for _ in range(3))
    v = torch.randn(*lead, n, H, shape.value_dim, device=device, dtype=act)
    beta = torch.randn(*lead, n, H, device=device, dtype=act)
    return q, k, g, v, beta


def tree_parents(shape):
    """Window parents of one tree window of T nodes (`shape.tree`)."""
    if shape.tree == "balanced":
        return [-1] + [(t - 1) // 2 for t in range(1, shape.spec_len)]
    return list(range(-1, shape.spec_len - 1))


def tree_accepted_path(shape):
    """The path a tree window accepts: the deepest one (the last node's)."""
    parents = tree_parents(shape)
    path = [shape.spec_len - 1]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def _packed_parents(shape, device):
    return torch.tensor(tree_parents(shape) * shape.batch, device=device, dtype=torch.int32)


def setup_verify(shape, device):
    H, K, V, T, B = shape.heads, shape.key_dim, shape.value_dim, shape.spec_len, shape.batch
    act = shape.act_dtype
    sets, N = _block_pool(shape, H * V * K * shape.state_dtype.itemsize)
    q, k, g, v, beta = _token_inputs(shape, device)
    A_log, dt_bias = torch.randn(H, device=device) * 0.5, torch.randn(H, K, device=device)
    state = torch.randn(N, H, V, K, device=device, dtype=shape.state_dtype)
    correction = torch.empty(N, H, T, V, device=device)
    key_gate = torch.empty(N, H, T, 2 * K, device=device, dtype=act)
    starts = _window_starts(shape, device)
    out = torch.empty_like(v)
    tree = {} if shape.tree is None else dict(parent=_packed_parents(shape, device))
    calls = [lambda idx=idx: kda_ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction,
                                            key_gate, starts, idx, lower_bound=-5.0, out=out,
                                            **tree)
             for idx in _index_sets(sets, B, device)]
    return calls, verify_bytes(shape) + (shape.tokens * 4 if shape.tree else 0)


# Bytes each op must move: every input read once, every output written once.
def _state_block_bytes(shape):
    """One block's state, all heads of one layer."""
    return shape.heads * shape.value_dim * shape.key_dim * shape.state_dtype.itemsize


def _conv_history_bytes(shape):
    """One block's convolution history (W - 1 columns), one layer."""
    return shape.conv_dim * (shape.conv_width - 1) * shape.act_dtype.itemsize


def verify_bytes(shape):
    """One layer's verify: state, q k g v beta read; out and records written."""
    H, K, V, n = shape.heads, shape.key_dim, shape.value_dim, shape.tokens
    act = shape.act_dtype.itemsize
    return (shape.batch * _state_block_bytes(shape)
            + n * H * (3 * K + V + 1) * act + n * H * V * act + n * H * (V * 4 + 2 * K * act))


def conv_update_bytes(shape):
    """One layer's conv_update: x read, out written, the history read and the
    window written."""
    B, D, W = shape.batch, shape.conv_dim, shape.conv_width
    act = shape.act_dtype.itemsize
    return (2 * shape.tokens * D + B * D * (W - 1) + B * D * (W - 2 + shape.spec_len)) * act


def conv_verify_bytes(shape):
    """One layer's conv_verify: conv_update's and verify's bytes but for the
    convolution's outputs, which verify reads in the same op."""
    return (conv_update_bytes(shape) + verify_bytes(shape)
            - 2 * shape.tokens * shape.conv_dim * shape.act_dtype.itemsize)


def commit_bytes(shape, accepted):
    """Every layer's commit of `accepted` tokens per request: state read and
    written, records read, conv history read and written."""
    L, H, K, V = shape.layers, shape.heads, shape.key_dim, shape.value_dim
    act = shape.act_dtype.itemsize
    per_request = L * (2 * _state_block_bytes(shape)
                       + accepted * H * (V * 4 + 2 * K * act)
                       + 2 * _conv_history_bytes(shape))
    return shape.batch * per_request


def commit_align_bytes(shape):
    """commit_bytes of T tokens, plus what align mode writes besides when every
    window crosses a block boundary: each request's and layer's state and conv
    history at the boundary."""
    boundary = _state_block_bytes(shape) + _conv_history_bytes(shape)
    return commit_bytes(shape, shape.spec_len) + shape.batch * shape.layers * boundary


def decode_bytes(shape):
    """Every layer's verify, then the commit of all T tokens."""
    return shape.layers * verify_bytes(shape) + commit_bytes(shape, shape.spec_len)


def step_bytes(shape, accepted=None):
    """Every layer's conv_verify, then the commit of `accepted` tokens per
    request (default T)."""
    accepted = shape.spec_len if accepted is None else accepted
    return shape.layers * conv_verify_bytes(shape) + commit_bytes(shape, accepted)


def record_bytes(shape):
    """One token's records, all heads of one layer: correction and key/gate."""
    return shape.heads * (shape.value_dim * 4 + 2 * shape.key_dim * shape.act_dtype.itemsize)


# Draws of accepted counts per request and call (acceptance < 1): each block
# sees this many different draws in turn, so that its fold period varies.
DRAWS_PER_BLOCK = 8


def calls_per_index_set(shape):
    """Calls of each index set in one CUDA-graph replay: DRAWS_PER_BLOCK draws
    with acceptance < 1; with every token accepted one, or in the deferred
    schedule R // T, the commits from one fold to the next (one where every
    commit folds). So every replay folds each block equally often: replays in
    different fold phases would take different times, and their median would
    time one phase while the bytes count them all."""
    if shape.acceptance < 1:
        return DRAWS_PER_BLOCK
    if shape.record_len is None or shape.folds_eagerly:
        return 1
    return shape.records // shape.spec_len


def accepted_draws(shape, calls, seed=0):
    """Accepted counts (host ints) of `calls` steps of `batch` requests: 1 +
    the leading accepted drafts of T - 1, each with probability `acceptance`."""
    rng = random.Random(seed)

    def one():
        count = 1
        while count < shape.spec_len and rng.random() < shape.acceptance:
            count += 1
        return count

    return [[one() for _ in range(shape.batch)] for _ in range(calls)]


def schedule_bytes(shape, draws, sets, pending, window_bytes):
    """Bytes per call of every layer's window (`window_bytes`: verify_bytes or
    conv_verify_bytes) and the commit of `draws[j]` tokens, call j using index
    set j % sets. The deferred schedule's count follows the pending records
    from `pending` (per set and request) over 16 rounds of the calls after 16
    uncounted ones, as the timed replays follow the warm-up's: verify reads
    the pending records, and commit reads and writes the state only where it
    folds (at every commit with records where it folds eagerly), each fold
    reading its records; the conv history moves at every commit."""
    T, R = shape.spec_len, shape.records
    one = _one_request(shape)
    window = window_bytes(one)
    history = 2 * _conv_history_bytes(shape)
    state, record = _state_block_bytes(shape), record_bytes(shape)
    if shape.record_len is None:
        per_call = [sum(window + history + 2 * state + c * record for c in draw) for draw in draws]
        return shape.layers * sum(per_call) / len(draws)
    pending = [list(row) for row in pending]
    eager = shape.folds_eagerly

    def one_round():
        moved = 0
        for j, draw in enumerate(draws):
            counts = pending[j % sets]
            for b, accepted in enumerate(draw):
                p = counts[b]
                total = p + min(accepted, R - p)
                moved += window + p * record + history
                if total > 0 and (eager or total + T > R):
                    moved += 2 * state + total * record
                    total = 0
                counts[b] = total
        return moved

    rounds = 16
    for _ in range(rounds):  # the warm-up's replays
        one_round()
    total_bytes = sum(one_round() for _ in range(rounds))
    return shape.layers * total_bytes / (rounds * len(draws))


def _commit_buffers(shape, device, N):
    L, H, K, V, T = shape.layers, shape.heads, shape.key_dim, shape.value_dim, shape.spec_len
    R = shape.records
    act = shape.act_dtype
    cols = shape.conv_width - 1 + T - 1
    buffers = dict(
        state=torch.randn(L, N, H, V, K, device=device, dtype=shape.state_dtype),
        # Engine layout [L, N, cols, D], passed dim-first.
        conv_state=torch.randn(L, N, cols, shape.conv_dim, device=device, dtype=act).transpose(-1, -2),
        correction=torch.randn(L, N, H, R, V, device=device),
        key_gate=torch.randn(L, N, H, R, 2 * K, device=device, dtype=act),
        A_log=torch.randn(L, H, device=device) * 0.5,
        dt_bias=torch.randn(L, H, K, device=device),
    )
    if shape.record_len is not None:  # every layer's counts alike, each leaving room for a window
        counts = torch.randint(0, R - T + 1, (N,), dtype=torch.int32)
        buffers.update(pending=counts.expand(L, N).contiguous().to(device), spec_len=T)
        if shape.eager_fold is not None:
            buffers.update(eager_fold=shape.eager_fold)
    return buffers


def _step_calls(shape, sets, device, step):
    """(calls, accepted draws, index sets) of a step benchmark: call j runs
    `step(index set j % sets, accepted counts j)`, calls_per_index_set calls
    per set (the counts on the device before capture)."""
    index_sets = _index_sets(sets, shape.batch, device)
    count = sets * calls_per_index_set(shape)
    draws = accepted_draws(shape, count)
    accepted = [torch.tensor(draw, device=device, dtype=torch.int32) for draw in draws]
    calls = [lambda j=j: step(index_sets[j % sets], accepted[j]) for j in range(count)]
    return calls, draws, index_sets


def _one_request(shape):
    return dataclasses.replace(shape, batch=1)


def setup_commit(shape, device):
    """Every layer's commit of all T tokens; of tree windows (`shape.tree`) the
    accepted path's (tree_accepted_path)."""
    B, T = shape.batch, shape.spec_len
    path = tree_accepted_path(shape) if shape.tree else list(range(T))
    sets, N = _block_pool(shape, commit_bytes(_one_request(shape), len(path)))
    bufs = _commit_buffers(shape, device, N)
    accepted = torch.full((B,), len(path), device=device, dtype=torch.int32)
    if shape.tree:
        bufs["accepted_path"] = torch.tensor(path + [0] * (T - len(path)), device=device,
                                             dtype=torch.int32).expand(B, T).contiguous()
    starts = _window_starts(shape, device)
    calls = [lambda idx=idx: kda_ops.commit(accepted, idx, starts, lower_bound=-5.0, **bufs)
             for idx in _index_sets(sets, B, device)]
    # A path's entries are read once per request (int32).
    return calls, commit_bytes(shape, len(path)) + (B * T * 4 if shape.tree else 0)


def setup_commit_align(shape, device):
    """commit in align mode (docs/semantics.md#4-the-commit-plan), every window
    crossing a block boundary after its first token: the checkpoint's block
    (column 0 of the request's table row) takes the boundary state in place,
    and the folded state goes to the next block (column 1)."""
    B, T = shape.batch, shape.spec_len
    block_size = max(16, T)  # >= T: each window crosses exactly one block boundary
    sets, _ = _block_pool(shape, commit_align_bytes(_one_request(shape)))
    bufs = _commit_buffers(shape, device, 2 * sets * B + 1)
    accepted = torch.full((B,), T, device=device, dtype=torch.int32)
    computed = torch.full((B,), block_size - 1, device=device, dtype=torch.int32)
    starts = _window_starts(shape, device)
    tables = [blocks.view(B, 2) for blocks in _index_sets(sets, 2 * B, device)]
    calls = [lambda table=table: kda_ops.commit(
        accepted, table[:, 0], starts, lower_bound=-5.0, block_table=table,
        num_computed_tokens=computed, block_size=block_size, **bufs) for table in tables]
    return calls, commit_align_bytes(shape)


def setup_verify_commit(shape, device):
    """Every layer's verify, then one commit of all layers (no conv_update):
    the state traffic of a decode step (docs/semantics.md#3-verify, #5-commit)."""
    L = shape.layers
    sets, N = _block_pool(shape, decode_bytes(_one_request(shape)))
    bufs = _commit_buffers(shape, device, N)
    q, k, g, v, beta = _token_inputs(shape, device, lead=(L,))
    out = torch.empty_like(v[0])
    starts = _window_starts(shape, device)

    def call(idx, accepted):
        for layer in range(L):
            deferred = ({} if shape.record_len is None
                        else dict(pending=bufs["pending"][layer], spec_len=shape.spec_len))
            kda_ops.verify(q[layer], k[layer], v[layer], g[layer], beta[layer],
                           bufs["A_log"][layer], bufs["dt_bias"][layer], bufs["state"][layer],
                           bufs["correction"][layer], bufs["key_gate"][layer], starts, idx,
                           lower_bound=-5.0, out=out, **deferred)
        kda_ops.commit(accepted, idx, starts, lower_bound=-5.0, **bufs)

    return _schedule_setup(shape, sets, bufs.get("pending"), device, call, verify_bytes)


def _schedule_setup(shape, sets, pending, device, step, window_bytes):
    """(calls, bytes per call) of a decode-step benchmark: see _step_calls and
    schedule_bytes."""
    calls, draws, index_sets = _step_calls(shape, sets, device, step)
    counts = None if pending is None else [pending[0, idx.long()].tolist() for idx in index_sets]
    return calls, schedule_bytes(shape, draws, sets, counts, window_bytes)


def setup_conv_update(shape, device):
    B, T, D, W = shape.batch, shape.spec_len, shape.conv_dim, shape.conv_width
    act = shape.act_dtype
    cols = W - 1 + T - 1
    sets, N = _block_pool(shape, D * cols * act.itemsize)
    x = torch.randn(shape.tokens, D, device=device, dtype=act)
    conv_state = torch.randn(N, cols, D, device=device, dtype=act).transpose(-1, -2)
    weight, bias = torch.randn(D, W, device=device, dtype=act), torch.randn(D, device=device, dtype=act)
    starts = _window_starts(shape, device)
    out = torch.empty_like(x)
    calls = [lambda idx=idx: kda_ops.conv_update(x, conv_state, weight, bias, starts, idx, out=out)
             for idx in _index_sets(sets, B, device)]
    return calls, conv_update_bytes(shape)


def setup_step(shape, device, compiled=False):
    """16 x conv_verify + one commit, captured in one CUDA graph; `compiled`:
    the step through torch.compile(fullgraph=True), captured alike."""
    from .models import KDADecodeStep
    sets, N = _block_pool(shape, decode_bytes(_one_request(shape)))
    model = KDADecodeStep.for_benchmark(shape, device, num_blocks=N)
    if model.deferred:  # every layer's counts alike, as _commit_buffers draws them
        model.pending.copy_(model.pending[:1].expand_as(model.pending))
    hidden, starts, _, _ = model.example_inputs(shape.batch)
    step = torch.compile(model.step, fullgraph=True) if compiled else model.step
    return _schedule_setup(shape, sets, model.pending if model.deferred else None, device,
                           lambda idx, accepted: step(hidden, starts, idx, accepted),
                           conv_verify_bytes)


SETUPS = {"verify": setup_verify, "commit": setup_commit, "commit_align": setup_commit_align,
          "conv_update": setup_conv_update, "verify_commit": setup_verify_commit,
          "step": setup_step, "step_compiled": functools.partial(setup_step, compiled=True),
          "verify_tree": setup_verify, "commit_tree": setup_commit}


def graph_time_us(calls):
    """Median time of one call, from replays of a CUDA graph that makes every
    call of the rotation once (no host launch overhead in the number)."""
    for call in calls:
        call()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    from triton.testing import do_bench  # imported here: --table and the setups need no triton
    ms = do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / len(calls)


def copy_bandwidth(device, nbytes=2 << 30):
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    from triton.testing import do_bench
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


ONE_LAYER_OPS = ("verify", "conv_update", "verify_tree")  # the others run every layer
NO_RECURRENT_STATE_OPS = ("conv_update",)  # one row whatever --state-dtypes says
TREE_OPS = ("verify_tree", "commit_tree")
TREE_SHAPES = ("chain", "balanced")

# Ops that run a decode step's work (every layer, then the commit): the table
# also gives their time over the bytes-over-bandwidth floor.
WHOLE_STEP_OPS = ("verify_commit", "step", "step_compiled")


def _variants(op, T, record_lens, acceptances, eager_folds=(None,)):
    """The Shape fields of each row of `op` at window length T: the whole-step
    ops under both schedules (R > T only, with each eager_fold) at every
    acceptance; the tree ops at every tree shape; the others immediate, every
    token accepted."""
    if op in TREE_OPS:
        return [dict(tree=tree) for tree in TREE_SHAPES]
    if op not in WHOLE_STEP_OPS:
        return [{}]
    schedules = [dict(record_len=None)] + [dict(record_len=R, eager_fold=eager)
                                           for R in record_lens if R > T
                                           for eager in eager_folds]
    return [dict(schedule, acceptance=a) for a in acceptances for schedule in schedules]


STATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _row_state_dtypes(op, state_dtypes):
    """The state dtypes `op` gets a row for: the first only for an op that
    reads no recurrent state (its rows would repeat)."""
    return state_dtypes[:1] if op in NO_RECURRENT_STATE_OPS else state_dtypes


def measure(ops, batches, spec_lens, layers, device, copy_bw, record_lens=(),
            acceptances=(1.0,), state_dtypes=("float32",), eager_folds=(None,)):
    """Yields a row per op and shape as it is measured, each printed to stderr."""
    shapes = ((op, state, Shape(batch=B, spec_len=T, layers=layers,
                                state_dtype=STATE_DTYPES[state], **variant))
              for op in ops for T in spec_lens
              for variant in _variants(op, T, record_lens, acceptances, eager_folds)
              for state in _row_state_dtypes(op, state_dtypes) for B in batches)
    for op, state, shape in shapes:
        calls, moved = SETUPS[op](shape, device)
        us = graph_time_us(calls)
        bw = moved / (us * 1e-6)
        row = dict(op=op, batch=shape.batch, spec_len=shape.spec_len,
                   record_len=shape.record_len, eager_fold=shape.eager_fold,
                   acceptance=shape.acceptance, tree=shape.tree, state=state,
                   layers=1 if op in ONE_LAYER_OPS else layers,
                   time_us=us, bytes=moved, bandwidth_gbs=bw / 1e9,
                   fraction_of_copy=bw / copy_bw, floor_us=moved / copy_bw * 1e6)
        print(f"{_label(row):32s} T={shape.spec_len} B={shape.batch:4d}  {us:9.1f} us  "
              f"{bw / 1e9:7.0f} GB/s  {bw / copy_bw:6.1%} of copy  "
              f"(floor {moved / copy_bw * 1e6:8.1f} us)", file=sys.stderr, flush=True)
        del calls
        torch.cuda.empty_cache()
        yield row


def run(ops, batches, spec_lens, layers, device, record_lens=(), acceptances=(1.0,),
        state_dtypes=("float32",), eager_folds=(None,)):
    """The copy bandwidth and every row of `measure`."""
    copy_bw = copy_bandwidth(device)
    return copy_bw, list(measure(ops, batches, spec_lens, layers, device, copy_bw, record_lens,
                                 acceptances, state_dtypes, eager_folds))


def _label(row):
    """An op's name in the table: with its schedule and acceptance where they vary."""
    label = row["op"]
    if row.get("state", "float32") != "float32":
        label += f", {row['state']} state"
    if row.get("tree") is not None:
        label += ", chain as a tree" if row["tree"] == "chain" else f", {row['tree']} tree"
    if row.get("record_len") is not None:
        label += f", deferred R = {row['record_len']}"
        if row.get("eager_fold") is not None:
            label += f", eager fold {'on' if row['eager_fold'] else 'off'}"
    if row.get("acceptance", 1.0) < 1:
        label += f", a = {row['acceptance']:g}"
    return label


def plot_series(rows):
    """{(op, label, T): [(batch, fraction of copy)]}: one line per row label
    (op, schedule, state dtype, tree) and T."""
    series = {}
    for r in rows:
        series.setdefault((r["op"], _label(r), r["spec_len"]), []).append(
            (r["batch"], r["fraction_of_copy"]))
    return series


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 6))
    series = plot_series(rows)
    ops = sorted({op for op, _, _ in series})
    spec_lens = sorted({T for _, _, T in series})
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "D", "v"]
    # The op's colour; its variants (state dtype, schedule, tree) by marker.
    variants = {op: sorted({label for o, label, _ in series if o == op}) for op in ops}
    for (op, label, T), points in sorted(series.items()):
        ax.plot(*zip(*points), color=f"C{ops.index(op) % 10}",
                linestyle=styles[spec_lens.index(T) % len(styles)],
                marker=markers[variants[op].index(label) % len(markers)], label=f"{label} T={T}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("effective bandwidth / copy bandwidth")
    ax.axhline(0.8, color="gray", linestyle="--", linewidth=0.8)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _cell(row):
    us = row["time_us"]
    text = f"{us:.1f} µs" if us < 1000 else f"{us:.0f} µs"
    text += f" ({row['fraction_of_copy']:.0%}"
    if row["op"] in WHOLE_STEP_OPS:
        text += f", {1 / row['fraction_of_copy']:.2f}× floor"
    return text + ")"


def markdown_table(runs):
    """Runs (`load_runs`) as one markdown table: a line per distinct GPU,
    versions and copy bandwidth, then a row per op and window length with
    each batch's time and fraction of copy."""
    headers = dict.fromkeys(f"{run['meta']['gpu']}, torch {run['meta']['torch']}, "
                            f"Triton {run['meta']['triton']}, "
                            f"copy {run['meta']['copy_bandwidth_gbs']:.0f} GB/s" for run in runs)
    rows = [row for run in runs for row in run["rows"]]
    batches = sorted({row["batch"] for row in rows})
    lines = [*headers, "", "| op | T | " + " | ".join(f"B = {b}" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    by_key = {(_label(row), row["spec_len"], row["batch"]): row for row in rows}
    for label, T in dict.fromkeys((_label(row), row["spec_len"]) for row in rows):
        cells = [_cell(by_key[label, T, b]) if (label, T, b) in by_key else "" for b in batches]
        lines.append(f"| {label} | {T} | " + " | ".join(cells) + " |")
    memory = _record_memory_lines(runs) + _tree_memory_lines(runs)
    return "\n".join(lines + ([""] + memory if memory else []))


# The chain op a tree op is measured against.
CHAIN_OPS = {"verify_tree": "verify", "commit_tree": "commit"}


def _baseline(row):
    """The row a row is measured against in `ratio_table`: a deferred row the
    immediate one of its op, window, acceptance and state dtype; a tree row
    its chain op's; None for the others."""
    if row.get("record_len") is not None:
        return dict(row, record_len=None, eager_fold=None)
    if row.get("tree") is not None:
        return dict(row, op=CHAIN_OPS[row["op"]], tree=None)
    return None


def ratio_table(runs):
    """Each deferred row's time over the immediate schedule's and each tree
    row's over its chain op's, of the same run (`_baseline`), as a markdown
    table: a row per op and window length, a cell per batch; "" where no row
    has a baseline."""
    batches = sorted({row["batch"] for run in runs for row in run["rows"]})
    ratios = {}  # (label, baseline's label, T) -> {batch: ratio}
    for run in runs:
        times = {(_label(row), row["spec_len"], row["batch"]): row["time_us"]
                 for row in run["rows"]}
        for row in run["rows"]:
            baseline = _baseline(row)
            against = None if baseline is None else _label(baseline)
            base_us = times.get((against, row["spec_len"], row["batch"]))
            if base_us is not None:
                ratios.setdefault((_label(row), against, row["spec_len"]), {})[row["batch"]] = (
                    row["time_us"] / base_us)
    if not ratios:
        return ""
    lines = ["| op | against | T | " + " | ".join(f"B = {b}" for b in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    for (label, against, T), cells in ratios.items():
        lines.append(f"| {label} | {against} | {T} | "
                     + " | ".join(f"{cells[b]:.2f}×" if b in cells else "" for b in batches)
                     + " |")
    return "\n".join(lines)


def _tables(runs):
    """What `--table` prints of runs shown together: markdown_table, then
    ratio_table where it has rows."""
    ratios = ratio_table(runs)
    return [markdown_table(runs)] + ([ratios] if ratios else [])


def _record_memory_lines(runs):
    """Per request and layer, for each (T, R, state dtype) of a deferred row:
    the records' bytes next to one state's and to the T states that
    speculative decoding without records keeps (at the benchmark's Shape)."""
    lines = []
    for run in runs:
        for T, R, dtype in dict.fromkeys(
                (row["spec_len"], row["record_len"], row.get("state", "float32"))
                for row in run["rows"] if row.get("record_len") is not None):
            shape = Shape(0, 0, state_dtype=STATE_DTYPES[dtype])
            records = R * record_bytes(shape)
            state = _state_block_bytes(shape)
            kind = "" if dtype == "float32" else f" ({dtype} state)"
            lines.append(f"- T = {T}, R = {R}{kind}: records {records / 1024:.0f} KiB per "
                         f"request and layer, {records / state:.2f}x one state "
                         f"({state / 1024:.0f} KiB); T full states: {T}x")
    return lines


def _tree_memory_lines(runs):
    """Per request and layer, for each T of a tree row: what a tree window of T
    nodes keeps (its records, as a chain's) next to T full states, what an
    engine without records keeps per node."""
    lines = []
    shape = Shape(0, 0)
    for run in runs:
        for T in dict.fromkeys(row["spec_len"] for row in run["rows"]
                               if row.get("tree") is not None):
            records = T * record_bytes(shape)
            states = T * _state_block_bytes(shape)
            lines.append(f"- tree of T = {T} nodes: records {records / 1024:.0f} KiB per request "
                         f"and layer (a chain's), against {states / 1024:.0f} KiB for T full "
                         f"states ({states / records:.1f}x)")
    return lines


def _int_list(text):
    return [positive_int(item) for item in text.split(",")]


def _probability_list(text):
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = None
        if value is None or not 0 <= value <= 1:
            raise argparse.ArgumentTypeError(f"expected probabilities in [0, 1], got {item!r}")
        values.append(value)
    return values


def _state_dtype_list(text):
    names = text.split(",")
    unknown = [name for name in names if name not in STATE_DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown state dtypes {unknown}; choose from "
                                         f"{', '.join(STATE_DTYPES)}")
    return names


EAGER_FOLD_CHOICES = {"default": None, "on": True, "off": False}


def _eager_fold_list(text):
    choices = [choice for choice in text.split(",") if choice]
    unknown = [choice for choice in choices if choice not in EAGER_FOLD_CHOICES]
    if unknown or not choices:
        raise argparse.ArgumentTypeError(
            f"expected choices of {', '.join(EAGER_FOLD_CHOICES)}, got {text!r}")
    return [EAGER_FOLD_CHOICES[choice] for choice in choices]


def _op_list(text):
    ops = text.split(",")
    unknown = [op for op in ops if op not in SETUPS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ops {unknown}; choose from {', '.join(SETUPS)}")
    return ops


# The long-format table of saved runs: a row per op and shape of a run.
SAVED_COLUMNS = ("run", "gpu", "torch", "triton", "copy_gbs", "commit", "date", "op",
                 "schedule", "tree", "state", "T", "B", "R", "a", "layers", "time_us", "bytes",
                 "fraction_of_copy")


def save_run(path, name, meta, rows):
    """Appends a run's rows to the long-format table at `path` (written with
    its header when new)."""
    path = Path(path)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, SAVED_COLUMNS, lineterminator="\n")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow(dict(
                run=name, gpu=meta["gpu"], torch=meta["torch"], triton=meta["triton"],
                copy_gbs=repr(meta["copy_bandwidth_gbs"]), commit=meta["commit"],
                date=meta["date"], op=row["op"],
                schedule=_schedule_name(row),
                tree=row.get("tree") or "", state=row.get("state", "float32"),
                T=row["spec_len"], B=row["batch"],
                R="" if row.get("record_len") is None else row["record_len"],
                a=repr(row.get("acceptance", 1.0)), layers=row["layers"],
                time_us=repr(row["time_us"]), bytes=repr(row["bytes"]),
                fraction_of_copy=repr(row["fraction_of_copy"])))


SCHEDULES = {"immediate": (False, None), "deferred": (True, None),
             "deferred, eager fold on": (True, True), "deferred, eager fold off": (True, False)}


def _schedule_name(row):
    """The saved table's schedule of a row: a key of SCHEDULES."""
    key = (row.get("record_len") is not None, row.get("eager_fold"))
    return next(name for name, value in SCHEDULES.items() if value == key)


def load_runs(path, names=None):
    """The runs of the long-format table at `path` (all, or `names` in that
    order) as dicts of `meta` and `rows`; ValueError if the file is not such
    a table or a name is not in it."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or tuple(reader.fieldnames) != SAVED_COLUMNS:
            raise ValueError(f"{path} is not a table of saved runs (expected the columns "
                             f"{', '.join(SAVED_COLUMNS)})")
        runs = {}
        for line in reader:
            run = runs.setdefault(line["run"], dict(name=line["run"], meta=dict(
                gpu=line["gpu"], torch=line["torch"], triton=line["triton"],
                copy_bandwidth_gbs=float(line["copy_gbs"]), commit=line["commit"],
                date=line["date"]), rows=[]))
            run["rows"].append(dict(
                op=line["op"], tree=line["tree"] or None, state=line["state"],
                spec_len=int(line["T"]),
                batch=int(line["B"]), record_len=int(line["R"]) if line["R"] else None,
                eager_fold=SCHEDULES[line["schedule"]][1],
                acceptance=float(line["a"]), layers=int(line["layers"]),
                time_us=float(line["time_us"]), bytes=float(line["bytes"]),
                fraction_of_copy=float(line["fraction_of_copy"])))
    if names is None:
        return list(runs.values())
    missing = [name for name in names if name not in runs]
    if missing:
        raise ValueError(f"{path} has no run named {', '.join(missing)} (it has "
                         f"{', '.join(runs)})")
    return [runs[name] for name in names]


def _saved_table(path):
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no table of saved runs at {path!r}")
    return path


def _name_list(text):
    return [name for name in text.split(",") if name]


def _commit():
    """The checkout's commit (with -dirty for uncommitted changes), or the
    package version outside a git checkout."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"kda_ops {kda_ops.__version__}"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m kda_ops.bench",
        description="kda_ops benchmark (CUDA): time per call and effective bandwidth as a "
                    "fraction of the device-to-device copy bandwidth measured in the same run")
    parser.add_argument("--ops", type=_op_list, default=",".join(SETUPS),
                        help="comma-separated ops to time (default: %(default)s)")
    parser.add_argument("--batches", type=_int_list, default="1,8,32,64,128,256",
                        help="comma-separated numbers of requests (default: %(default)s)")
    parser.add_argument("--spec-lens", type=_int_list, default="2,4,8",
                        help="comma-separated window lengths T (default: %(default)s)")
    parser.add_argument("--record-lens", type=_int_list, default=[],
                        help="comma-separated record positions R > T: verify_commit and the "
                             "step ops also run the deferred schedule with each "
                             "(default: none)")
    parser.add_argument("--eager-fold", type=_eager_fold_list, default=[None],
                        metavar="CHOICE,...",
                        help="with --record-lens: comma-separated eager_fold choices of the "
                             "deferred commit, each a row: default (below "
                             f"{DEFERRED_EAGER_FOLD_BELOW_BATCH} requests), on, off "
                             "(default: default)")
    parser.add_argument("--acceptance", type=_probability_list, default=[1.0],
                        help="comma-separated probabilities that each draft token is accepted, "
                             "for verify_commit and the step ops (default: 1, every token)")
    parser.add_argument("--state-dtypes", type=_state_dtype_list, default=["float32"],
                        help="comma-separated dtypes of the recurrent state: float32, "
                             "bfloat16 (default: float32)")
    parser.add_argument("--layers", type=positive_int, default=16,
                        help="layers for the ops that run every layer (commit, commit_align, "
                             "verify_commit, the step ops) (default: %(default)s)")
    parser.add_argument("--save", default="bench_runs.csv", metavar="CSV",
                        help="append each row as it is measured, with the run's GPU, versions, "
                             "copy bandwidth, commit and date, to this long-format table "
                             "(default: "
                             "%(default)s)")
    parser.add_argument("--run", default=None, metavar="NAME",
                        help="the run's name in the saved table (default: GPU and time)")
    parser.add_argument("--plot", default=None,
                        help="also draw fraction of copy against batch to this PNG, for "
                             "this run or, with --table, the saved runs "
                             "(needs matplotlib: pip install 'kda_ops[plot]')")
    parser.add_argument("--table", type=_saved_table, metavar="CSV",
                        help="print the runs saved in this table as markdown and exit "
                             "(no GPU needed)")
    parser.add_argument("--runs", type=_name_list, default=None, metavar="NAME,...",
                        help="with --table: these runs only, as one table (default: each run "
                             "as a table of its own)")
    opts = parser.parse_args(argv)
    if opts.table:
        try:
            runs = load_runs(opts.table, opts.runs)
        except ValueError as error:
            parser.error(f"argument --table: {error}")
        print("\n\n".join(_tables(runs) if opts.runs else
                           [text for run in runs for text in _tables([run])]))
        if opts.plot:
            plot([row for run in runs for row in run["rows"]], opts.plot)
        return
    exit_unless_cuda_runs(parser.prog, "timing the ops", "--table prints saved runs without one")
    import triton
    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=triton.__version__, copy_bandwidth_gbs=copy_bw / 1e9,
                commit=_commit(), date=time.strftime("%Y-%m-%d"))
    name = opts.run or f"{meta['gpu']} {time.strftime('%Y-%m-%d %H:%M:%S')}"
    rows = []
    # Each row is saved as it is measured: an interrupted run keeps what it measured.
    for row in measure(opts.ops, opts.batches, opts.spec_lens, opts.layers, device, copy_bw,
                       opts.record_lens, opts.acceptance, opts.state_dtypes, opts.eager_fold):
        save_run(opts.save, name, meta, [row])
        rows.append(row)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s on {meta['gpu']} "
          f"(torch {meta['torch']}, triton {meta['triton']})")
    print("\n\n".join(_tables([dict(meta=meta, rows=rows)])))
    if opts.plot:
        plot(rows, opts.plot)


if __name__ == "__main__":
    main()
