"""Each pytest-xdist worker takes its share of the cores for torch's threads:
with one OpenMP pool per worker sized to every core, the pools' spinning
threads starve each other (the transformers tests took over ten minutes on
two cores with two workers of two threads, 32 s with one thread each)."""

import os

import torch

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
