"""Loads an AOTInductor package and runs it, in a process of its own (loading
has crashed with SIGSEGV with some toolchains, docs/compile.md#5-aotinductor;
the parent test tells a crash from a failure by the exit status, and a crash
in the loader from one in the package's run by a line printed after loading).

    python aoti_worker.py PACKAGE CASES_FILE RESULTS_FILE

CASES_FILE holds a list of argument lists (CPU tensors). Each case is moved to
the package's device and run once; RESULTS_FILE gets, per case, the outputs and
every argument after the call (the package mutates the cache arguments in
place), back on the CPU.
"""

import sys

import torch

LOADED = "package loaded"


def main(package, cases_file, results_file):
    import kda_ops  # noqa: F401  (the ops' Python registrations, as an engine would have)

    compiled = torch._inductor.aoti_load_package(package)
    print(LOADED, flush=True)  # a crash before this line is in the loader
    cases = torch.load(cases_file)
    device = cases["device"]
    results = []
    for args in cases["cases"]:
        args = [a.to(device) for a in args]
        out = compiled(*args)
        outs = out if isinstance(out, (list, tuple)) else [out]
        torch.cuda.synchronize() if device == "cuda" else None
        results.append(([o.cpu() for o in outs], [a.cpu() for a in args]))
    torch.save(results, results_file)
    print("ok", len(results))


if __name__ == "__main__":
    main(*sys.argv[1:4])
