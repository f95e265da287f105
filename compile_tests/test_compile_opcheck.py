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
    assert registered - checked == set(), f"ops without an opcheck case: {registered - checked}"
