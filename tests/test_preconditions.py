"""Preconditions that errors and the value checks must name: the device of
each tensor, the switch of the checks, the float64 reference model, and the
message for a missing triton under the interpreter."""

import copy

import pytest
import torch

import kda_ops
from kda_ops.models import KDADecodeStep, make_step_inputs
from kda_ops.value_checks import value_checks_enabled

from test_commit import make_commit_problem
from test_conv_update import POSITIONAL as CONV_POSITIONAL
from test_conv_update import make_problem as make_conv_problem
from test_verify import call_verify, make_problem as make_verify_problem


def commit_call(args):
    a = dict(args)
    return kda_ops.commit(a.pop("num_accepted_tokens"), a.pop("state_indices"),
                          a.pop("query_start_loc"), **a)


@pytest.mark.parametrize("op, name", [("verify", "q"), ("verify", "state"), ("verify", "k"),
                                      ("conv_update", "x"), ("conv_update", "weight"),
                                      ("commit", "state"), ("commit", "num_accepted_tokens")])
def test_the_tensor_off_the_others_device_is_the_one_named(op, name):
    if op == "verify":
        args, _ = make_verify_problem("cpu", seed=40)
        call = call_verify
    elif op == "conv_update":
        args, _ = make_conv_problem("cpu", seed=41)
        call = lambda a: kda_ops.conv_update(*(a[n] for n in CONV_POSITIONAL))  # noqa: E731
    else:
        args, _ = make_commit_problem("cpu", seed=42)
        call = commit_call
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"`{name}` must be on cpu like the other tensors, "
                                         rf"got meta"):
        call(args)


def test_two_tensors_on_two_devices_are_both_named():
    block_table = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="must share one device, got `block_table` on cpu, "
                                         "`seq_lens` on meta"):
        kda_ops.aligned_state_indices(block_table, torch.ones(2, dtype=torch.int32,
                                                              device="meta"), 4, 1)


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("Yes", True), ("ON", True),
                                       ("0", False), ("false", False), ("no", False),
                                       ("off", False), ("", False)])
def test_the_environment_switch_takes_the_usual_spellings(value, on, monkeypatch):
    monkeypatch.setenv("KDA_OPS_CHECK_VALUES", value)
    assert value_checks_enabled() is on


def test_an_unknown_environment_value_is_an_error(monkeypatch):
    monkeypatch.setenv("KDA_OPS_CHECK_VALUES", "ture")
    with pytest.raises(ValueError, match="KDA_OPS_CHECK_VALUES must be one of .*got 'ture'"):
        value_checks_enabled()


@pytest.mark.parametrize("record_len", [None, 7])
def test_a_reference_model_converted_to_float64_runs_in_float64(record_len):
    """`KDADecodeStep.double()` converts the checkpoints and records too (a
    float64 model runs every op in float64), and `.float()` returns them to
    their dtypes."""
    kwargs = dict(num_layers=2, num_heads=2, head_dim=8, spec_len=3, num_blocks=5,
                  record_len=record_len)
    reference = KDADecodeStep(**kwargs)
    reference.randomize_caches(1)
    model = copy.deepcopy(reference).double()
    assert {model.state.dtype, model.correction.dtype, model.key_gate.dtype} == {torch.float64}
    hidden, qsl, indices, accepted = make_step_inputs(reference, [3, 1, 2], seed=2)
    with torch.no_grad():
        out = model.decode_step(hidden.double(), qsl, indices, accepted)
        expected = reference.decode_step(hidden, qsl, indices, accepted)
    assert out.dtype == torch.float64
    assert (out - expected.double()).abs().max() < 1e-4
    model.float()
    assert model.state.dtype == torch.float32 and model.correction.dtype == torch.float32
    with torch.no_grad():
        model.decode_step(hidden, qsl, indices, accepted)


def test_commit_names_its_rows_and_record_positions_apart():
    doc = kda_ops.commit.__doc__
    assert "`[R]`" not in doc and "R >= T positions" in doc
