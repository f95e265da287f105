"""Shared test utilities: devices, the relative-error check, random inputs."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Set by tests/test_sanitizer.py for the tests it runs under compute-sanitizer.
UNDER_SANITIZER = os.environ.get("KDA_OPS_TESTS_UNDER_SANITIZER") == "1"


def long_run_steps(steps, short):
    """Steps of a long-run test: `short` interpreted or under compute-sanitizer
    (each launch checked; memcheck wants every kernel path, not many repeats)."""
    return short if INTERPRET or UNDER_SANITIZER else steps
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Relative error bounds by the dtype the result is stored in: fp32 arithmetic
# lands near 1e-6; a bf16/fp16 store rounds each element by up to 2^-8 / 2^-11.
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def assert_out_required(op, call):
    """`op`'s schema has a required, written `out` (no default, not Optional), and
    the dispatcher refuses a call without it before the op body runs."""
    out = next(a for a in op.default._schema.arguments if a.name == "out")
    assert out.alias_info is not None and out.alias_info.is_write
    assert not out.has_default_value() and str(out.type) == "Tensor"
    with pytest.raises((RuntimeError, TypeError), match="out"):
        call()


def rel_error(actual, expected):
    """||actual - expected|| / ||expected|| in float64 (NaN anywhere -> inf)."""
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if torch.isnan(actual).any() or torch.isnan(expected).any():
        return float("inf")
    return (torch.linalg.vector_norm(actual - expected)
            / torch.linalg.vector_norm(expected).clamp_min(1e-30)).item()


def assert_rel_close(actual, expected, tol=None, name="value"):
    tol = TOLERANCE[actual.dtype] if tol is None else tol
    err = rel_error(actual, expected)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def guarded(shape, dtype, device, generator=None, guard=2):
    """A random tensor that is a view into a larger random buffer, with `guard`
    extra slices on both sides of the first dim. Returns (view, buffer): after an
    op, everything in the buffer outside the view must be bit-identical."""
    full = (shape[0] + 2 * guard,) + tuple(shape[1:])
    buffer = torch.randn(full, generator=generator, dtype=torch.float32).to(dtype).to(device)
    return buffer[guard:guard + shape[0]], buffer


def outside(view, buffer):
    """The elements of `buffer` outside `view` (a first-dim slice of it), flattened."""
    guard = view.storage_offset() // max(buffer[0].numel(), 1) if buffer.dim() else 0
    return torch.cat([buffer[:guard].flatten(), buffer[guard + view.shape[0]:].flatten()])


def query_start_loc(lens, device):
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return out.to(device)
