"""Registers, spills and shared memory of the kda_ops kernels on sm_90, offline.

    python tools/kernel_resources.py [--spec-lens 2,4,8] [--batch 128] [--record-len R]
        [--verify-form token_loop|closed_form|tensor_cores|separate_terms] [--tree]
        [--ttgir DIR] [--sass]

Compiles the state kernels and conv_update for an H100/H200 target without a
GPU (Triton's compiler plus the ptxas it ships), at the benchmark's shapes
(H = 32, K = V = 128, bf16 activations, lower bound on) with the kernels and
launch settings that the launchers themselves take (kernels/dispatch.py), and
prints what `ptxas -v` reports. Unit strides are specialised to 1 and pointers and other strides marked
16-divisible, as at a real launch, so the layouts match what the GPU runs. A
quick check without a GPU: spills or a register count that halves occupancy
show up here. With --sass it also counts the SASS instructions of each kernel
(nvdisasm) and the size of every loop body (a backward branch), from which
the instructions a warp issues follow once the loops' trip counts are known.
Written against Triton 3.9. Triton 3.6, which docs/performance.md's numbers
ran on, can choose other layouts (3-D tiles: see the chunk-major tile in
kernels/verify.py); to see its code, run this tool from an environment made
with `pip install 'torch==2.13.0' 'triton==3.6.0'`, with PYTHONPATH set to
the checkout.
"""

import argparse
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kda_ops.constants import DEFERRED_EAGER_FOLD_BELOW_BATCH
from kda_ops.kernels import commit as commit_kernels
from kda_ops.kernels import conv as conv_kernels
from kda_ops.kernels import dispatch
from kda_ops.kernels import verify as verify_kernels

TARGET = GPUTarget("cuda", 90, 32)
UNIT_STRIDES = {"stride_q_dim", "stride_k_dim", "stride_v_dim", "stride_g_dim", "stride_s_k",
                "stride_c_dim", "stride_kg_dim", "stride_o_dim", "stride_dt_dim",
                "stride_beta_head", "stride_A_head", "stride_query_start",
                "stride_state_indices", "stride_accepted", "stride_request", "stride_computed",
                "stride_x_dim", "stride_conv_dim", "stride_out_dim", "stride_w_tap",
                "stride_bias"}
ACTIVATION_POINTERS = {"q_ptr", "k_ptr", "v_ptr", "g_ptr", "beta_ptr", "key_gate_ptr", "out_ptr",
                       "x_ptr", "conv_ptr", "weight_ptr", "bias_ptr"}
INDEX_POINTERS = {"query_start_ptr", "state_indices_ptr", "accepted_ptr", "request_ptr",
                  "block_table_ptr", "computed_ptr", "pending_ptr", "fold_plan_ptr",
                  "parent_ptr", "path_ptr", "counts_before_ptr"}


def arg_type(name):
    if name.endswith("_ptr"):
        if name in ACTIVATION_POINTERS:
            return "*bf16"
        return "*i32" if name in INDEX_POINTERS else "*fp32"
    if name in ("lower_bound", "scale"):
        return "fp32"
    return "i64" if name.startswith("stride") else "i32"


def ptxas():
    """Triton's newest bundled ptxas (it must accept the PTX version Triton emits)."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    names = sorted(n for n in os.listdir(bin_dir) if n.startswith("ptxas"))
    return os.path.join(bin_dir, names[-1])


def run_on_file(data, suffix, command):
    """`command + [file]` on `data` written to a temporary file (text or bytes)."""
    with tempfile.NamedTemporaryFile("wb" if isinstance(data, bytes) else "w", suffix=suffix,
                                     delete=False) as f:
        f.write(data)
    try:
        return subprocess.run(command + [f.name], capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)


def sass_summary(cubin):
    """(instructions, [loop body sizes]) of a cubin's SASS."""
    listing = run_on_file(cubin, ".cubin",
                          [os.path.join(os.path.dirname(ptxas()), "nvdisasm"), "-c"]).stdout
    count, labels, branches = 0, {}, []
    for line in listing.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = count
        instruction = re.match(r"\s*/\*[0-9a-f]+\*/\s*(.*?);", line)
        if instruction:
            target = re.search(r"BRA\s.*?(\.L_x_\d+)", instruction.group(1))
            if target:
                branches.append((count, target.group(1)))
            count += 1
    # A branch back to its own address is the trap after EXIT, not a loop.
    loops = [at - labels[target] + 1 for at, target in branches
             if target in labels and labels[target] < at]
    return count, loops


def compile_report(kernel, constexprs, num_warps, ttgir_path=None, sass=False):
    names = kernel.arg_names
    constexprs = dict(constexprs, **{n: 1 for n in names if n in UNIT_STRIDES})
    # An unset constexpr would compile as a runtime argument: another kernel.
    missing = [names[i] for i in kernel.constexprs if names[i] not in constexprs]
    if missing:
        raise ValueError(f"{kernel.__name__}: no value for constexpr {', '.join(missing)}")
    signature = {n: "constexpr" if n in constexprs else arg_type(n) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and (n.endswith("_ptr") or n.startswith("stride"))
             and n != "stride_beta_tok"}
    source = ASTSource(kernel, signature,
                       constexprs={(names.index(n),): v for n, v in constexprs.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=TARGET, options=dict(num_warps=num_warps))
    if ttgir_path:
        with open(ttgir_path, "w") as f:
            f.write(compiled.asm["ttgir"])
    result = run_on_file(compiled.asm["ptx"], ".ptx",
                         [ptxas(), "-v", "-arch=sm_90a", "-o", os.devnull])
    registers = re.search(r"Used (\d+) registers", result.stderr)
    spills = re.search(r"(\d+) bytes spill stores", result.stderr)
    report = dict(registers=int(registers.group(1)), spill_store_bytes=int(spills.group(1)),
                  shared_bytes=compiled.metadata.shared)
    if sass:
        report["instructions"], report["loops"] = sass_summary(compiled.asm["cubin"])
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python tools/kernel_resources.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--spec-lens", default="2,4,8", help="window lengths T (default 2,4,8)")
    parser.add_argument("--batch", type=int, default=128,
                        help="requests, which picks verify's form as at a launch (default 128)")
    parser.add_argument("--verify-form", default=None, choices=dispatch.VERIFY_FORMS,
                        help="verify's form instead of the policy's for --batch")
    parser.add_argument("--record-len", type=int, default=None,
                        help="the deferred schedule's kernels, with records of R > T positions")
    parser.add_argument("--tree", action="store_true",
                        help="the kernels of tree windows (verify, conv_update) and of their "
                             "accepted paths (commit)")
    parser.add_argument("--fused-conv", action="store_true",
                        help="also conv_verify's kernel with the convolution inside verify's "
                             "programs (kernel_choices(fused_conv=True))")
    parser.add_argument("--ttgir", default=None, help="directory to write each kernel's TTGIR")
    parser.add_argument("--sass", action="store_true",
                        help="also SASS instructions per warp and loop body sizes")
    args = parser.parse_args(argv)
    H, K = 32, 128
    V = K
    # Launched as on sm_90 (dispatch.dependent_launch): programmatically below
    # dispatch.PROGRAMMATIC_LAUNCH_BELOW_BATCH requests, with verify's L2 prefetch.
    pdl = args.batch < dispatch.PROGRAMMATIC_LAUNCH_BELOW_BATCH
    with dispatch.kernel_choices(verify_form=args.verify_form, fused_conv=args.fused_conv):
        for T in (int(t) for t in args.spec_lens.split(",")):
            R, deferred = args.record_len, args.record_len is not None
            pending_forms = dispatch.expects_pending(deferred, args.batch)
            eager_fold_below = DEFERRED_EAGER_FOLD_BELOW_BATCH if deferred else 0
            config = dispatch.verify_config(K, V, args.batch * H, T, pending_forms, args.tree)
            cases = dict(verify_kernels.verify_launches(config, K, V, T, True, pdl, R, deferred,
                                                        args.tree))
            for name, align in (("commit_state", False), ("commit_align", True)):
                cases[name] = commit_kernels.commit_state_launch(
                    K, V, H, T, True, False, align, pdl, R, deferred, tree=args.tree,
                    eager_fold_below=eager_fold_below, counts_before=deferred)
            cases["commit_conv"] = commit_kernels.commit_conv_launch(
                H * (2 * K + V), 3, deferred, args.tree, pdl, SPEC_LEN=T,
                HAS_REQUEST_INDICES=False, ALIGN=False, RECORDS=R or T,
                EAGER_FOLD_BELOW=eager_fold_below)
            if deferred:
                cases["commit_listed"] = commit_kernels.commit_state_launch(
                    K, V, H, T, True, False, False, pdl, R, deferred, listed=True,
                    eager_fold_below=eager_fold_below)
                cases["fold_plan"] = commit_kernels.fold_plan_launch(T, R, False, False, pdl,
                                                                     eager_fold_below, True)
            cases["conv_update"] = conv_kernels.conv_update_launch(H * (2 * K + V), 4, T, True,
                                                                   True, pdl, args.tree)
            fused = dispatch.conv_verify_config(K, V, args.batch * H, T, pending_forms, args.tree)
            if fused is not None:
                D = H * (2 * K + V)  # only the convolution's width and options are read
                conv = verify_kernels.FusedConv(None, None, torch.empty(D, 4), torch.empty(D),
                                                silu=True)
                cases["conv_verify"] = verify_kernels.verify_launches(
                    fused, K, V, T, True, pdl, R, deferred, args.tree, conv)["verify"]
            for name, (kernel, constexprs, warps) in cases.items():
                ttgir = os.path.join(args.ttgir, f"{name}_T{T}.ttgir") if args.ttgir else None
                report = compile_report(kernel, constexprs, warps, ttgir, args.sass)
                form = config.form if kernel in verify_kernels.VERIFY_KERNELS else ""
                line = (f"{name:20s} T={T} {form:14s} warps={warps}: {report['registers']} "
                        f"registers, {report['spill_store_bytes']} B spilled, "
                        f"{report['shared_bytes']} B shared")
                if args.sass:
                    line += (f", {report['instructions']} SASS instructions per warp, loop "
                             f"bodies {report['loops'] or 'none'}")
                print(line)


if __name__ == "__main__":
    main()
