"""What a user installs: the version's single source, the files in the wheel,
and the CPU path where triton is not installed."""

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

import kda_ops
from kda_ops.ops import MISSING_TRITON, MISSING_TRITON_INTERPRET

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_PARENT = pathlib.Path(kda_ops.__file__).resolve().parent.parent


def pyproject():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_comes_from_the_package():
    project = pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kda_ops.__version__"}


def test_installed_metadata_matches_the_package_version():
    try:
        installed = importlib.metadata.version("kda_ops")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kda_ops is not installed")
    assert installed == kda_ops.__version__


def test_missing_triton_error_asks_for_the_required_triton():
    (triton,) = [dep for dep in pyproject()["project"]["dependencies"] if dep.startswith("triton")]
    required = triton.split(";")[0].strip()
    assert f"pip install '{required}'" in MISSING_TRITON
    assert f"pip install '{required}'" in MISSING_TRITON_INTERPRET


def test_changelog_has_an_entry_for_the_version():
    assert f"## [{kda_ops.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


def copy_of_the_source(destination):
    """The source tree without build outputs, so that a build leaves the checkout clean."""
    shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "dist", ".pytest_cache"))
    return destination


def build(kind, tmp_path):
    """Builds a wheel or sdist with the installed setuptools (no download)."""
    setuptools = pytest.importorskip("setuptools")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip("the license expression needs setuptools >= 77")
    source = copy_of_the_source(tmp_path / "source")
    out = tmp_path / "out"
    subprocess.run([sys.executable, "-c",
                    f"from setuptools import build_meta; build_meta.build_{kind}({str(out)!r})"],
                   cwd=source, check=True, capture_output=True)
    (built,) = out.iterdir()
    return built


def test_wheel_ships_the_license_the_type_marker_and_the_version(tmp_path):
    wheel = build("wheel", tmp_path)
    version = kda_ops.__version__
    assert wheel.name.startswith(f"kda_ops-{version}-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = archive.read(f"kda_ops-{version}.dist-info/METADATA").decode()
    assert f"kda_ops-{version}.dist-info/licenses/LICENSE" in names
    assert "kda_ops/py.typed" in names
    assert "kda_ops/kernels/verify.py" in names
    assert "License-Expression: Apache-2.0" in metadata.splitlines()


def test_sdist_ships_the_docs_changelog_and_tests(tmp_path):
    sdist = build("sdist", tmp_path)
    with tarfile.open(sdist) as archive:
        names = {name.partition("/")[2] for name in archive.getnames()}
    docs = {f"docs/{path.name}" for path in (ROOT / "docs").iterdir()}
    assert docs <= names
    assert {"README.md", "CHANGELOG.md", "LICENSE", "pyproject.toml", "kda_ops/py.typed",
            "tests/test_bench.py", "compile_tests/conftest.py"} <= names
    assert not any("__pycache__" in name for name in names)


# Makes `import triton` fail as it does where triton is not installed.
BLOCK_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTriton())
"""

# One request of a two-token window in block 1 of three: verify, then commit both tokens.
VERIFY_AND_COMMIT = """
import torch
import kda_ops

H, K, V, T, N = 2, 8, 8, 2, 3
gen = torch.Generator().manual_seed(0)
q, k, g = (torch.randn(T, H, K, generator=gen) for _ in range(3))
v, beta = torch.randn(T, H, V, generator=gen), torch.rand(T, H, generator=gen)
A_log, dt_bias = torch.zeros(H), torch.zeros(H, K)
state = torch.zeros(N, H, V, K)
correction, key_gate = torch.empty(N, H, T, V), torch.empty(N, H, T, 2 * K)
starts, blocks = torch.tensor([0, T], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
out = kda_ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate, starts, blocks)
kda_ops.commit(torch.tensor([T], dtype=torch.int32), blocks, starts, state=state,
               conv_state=None, correction=correction, key_gate=key_gate, A_log=A_log,
               dt_bias=dt_bias)
"""


def run_without_triton(script, interpret=False):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", BLOCK_TRITON + script], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cpu_path_works_without_triton():
    result = run_without_triton(VERIFY_AND_COMMIT + """
import sys
import kda_ops.bench, kda_ops.planner, kda_ops.models
assert "triton" not in sys.modules
assert out.abs().sum() > 0
assert state[1].abs().sum() > 0 and not state[0].any() and not state[2].any()
print("version", kda_ops.__version__)
""")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["version", kda_ops.__version__]
    assert "Triton not available" not in result.stderr


def test_triton_kernels_without_triton_raise_one_clear_error():
    """TRITON_INTERPRET=1 sends CPU tensors to the Triton kernels, as CUDA
    tensors always are: without triton, the op names what to install."""
    result = run_without_triton(VERIFY_AND_COMMIT, interpret=True)
    assert result.returncode != 0
    assert result.stderr.strip().splitlines()[-1] == f"ImportError: {MISSING_TRITON_INTERPRET}"


def test_import_kda_ops_leaves_transformers_alone():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", "import sys, kda_ops, kda_ops.bench\n"
                             "assert 'transformers' not in sys.modules"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def test_transformers_extra_pins_the_version_the_tests_use():
    extras = pyproject()["project"]["optional-dependencies"]
    (pin,) = extras["transformers"]
    assert pin.startswith("transformers") and pin in extras["test"]


def test_transformers_tests_skip_without_transformers():
    """Without transformers, its tests are skipped, and kda_ops.transformers
    says what to install."""
    block = BLOCK_TRITON.replace('"triton"', '"transformers"')
    script = block + (
        "import pytest\n"
        "try:\n"
        "    import kda_ops.transformers\n"
        "except ImportError as error:\n"
        "    print(error)\n"
        f"sys.exit(pytest.main(['-q', '-p', 'no:xdist', '-p', 'no:cacheprovider', "
        f"{str(ROOT / 'tests' / 'test_transformers.py')!r}]))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=ROOT / "tests")
    # pytest exits with 5 when the one module it was given is skipped whole.
    assert result.returncode in (0, 5), result.stdout + result.stderr
    assert "pip install 'kda_ops[transformers]'" in result.stdout
    assert "skipped" in result.stdout and "passed" not in result.stdout
