"""What a user installs: the version's single source, the files in the wheel."""

import importlib.metadata
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

import kda_ops

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
