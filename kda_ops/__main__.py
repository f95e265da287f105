"""The main job: a short speculative-decoding demo, checked against plain
sequential decoding of the accepted tokens.

    python -m kda_ops [--device cuda|cpu] [--steps 6] [--batch 4] [--record-len 12]

Random KDA layers; each step runs a window of 1..T tokens per request through
verify on every layer, draws how many tokens were accepted, and commits all
layers at once, under both schedules: the immediate one (every commit folds)
and the deferred one (records of R > T positions; the fold is written back
when they run out of room, and a flush at the end; `eager_fold=False`, as
commit would fold every commit at the demo's small batches by default). The
float64 oracle decodes the accepted tokens one by one; after each step the states are compared with
it (in the deferred schedule the checkpoints folded with their pending
records, on copies), and the report gives the largest differences and the
memory the records take.
"""

import argparse
import sys

import torch

import kda_ops
from kda_ops import naive
from kda_ops._cli import cpu_or_cuda_device, exit_unless_cuda_runs, positive_int


def checkpoint_error(state, reference):
    return ((state.cpu().double() - reference).norm() / reference.norm()).item()


def folded_copy(state, correction, key_gate, pending, indices, A_log, dt_bias, lower_bound):
    """The states after every accepted token in the deferred schedule: the
    checkpoints folded with their pending records, by a flush of copies of
    what flush writes (the demo's own buffers keep deferring)."""
    state = state.clone()
    kda_ops.flush(indices, state=state, correction=correction, key_gate=key_gate,
                  pending=pending.clone(), A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return state


def run_demo(device, steps, batch, num_layers=2, H=4, K=32, V=32, T=4, seed=0, on_step=None,
             record_len=None):
    """Runs the demo and returns its report; `on_step`, if given, receives a
    line of progress after each step's commit. `record_len` R > T runs the
    deferred schedule (default T: the immediate one)."""
    R = T if record_len is None else record_len
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    N = batch + 1  # block 0 is the null block
    blocks = list(range(1, batch + 1))
    state = rand(num_layers, N, H, V, K) * 0.1
    reference = state.double().clone()
    state = state.to(device)
    correction = torch.empty(num_layers, N, H, R, V, device=device)
    key_gate = torch.empty(num_layers, N, H, R, 2 * K, dtype=dtype, device=device)
    pending = (torch.zeros(num_layers, N, dtype=torch.int32, device=device) if R > T
               else None)
    A_log = (rand(num_layers, H) * 0.5).to(device)
    dt_bias = rand(num_layers, H, K).to(device)
    indices = torch.tensor(blocks, dtype=torch.int32, device=device)
    lower_bound = -5.0
    worst_out, worst_state, tokens_checked, accepted_total = 0.0, 0.0, 0, 0
    for step in range(1, steps + 1):
        step_worst_out = 0.0
        lens = torch.randint(1, T + 1, (batch,), generator=gen)
        accepted = torch.minimum(torch.randint(1, T + 1, (batch,), generator=gen), lens)
        starts = torch.zeros(batch + 1, dtype=torch.int32)
        starts[1:] = lens.cumsum(0)
        n = int(starts[-1])
        for layer in range(num_layers):
            q, k, g = (rand(n, H, K).to(dtype) for _ in range(3))
            v, beta = rand(n, H, V).to(dtype), rand(n, H).to(dtype)
            out = kda_ops.verify(q.to(device), k.to(device), v.to(device), g.to(device),
                                 beta.to(device), A_log[layer], dt_bias[layer], state[layer],
                                 correction[layer], key_gate[layer], starts.to(device), indices,
                                 lower_bound=lower_bound,
                                 pending=None if pending is None else pending[layer],
                                 spec_len=None if pending is None else T).cpu()
            for b in range(batch):
                for t in range(int(accepted[b])):
                    tok = int(starts[b]) + t
                    for h in range(H):
                        S, _, o = naive.step(reference[layer, blocks[b], h], q[tok, h], k[tok, h],
                                             v[tok, h], g[tok, h], beta[tok, h],
                                             A_log[layer, h].cpu(), dt_bias[layer, h].cpu(),
                                             lower_bound, K ** -0.5)
                        reference[layer, blocks[b], h] = S
                        scale = o.abs().max().item() + 1e-6
                        step_worst_out = max(step_worst_out,
                                             (out[tok, h].double() - o).abs().max().item() / scale)
                    tokens_checked += 1
        worst_out = max(worst_out, step_worst_out)
        accepted_total += int(accepted.sum())
        kda_ops.commit(accepted.to(torch.int32).to(device), indices, starts.to(device),
                       state=state, conv_state=None, correction=correction, key_gate=key_gate,
                       A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
                       **({} if pending is None else
                          dict(pending=pending, spec_len=T, eager_fold=False)))
        if pending is None:
            step_state, held = state, "checkpoint"
        else:
            step_state = folded_copy(state, correction, key_gate, pending, indices, A_log,
                                     dt_bias, lower_bound)
            held = f"checkpoint and up to {int(pending.max())} pending records"
        step_state_error = checkpoint_error(step_state, reference)
        worst_state = max(worst_state, step_state_error)
        if on_step is not None:
            on_step(f"step {step}/{steps}: {int(accepted.sum())} tokens accepted per layer, "
                    f"max output error {step_worst_out:.2e}, "
                    f"state error {step_state_error:.2e} ({held})")
    if pending is not None:  # the checkpoints hold every accepted token only after a flush
        kda_ops.flush(indices, state=state, correction=correction, key_gate=key_gate,
                      pending=pending, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    state_error = checkpoint_error(state, reference)
    record_bytes = H * R * (V * 4 + 2 * K * key_gate.element_size())
    full_state_bytes = H * T * V * K * 4
    return dict(device=str(device), dtype=str(dtype), steps=steps, batch=batch, record_len=R,
                layers=num_layers, accepted_tokens=accepted_total, tokens_checked=tokens_checked,
                max_output_rel_error=worst_out, max_step_state_rel_error=worst_state,
                state_rel_error=state_error,
                record_bytes=record_bytes, full_state_bytes=full_state_bytes)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kda_ops",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=cpu_or_cuda_device,
                        default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the ops run: cpu (float32 activations) or cuda[:N] "
                             "(bfloat16 activations) (default: cuda when torch finds a GPU, "
                             "else cpu)")
    parser.add_argument("--steps", type=positive_int, default=6,
                        help="decoding steps, each a verify of every layer and one commit "
                             "(default: %(default)s)")
    parser.add_argument("--batch", type=positive_int, default=4,
                        help="requests per step, each with a window of 1 to 4 tokens "
                             "(default: %(default)s)")
    parser.add_argument("--record-len", type=positive_int, default=12,
                        help="record positions R of the deferred schedule, at least T = 4 "
                             "(default: %(default)s)")
    opts = parser.parse_args(argv)
    if opts.record_len < 4:
        parser.error(f"argument --record-len: must be at least T = 4, got {opts.record_len}")
    if opts.device.type == "cuda":
        exit_unless_cuda_runs(parser.prog, f"--device {opts.device}", "run with --device cpu",
                              opts.device.index)
    ok = True
    for schedule, record_len in (("immediate", None), ("deferred", opts.record_len)):
        report = run_demo(opts.device, opts.steps, opts.batch, record_len=record_len,
                          on_step=lambda line: print(f"{schedule}: {line}", file=sys.stderr,
                                                     flush=True))
        tol = 2e-2 if report["dtype"] == "torch.bfloat16" else 1e-4
        ok &= (report["max_output_rel_error"] < tol and report["state_rel_error"] < 1e-4
               and report["max_step_state_rel_error"] < 1e-4)
        print(f"kda_ops {opts.steps}-step speculative decoding demo on {report['device']} "
              f"({report['layers']} layers, batch {report['batch']}, activations "
              f"{report['dtype']}), {schedule} schedule (records of R = "
              f"{report['record_len']} tokens)")
        print(f"  accepted tokens decoded and checked: {report['accepted_tokens']} per layer, "
              f"{report['tokens_checked']} outputs")
        print(f"  max output error vs sequential float64 decoding: "
              f"{report['max_output_rel_error']:.2e} (relative to each output's max)")
        print(f"  state error after each step: at most {report['max_step_state_rel_error']:.2e}"
              f"; checkpoint error after all commits: {report['state_rel_error']:.2e} "
              f"(relative norms)")
        print(f"  per request and layer: records {report['record_bytes']:,} B vs "
              f"{report['full_state_bytes']:,} B for one state per window token "
              f"({report['full_state_bytes'] / report['record_bytes']:.1f}x less)")
    print("  result:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
