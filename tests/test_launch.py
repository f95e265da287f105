"""Programmatic dependent launch: when the kernels use it, and that a chain of
kernels, each reading what the one before it wrote, gives the same bits with
and without it (a load above the wait would race with the previous kernel)."""

import os
import subprocess
import sys
import types

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch._library.triton import set_wrap_triton_enabled
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

import kda_ops
from kda_ops.kernels import dispatch
from kda_ops.kernels.dispatch import kernel_choices

from helpers import query_start_loc, requires_cuda


def test_dependent_launch_only_for_cuda_tensors():
    with set_wrap_triton_enabled(False):  # as the ops run eagerly
        assert dispatch.dependent_launch(torch.zeros(1), 1) == {"PDL": False,
                                                                "enable_fp_fusion": True}


def test_traced_launch_adds_no_guard_on_the_batch():
    """While torch.compile or torch.export traces an op, the batch may be
    symbolic: comparing it with the threshold would add a guard (a recompile
    per side of it, and export's dynamic batch rejected). The policy must
    decide on tracing first."""
    shape_env = ShapeEnv()
    symbol = shape_env.create_symbol(4, ConstantSource("batch"), dynamic_dim=DimDynamic.DYNAMIC)
    batch = shape_env.create_symintnode(symbol, hint=4)
    traced_cuda_tensor = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    with set_wrap_triton_enabled(True):
        assert dispatch.dependent_launch(traced_cuda_tensor, batch) == {"PDL": False}
    assert shape_env.guards == []


def test_listed_folds_policy_adds_no_guard_on_the_batch():
    """The deferred commit plans its folds first from the threshold batch; a
    symbolic batch takes the plan without a guard (the compiled graph serves
    every batch)."""
    from_batch = dispatch.LISTED_FOLDS_FROM_BATCH
    assert dispatch.listed_folds(from_batch)
    assert not dispatch.listed_folds(from_batch - 1)
    with kernel_choices(listed_folds=True):
        assert dispatch.listed_folds(1)
    with kernel_choices(listed_folds=False):
        assert not dispatch.listed_folds(256)
    shape_env = ShapeEnv()
    symbol = shape_env.create_symbol(4, ConstantSource("batch"), dynamic_dim=DimDynamic.DYNAMIC)
    batch = shape_env.create_symintnode(symbol, hint=4)
    assert dispatch.listed_folds(batch)
    assert shape_env.guards == []


@requires_cuda
def test_dependent_launch_policy():
    t = torch.zeros(1, device="cuda")
    below = dispatch.PROGRAMMATIC_LAUNCH_BELOW_BATCH
    plain = {"PDL": False, "enable_fp_fusion": True}
    on = (dict(plain, PDL=True, launch_pdl=True) if torch.cuda.get_device_capability()[0] >= 9
          else plain)
    with set_wrap_triton_enabled(False):  # as the ops run eagerly
        assert dispatch.dependent_launch(t, below - 1) == on
        assert dispatch.dependent_launch(t, below) == plain
        with kernel_choices(programmatic_launch=False):
            assert dispatch.dependent_launch(t, 1) == plain
    with set_wrap_triton_enabled(True):  # as while torch.compile traces the ops
        assert dispatch.dependent_launch(t, 1) == {"PDL": False}


def make_chain(device, *, layers=6, H=4, K=32, T=4, lens=(4, 3), indices=(2, 1), N=4, W=4):
    """Buffers of a decode step in which every kernel reads the previous one's
    output: layer l's conv_update convolves layer l-1's verify output, whose
    result is layer l's queries, then one commit of every layer."""
    gen = torch.Generator().manual_seed(5)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    D = H * K
    starts = query_start_loc(lens, device)
    n = int(starts[-1])
    return dict(
        layers=layers, H=H, K=K, T=T, starts=starts, n=n,
        indices=torch.tensor(indices, dtype=torch.int32, device=device),
        accepted=torch.tensor([min(x, T) - 1 for x in lens], dtype=torch.int32, device=device),
        first=rand(n, D), k=rand(layers, n, H, K), g=rand(layers, n, H, K),
        beta=rand(layers, n, H), weight=rand(layers, D, W) * 0.5, bias=rand(layers, D),
        A_log=rand(layers, H) * 0.5, dt_bias=rand(layers, H, K),
        state=rand(layers, N, H, K, K), conv_state=rand(layers, N, D, W - 1 + T - 1),
        correction=rand(layers, N, H, T, K), key_gate=rand(layers, N, H, T, 2 * K),
        conv_out=torch.zeros(layers, n, D, device=device),
        out=torch.zeros(layers, n, H, K, device=device))


def run_chain(c):
    h = c["first"]
    n, H, K = c["n"], c["H"], c["K"]
    for layer in range(c["layers"]):
        x = kda_ops.conv_update(h, c["conv_state"][layer], c["weight"][layer], c["bias"][layer],
                                c["starts"], c["indices"], out=c["conv_out"][layer])
        q = x.view(n, H, K)
        out = kda_ops.verify(q, c["k"][layer], q, c["g"][layer], c["beta"][layer],
                             c["A_log"][layer], c["dt_bias"][layer], c["state"][layer],
                             c["correction"][layer], c["key_gate"][layer], c["starts"],
                             c["indices"], lower_bound=-5.0, out=c["out"][layer])
        h = out.view(n, H * K)
    kda_ops.commit(c["accepted"], c["indices"], c["starts"], state=c["state"],
                   conv_state=c["conv_state"], correction=c["correction"],
                   key_gate=c["key_gate"], A_log=c["A_log"], dt_bias=c["dt_bias"],
                   lower_bound=-5.0)


RESULTS = ("conv_out", "out", "state", "conv_state", "correction", "key_gate")


@requires_cuda
@pytest.mark.parametrize("separate_terms, prefetch", [(False, False), (True, False),
                                                      (False, True)])
def test_dependent_launch_chain_is_exact(separate_terms, prefetch):
    """The chain with plain launches, then with programmatic dependent launch
    eagerly and replayed from a CUDA graph: every output and buffer bitwise
    equal. separate_terms puts verify's two-kernel form in the chain; prefetch
    has verify ask the L2 for its state before its wait (the default)."""
    form = dict(verify_form="separate_terms") if separate_terms else {}
    with kernel_choices(programmatic_launch=False, **form):
        plain = make_chain("cuda")
        run_chain(plain)
    with kernel_choices(programmatic_launch=True, prefetch_state=prefetch, **form):
        assert_eager_and_graphed_chains_match(plain)


def assert_eager_and_graphed_chains_match(plain):
    """The chain run eagerly and replayed from a CUDA graph, under the kernel
    choices in force, against `plain`: bitwise equal."""
    if torch.cuda.get_device_capability()[0] >= 9:
        with set_wrap_triton_enabled(False):
            assert dispatch.dependent_launch(plain["first"], len(plain["accepted"]))["PDL"]
    eager = make_chain("cuda")
    run_chain(eager)
    graphed = make_chain("cuda")
    initial = {name: graphed[name].clone() for name in RESULTS}
    run_chain(graphed)  # compiles every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_chain(graphed)
    for replay in range(3):
        for name in RESULTS:
            graphed[name].copy_(initial[name])
        graph.replay()
        torch.cuda.synchronize()
        for name in RESULTS:
            for run, result in (("eager", eager), (f"replay {replay}", graphed)):
                assert torch.equal(result[name], plain[name]), f"{name} differs ({run})"


_CHAIN_IN_A_PROCESS = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_launch import RESULTS, make_chain, run_chain
chain = make_chain("cuda")
run_chain(chain)
torch.save({name: chain[name].cpu() for name in RESULTS}, sys.argv[2])
"""


@requires_cuda
def test_fp_fusion_does_not_follow_tritons_default(tmp_path):
    """The kernels compile with FP fusion on (dispatch.dependent_launch), so a
    process whose Triton default is off computes the same bits as one whose
    default is on; unpinned, verify, conv_update and commit would run unfused."""
    results = {}
    for default in ("0", "1"):
        saved = tmp_path / f"chain_{default}.pt"
        env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=default,
                   TRITON_CACHE_DIR=str(tmp_path / f"triton_cache_{default}"))
        subprocess.run([sys.executable, "-c", _CHAIN_IN_A_PROCESS, os.path.dirname(__file__),
                        str(saved)], env=env, check=True)
        results[default] = torch.load(saved)
    for name in RESULTS:
        assert torch.equal(results["0"][name], results["1"][name]), f"{name} differs"
