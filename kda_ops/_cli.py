"""Argument types and device checks shared by `python -m kda_ops` and
`python -m kda_ops.bench`."""

import argparse

import torch

from . import ops


def positive_int(text):
    if not (text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def cpu_or_cuda_device(text):
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return device


def exit_unless_cuda_runs(prog, what, instead, index=None):
    """Exits with one line, instead of a traceback from the first kernel, when
    torch has no CUDA GPU (numbered `index`) for `what` or triton is missing;
    `instead` says what works without one."""
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not found:
        raise SystemExit(f"{prog}: error: {what} needs a CUDA GPU, and torch "
                         f"{torch.__version__} finds none; {instead}")
    if index is not None and index >= found:
        raise SystemExit(f"{prog}: error: {what}: torch finds {found} CUDA GPU(s); {instead}")
    if ops.triton_import_error is not None:
        raise SystemExit(f"{prog}: error: {ops.MISSING_TRITON.removeprefix('kda_ops: ')}")
