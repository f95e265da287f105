"""tools/grid_order.py, which the kernels' race check runs the suite under
(README, "Run the tests"), still reorders the interpreter's programs."""

import pytest
import torch

from helpers import INTERPRET

pytestmark = pytest.mark.skipif(not INTERPRET, reason="reorders TRITON_INTERPRET=1 launches")

grid_order = pytest.importorskip("tools.grid_order")


def _launch_order(order, programs=(3, 2, 2), key=None):
    """The programs of one launch, numbered in grid order, in the order they ran
    (the shuffle reseeded with `key` first, as the plugin does for each test)."""
    import triton
    import triton.language as tl

    @triton.jit
    def record(ran, clock, Y: tl.constexpr, Z: tl.constexpr):
        tick = tl.atomic_add(clock, 1)
        program = (tl.program_id(0) * Y + tl.program_id(1)) * Z + tl.program_id(2)
        tl.store(ran + tick, program)

    count = programs[0] * programs[1] * programs[2]
    ran, clock = torch.full((count,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with grid_order.program_order(order) as reseed:
        if key is not None:
            reseed(key)
        record[programs](ran, clock, programs[1], programs[2])
    return ran.tolist()


def test_orders():
    count = 12
    assert _launch_order("grid") == list(range(count))
    assert _launch_order("reverse") == list(range(count))[::-1]
    shuffled = _launch_order("shuffle:3")
    assert sorted(shuffled) == list(range(count)) and shuffled != list(range(count))
    assert _launch_order("shuffle:3") == shuffled


def test_each_test_shuffles_alike_wherever_it_runs():
    """The plugin reseeds the shuffle from the seed and each test's id: a test
    draws the same order alone or after others, and tests draw different ones."""
    first = _launch_order("shuffle:3", key="tests/test_a.py::test_x")
    assert _launch_order("shuffle:3", key="tests/test_a.py::test_x") == first
    assert _launch_order("shuffle:3", key="tests/test_a.py::test_y") != first
    assert _launch_order("shuffle:4", key="tests/test_a.py::test_x") != first


@pytest.mark.parametrize("order", ["backwards", "reverse:1", "shuffle:x"])
def test_rejects_unknown_order(order):
    with pytest.raises(ValueError, match="grid order must be one of"):
        with grid_order.program_order(order):
            pass
