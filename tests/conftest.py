"""Test-process settings.

Each pytest-xdist worker takes its share of the cores for torch's threads:
with one OpenMP pool per worker sized to every core, the pools' spinning
threads starve each other (the transformers tests took over ten minutes on
two cores with two workers of two threads, 32 s with one thread each).

Under Triton's interpreter each launch runs in a thread of its own, so that
its Python frames start at the bottom of a fresh stack. CPython 3.11 keeps
frames in 16 KiB chunks and frees a chunk as soon as the frame that opened it
returns: where a chunk boundary falls inside a kernel's nested calls, every
call there allocates and frees a chunk. How deep pytest calls a test decides
where the boundary falls, and one verify test took 8.2 s at one depth and
17.8 s at another; on a fresh stack it takes 8.3-8.6 s at every depth.
"""

import os
import threading

import torch

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))

if os.environ.get("TRITON_INTERPRET") == "1":
    from triton.runtime import interpreter

    _run_launch = interpreter.InterpretedFunction.run

    def _run_launch_on_fresh_stack(self, *args, **kwargs):
        outcome = {}

        def launch():
            try:
                outcome["result"] = _run_launch(self, *args, **kwargs)
            except BaseException as error:  # re-raised in the caller's thread
                outcome["error"] = error

        thread = threading.Thread(target=launch, name="triton-interpreter-launch")
        thread.start()
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("result")

    interpreter.InterpretedFunction.run = _run_launch_on_fresh_stack
