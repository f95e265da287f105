"""Runs the programs of every Triton launch in another order under Triton's
CPU interpreter (`TRITON_INTERPRET=1`), which otherwise runs them one after
another in grid order. A test that passes in grid order but fails in another
has programs of one launch that read what another writes: on a GPU, where
they run at once, that is a race.

    TRITON_INTERPRET=1 python -m pytest -p tools.grid_order --grid-order reverse tests
    TRITON_INTERPRET=1 python -m pytest -p tools.grid_order --grid-order shuffle:7 tests

Under pytest a shuffle is drawn afresh for each test from the seed and the
test's id, so a test shuffles alike alone, in a whole run and on any xdist
worker. As a context manager: `with program_order("reverse"): ...`. The patched call
follows `triton.runtime.interpreter.GridExecutor.__call__` of Triton 3.9,
which the interpreter tests run; tests/test_grid_order.py checks that it
still takes effect.
"""

import argparse
import contextlib
import inspect
import random

import pytest

ORDERS = ("grid", "reverse", "shuffle")


def _parse(order):
    """"grid", "reverse" or "shuffle[:SEED]" -> (name, seed)."""
    name, _, seed = order.partition(":")
    if name not in ORDERS or (seed and (name != "shuffle" or not seed.isdigit())):
        raise ValueError(f"grid order must be one of grid, reverse, shuffle[:SEED]; got {order!r}")
    return name, int(seed or 0)


def _permuted_call(name, rng):
    from triton.runtime import interpreter

    def call(self, *args_dev, **kwargs):
        spec = inspect.getfullargspec(self.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
        args_hst, kwargs_hst = self._init_args_hst(args_dev, kwargs)
        for hook in self.pre_run_hooks:
            hook(*args_hst, **kwargs_hst)
        patch_scope = interpreter._patch_lang(self.fn)
        try:
            args = inspect.getcallargs(self.fn, *args_hst, **kwargs_hst)
            args = {key: value if key in self.constexprs else interpreter._implicit_cvt(value)
                    for key, value in args.items()}
            grid = self.grid(args) if callable(self.grid) else self.grid
            grid = tuple(grid) + (1,) * (3 - len(grid))
            interpreter.interpreter_builder.set_grid_dim(*grid)
            programs = [(x, y, z) for x in range(grid[0]) for y in range(grid[1])
                        for z in range(grid[2])]
            if name == "reverse":
                programs.reverse()
            elif name == "shuffle":
                rng.shuffle(programs)
            for program in programs:
                interpreter.interpreter_builder.set_grid_idx(*program)
                self.fn(**args)
        finally:
            patch_scope.restore()
        self._restore_args_dev(args_dev, args_hst, kwargs, kwargs_hst)

    return call


@contextlib.contextmanager
def program_order(order):
    """Interpreted launches run their programs in `order` ("grid", "reverse"
    or "shuffle[:SEED]") inside the block; yields a `reseed(key)` that
    restarts the shuffle from the seed and `key`."""
    name, seed = _parse(order)
    rng = random.Random(seed)
    try:
        from triton.runtime.interpreter import GridExecutor
    except ImportError:  # without Triton no launch is interpreted: nothing to reorder
        yield lambda key: None
        return
    original = GridExecutor.__call__
    GridExecutor.__call__ = _permuted_call(name, rng)
    try:
        yield lambda key: rng.seed(f"{seed}:{key}")  # str seeds hash alike in every process
    finally:
        GridExecutor.__call__ = original


def _order_option(order):
    try:
        _parse(order)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return order


def pytest_addoption(parser):
    parser.addoption("--grid-order", default="grid", type=_order_option,
                     help="program order of interpreted Triton launches: grid (default), "
                          "reverse or shuffle[:SEED]")


_RESEED = pytest.StashKey()


def pytest_configure(config):
    order = program_order(config.getoption("--grid-order"))
    config.stash[_RESEED] = order.__enter__()
    config.add_cleanup(lambda: order.__exit__(None, None, None))


def pytest_runtest_setup(item):
    item.config.stash[_RESEED](item.nodeid)
