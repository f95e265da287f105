"""The benchmark's setups (kda_ops.bench) on CPU tensors: every op's calls run,
and the bytes each op is divided by are the bytes of the tensors it must read
and write once (docs/performance.md, Method), counted here from the tensors."""

import dataclasses
import pathlib

import pytest
import torch

from kda_ops import bench

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
SAVED_RUNS = DOCS / "bench_runs.csv"

SHAPE = bench.Shape(batch=2, spec_len=3, layers=2, heads=2, key_dim=16, value_dim=8)


def nbytes(*specs):
    """Bytes of tensors given as (shape, dtype)."""
    return sum(torch.empty(shape, dtype=dtype, device="meta").nbytes for shape, dtype in specs)


def expected_bytes(shape, op):
    B, n, L, H, K, V = (shape.batch, shape.tokens, shape.layers, shape.heads, shape.key_dim,
                        shape.value_dim)
    D, W, T, act, st = (shape.conv_dim, shape.conv_width, shape.spec_len, shape.act_dtype,
                        shape.state_dtype)
    f32 = torch.float32
    verify = nbytes(((B, H, V, K), st),                                    # state blocks read
                    ((n, H, K), act), ((n, H, K), act), ((n, H, K), act),  # q, k, g
                    ((n, H, V), act), ((n, H), act),                       # v, beta
                    ((n, H, V), act),                                      # out
                    ((B, H, T, V), f32), ((B, H, T, 2 * K), act))          # records
    conv = nbytes(((n, D), act), ((n, D), act),                            # x, out
                  ((B, D, W - 1), act), ((B, D, W - 1 + T - 1), act))      # history, window
    # A tree commits its accepted path: the deepest one of a balanced tree.
    C = len(bench.tree_accepted_path(shape)) if shape.tree else T
    commit = L * nbytes(((B, H, V, K), st), ((B, H, V, K), st),            # state read, written
                        ((B, H, C, V), f32), ((B, H, C, 2 * K), act),      # records of C tokens
                        ((B, D, W - 1), act), ((B, D, W - 1), act))        # history read, written
    boundary = L * nbytes(((B, H, V, K), st), ((B, D, W - 1), act))       # align: boundary written
    qkv = nbytes(((n, D), act), ((n, D), act))  # conv_verify: conv outputs kept to the op
    parents, path = nbytes(((n,), torch.int32)), nbytes(((B, T), torch.int32))
    return {"verify": verify, "conv_update": conv, "commit": commit,
            "commit_align": commit + boundary,
            "verify_commit": L * verify + commit, "step": L * (conv + verify - qkv) + commit,
            "step_compiled": L * (conv + verify - qkv) + commit,
            "verify_tree": verify + parents, "commit_tree": commit + path}[op]


CASES = ([(op, None) for op in sorted(bench.SETUPS) if op not in bench.TREE_OPS]
         + [(op, tree) for op in bench.TREE_OPS for tree in bench.TREE_SHAPES])


@pytest.mark.parametrize("op, tree", CASES)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_setup_runs_and_counts_the_bytes_it_moves(op, tree, state_dtype):
    shape = dataclasses.replace(SHAPE, tree=tree, state_dtype=state_dtype)
    calls, moved = bench.SETUPS[op](shape, "cpu")
    assert len(calls) > 1, "the calls must rotate over index sets"
    calls[0]()
    calls[-1]()
    assert moved == expected_bytes(shape, op)


@pytest.mark.parametrize("op", sorted(bench.SETUPS))
def test_layers_recorded_for_an_op_are_the_layers_it_runs(op):
    """A saved row's `layers` is 1 exactly for the ops whose work does not
    grow with the layer count."""
    tree = "balanced" if op in bench.TREE_OPS else None
    one, two = (bench.SETUPS[op](bench.Shape(batch=2, spec_len=2, layers=layers, heads=2,
                                             key_dim=8, value_dim=8, tree=tree), "cpu")[1]
                for layers in (1, 2))
    assert (one == two) == (op in bench.ONE_LAYER_OPS)


@pytest.mark.parametrize("spec_len", [SHAPE.spec_len, 20])
def test_commit_align_writes_a_boundary_in_every_window(monkeypatch, spec_len):
    """Every call of commit_align folds all T tokens into the next block of the
    request's table row and writes the boundary state into the checkpoint's
    own block, as its bytes count."""
    seen = []
    monkeypatch.setattr(bench.kda_ops, "commit",
                        lambda *args, **kwargs: seen.append((args, kwargs)))
    shape = dataclasses.replace(SHAPE, spec_len=spec_len)
    calls, _ = bench.setup_commit_align(shape, "cpu")
    for call in calls:
        call()
    assert len(seen) == len(calls)
    for (accepted, source, starts), kwargs in seen:
        table = kwargs["block_table"]
        lens, final, boundary, _ = bench.kda_ops.commit_plan(
            accepted, source, starts, spec_len=spec_len, block_table=table,
            num_computed_tokens=kwargs["num_computed_tokens"], block_size=kwargs["block_size"])
        assert lens.tolist() == [spec_len] * shape.batch
        last_token = kwargs["num_computed_tokens"] + spec_len - 1
        assert (last_token // kwargs["block_size"] == 1).all(), "the table's columns clamp final"
        assert torch.equal(boundary, source) and torch.equal(final, table[:, 1])
    blocks = torch.cat([kwargs["block_table"].flatten() for _, kwargs in seen])
    assert len(set(blocks.tolist())) == len(blocks), "a block is reused across calls"


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_step_bytes(state_dtype):
    shape = bench.Shape(batch=3, spec_len=2, layers=3, heads=2, key_dim=8, value_dim=16,
                        conv_width=3, act_dtype=torch.float16, state_dtype=state_dtype)
    assert bench.step_bytes(shape) == expected_bytes(shape, "step")
    fewer = expected_bytes(shape, "step") - shape.layers * nbytes(
        ((shape.batch, shape.heads, 1, shape.value_dim), torch.float32),
        ((shape.batch, shape.heads, 1, 2 * shape.key_dim), shape.act_dtype))
    assert bench.step_bytes(shape, accepted=1) == fewer


def test_schedule_bytes_follow_the_pending_records():
    """T = 3, R = 7, every token accepted, nothing pending at first: commits
    alternate between leaving 3 tokens pending and folding 6, so a call moves
    on average one window, the history, 1.5 pending records read by verify,
    and half a fold (state read and written, 6 records read). Folding eagerly
    (eager_fold's default at one request), each commit folds its 3."""
    shape = bench.Shape(batch=1, spec_len=3, layers=2, heads=2, key_dim=8, value_dim=8,
                        record_len=7, eager_fold=False)
    window = bench.verify_bytes(shape) + 2 * bench._conv_history_bytes(shape)
    state, record = bench._state_block_bytes(shape), bench.record_bytes(shape)
    one_layer = window + 1.5 * record + (2 * state + 6 * record) / 2
    assert bench.schedule_bytes(shape, [[3]], 1, [[0]], bench.verify_bytes) == 2 * one_layer
    eager = dataclasses.replace(shape, eager_fold=None)
    assert eager.folds_eagerly
    assert bench.schedule_bytes(eager, [[3]], 1, [[0]], bench.verify_bytes) == \
        2 * (window + 2 * state + 3 * record)
    immediate = dataclasses.replace(shape, record_len=None)
    assert bench.schedule_bytes(immediate, [[3]], 1, None, bench.conv_verify_bytes) == \
        bench.step_bytes(immediate)


@pytest.mark.parametrize("acceptance, expected", [(0.0, {1}), (1.0, {4}), (0.7, {1, 2, 3, 4})])
def test_accepted_draws(acceptance, expected):
    """1 + the leading accepted drafts of T - 1 = 3."""
    shape = bench.Shape(batch=50, spec_len=4, acceptance=acceptance)
    draws = bench.accepted_draws(shape, 20)
    assert len(draws) == 20 and all(len(draw) == 50 for draw in draws)
    assert {c for draw in draws for c in draw} == expected


@pytest.mark.parametrize("op", ["verify_commit", "step"])
def test_deferred_setups_run_the_schedule(op, monkeypatch):
    """With R > T the setups run the deferred schedule (the pending counts
    move), with acceptance < 1 over several draws per index set."""
    import kda_ops.api

    shape = dataclasses.replace(SHAPE, record_len=7, acceptance=0.7, eager_fold=False)
    counts = []
    real_commit = kda_ops.api.commit

    def commit(*args, **kwargs):
        counts.append(kwargs["pending"].clone())
        real_commit(*args, **kwargs)

    monkeypatch.setattr(bench.kda_ops, "commit", commit)  # verify_commit calls this one,
    monkeypatch.setattr(kda_ops.api, "commit", commit)  # the model this one
    calls, moved = bench.SETUPS[op](shape, "cpu")
    assert len(calls) > bench.DRAWS_PER_BLOCK
    for call in calls[:3]:
        call()
    assert len(counts) == 3 and not all(torch.equal(counts[0], c) for c in counts[1:])
    assert moved < expected_bytes(SHAPE, op)


@pytest.mark.parametrize("eager_fold", [False, None])
@pytest.mark.parametrize("spec_len, record_len", [(3, 5), (3, 7), (2, 7), (3, 12)])
def test_every_replay_folds_each_block_once(spec_len, record_len, eager_fold, monkeypatch):
    """With every token accepted, one replay of the deferred calls commits each
    block R // T times (once where every commit folds, eager_fold's default at
    this batch): from the second replay on, each folds exactly once per replay
    (a fold leaves no record pending), so replays take equal times."""
    import kda_ops.api

    monkeypatch.setattr(bench, "MAX_ROTATION_SETS", 2)
    shape = dataclasses.replace(SHAPE, spec_len=spec_len, record_len=record_len,
                                eager_fold=eager_fold)
    assert shape.folds_eagerly == (eager_fold is None)
    folded = []
    real_commit = kda_ops.api.commit

    def commit(accepted, state_indices, *args, **kwargs):
        real_commit(accepted, state_indices, *args, **kwargs)
        folded.append(state_indices[kwargs["pending"][0, state_indices.long()] == 0].tolist())

    monkeypatch.setattr(bench.kda_ops, "commit", commit)
    monkeypatch.setattr(bench.kda_ops, "verify", lambda *args, **kwargs: None)  # reads only
    calls, _ = bench.SETUPS["verify_commit"](shape, "cpu")
    assert len(calls) == 2 * (1 if eager_fold is None else record_len // spec_len)
    for replay in range(3):
        folded.clear()
        for call in calls:
            call()
        if replay:
            per_block = sorted(b for call_folds in folded for b in call_folds)
            assert per_block == list(range(1, 2 * shape.batch + 1))


@pytest.mark.parametrize("argv, argument", [
    (["--ops", "verify,unknown"], "--ops"),
    (["--batches", "8,0"], "--batches"),
    (["--spec-lens", "4,x"], "--spec-lens"),
    (["--layers", "0"], "--layers"),
    (["--acceptance", "1.5"], "--acceptance"),
    (["--record-lens", "0"], "--record-lens"),
    (["--state-dtypes", "float32,float16"], "--state-dtypes"),
    (["--eager-fold", "default,sometimes"], "--eager-fold"),
])
def test_command_line_rejects_bad_values_naming_the_argument(argv, argument, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
    assert f"argument {argument}" in capsys.readouterr().err


def saved_row(op, spec_len, batch, time_us, fraction):
    return dict(op=op, spec_len=spec_len, batch=batch, time_us=time_us,
                fraction_of_copy=fraction)


META = dict(gpu="GPU X", torch="2.11.0", triton="3.6.0", copy_bandwidth_gbs=4000.4, note="a")


def test_markdown_table_cells_and_gaps():
    runs = [dict(meta=META, rows=[saved_row("verify", 4, 1, 3.24, 0.17),
                                  saved_row("verify", 4, 32, 1234.5, 0.5)]),
            dict(meta=META | {"note": "another run, same GPU and versions"},
                 rows=[saved_row("step", 4, 32, 900.0, 0.8)])]
    assert bench.markdown_table(runs).splitlines() == [
        "GPU X, torch 2.11.0, Triton 3.6.0, copy 4000 GB/s",
        "",
        "| op | T | B = 1 | B = 32 |",
        "|---|---|---|---|",
        "| verify | 4 | 3.2 µs (17%) | 1234 µs (50%) |",
        "| step | 4 |  | 900.0 µs (80%, 1.25× floor) |",
    ]


def test_markdown_table_names_each_distinct_run():
    runs = [dict(meta=META, rows=[saved_row("commit", 2, 8, 10.0, 0.9)]),
            dict(meta=META | {"copy_bandwidth_gbs": 3000.0}, rows=[])]
    assert bench.markdown_table(runs).splitlines()[:2] == [
        "GPU X, torch 2.11.0, Triton 3.6.0, copy 4000 GB/s",
        "GPU X, torch 2.11.0, Triton 3.6.0, copy 3000 GB/s"]


def test_table_rejects_a_file_that_is_not_a_table_of_runs(tmp_path, capsys):
    not_runs = tmp_path / "rows.csv"
    not_runs.write_text("op,T,B\nverify,4,1\n")
    for argv in (["--table", str(not_runs)], ["--table", str(tmp_path / "missing.csv")],
                 ["--table", str(SAVED_RUNS), "--runs", "no-such-run"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2
        assert "argument --table" in capsys.readouterr().err


def test_saved_runs_round_trip(tmp_path):
    """Two runs appended to one table come back as they were saved: the
    schedule (eager fold included), tree, state dtype and acceptance of each row, each run's GPU,
    versions, commit and date."""
    meta = dict(META, commit="abc1234", date="2026-12-07")
    first = [dict(op="step", batch=8, spec_len=4, record_len=12, eager_fold=None,
                  acceptance=0.7, tree=None, state="bfloat16", layers=16, time_us=123.456789,
                  bytes=1.5e9, fraction_of_copy=0.812345),
             dict(op="verify_tree", batch=1, spec_len=16, record_len=None, eager_fold=None,
                  acceptance=1.0, tree="balanced", state="float32", layers=1, time_us=23.4,
                  bytes=2244736, fraction_of_copy=0.05)]
    second = [dict(first[0], batch=64, time_us=1000.0),
              dict(first[0], eager_fold=False), dict(first[0], eager_fold=True)]
    path = tmp_path / "runs.csv"
    bench.save_run(path, "first", meta, first)
    bench.save_run(path, "second", meta | {"gpu": "GPU Y"}, second)
    runs = bench.load_runs(path)
    assert [run["name"] for run in runs] == ["first", "second"]
    assert runs[0]["meta"] == {name: meta[name] for name in (
        "gpu", "torch", "triton", "copy_bandwidth_gbs", "commit", "date")}
    assert runs[1]["meta"]["gpu"] == "GPU Y"
    assert runs[0]["rows"] == first and runs[1]["rows"] == second
    assert bench.load_runs(path, ["second"]) == runs[1:]



def test_an_interrupted_run_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    """--save appends each row as it is measured: a benchmark stopped part way
    (a timeout, ^C) leaves the rows before the stop in the table."""
    times = iter([11.0, 12.0])

    def time_or_stop(calls):
        try:
            return next(times)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(bench, "exit_unless_cuda_runs", lambda *args: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "GPU X")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e12)
    monkeypatch.setattr(bench, "graph_time_us", time_or_stop)
    monkeypatch.setitem(bench.SETUPS, "verify", lambda shape, device: ([], 1e6))
    path = tmp_path / "runs.csv"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--ops", "verify", "--batches", "1,2,4", "--spec-lens", "4",
                    "--save", str(path), "--run", "stopped"])
    [run] = bench.load_runs(path)
    assert run["name"] == "stopped" and run["meta"]["gpu"] == "GPU X"
    assert [(row["batch"], row["time_us"]) for row in run["rows"]] == [(1, 11.0), (2, 12.0)]


def test_state_dtypes_give_rows_to_ops_with_a_recurrent_state(monkeypatch):
    """--state-dtypes float32,bfloat16 measures verify and commit at both,
    conv_update (no recurrent state) once."""
    monkeypatch.setattr(bench, "graph_time_us", lambda calls: 1.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for op in ("verify", "commit", "conv_update"):
        monkeypatch.setitem(bench.SETUPS, op, lambda shape, device: ([], 1e6))
    rows = bench.measure(["verify", "commit", "conv_update"], [1], [4], 16, "cpu", 1e12,
                         state_dtypes=("float32", "bfloat16"))
    assert [(row["op"], row["state"]) for row in rows] == [
        ("verify", "float32"), ("verify", "bfloat16"), ("commit", "float32"),
        ("commit", "bfloat16"), ("conv_update", "float32")]


# The saved runs whose tables docs/performance.md shows.
DOC_RUNS = ["h100-2026-12-07", "h100-deferred-default", "h100-trees-t8", "h100-trees-t16"]


@pytest.mark.parametrize("name", DOC_RUNS)
def test_performance_doc_shows_the_saved_runs(name):
    """docs/performance.md's tables are `--table` of the saved runs (with the
    ratio table where the run has one), so they cannot drift from the rows
    they come from."""
    runs = bench.load_runs(SAVED_RUNS, [name])
    assert "\n\n".join(bench._tables(runs)) in (DOCS / "performance.md").read_text()


def test_table_prints_each_saved_run(capsys):
    bench.main(["--table", str(SAVED_RUNS)])
    printed = capsys.readouterr().out
    for run in bench.load_runs(SAVED_RUNS):
        assert bench.markdown_table([run]) in printed
        assert bench.ratio_table([run]) in printed


def test_ratio_table_against_each_row_s_baseline():
    """A deferred row over the immediate row of its op, window, acceptance and
    state dtype; a tree row over its chain op's; rows without a baseline in
    the run are left out, and a batch without one is an empty cell."""
    def row(op, batch, time_us, **fields):
        return dict(dict(op=op, spec_len=4, batch=batch, time_us=time_us, record_len=None,
                         eager_fold=None, acceptance=1.0, tree=None, state="float32"), **fields)

    runs = [dict(meta=META, rows=[
        row("step", 1, 100.0), row("step", 64, 2000.0),
        row("step", 1, 150.0, acceptance=0.7), row("step", 64, 1800.0, acceptance=0.7),
        row("step", 1, 160.0, record_len=12), row("step", 64, 1300.0, record_len=12),
        row("step", 64, 1170.0, record_len=12, acceptance=0.7, eager_fold=False),
        row("step", 64, 900.0, record_len=12, state="bfloat16"),
        row("verify", 1, 5.0), row("verify_tree", 1, 6.5, tree="balanced"),
        row("commit_tree", 1, 30.0, tree="chain")])]
    assert bench.ratio_table(runs).splitlines() == [
        "| op | against | T | B = 1 | B = 64 |",
        "|---|---|---|---|---|",
        "| step, deferred R = 12 | step | 4 | 1.60× | 0.65× |",
        "| step, deferred R = 12, eager fold off, a = 0.7 | step, a = 0.7 | 4 |  | 0.65× |",
        "| verify_tree, balanced tree | verify | 4 | 1.30× |  |",
    ]
    assert bench.ratio_table([dict(meta=META, rows=[row("verify", 1, 5.0)])]) == ""


def test_plot_of_saved_runs(tmp_path):
    png = tmp_path / "saved.png"
    bench.main(["--table", str(SAVED_RUNS), "--runs", "h100-2026-12-07", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_a_line_per_row_label_and_window():
    """A bfloat16 state's rows get lines of their own, not joined to the
    float32 rows of the same op and T."""
    [run] = bench.load_runs(SAVED_RUNS, ["h100-2026-12-07"])
    series = bench.plot_series(run["rows"])
    assert ("verify", "verify, bfloat16 state", 4) in series
    for points in series.values():
        batches = [batch for batch, _ in points]
        assert batches == sorted(set(batches)), "one point per batch on each line"
