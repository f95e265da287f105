"""conv_verify: conv_update of q | k | v, then verify, in one op; against the
float64 reference and against the two ops, in every verify form, with and
without the convolution inside verify's programs."""

import pytest
import torch

import kda_ops
from kda_ops import naive
from kda_ops.kernels.dispatch import conv_verify_config, kernel_choices

from helpers import DEVICES, TOLERANCE, assert_rel_close, query_start_loc

H, W = 2, 4


def problem(device, seed, *, T=4, K=16, V=40, lens=(4, 2, 0, 6, 3, 1), indices=(1, 3, 2, 0, 9, 5),
            N=7, dtype=torch.float32, records=None, token_first=False):
    """Ragged windows (one empty, one past T), a padding row (0) and a row past
    the cache (9); random caches, records of `records` positions (default T)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    R = T if records is None else records
    D = H * (2 * K + V)
    qsl = query_start_loc(lens, device)
    n = int(qsl[-1])
    cols = W - 1 + T - 1
    conv_state = (rand(N, cols, D).to(dtype).transpose(-1, -2) if token_first
                  else rand(N, D, cols).to(dtype))
    return dict(x=rand(n, D).to(dtype), conv_state=conv_state,
                conv_weight=rand(D, W, scale=0.5).to(dtype), conv_bias=rand(D).to(dtype),
                g=rand(n, H, K).to(dtype), beta=rand(n, H).to(dtype), A_log=rand(H, scale=0.5),
                dt_bias=rand(H, K), state=rand(N, H, V, K), correction=rand(N, H, R, V),
                key_gate=rand(N, H, R, 2 * K).to(dtype), query_start_loc=qsl,
                state_indices=torch.tensor(indices, dtype=torch.int32, device=device))


CACHES = ("conv_state", "correction", "key_gate")


def run(a, **kwargs):
    """conv_verify on copies of the caches: (out, conv_state, correction, key_gate)."""
    caches = {name: a[name].clone() for name in CACHES}
    out = kda_ops.conv_verify(**dict(a, **caches), **kwargs)
    return (out,) + tuple(caches[name] for name in CACHES)


def run_two_ops(a, K, V, **kwargs):
    """conv_update, then verify of its q | k | v split, on copies of the caches."""
    caches = {name: a[name].clone() for name in CACHES}
    conv_kwargs = {name: kwargs[name] for name in ("parent",) if name in kwargs}
    mixed = kda_ops.conv_update(a["x"], caches["conv_state"], a["conv_weight"], a["conv_bias"],
                                a["query_start_loc"], a["state_indices"], **conv_kwargs)
    q, k, v = (t.unflatten(-1, (H, -1)) for t in mixed.split([H * K, H * K, H * V], -1))
    out = kda_ops.verify(q, k, v, a["g"], a["beta"], a["A_log"], a["dt_bias"], a["state"],
                         caches["correction"], caches["key_gate"], a["query_start_loc"],
                         a["state_indices"], **kwargs)
    return (out,) + tuple(caches[name] for name in CACHES)


def oracle(a, **kwargs):
    cpu = {name: t.cpu() for name, t in a.items()}
    kwargs = {name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in kwargs.items()}
    return naive.conv_verify(**cpu, **kwargs)


def assert_matches_oracle(result, expected):
    out, conv_state, correction, key_gate = result
    expected_out, expected_conv, expected_corr, expected_kg = expected
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], name="out")
    assert torch.equal(conv_state.cpu(), expected_conv)
    # float32, but from the convolution's outputs rounded to the activation dtype
    # (from float32 here, from float64 in the reference): their rounding error.
    assert_rel_close(correction.cpu(), expected_corr, tol=TOLERANCE[out.dtype],
                     name="correction")
    assert_rel_close(key_gate.cpu(), expected_kg, name="key_gate")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("token_first", [False, True], ids=["dim_first", "token_first"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_conv_verify_matches_the_oracle(device, dtype, token_first, lower_bound):
    a = problem(device, seed=1, dtype=dtype, token_first=token_first)
    assert_matches_oracle(run(a, lower_bound=lower_bound),
                          oracle(a, lower_bound=lower_bound))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("form, T", [
    ("closed_form", 4), ("closed_form", 2), ("token_loop", 6), ("tensor_cores", 4),
    ("tensor_cores", 8), ("separate_terms", 4)])
def test_conv_verify_is_conv_update_then_verify_in_every_form(device, fused, form, T):
    """Every verify form, with the convolution in verify's programs (one per
    request and head, every V tile: V = 40 spans two 32-row tiles) or in
    conv_update's kernel first; the two-kernel form always takes the latter."""
    K, V = 16, 40
    lens = (T, T // 2, 0, T + 2, 3, 1)
    a = problem(device, seed=2 + T, T=T, K=K, V=V, lens=lens)
    with kernel_choices(verify_form=form, fused_conv=fused):
        config = conv_verify_config(K, V, len(lens) * H, T)
        assert (config is not None) == (fused and form != "separate_terms")
        if config is not None:
            assert config.form == form and config.v_tiles * config.block_v >= V
        result = run(a, lower_bound=-5.0)
        expected = run_two_ops(a, K, V, lower_bound=-5.0)
    for name, actual, wanted in zip(("out", "conv_state", "correction", "key_gate"), result,
                                    expected):
        assert_rel_close(actual, wanted, tol=1e-6, name=name)
    assert torch.equal(result[1], expected[1])
    assert_matches_oracle(result, oracle(a, lower_bound=-5.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["closed_form", "token_loop", "tensor_cores", "separate_terms"])
def test_conv_verify_deferred(device, form):
    """Records of R = 7 positions with 0-3 pending per block: each window
    starts from its checkpoint folded with them and records after them."""
    T, R = 4, 7
    a = problem(device, seed=5, T=T, records=R)
    pending = torch.tensor([0, 3, 1, 2, 0, 3, 1], dtype=torch.int32, device=device)
    with kernel_choices(verify_form=form):
        result = run(a, lower_bound=-5.0, pending=pending, spec_len=T)
    assert_matches_oracle(result, oracle(a, lower_bound=-5.0, pending=pending, spec_len=T))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form, T", [("closed_form", 8), ("tensor_cores", 16),
                                     ("separate_terms", 8)])
@pytest.mark.parametrize("deferred", [False, True])
def test_conv_verify_tree(device, form, T, deferred):
    """Tree windows (out-of-range parents included): each node convolves and
    runs along its own path; `deferred`, from the checkpoint folded with 0-3
    pending records, recorded after them."""
    lens = (T, 5, 0, T + 1, 3, 1)
    a = problem(device, seed=9, T=T, lens=lens, records=T + 3 if deferred else None)
    schedule = {} if not deferred else dict(
        pending=torch.tensor([0, 3, 1, 2, 0, 3, 1], dtype=torch.int32, device=device),
        spec_len=T)
    gen = torch.Generator().manual_seed(T)
    parent = torch.cat([torch.cat([torch.tensor([-1]), (torch.rand(n - 1, generator=gen)
                                                        * torch.arange(1, n)).long()])
                        if n else torch.zeros(0, dtype=torch.long) for n in lens])
    parent[T + 2] = -1  # a second root in the first window
    parent[T + 5 + 2] = T + 9  # a parent past the window
    parent = parent.to(torch.int32).to(device)
    with kernel_choices(verify_form=form):
        result = run(a, lower_bound=-5.0, parent=parent, **schedule)
    assert_matches_oracle(result, oracle(a, lower_bound=-5.0, parent=parent, **schedule))


def test_conv_verify_policy():
    """By default the two ops' kernels (measured faster, kernels/dispatch.py);
    with fused_conv the convolution runs inside verify's programs, one per
    request and head, wherever verify's form allows."""
    assert conv_verify_config(128, 128, 32, 4) is None
    with kernel_choices(fused_conv=True):
        assert conv_verify_config(128, 128, 32, 8).v_tiles == 4
        assert conv_verify_config(128, 128, 64 * 32, 4) is None  # the two-kernel form


@pytest.mark.parametrize("device", DEVICES)
def test_conv_verify_model_step_equals_the_two_ops(device):
    """KDADecodeStep's layers through conv_verify (default) and through
    conv_update + verify: the same outputs, states and caches."""
    from kda_ops.models import KDADecodeStep, make_step_inputs
    models = [KDADecodeStep(num_layers=2, num_heads=2, head_dim=16, spec_len=4, num_blocks=8,
                            lower_bound=-5.0, use_conv_verify=fuse, device=device)
              for fuse in (True, False)]
    for model in models:
        model.randomize_caches(3)
    inputs = make_step_inputs(models[0], [4, 2, 3], seed=4)
    with kernel_choices(fused_conv=True):
        fused_out = models[0].decode_step(*inputs)
    unfused_out = models[1].decode_step(*inputs)
    assert_rel_close(fused_out, unfused_out, tol=1e-6, name="out")
    for fused, unfused in zip(*(model.buffers_as_caches() for model in models)):
        assert_rel_close(fused, unfused, tol=1e-6, name="caches")


def test_conv_verify_refuses_mismatched_shapes():
    a = problem("cpu", seed=1)
    with pytest.raises(ValueError, match=r"x.*q \| k \| v"):
        kda_ops.conv_verify(**dict(a, x=a["x"][:, :-2], conv_weight=a["conv_weight"][:-2],
                                   conv_bias=a["conv_bias"][:-2],
                                   conv_state=a["conv_state"][:, :-2]))
    with pytest.raises(ValueError, match="conv_state.*verify's T = 4"):
        kda_ops.conv_verify(**dict(a, conv_state=a["conv_state"][..., :-1]))
    with pytest.raises(ValueError, match=r"conv_weight.*conv_weight\.squeeze\(1\)"):
        kda_ops.conv_verify(**dict(a, conv_weight=a["conv_weight"].unsqueeze(1)))
    with pytest.raises(ValueError, match="conv_bias"):
        kda_ops.conv_verify(**dict(a, conv_bias=a["conv_bias"][:-1]))
    with pytest.raises(ValueError, match="`g` must have dtype"):
        kda_ops.conv_verify(**dict(a, g=a["g"].double()))
    # Before `out` is allocated from their shapes.
    for name, wrong, message in (("state", a["state"].flatten(), "`state` must have 4 dims"),
                                 ("x", a["x"][0, 0], "`x` must have 2 dims"),
                                 ("g", None, "`g` must be a tensor")):
        with pytest.raises(ValueError, match=message):
            kda_ops.conv_verify(**dict(a, **{name: wrong}, out=None))


def test_conv_verify_value_checks_name_the_op():
    def checked_problem():  # windows of at most T, live or padding rows
        return problem("cpu", seed=1, lens=(4, 2, 0, 3), indices=(1, 3, 2, 0))

    a = checked_problem()
    with kda_ops.value_checks():
        kda_ops.conv_verify(**a)
    a["x"][1, 3] = float("nan")
    with kda_ops.value_checks(), pytest.raises(ValueError, match="x.*conv_verify"):
        kda_ops.conv_verify(**a)
    a = checked_problem()
    a["g"][0, 1, 2] = float("inf")
    with kda_ops.value_checks(), pytest.raises(ValueError, match="g.*conv_verify"):
        kda_ops.conv_verify(**a)
