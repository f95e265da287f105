"""Runs a compiled two-layer decode step (Inductor, fullgraph) for a few
steps against eager, in a process of its own, for compute-sanitizer:

    compute-sanitizer --tool memcheck python memcheck_worker.py

Exits 0 when every step's outputs and caches match eager. Run it with
PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that every tensor is an allocation of
its own and an access past one is reported instead of landing in another.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from compile_helpers import assert_compiled_steps_match, model_copy, tiny_model  # noqa: E402


def main():
    model = tiny_model("cuda", conv_layout="token_first", num_blocks=40, num_layers=2)
    assert_compiled_steps_match(model, model_copy(model))
    torch.cuda.synchronize()
    print("compiled two-layer step: 3 steps equal eager")


if __name__ == "__main__":
    main()
