"""Registers, spills and shared memory of the kda_ops kernels on sm_90, offline.

    python tools/kernel_resources.py [--spec-lens 2,4,8] [--ttgir DIR] [--sass]
        [--verify-config BV,KEY_CHUNK,V_TILES,UNROLL,CLOSED,TC,SEPARATE,STAGES,WARPS]
        [--commit-config BV,WARPS,RECORD_STAGES]

Compiles the state kernels and conv_update for an H100/H200 target without a
GPU (Triton's compiler plus the ptxas it ships), at the benchmark's shapes
(H = 32, K = V = 128, bf16 activations, lower bound on) and the launch
configuration the package uses, and prints what `ptxas -v` reports. Unit
strides are specialised to 1 and pointers and other strides marked
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

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kda_ops.kernels import commit as commit_kernels
from kda_ops.kernels import conv as conv_kernels
from kda_ops.kernels import verify as verify_kernels
from kda_ops.kernels import verify_tensor_cores as tensor_core_kernels

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
                  "block_table_ptr", "computed_ptr"}


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
    # Plain launches, as from B = 8 (common.PROGRAMMATIC_LAUNCH_BELOW_BATCH).
    constexprs = dict(constexprs, PDL=False, **{n: 1 for n in names if n in UNIT_STRIDES})
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec-lens", default="2,4,8")
    parser.add_argument("--ttgir", default=None, help="directory to write each kernel's TTGIR")
    parser.add_argument("--sass", action="store_true",
                        help="also SASS instructions per warp and loop body sizes")
    parser.add_argument("--verify-config", default=None,
                        help="BV,KEY_CHUNK,V_TILES,UNROLL,CLOSED,TC,SEPARATE,STAGES,WARPS of "
                             "verify instead of the package's (which is taken at B = 128)")
    parser.add_argument("--commit-config", default=None,
                        help="BV,WARPS,RECORD_STAGES of the commit fold instead of the package's")
    args = parser.parse_args(argv)
    K = V = 128
    commit_bv, commit_warps, commit_stages = (
        tuple(int(x) for x in args.commit_config.split(","))
        if args.commit_config else commit_kernels.commit_config(V))
    for T in (int(t) for t in args.spec_lens.split(",")):
        verify = (verify_kernels.VerifyConfig(*(int(x) for x in args.verify_config.split(",")))
                  if args.verify_config else verify_kernels.verify_config(K, V, 128 * 32, T))
        BT = triton.next_power_of_2(T)
        if verify.separate_terms:
            link = T >= verify_kernels.LINK_ON_TENSOR_CORES_FROM_LEN
            cases = {
                "window_terms": (tensor_core_kernels._window_terms_kernel,
                                 dict(K=K, BK=K, SPEC_LEN=T, BT=BT, USE_LOWER_BOUND=True,
                                      LINK_MATRIX=link),
                                 verify_kernels.WINDOW_TERMS_WARPS),
                "verify_tc": (tensor_core_kernels._tensor_core_verify_kernel,
                              dict(K=K, V=V, BK=K, BV=verify.block_v, SPEC_LEN=T, BT=BT,
                                   NP=max(16, 2 * BT), KEY_CHUNK=verify.key_chunk,
                                   STAGES=verify.stages, LINK_MATRIX=link,
                                   CHEAP_SPLIT=verify_kernels.CHEAP_TF32_SPLIT),
                              verify.num_warps),
            }
        else:
            cases = {
                "verify": (verify_kernels._verify_kernel,
                           dict(K=K, V=V, BK=K, BV=verify.block_v, SPEC_LEN=T, BT=BT,
                                USE_LOWER_BOUND=True, KEY_CHUNK=verify.key_chunk,
                                V_TILES=verify.v_tiles, UNROLL_TOKENS=bool(verify.unroll_tokens),
                                CLOSED_FORM=bool(verify.closed_form),
                                TENSOR_CORES=bool(verify.tensor_cores), NP=max(16, 2 * BT),
                                STAGES=verify.stages,
                                PREFETCH_STATE=False),  # no PDL at this batch
                           verify.num_warps),
            }
        conv_bd, conv_warps = conv_kernels.conv_config(32 * 3 * K)
        cases.update({
            "commit_state": (commit_kernels._commit_state_kernel,
                             dict(K=K, V=V, BK=K, BV=commit_bv, NUM_HEADS=32, SPEC_LEN=T,
                                  USE_LOWER_BOUND=True, HAS_REQUEST_INDICES=False, ALIGN=False,
                                  RECORD_STAGES=commit_stages),
                             commit_warps),
            "commit_align": (commit_kernels._commit_state_kernel,
                             dict(K=K, V=V, BK=K, BV=commit_bv, NUM_HEADS=32, SPEC_LEN=T,
                                  USE_LOWER_BOUND=True, HAS_REQUEST_INDICES=False, ALIGN=True,
                                  RECORD_STAGES=commit_stages),
                             commit_warps),
            "conv_update": (conv_kernels._conv_update_kernel,
                            dict(WIDTH=4, SPEC_LEN=T, BD=conv_bd, HAS_BIAS=True, SILU=True),
                            conv_warps),
        })
        for name, (kernel, constexprs, warps) in cases.items():
            ttgir = os.path.join(args.ttgir, f"{name}_T{T}.ttgir") if args.ttgir else None
            report = compile_report(kernel, constexprs, warps, ttgir, args.sass)
            line = (f"{name:13s} T={T} warps={warps}: {report['registers']} registers, "
                    f"{report['spill_store_bytes']} B spilled, {report['shared_bytes']} B shared")
            if args.sass:
                line += (f", {report['instructions']} SASS instructions per warp, loop bodies "
                         f"{report['loops'] or 'none'}")
            print(line)


if __name__ == "__main__":
    main()
