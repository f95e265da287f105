"""The command lines: `python -m kda_ops` (the main job) and `python -m kda_ops.bench`."""

import functools
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import kda_ops
from kda_ops import __main__ as main_job
from kda_ops import bench, ops

PACKAGE_PARENT = pathlib.Path(kda_ops.__file__).resolve().parent.parent
MODULES = ["kda_ops", "kda_ops.bench"]
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="checks the exit without a CUDA GPU")


def run_module(module, *args):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True,
                          text=True, timeout=300)


@functools.lru_cache
def help_output(module):
    result = run_module(module, "--help")
    assert result.returncode == 0, result.stderr
    return result.stdout


def option_help(help_text):
    """{option signature: its help text} from argparse's --help output."""
    entries = []
    for line in help_text.split("\noptions:\n", 1)[1].splitlines():
        if line.startswith("  -"):
            entries.append(re.split(r"\s{2,}", line.strip(), maxsplit=1))
        elif line.startswith("    ") and entries:
            entries[-1].append(line.strip())
    return {entry[0]: " ".join(entry[1:]) for entry in entries}


@pytest.mark.parametrize("module", MODULES)
def test_usage_names_the_module_to_run(module):
    assert help_output(module).startswith(f"usage: python -m {module} [-h]")


@pytest.mark.parametrize("module, options", [
    ("kda_ops", ["--device", "--steps", "--batch", "--record-len"]),
    ("kda_ops.bench", ["--ops", "--batches", "--spec-lens", "--record-lens", "--eager-fold",
                       "--acceptance",
                       "--state-dtypes", "--layers", "--save", "--run", "--plot", "--table",
                       "--runs"]),
])
def test_every_option_has_help(module, options):
    helps = option_help(help_output(module))
    assert sorted(signature.split()[0].rstrip(",") for signature in helps) == sorted(
        ["-h"] + options)
    for signature, text in helps.items():
        assert text, f"{signature} has no help"
    if module == "kda_ops":
        assert all("(default:" in text for signature, text in helps.items()
                   if not signature.startswith("-h"))


@pytest.mark.parametrize("args, option", [
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--batch", "0"], "--batch"),
    (["--record-len", "3"], "--record-len"),
    (["--device", "tpu"], "--device"),
])
def test_main_job_rejects_bad_values_naming_the_option(args, option):
    result = run_module("kda_ops", *args)
    assert result.returncode == 2
    assert f"python -m kda_ops: error: argument {option}:" in result.stderr
    assert not result.stdout


@needs_no_cuda
@pytest.mark.parametrize("module, args", [("kda_ops", ["--device", "cuda"]),
                                          ("kda_ops.bench", ["--ops", "verify"])])
def test_cuda_without_a_gpu_is_one_line(module, args):
    result = run_module(module, *args)
    assert result.returncode == 1
    assert len(result.stderr.splitlines()) == 1
    assert result.stderr.startswith(f"python -m {module}: error: ")
    assert "needs a CUDA GPU" in result.stderr


@pytest.mark.parametrize("run_main", [
    lambda: main_job.main(["--device", "cuda"]),
    lambda: bench.main(["--ops", "verify"]),
])
def test_cuda_without_triton_is_one_line(monkeypatch, run_main):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ops, "triton_import_error", ImportError("No module named 'triton'"))
    with pytest.raises(SystemExit) as exit_info:
        run_main()
    message = str(exit_info.value.code)
    assert len(message.splitlines()) == 1
    assert message.endswith(ops.MISSING_TRITON.removeprefix("kda_ops: "))


def test_main_job_reports_each_step_on_stderr():
    result = run_module("kda_ops", "--device", "cpu", "--steps", "3", "--batch", "2")
    assert result.returncode == 0, result.stderr
    for schedule in ("immediate", "deferred"):
        steps = [line for line in result.stderr.splitlines()
                 if line.startswith(f"{schedule}: step ")]
        assert [line.split(":")[1].strip() for line in steps] == ["step 1/3", "step 2/3",
                                                                  "step 3/3"]
        assert all("tokens accepted per layer, max output error" in line for line in steps)
        # Every step's states agree with sequential decoding, the deferred ones
        # with the pending records folded in (on copies: the schedule goes on deferring).
        errors = [float(re.search(r"state error (\S+) \(", line).group(1)) for line in steps]
        assert max(errors) < 1e-4, steps
        held = "checkpoint)" if schedule == "immediate" else "pending records)"
        assert all(line.endswith(held) for line in steps), steps
        if schedule == "deferred":  # it defers, though the default folds at this batch
            assert any(int(re.search(r"up to (\d+) pending", line).group(1)) > 0
                       for line in steps), steps
    assert not any(": step " in line for line in result.stdout.splitlines())
    assert result.stdout.splitlines()[-1] == "  result: OK"


def test_benchmark_reports_each_row_on_stderr(monkeypatch, capsys):
    """Each measured row is printed as it is measured, to stderr: stdout keeps
    the summary and the table."""
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: 1e12)
    monkeypatch.setattr(bench, "graph_time_us", lambda calls: 10.0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    _, rows = bench.run(["verify", "commit"], [1, 2], [2], 2, "cpu")
    out, err = capsys.readouterr()
    assert not out
    lines = err.splitlines()
    assert len(lines) == len(rows) == 4
    assert [line.split()[:3] for line in lines] == [
        ["verify", "T=2", "B="], ["verify", "T=2", "B="], ["commit", "T=2", "B="],
        ["commit", "T=2", "B="]]
