"""Every kernel the ops launch, built for sm_90 by Triton's compiler (its code
generator and the ptxas it ships) from CPU tensors, without a GPU and without
running anything. The interpreter runs a kernel as Python and never builds it,
so a kernel that only the compiler rejects (two return statements of different
types, a layout it cannot lower) passes the interpreted suite and fails on
every GPU; here it fails on the CPU. Each case calls the public ops as an
engine does, with the kernel choices that select each specialisation."""

import contextlib
import os

import pytest
import torch

import kda_ops
from kda_ops.kernels import dispatch
from kda_ops.kernels.dispatch import kernel_choices

from helpers import query_start_loc
from tools.stand_in_target import sm90_launches

triton = pytest.importorskip("triton")
pytestmark = [
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="the interpreter's kernels are Python functions, not built"),
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="with a GPU the CUDA tests build and run the kernels"),
]

# The benchmark's head size (K = V = 128), so that the layouts are those a model gets.
H, K, V, W, LAYERS = 2, 128, 128, 4, 2
D = H * (2 * K + V)
SMALL_BATCH, LARGE_BATCH = 2, 160  # programmatic launch below 8; two V tiles from 256 pairs


@contextlib.contextmanager
def built_not_run(monkeypatch):
    """CPU tensors take the Triton launches, which build their kernels for
    sm_90 (tools/stand_in_target.py; programmatic launch where a GPU would
    take it) and launch nothing; yields the names of the kernels built."""
    from triton.runtime.jit import JITFunction

    built = []
    run = JITFunction.run

    def build_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        built.append(self.__name__)
        return kernel

    monkeypatch.setattr(JITFunction, "run", build_only)
    monkeypatch.setattr(dispatch, "launches_programmatically", lambda t: True)
    with sm90_launches():
        yield built


def step_inputs(batch, T, *, tree=False, records=None, activations=torch.bfloat16,
                state_dtype=torch.float32):
    """A decode step's tensors, unfilled (nothing reads them): windows of T
    tokens, caches of every layer stacked with records of `records` positions
    (default T; given, the deferred schedule's pending counts too)."""
    R = records or T
    N = batch + 1
    n = batch * T
    act = dict(dtype=activations)
    a = dict(q=torch.empty(n, H, K, **act), k=torch.empty(n, H, K, **act),
             v=torch.empty(n, H, V, **act), g=torch.empty(n, H, K, **act),
             beta=torch.empty(n, H, **act), x=torch.empty(n, D, **act),
             conv_weight=torch.empty(D, W, **act), conv_bias=torch.empty(D, **act),
             A_log=torch.empty(LAYERS, H), dt_bias=torch.empty(LAYERS, H, K),
             state=torch.empty(LAYERS, N, H, V, K, dtype=state_dtype),
             correction=torch.empty(LAYERS, N, H, R, V),
             key_gate=torch.empty(LAYERS, N, H, R, 2 * K, **act),
             conv_state=torch.empty(LAYERS, N, D, W - 1 + T - 1, **act),
             query_start_loc=query_start_loc([T] * batch, "cpu"),
             state_indices=torch.arange(1, N, dtype=torch.int32),
             num_accepted_tokens=torch.ones(batch, dtype=torch.int32))
    if records is not None:
        a["pending"] = torch.zeros(LAYERS, N, dtype=torch.int32)
    if tree:
        a["parent"] = torch.tensor([-1] + [(t - 1) // 2 for t in range(1, T)],
                                   dtype=torch.int32).repeat(batch)
        a["accepted_path"] = torch.zeros(batch, T, dtype=torch.int32)
    return a


PER_LAYER = ("A_log", "dt_bias", "state", "correction", "key_gate", "conv_state", "pending")


def first_layer(a):
    """The step's tensors with layer 0's caches, as a per-layer op takes them."""
    return {name: t[0] if name in PER_LAYER else t for name, t in a.items()}


def verify_kernels(form, fused_conv):
    """The kernels a verify of `form` launches (conv_update's first unless fused)."""
    kernels = ({"window_terms_kernel", "tensor_core_verify_kernel"}
               if form == "separate_terms" else {"_verify_kernel"})
    return kernels | ({"_conv_update_kernel"} if fused_conv is False else set())


def _fits(form, T, tree):
    if form in ("tensor_cores", "separate_terms") and not dispatch.tensor_cores_fit(K, T, tree):
        return False
    if tree and form == "separate_terms":
        return T <= dispatch.TREE_SEPARATE_TERMS_UP_TO
    return not (tree and form == "token_loop")


# At T = 4 every form, chains and trees, verify and conv_verify (fused or
# not); at T = 16 the forms the policy picks there (verify only).
VERIFY_CASES = [
    (4, form, deferred, tree, fused, batch)
    for form in dispatch.VERIFY_FORMS
    for tree in (False, True)
    if _fits(form, 4, tree)
    for deferred in (False, True)
    for fused in (None, False, True)  # None: verify; else conv_verify, fused or not
    if not (fused and form == "separate_terms")
    for batch in ((SMALL_BATCH, LARGE_BATCH) if form in ("token_loop", "closed_form")
                  and fused is None else (SMALL_BATCH,))
] + [
    (16, dispatch.verify_form(K, batch * H, 16, deferred, tree), deferred, tree, None, batch)
    for tree in (False, True)
    for deferred in (False, True)
    for batch in (SMALL_BATCH, LARGE_BATCH)
]


@pytest.mark.parametrize("T, form, deferred, tree, fused_conv, batch", VERIFY_CASES)
def test_verify_and_conv_verify_build(monkeypatch, T, form, deferred, tree, fused_conv, batch):
    """verify and conv_verify in every form that takes the window, immediate
    and deferred, chains and trees, the convolution fused or launched first,
    with programmatic launch (and, at a large batch, without it and with two
    V tiles a program)."""
    a = first_layer(step_inputs(batch, T, tree=tree, records=T + 8 if deferred else None))
    extra = dict(lower_bound=-5.0)
    if deferred:
        extra.update(pending=a["pending"], spec_len=T)
    if tree:
        extra.update(parent=a["parent"])
    caches = [a[name] for name in ("A_log", "dt_bias", "state", "correction", "key_gate")]
    with built_not_run(monkeypatch) as built, kernel_choices(
            verify_form=form, fused_conv=bool(fused_conv)):
        if fused_conv is None:
            kda_ops.verify(a["q"], a["k"], a["v"], a["g"], a["beta"], *caches,
                           a["query_start_loc"], a["state_indices"], **extra)
        else:
            kda_ops.conv_verify(a["x"], a["conv_state"], a["conv_weight"], a["conv_bias"],
                                a["g"], a["beta"], *caches, a["query_start_loc"],
                                a["state_indices"], **extra)
    assert set(built) == verify_kernels(form, fused_conv)


COMMIT_CASES = [
    dict(tree=tree, deferred=deferred, align=align, history=history, listed=listed,
         eager_fold=eager_fold, batch=batch)
    for tree in (False, True)
    for deferred in (False, True)
    for align in (False, True)
    for history in (False, True)
    for listed in ((False, True) if deferred and not tree else (False,))
    for eager_fold in ((None, False) if deferred else (None,))
    for batch in (SMALL_BATCH, LARGE_BATCH)
]


def commit_kernels(case):
    kernels = {"_commit_state_kernel"}
    if case["history"]:
        kernels.add("_commit_conv_kernel")
    elif case["deferred"]:
        kernels.add("_pending_counts_kernel")
    if case["listed"]:
        kernels.add("_fold_plan_kernel")
    return kernels


@pytest.mark.parametrize("case", COMMIT_CASES,
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_commit_builds(monkeypatch, case):
    """commit of chains and accepted paths, immediate and deferred (eager fold
    by default or off; the fold plan or a program per tile), in align mode or
    not, with the convolution history or without (the counts launch), with
    programmatic launch and without."""
    T, batch = 4, case["batch"]
    a = step_inputs(batch, T, tree=case["tree"], records=T + 8 if case["deferred"] else None)
    extra = dict(lower_bound=-5.0)
    if case["deferred"]:
        extra.update(pending=a["pending"], spec_len=T, eager_fold=case["eager_fold"])
    if case["tree"]:
        extra.update(accepted_path=a["accepted_path"])
    if case["history"]:
        extra.update(conv_state=a["conv_state"])
    if case["align"]:
        extra.update(block_table=torch.arange(batch * 2, dtype=torch.int32).view(batch, 2) + 1,
                     num_computed_tokens=torch.zeros(batch, dtype=torch.int32), block_size=8)
    with built_not_run(monkeypatch) as built, kernel_choices(listed_folds=case["listed"]):
        kda_ops.commit(a["num_accepted_tokens"], a["state_indices"], a["query_start_loc"],
                       state=a["state"], correction=a["correction"], key_gate=a["key_gate"],
                       A_log=a["A_log"], dt_bias=a["dt_bias"], **extra)
    assert set(built) == commit_kernels(case)


OPTION_CASES = [
    dict(state_dtype=torch.bfloat16),
    dict(activations=torch.float16),
    dict(activations=torch.float32),
    dict(lower_bound=None),
    dict(request_indices=True),
    dict(conv_bias=False, activation=None),
]


@pytest.mark.parametrize("form", ["closed_form", "separate_terms"])
@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("options", OPTION_CASES,
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_dtypes_and_options_build(monkeypatch, form, deferred, options):
    """A bf16 state, fp16 and fp32 activations, the softplus gate (no lower
    bound), commit's request indices, and the convolution without bias or
    activation (fused, unless separate terms): conv_verify, then commit."""
    T, batch = 4, SMALL_BATCH
    dtypes = {name: options[name] for name in ("state_dtype", "activations") if name in options}
    stacked = step_inputs(batch, T, records=T + 8 if deferred else None, **dtypes)
    a = first_layer(stacked)
    lower_bound = options.get("lower_bound", -5.0)
    extra = dict(pending=a["pending"], spec_len=T) if deferred else {}
    fused = "activation" in options and form != "separate_terms"
    with built_not_run(monkeypatch) as built, kernel_choices(verify_form=form, fused_conv=fused):
        kda_ops.conv_verify(
            a["x"], a["conv_state"], a["conv_weight"],
            a["conv_bias"] if options.get("conv_bias", True) else None, a["g"], a["beta"],
            *(a[name] for name in ("A_log", "dt_bias", "state", "correction", "key_gate")),
            a["query_start_loc"], a["state_indices"],
            activation=options.get("activation", "silu"), lower_bound=lower_bound, **extra)
        if deferred:
            extra = dict(pending=stacked["pending"], spec_len=T)
        if options.get("request_indices"):
            extra.update(request_indices=torch.arange(batch, dtype=torch.int32))
        kda_ops.commit(stacked["num_accepted_tokens"], stacked["state_indices"],
                       stacked["query_start_loc"], state=stacked["state"],
                       conv_state=stacked["conv_state"], correction=stacked["correction"],
                       key_gate=stacked["key_gate"], A_log=stacked["A_log"],
                       dt_bias=stacked["dt_bias"], lower_bound=lower_bound, **extra)
    assert set(built) == (verify_kernels(form, fused) | {"_commit_state_kernel",
                                                          "_commit_conv_kernel"})


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("bias, activation", [(True, "silu"), (False, None)])
def test_conv_update_builds(monkeypatch, tree, bias, activation):
    a = first_layer(step_inputs(SMALL_BATCH, 4, tree=tree))
    with built_not_run(monkeypatch) as built:
        kda_ops.conv_update(a["x"], a["conv_state"], a["conv_weight"],
                            a["conv_bias"] if bias else None, a["query_start_loc"],
                            a["state_indices"], activation=activation,
                            parent=a.get("parent"))
    assert built == ["_conv_update_kernel"]


FLUSH_AND_HELPER_KERNELS = {"_commit_state_kernel", "_pending_counts_kernel",
                            "_commit_plan_kernel", "_aligned_state_indices_kernel",
                            "_stage_spec_decode_kernel"}


@pytest.mark.parametrize("align", [False, True])
def test_flush_commit_plan_and_metadata_helpers_build(monkeypatch, align):
    a = step_inputs(SMALL_BATCH, 4, records=12)
    table = dict(block_table=torch.arange(SMALL_BATCH * 2, dtype=torch.int32).view(-1, 2) + 1,
                 num_computed_tokens=torch.zeros(SMALL_BATCH, dtype=torch.int32),
                 block_size=8) if align else {}
    with built_not_run(monkeypatch) as built:
        kda_ops.flush(a["state_indices"], state=a["state"], correction=a["correction"],
                      key_gate=a["key_gate"], pending=a["pending"], A_log=a["A_log"],
                      dt_bias=a["dt_bias"], lower_bound=-5.0)
        kda_ops.commit_plan(a["num_accepted_tokens"], a["state_indices"], a["query_start_loc"],
                            spec_len=4, **table)
        kda_ops.aligned_state_indices(torch.ones(SMALL_BATCH, 4, dtype=torch.int32),
                                      torch.ones(SMALL_BATCH, dtype=torch.int32), 8, 2)
        staged = (torch.empty(8, dtype=torch.int32), torch.empty(9, dtype=torch.int32),
                  torch.empty(8, dtype=torch.int32))
        kda_ops.stage_spec_decode_metadata(a["state_indices"], a["query_start_loc"],
                                           a["num_accepted_tokens"], *staged, SMALL_BATCH)
    assert set(built) == FLUSH_AND_HELPER_KERNELS


def test_every_kernel_is_built_by_a_case_above():
    """The kernels the cases above build (each asserts its own) are every
    kernel of kda_ops.kernels: one added without a case fails here."""
    from triton.runtime.jit import JITFunction

    from kda_ops.kernels import commit, conv, staging, verify, verify_tensor_cores

    defined = {name for module in (commit, conv, staging, verify, verify_tensor_cores)
               for name, value in vars(module).items()
               if isinstance(value, JITFunction) and name.endswith("_kernel")
               and value.fn.__module__ == module.__name__}
    covered = set().union(
        *(verify_kernels(form, fused) for _, form, _, _, fused, _ in VERIFY_CASES),
        *(commit_kernels(case) for case in COMMIT_CASES),
        {"_conv_update_kernel"}, FLUSH_AND_HELPER_KERNELS)
    assert defined == covered
