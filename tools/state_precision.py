"""Accuracy of a bfloat16 checkpoint against a float32 one, both against float64.

    python tools/state_precision.py [--steps 1000] [--batch 8] [--heads 4]
        [--spec-len 4] [--acceptance 0.7] [--record-len R] [--device cpu|cuda] [--seed 0]

Runs the same speculative decode of one layer (K = V = 128, `--heads` heads)
with the checkpoint in bfloat16, in float32 and in float64 (every tensor of
the float64 run in float64: docs/semantics.md#12-float64, the reference), for
`--steps` steps of random windows of 1..T tokens whose drafts are accepted
each with `--acceptance`, from the same inputs: random values rounded to
bfloat16, held in float32 (float64 for the reference), so that the outputs
are not rounded to bfloat16 and the errors are the state's and the
arithmetic's. Model-like magnitudes: gate
parameters as KDA initialises them (A = exp(A_log) uniform in [1, 16],
dt_bias the inverse softplus of dt log-uniform in [1e-3, 1e-1]), unit-scale
raw q, k, v, gate inputs and beta logits. Prints, per state dtype, the
relative error (Frobenius norm over the whole tensor) of the outputs of the
last step and of the states after the last step, and the largest output
error over all steps. With `--record-len R > T`, the deferred schedule with
tokens kept pending at every batch (`eager_fold=False`; below 16 requests
commit's default folds every commit, as the immediate schedule does).
"""

import argparse
import math

import torch

import kda_ops


def gate_parameters(heads, key_dim, gen):
    A = torch.empty(heads).uniform_(1.0, 16.0, generator=gen)
    dt = torch.exp(torch.empty(heads, key_dim).uniform_(math.log(1e-3), math.log(1e-1),
                                                         generator=gen))
    return torch.log(A), dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)


def rel(actual, expected):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return (torch.linalg.vector_norm(actual - expected)
            / torch.linalg.vector_norm(expected).clamp_min(1e-300)).item()


def run(opts):
    gen = torch.Generator().manual_seed(opts.seed)
    H, K, T, B = opts.heads, 128, opts.spec_len, opts.batch
    R = opts.record_len or T
    N = B + 1
    A_log, dt_bias = gate_parameters(H, K, gen)
    blocks = torch.arange(1, N, dtype=torch.int32)
    runs = {}
    # float32 activations holding bfloat16 values: the outputs are not rounded
    # to bfloat16, so the errors are the state's and the arithmetic's.
    for name, state_dtype, act_dtype in (("bfloat16", torch.bfloat16, torch.float32),
                                         ("float32", torch.float32, torch.float32),
                                         ("float64", torch.float64, torch.float64)):
        record_dtype = torch.float64 if state_dtype == torch.float64 else torch.float32
        runs[name] = dict(
            state=torch.zeros(N, H, K, K, dtype=state_dtype, device=opts.device),
            correction=torch.zeros(N, H, R, K, dtype=record_dtype, device=opts.device),
            key_gate=torch.zeros(N, H, R, 2 * K, dtype=act_dtype, device=opts.device),
            pending=(torch.zeros(N, dtype=torch.int32, device=opts.device)
                     if R > T else None),
            act_dtype=act_dtype, worst=0.0)
    for step in range(opts.steps):
        lens = torch.randint(1, T + 1, (B,), generator=gen)
        drafts = torch.rand(B, T - 1, generator=gen) < opts.acceptance
        accepted = 1 + drafts.int().cumprod(1).sum(1).clamp(max=T - 1)
        accepted = torch.minimum(accepted, lens).to(torch.int32)
        qsl = torch.zeros(B + 1, dtype=torch.int32)
        qsl[1:] = lens.cumsum(0)
        n = int(qsl[-1])
        # The inputs, rounded to bfloat16 once; the float64 run takes those values.
        inputs = [torch.randn(n, H, K, generator=gen).bfloat16() for _ in range(4)]
        inputs.append(torch.randn(n, H, generator=gen).bfloat16())
        outs = {}
        for name, r in runs.items():
            q, k, v, g, beta = (t.to(r["act_dtype"]).to(opts.device) for t in inputs)
            window = dict(pending=r["pending"], spec_len=T) if r["pending"] is not None else {}
            outs[name] = kda_ops.verify(q, k, v, g, beta, A_log.to(opts.device),
                                        dt_bias.to(opts.device), r["state"], r["correction"],
                                        r["key_gate"], qsl.to(opts.device),
                                        blocks.to(opts.device), **window)
            kda_ops.commit(accepted.to(opts.device), blocks.to(opts.device),
                           qsl.to(opts.device), state=r["state"], correction=r["correction"],
                           key_gate=r["key_gate"], A_log=A_log.to(opts.device),
                           dt_bias=dt_bias.to(opts.device),
                           **(dict(window, eager_fold=False) if window else {}))
        for name in ("bfloat16", "float32"):
            runs[name]["worst"] = max(runs[name]["worst"], rel(outs[name], outs["float64"]))
    if R > T:
        for r in runs.values():
            kda_ops.flush(blocks.to(opts.device), state=r["state"], correction=r["correction"],
                          key_gate=r["key_gate"], pending=r["pending"],
                          A_log=A_log.to(opts.device), dt_bias=dt_bias.to(opts.device))
    reference = runs["float64"]["state"]
    print(f"{opts.steps} steps, B = {B}, H = {H}, K = V = 128, T = {T}"
          + (f", R = {R}" if R > T else "") + f", acceptance {opts.acceptance}, "
          f"on {opts.device}\n")
    print("| state dtype | outputs, last step | outputs, worst step | state after the last step |")
    print("|---|---|---|---|")
    for name in ("bfloat16", "float32"):
        print(f"| {name} | {rel(outs[name], outs['float64']):.1e} | {runs[name]['worst']:.1e} "
              f"| {rel(runs[name]['state'], reference):.1e} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--spec-len", type=int, default=4)
    parser.add_argument("--record-len", type=int, default=None)
    parser.add_argument("--acceptance", type=float, default=0.7)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    run(parser.parse_args(argv))


if __name__ == "__main__":
    main()
