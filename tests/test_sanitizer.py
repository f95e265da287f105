"""compute-sanitizer over the deferred schedule's, the tree drafts' and
conv_verify's CUDA tests: every verify form with pending records, the
deferred commit in both its forms (a program per tile; the fold plan, whose
persistent programs claim tiles from a counter), flush and align mode; tree
verify in every form that takes trees, conv_update of trees and the commit of
accepted paths (align mode included), in both schedules; conv_verify in every
form, fused or not; in a process of their own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import requires_cuda

TESTS = Path(__file__).parent
# The CUDA tests it runs: in test_verify.py those with pending records, in
# test_deferred.py, test_trees.py and test_conv_verify.py all of them (the
# long runs with their interpreted step counts: helpers.long_run_steps).
SELECTION = [str(TESTS / "test_verify.py"), str(TESTS / "test_deferred.py"),
             str(TESTS / "test_trees.py"), str(TESTS / "test_conv_verify.py"), "-k",
             "cuda and (pending or deferred or trees or conv_verify)"]


@requires_cuda
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None,
                    reason="compute-sanitizer (CUDA toolkit) is not on PATH")
def test_deferred_tree_and_conv_verify_kernels_under_memcheck_on_cuda():
    """memcheck finds no access outside an allocation (every tensor its own
    allocation: PyTorch's caching allocator off), and the tests still pass
    under it."""
    env = dict(os.environ, PYTORCH_NO_CUDA_MEMORY_CACHING="1",
               KDA_OPS_TESTS_UNDER_SANITIZER="1")
    proc = subprocess.run(
        ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "3", sys.executable,
         "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *SELECTION],
        capture_output=True, text=True, env=env, timeout=1200, cwd=TESTS.parent)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "ERROR SUMMARY: 0 errors" in output, output[-4000:]
    assert " passed" in output and "skipped" not in output, output[-2000:]
