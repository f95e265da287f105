"""torch.library.opcheck for every kda_ops op, on CPU and CUDA: schema and
mutation annotations, the fake (meta) implementation against the real one, and
tracing through AOTAutograd with dynamic shapes."""

import pytest
import torch

from compile_helpers import DEVICES, NOT_UNDER_INTERPRETER, op_problems

pytestmark = NOT_UNDER_INTERPRETER

CASES = sorted(op_problems("cpu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASES)
def test_opcheck(device, case):
    op, kwargs = op_problems(device)[case]
    torch.library.opcheck(op, (), kwargs)


def test_every_registered_op_is_checked():
    """A new op in the namespace must get an opcheck case here."""
    import kda_ops  # noqa: F401  (registers the ops)

    registered = {name for name in dir(torch.ops.kda_ops)
                  if isinstance(getattr(torch.ops.kda_ops, name), torch._ops.OpOverloadPacket)}
    checked = {str(op_problems("cpu")[case][0]).split(".")[1] for case in CASES}
    # no_backward only raises when run (opcheck runs it): test_no_backward_op checks it.
    unchecked = registered - checked - {"no_backward"}
    assert unchecked == set(), f"ops without an opcheck case: {unchecked}"


def test_no_backward_op():
    """The op that stands for a gradient: it mutates nothing, its fake returns
    a tensor like the input it stands for, and running it raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = torch.ops.kda_ops.no_backward.default
    assert not op._schema.is_mutable
    grad, weight = torch.ones(3), torch.ones(2, 5, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fake = op(mode.from_tensor(grad), mode.from_tensor(weight), "verify")
    assert (fake.shape, fake.dtype) == (weight.shape, weight.dtype)
    with pytest.raises(RuntimeError, match="kda_ops.verify is inference-only"):
        op(grad, weight, "verify")
