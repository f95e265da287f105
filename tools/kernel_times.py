"""Device time of each kernel of one verify and one commit, under both schedules.

    python tools/kernel_times.py [--batches 1,16,64] [--spec-len 4] [--record-len 12]
        [--pending 0,4,8] [--accepted 2] [--layers 16] [--verify-form FORM]
        [--listed-folds on|off]

Where a decode step's time goes, kernel by kernel: for each batch, verify (one
layer) and commit (every layer) in the immediate schedule, then in the
deferred one with every block holding each count of pending records in turn
(the counts are reset after each commit, so every call sees the same count;
commit keeps tokens pending at every batch, `eager_fold=False`).
Each kernel's time is the median over 40 calls of its device time in
torch.profiler, launched plainly (no programmatic launch, so no kernel waits
inside its predecessor). Inputs rotate over index sets, as in the benchmark
(one layer's states over at least 512 MiB, at most 64 sets), so that the
states are not in the L2. The shapes are the benchmark's: H = 32, K = V =
128, fp32 state, bf16 activations, lower bound on. Needs a CUDA GPU.
"""

import argparse
import collections
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import kda_ops
from kda_ops import bench
from kda_ops.kernels.dispatch import VERIFY_FORMS, kernel_choices

CALLS = 40


def kernel_times(fn, calls=CALLS):
    """{kernel name: median device time in µs} over `calls` calls of `fn`."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times = collections.defaultdict(list)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name].append(event.device_time)
    return {name: statistics.median(t) for name, t in times.items()}


def setup(batch, spec_len, layers, records, pending_count, accepted_count, sets, device="cuda"):
    """(verify, commit) closures over the benchmark's buffers (bench._commit_buffers,
    bench._token_inputs) of `sets * batch` blocks; the deferred schedule where
    `records` > `spec_len`, every block holding `pending_count`."""
    T = spec_len
    # Kept pending (eager_fold=False): the counts decide the folds at every batch.
    shape = bench.Shape(batch=batch, spec_len=T, layers=layers,
                        record_len=records if records > T else None,
                        eager_fold=False if records > T else None)
    N = sets * batch + 1
    bufs = bench._commit_buffers(shape, device, N)
    del bufs["conv_state"]  # the state kernels only
    q, k, g, v, beta = bench._token_inputs(shape, device)
    starts = bench._window_starts(shape, device)
    index_sets = bench._index_sets(sets, batch, device)
    accepted = torch.full((batch,), accepted_count, device=device, dtype=torch.int32)
    out = torch.empty_like(v)
    deferred = shape.record_len is not None
    if deferred:
        bufs["pending"].fill_(pending_count)
    turn = [0]

    def next_indices():
        turn[0] += 1
        return index_sets[turn[0] % sets]

    def verify():
        schedule = dict(pending=bufs["pending"][0], spec_len=T) if deferred else {}
        kda_ops.verify(q, k, v, g, beta, bufs["A_log"][0], bufs["dt_bias"][0], bufs["state"][0],
                       bufs["correction"][0], bufs["key_gate"][0], starts, next_indices(),
                       lower_bound=-5.0, out=out, **schedule)

    def commit():
        kda_ops.commit(accepted, next_indices(), starts, lower_bound=-5.0, **bufs)
        if deferred:
            bufs["pending"].fill_(pending_count)

    return verify, commit


def rotation_sets(batch):
    """The benchmark's index sets for verify at `batch` requests (bench._block_pool
    of one layer's states): 64 at B = 1, 4 at B = 64, 1 from B = 256."""
    shape = bench.Shape(batch=batch, spec_len=1, layers=1)
    return bench._block_pool(shape, bench._state_block_bytes(shape))[0]


def _ints(text):
    return [int(x) for x in text.split(",")]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tools/kernel_times.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--spec-len", type=int, default=4, help="T (default 4)")
    parser.add_argument("--record-len", type=int, default=12,
                        help="the deferred schedule's R > T (default 12)")
    parser.add_argument("--pending", default="0,4,8",
                        help="pending counts of the deferred rows (default 0,4,8)")
    parser.add_argument("--accepted", type=int, default=2,
                        help="tokens each commit accepts (default 2)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--verify-form", default=None, choices=VERIFY_FORMS,
                        help="verify's form instead of the policy's")
    parser.add_argument("--listed-folds", default=None, choices=("on", "off"),
                        help="the deferred commit's listed folds on or off instead of the "
                             "policy's")
    args = parser.parse_args(argv)
    listed = None if args.listed_folds is None else args.listed_folds == "on"
    T = args.spec_len
    cases = [(T, 0)] + [(args.record_len, p) for p in _ints(args.pending)]
    with kernel_choices(programmatic_launch=False, verify_form=args.verify_form,
                        listed_folds=listed):
        for batch in _ints(args.batches):
            for records, pending_count in cases:
                verify, commit = setup(batch, T, args.layers, records, pending_count,
                                       args.accepted, sets=rotation_sets(batch))
                label = ("immediate" if records == T
                         else f"deferred R = {records}, {pending_count} pending")
                for op, fn in (("verify", verify), (f"commit of {args.layers} layers", commit)):
                    times = kernel_times(fn)
                    kernels = ", ".join(f"{name} {us:.1f} µs" for name, us in sorted(times.items())
                                        if "Fill" not in name)  # the count reset
                    print(f"B = {batch}, T = {T}, {label}: {op}: {kernels}", flush=True)
                del verify, commit
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
