"""Preconditions that errors and the value checks must name: the device of
each tensor, the switch of the checks, the float64 reference model, and the
message for a missing triton under the interpreter."""

import copy

import pytest
import torch

import kda_ops
from kda_ops.models import KDADecodeStep, make_step_inputs
from kda_ops.value_checks import value_checks_enabled

from helpers import DEVICES
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


# ------------------------------------------------------- align-mode blocks
def align_problem(device, table):
    """Three rows of 3-token windows in blocks 1, 2, 3 of six, 8-token blocks,
    with the block table `table`: accepted [2, 3, 1] from 7, 6, 7 computed
    tokens."""
    args, _ = make_commit_problem(device, N=6, lens=(3, 3, 3), accepted=(2, 3, 1),
                                  indices=(1, 2, 3), seed=43)
    return dict(args, block_table=torch.tensor(table, dtype=torch.int32, device=device),
                num_computed_tokens=torch.tensor([7, 6, 7], dtype=torch.int32, device=device),
                block_size=8)


ALIGN_MISUSE = [
    ("two rows end in one block", [[1, 4], [2, 4], [3, 5]],
     r"gives rows 0 and 1 the same block 4 \(final of row 0, final of row 1\)"),
    ("a row ends in another's source", [[1, 2], [2, 4], [3, 5]],
     r"gives row 0 the final block 2, which row 1 reads as its source"),
    ("a block past the cache", [[1, 40], [2, 4], [3, 5]],
     r"gives row 0 the final block 40, outside the 6 blocks"),
    ("a row ends in the null block", [[1, 0], [2, 4], [3, 5]],
     r"gives row 0 the final block 0, outside the 6 blocks of the cache \(or the null"),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case, table, message", ALIGN_MISUSE, ids=[c[0] for c in ALIGN_MISUSE])
def test_value_checks_catch_align_mode_blocks_that_collide(device, case, table, message):
    args = align_problem(device, table)
    before = [t.clone() for t in (args["state"], args["conv_state"])]
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=rf"`block_table` {message}"):
            commit_call(args)
        assert all(torch.equal(b, t) for b, t in zip(before, (args["state"],
                                                               args["conv_state"])))
        commit_call(align_problem(device, [[1, 4], [2, 5], [3, 3]]))  # disjoint: passes


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_catch_align_collisions_under_the_deferred_schedule(device):
    args = align_problem(device, [[1, 4], [2, 4], [3, 5]])
    R = 9
    L = args["state"].shape[0]
    args["correction"] = torch.randn(L, 6, 2, R, 8, device=device)
    args["key_gate"] = torch.randn(L, 6, 2, R, 32, device=device).to(args["key_gate"].dtype)
    args["pending"] = torch.zeros(L, 6, dtype=torch.int32, device=device)
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match="`block_table` gives rows 0 and 1 the same block 4"):
            commit_call(dict(args, spec_len=4))


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_catch_a_conv_state_sized_for_another_window(device):
    """conv_update ran with W = 4 on a conv state of W-1+2-1 columns (T = 2);
    commit with records of T = 4 would read its history as 1 column wide."""
    conv, _ = make_conv_problem(device, D=10, W=4, T=2, N=12, lens=(1, 2), indices=(1, 2),
                                seed=44)
    args, _ = make_commit_problem(device, stacked=False, N=12, T=4, W=4, D=10, lens=(1, 2),
                                  accepted=(1, 1), indices=(1, 2), seed=45)
    args["conv_state"] = conv["conv_state"]
    with kda_ops.value_checks():
        kda_ops.conv_update(*(conv[n] for n in CONV_POSITIONAL))
        with pytest.raises(ValueError, match=r"`conv_state` has 4 columns in blocks, but "
                                             r"conv_update convolved it with W = 4: commit "
                                             r"needs W-1\+T-1 = 6 for T = 4"):
            commit_call(args)


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_take_rows_past_the_block_table_as_null(device):
    """In align mode a row past the block table commits nothing, whatever its
    accepted count; a live row's count is still checked."""
    args = align_problem(device, [[1, 4], [2, 5]])  # row 2 has no table row
    args["num_computed_tokens"] = args["num_computed_tokens"][:2]
    args["num_accepted_tokens"][2] = 99
    with kda_ops.value_checks():
        commit_call(args)
        args["num_accepted_tokens"][1] = 99
        with pytest.raises(ValueError, match=r"`num_accepted_tokens` \[1\] = 99 \(row 1\)"):
            commit_call(args)


# ---------------------------------------------------------------- flush
def flush_problem(device, indices):
    args, _ = make_commit_problem(device, seed=46, T=6)
    L, N = args["state"].shape[:2]
    pending = torch.randint(0, 4, (L, N), generator=torch.Generator().manual_seed(0),
                            dtype=torch.int32).to(device)
    return dict(state_indices=torch.tensor(indices, dtype=torch.int32, device=device),
                state=args["state"], correction=args["correction"],
                key_gate=args["key_gate"], pending=pending, A_log=args["A_log"],
                dt_bias=args["dt_bias"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("indices, message", [
    ((1, 3, 1), "rows 0 and 2 share block 1"),
    ((1, 12), "row 1's block 12 is outside `state`'s 12 blocks")])
def test_value_checks_cover_flush(device, indices, message):
    """A block listed twice would be folded twice by the kernels: the checks
    refuse it, as a block outside the cache."""
    args = flush_problem(device, indices)
    before = args["state"].clone(), args["pending"].clone()
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=rf"`state_indices` {message}"):
            kda_ops.flush(args.pop("state_indices"), **args)
    assert torch.equal(before[0], args["state"]) and torch.equal(before[1], args["pending"])


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_take_caches_of_no_layer(device):
    """Stacked caches of zero layers: flush and the deferred commit do
    nothing, with or without the checks."""
    args = flush_problem(device, (1, 3))
    empty = {name: t[:0] for name, t in args.items() if name != "state_indices"}
    commit_args, _ = make_commit_problem(device, seed=52, T=6, lens=(1, 2, 3),
                                         accepted=(1, 2, 3), indices=(1, 2, 3))
    commit_args = {name: t[:0] if name in ("state", "conv_state", "correction", "key_gate",
                                           "A_log", "dt_bias") else t
                   for name, t in commit_args.items()}
    with kda_ops.value_checks():
        kda_ops.flush(args["state_indices"], **empty)
        commit_call(dict(commit_args, pending=empty["pending"], spec_len=3))



# ---------------------------------------------------------- finite values
def poisoned_verify(device, name, value):
    args, buffers = make_verify_problem(device, seed=47, lens=(1, 3, 4, 2, 0),
                                        indices=(1, 2, 0, 3, 4))
    scale = None
    if name == "scale":
        scale = value
    elif name == "state":
        args["state"][2, 1, 3, 5] = value  # row 1's block
    elif name == "dt_bias":
        args["dt_bias"][1, 2] = value
    else:
        token = int(args["query_start_loc"][1]) + 2  # row 1's third token
        args[name][token, 1] = value
    return args, buffers, scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, value, where", [
    ("q", float("nan"), r"at token \d+ \(row 1\) given to verify"),
    ("beta", float("nan"), r"at token \d+ \(row 1\) given to verify"),
    ("v", float("inf"), r"at token \d+ \(row 1\) given to verify"),
    ("dt_bias", float("nan"), r"at \(1, 2\) in verify"),
    ("state", float("nan"), r"in block 2 \(row 1\) given to verify"),
    ("scale", float("nan"), r"is nan in verify")])
def test_value_checks_name_non_finite_inputs(device, name, value, where):
    args, buffers, scale = poisoned_verify(device, name, value)
    before = [b.clone() for b in buffers.values()]
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=rf"`{name}` .*{where}"):
            call_verify(args, scale=scale)
    assert all(((b == after) | (b.isnan() & after.isnan())).all()
               for b, after in zip(before, buffers.values())), "a refused call wrote a buffer"
    call_verify(args, scale=scale)  # without the checks, nothing is said


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_name_non_finite_outputs(device):
    """Finite inputs whose outputs overflow float16."""
    args, _ = make_verify_problem(device, seed=48, dtype=torch.float16, lens=(1, 3, 4, 2, 0),
                                  indices=(1, 2, 0, 3, 4))
    args["state"].mul_(1e7)
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`out` holds -?inf at token \d+ \(row \d\) "
                                             r"written by verify"):
            call_verify(args)


@pytest.mark.parametrize("device", DEVICES)
def test_value_checks_name_non_finite_values_in_conv_update_commit_and_flush(device):
    conv, _ = make_conv_problem(device, seed=49, lens=(1, 2, 3), indices=(1, 3, 4))
    token = int(conv["query_start_loc"][2])
    conv["x"][token, 3] = float("nan")
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`x` holds nan at token \d+ \(row 2\) given to "
                                             r"conv_update"):
            kda_ops.conv_update(*(conv[n] for n in CONV_POSITIONAL))
    args, _ = make_commit_problem(device, seed=50, lens=(1, 2, 3), accepted=(1, 2, 3),
                                  indices=(1, 2, 3))
    args["correction"][1, 2, 1, 0, 3] = float("nan")  # layer 1, block 2 (row 1), position 0
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`correction` holds nan in layer 1, block 2 "
                                             r"\(row 1\) given to commit"):
            commit_call(args)
    args, _ = make_commit_problem(device, seed=51, lens=(1, 2, 3), accepted=(1, 2, 3),
                                  indices=(1, 2, 3))
    args["conv_state"][1, 2, 4, 0] = float("nan")  # layer 1, block 2 (row 1), its history
    before = args["state"].clone()
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`conv_state` holds nan in layer 1, block 2 "
                                             r"\(row 1\) given to commit"):
            commit_call(args)
    assert torch.equal(args["state"], before)
    args = flush_problem(device, (1, 3))
    args["state"][0, 3, 1, 2, 2] = float("inf")
    args["pending"].fill_(2)
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`state` holds inf in layer 0, block 3 \(row 1\) "
                                             r"given to flush"):
            kda_ops.flush(args.pop("state_indices"), **args)
