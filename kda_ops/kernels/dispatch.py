"""The launch policy of every kernel: which form of verify runs, tile sizes,
warps and programmatic launch, in one place.

The launchers ask `verify_config`, `commit_config`, `conv_config` and
`dependent_launch`; so do the tests and tools/kernel_resources.py. Thresholds
were measured on an H200 (torch 2.11, Triton 3.6; H = 32, K = V = 128, fp32
state, bf16 activations) unless a line says otherwise; "pairs" counts
(request, head) pairs, batch × heads. `kernel_choices()` overrides the policy
inside a block, for tests and measurements; it never changes results beyond
rounding.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import NamedTuple, Optional

import torch
import triton
from torch._library.triton import is_wrap_triton_enabled
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..constants import DEFERRED_EAGER_FOLD_BELOW_BATCH

# ------------------------------------------------------------------ verify
# Window lengths up to this run in closed form (8-13% faster than the token loop at T = 4).
CLOSED_FORM_UP_TO = 4
# The token loop unrolls with one V tile per program up to this length (1-35% faster at T = 4, 8).
UNROLL_ONE_TILE_UP_TO = 8
# Two V tiles per program from this many pairs: phase 1 once for both (4-15% faster from
# B = 64, 45-81% slower at B = 1).
TWO_TILES_FROM_PAIRS = 256
# The tensor-core forms need at least 16 keys (the tensor cores' smallest K) ...
TENSOR_CORES_MIN_KEYS = 16
# ... and windows of at most 8 tokens (the longest measured) ...
TENSOR_CORES_UP_TO = 8
# ... or trees of at most 16 nodes: trees have no token loop to fall back on.
TREE_TENSOR_CORES_UP_TO = 16
# Trees past 8 nodes skip the two-kernel form: at 16 its one-warp window terms spill 6 KB
# (ptxas) and it ran at 13-14% of copy from B = 32, the one-kernel form at 26% at B = 8 (H100).
TREE_SEPARATE_TERMS_UP_TO = 8
# One-kernel tensor cores for T = 5..8 from this many pairs (27-29% faster than the loop at T = 8).
TENSOR_CORES_FROM_PAIRS = 256
# Its tile: 128 rows with 8 warps (7-19% faster than 64 rows with 4), 3 stages (4-8% over 2).
TENSOR_CORES_BLOCK_V = 128
TENSOR_CORES_STAGES = 3
# The two-kernel tensor-core form from T = 4 (7-20% faster than the FMA closed form there) ...
SEPARATE_TERMS_FROM_LEN = 4
# ... from this many pairs (12-22% faster at T = 8 from B = 24; even to 27% slower at B <= 16).
SEPARATE_TERMS_FROM_PAIRS = 768
# The deferred schedule takes the tensor-core forms from fewer pairs: the records' terms
# double the FMA forms' instructions. Verify at 0-8 pending records, H100: the two-kernel
# form from T = 2 ...
DEFERRED_SEPARATE_TERMS_FROM_LEN = 2
# ... and this many pairs at T <= 4 (T = 4, R = 12: 25-30 against 44-59 µs at B = 16,
# 11-15 against 12-18 at B = 4, 9-13 against 8-12 at B = 2; T = 2, R = 8: even at B = 4) ...
DEFERRED_SEPARATE_TERMS_FROM_PAIRS = 128
# ... at T = 5..8 the one-kernel form from this many (T = 8, R = 16: 11-16 against 18-37 µs
# at B = 4; 10-14 against 9-18 at B = 2) ...
DEFERRED_TENSOR_CORES_FROM_PAIRS = 128
# ... and the two-kernel form from this many (30-36 against 32-42 µs at B = 16; 20-23
# against 17-21 at B = 8).
DEFERRED_LONG_SEPARATE_TERMS_FROM_PAIRS = 512
# Its state programs as (rows, warps): 32 rows in 2 warps up to this length (deferred step
# at T = 2, 4, H100: 0.4-7.4% faster from B = 4; state products at T = 8: 6% slower) ...
SMALL_STATE_TILES_UP_TO_LEN = 4
SMALL_STATE_TILE = (32, 2)
STATE_TILE = (64, 4)
# ... and the window terms in one-warp programs.
WINDOW_TERMS_WARPS = 1
# It links the tokens by a tensor-core product from T = 5 (8-10% faster at T = 8, 1-3% slower at 4)
LINK_ON_TENSOR_CORES_FROM_LEN = 5
# up to T = 8: trees of 16 nodes linked so lost accuracy (relative error 5.5e-4 on H100).
LINK_ON_TENSOR_CORES_UP_TO = 8

VERIFY_FORMS = ("token_loop", "closed_form", "tensor_cores", "separate_terms")

# conv_verify convolves inside verify's programs (one program per request and head then
# holds every V tile) below this many pairs, else launches conv_update's kernel and then
# verify's: none, as the 16-layer step at T = 4 took 221 / 258 / 343 / 486 µs that way at
# B = 1 / 2 / 4 / 8 against 110 / 151 / 261 / 438 µs with the two kernels (H100).
FUSED_CONV_BELOW_PAIRS = 0

# ------------------------------------------------------------------ launches
# Programmatic dependent launch below this batch on sm_90+: 9-13% less for 16 verifies
# and a commit at B = 1; nothing from B = 8, up to 2% more from B = 32.
PROGRAMMATIC_LAUNCH_BELOW_BATCH = 8


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """Overrides of the policy (None: the measured default).

    verify_form: one of VERIFY_FORMS, whatever the batch.
    programmatic_launch: False launches every kernel plainly.
    prefetch_state: whether a programmatically launched verify asks the L2 for
        its state before its wait (16 verifies + commit at B = 1: 79 / 82 / 131
        against 87 / 87 / 134 µs at T = 2 / 4 / 8).
    link_on_tensor_cores: the two-kernel form's token links (default from
        LINK_ON_TENSOR_CORES_FROM_LEN); never past LINK_ON_TENSOR_CORES_UP_TO.
    listed_folds: whether the deferred commit plans its folds first (default
        from LISTED_FOLDS_FROM_BATCH).
    cheap_tf32_split: the two-kernel form splits its 3xTF32 operands with an
        integer add and a mask (1-5% faster at T = 4) rather than Triton's tf32x3.
    fused_conv: conv_verify convolves inside verify's programs (True: wherever
        the verify form allows) or launches conv_update's kernel first (False;
        the default below FUSED_CONV_BELOW_PAIRS).
    """

    verify_form: Optional[str] = None
    programmatic_launch: bool = True
    prefetch_state: bool = True
    link_on_tensor_cores: Optional[bool] = None
    cheap_tf32_split: bool = True
    listed_folds: Optional[bool] = None
    fused_conv: Optional[bool] = None


_choices: contextvars.ContextVar = contextvars.ContextVar("kda_ops_kernel_choices",
                                                          default=KernelChoices())


@contextlib.contextmanager
def kernel_choices(**overrides):
    """Overrides the launch policy inside the block (fields of KernelChoices);
    a traced graph bakes in the choices in force when it was traced."""
    choices = dataclasses.replace(_choices.get(), **overrides)
    if choices.verify_form not in (None,) + VERIFY_FORMS:
        raise ValueError(f"verify_form must be one of {VERIFY_FORMS} or None, "
                         f"got {choices.verify_form!r}")
    token = _choices.set(choices)
    try:
        yield choices
    finally:
        _choices.reset(token)


class VerifyConfig(NamedTuple):
    """The compile-time choices of one verify launch."""

    form: str  # one of VERIFY_FORMS
    block_v: int
    key_chunk: int
    v_tiles: int
    unroll_tokens: bool
    stages: int
    num_warps: int
    link_on_tensor_cores: bool  # separate_terms only
    cheap_tf32_split: bool  # separate_terms only
    prefetch_state: bool  # with a programmatic launch
    prefetch_records: bool  # the pending records too: the deferred forms

    @property
    def closed_form(self) -> bool:
        return self.form != "token_loop"

    @property
    def tensor_cores(self) -> bool:
        return self.form in ("tensor_cores", "separate_terms")

    @property
    def separate_terms(self) -> bool:
        return self.form == "separate_terms"


def tensor_cores_fit(key_dim, spec_len, tree=False) -> bool:
    return key_dim >= TENSOR_CORES_MIN_KEYS and spec_len <= (
        TREE_TENSOR_CORES_UP_TO if tree else TENSOR_CORES_UP_TO)


def expects_pending(deferred, batch):
    """Whether verify over `batch` requests takes the deferred schedule's
    forms: below DEFERRED_EAGER_FOLD_BELOW_BATCH every commit folds by default
    (docs/semantics.md#11-the-deferred-schedule), so windows start at no
    pending record, as in the immediate schedule."""
    return deferred and not statically_known_true(batch < DEFERRED_EAGER_FOLD_BELOW_BATCH)


def verify_form(key_dim, request_heads, spec_len, deferred=False, tree=False) -> str:
    """The measured-best form for `request_heads` = batch × heads pairs, in the
    deferred schedule or not. A symbolic batch takes a pairs threshold only
    where its range proves it. Tree windows take the closed forms only: the
    token loop carries one state along one chain."""
    fit = tensor_cores_fit(key_dim, spec_len, tree)
    long_window = spec_len > CLOSED_FORM_UP_TO
    if deferred:
        separate_from = (DEFERRED_LONG_SEPARATE_TERMS_FROM_PAIRS if long_window
                         else DEFERRED_SEPARATE_TERMS_FROM_PAIRS)
        one_kernel_from = DEFERRED_TENSOR_CORES_FROM_PAIRS
        separate_from_len = DEFERRED_SEPARATE_TERMS_FROM_LEN
    else:
        separate_from, one_kernel_from = SEPARATE_TERMS_FROM_PAIRS, TENSOR_CORES_FROM_PAIRS
        separate_from_len = SEPARATE_TERMS_FROM_LEN
    separate_fits = fit and not (tree and spec_len > TREE_SEPARATE_TERMS_UP_TO)
    if (separate_fits and spec_len >= separate_from_len
            and statically_known_true(request_heads >= separate_from)):
        return "separate_terms"
    if fit and long_window and statically_known_true(request_heads >= one_kernel_from):
        return "tensor_cores"
    return "closed_form" if spec_len <= CLOSED_FORM_UP_TO or tree else "token_loop"


def verify_config(key_dim, value_dim, request_heads, spec_len, deferred=False,
                  tree=False) -> VerifyConfig:
    """The VerifyConfig of a launch over `request_heads` = batch × heads pairs,
    of tree windows with `tree`."""
    choices = _choices.get()
    form = choices.verify_form or verify_form(key_dim, request_heads, spec_len, deferred, tree)
    if form in ("tensor_cores", "separate_terms") and not tensor_cores_fit(key_dim, spec_len,
                                                                            tree):
        longest = TREE_TENSOR_CORES_UP_TO if tree else TENSOR_CORES_UP_TO
        raise ValueError(f"verify form {form!r} needs K >= {TENSOR_CORES_MIN_KEYS} and "
                         f"T <= {longest}, got K = {key_dim}, T = {spec_len}")
    if form == "token_loop" and tree:
        raise ValueError("verify form 'token_loop' runs chains only: tree windows (`parent`) "
                         "take 'closed_form', 'tensor_cores' or 'separate_terms'")
    key_chunk = min(triton.next_power_of_2(key_dim), 32)
    link = (spec_len >= LINK_ON_TENSOR_CORES_FROM_LEN if choices.link_on_tensor_cores is None
            else choices.link_on_tensor_cores) and spec_len <= LINK_ON_TENSOR_CORES_UP_TO
    common = dict(form=form, key_chunk=key_chunk, link_on_tensor_cores=link,
                  cheap_tf32_split=choices.cheap_tf32_split,
                  prefetch_state=choices.prefetch_state, prefetch_records=deferred)
    rows = triton.next_power_of_2(value_dim)
    if form == "separate_terms":
        # 16 rows at least: smaller tiles the tensor cores only take padded.
        tile_rows, warps = (SMALL_STATE_TILE if spec_len <= SMALL_STATE_TILES_UP_TO_LEN
                            else STATE_TILE)
        return VerifyConfig(block_v=max(min(rows, tile_rows), 16), v_tiles=1,
                            unroll_tokens=True, stages=TENSOR_CORES_STAGES,
                            num_warps=warps, **common)
    if form == "tensor_cores":
        block_v = max(min(rows, TENSOR_CORES_BLOCK_V), 16)
        return VerifyConfig(block_v=block_v, v_tiles=1, unroll_tokens=True,
                            stages=TENSOR_CORES_STAGES, num_warps=8 if block_v >= 128 else 4,
                            **common)
    block_v = min(rows, 32)
    two_tiles = (value_dim > block_v
                 and statically_known_true(request_heads >= TWO_TILES_FROM_PAIRS))
    return VerifyConfig(
        block_v=block_v, v_tiles=2 if two_tiles else 1,
        unroll_tokens=form == "closed_form" or (not two_tiles
                                                and spec_len <= UNROLL_ONE_TILE_UP_TO),
        stages=1, num_warps=4, **common)


def conv_verify_config(key_dim, value_dim, request_heads, spec_len, deferred=False,
                       tree=False) -> Optional[VerifyConfig]:
    """conv_verify's VerifyConfig, with one program per (request, head) (it
    then owns the head's channels of the convolution), or None: conv_update's
    kernel, then verify's launch."""
    config = verify_config(key_dim, value_dim, request_heads, spec_len, deferred, tree)
    fused = _choices.get().fused_conv
    if fused is None:
        fused = statically_known_true(request_heads < FUSED_CONV_BELOW_PAIRS)
    if not fused or config.separate_terms:
        return None
    return config._replace(v_tiles=triton.cdiv(value_dim, config.block_v))


# ------------------------------------------------------------------ commit, conv
def commit_config(value_dim):
    """(BV, num_warps, record pipeline stages) of the state fold: 32 rows in one
    warp with 4 stages (no spill) took T = 8 from 86-88% to 92-93% of copy from
    B = 32, against 64 rows in two warps with 3 stages."""
    return min(triton.next_power_of_2(value_dim), 32), 1, 4


def conv_config(dim):
    """(BD, num_warps) of conv_update and of commit's history compaction: four
    channels per thread (256 / 2, 512 / 4, 1024 / 8 within 6% of each other
    from B = 8; eight per thread took 36-56% longer from B = 128)."""
    return min(triton.next_power_of_2(dim), 256), 2


# The deferred commit first plans which (layer, request) pairs fold now, then folds
# their tiles in a persistent grid, from this batch (H100, R = 12, 16 layers: a commit
# without a fold 6.7 + 2.2 against 20.9 µs at B = 16, 6.8 + 2.2 against 80.3 at B = 64;
# every pair folding at T = 4, 1588 against 1611 µs at B = 64, 6341 against 6552 at B =
# 256, and alike at T = 8; at B = 8, with a static share of the tiles, 8.2 against 11.0
# µs without a fold but 222.7 against 206.2 folding).
LISTED_FOLDS_FROM_BATCH = 16
# One-warp fold programs per multiprocessor: 255 registers each (ptxas, Triton 3.6).
FOLD_PROGRAMS_PER_SM = 8


def listed_folds(batch):
    """Whether the deferred commit over `batch` requests folds from a plan of
    the folding pairs. A symbolic batch does unless its range is below the
    threshold: no guard on the batch."""
    choice = _choices.get().listed_folds
    if choice is not None:
        return choice
    return not statically_known_true(batch < LISTED_FOLDS_FROM_BATCH)


def fold_programs(t):
    """Programs of the persistent fold grid on `t`'s device."""
    if not t.is_cuda:
        return 4
    return torch.cuda.get_device_properties(t.device).multi_processor_count * FOLD_PROGRAMS_PER_SM


def dependent_launch(t, batch):
    """Launch options of a kernel over `batch` requests on `t`'s device, where
    an op launches the kernel itself (eagerly, from a compiled graph or an
    AOTInductor package for the ops that write their arguments, and what a
    CUDA graph captures from either): FP fusion on, and programmatic dependent
    launch on sm_90 or later. Launches that Inductor emits (the decomposed ops,
    traced with wrap_triton enabled; integer kernels) stay plain: torch passes
    no launch_pdl to user kernels."""
    # Traced first: a traced batch may be symbolic, and comparing it would
    # add a guard (a recompile per batch size).
    if is_wrap_triton_enabled():
        return dict(PDL=False)
    # FP fusion pinned on, so that results and speed do not follow the user's
    # TRITON_DEFAULT_FP_FUSION (off: the step 6-13% slower at B = 1, H100).
    options = dict(PDL=False, enable_fp_fusion=True)
    if (_choices.get().programmatic_launch and batch < PROGRAMMATIC_LAUNCH_BELOW_BATCH
            and launches_programmatically(t)):
        options.update(PDL=True, launch_pdl=True)
    return options


def launches_programmatically(t):
    """Whether `t`'s device takes programmatic dependent launch (sm_90 or later)."""
    return t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9


def launch_options(launch):
    """The launch keywords of a `dependent_launch` choice, for a kernel whose
    PDL constexpr is already among its constexprs."""
    return {name: value for name, value in launch.items() if name != "PDL"}
