"""Tree drafts under torch.compile: a step of conv_update and verify over tree
windows and the commit of accepted paths captures as one graph (fullgraph),
compiles once as the trees change (their values, not their shapes) and at most
twice as token counts change, matches eager under Inductor (under the
deferred schedule too), exports, and replays in one captured CUDA graph as
the trees change."""

import random

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import kda_ops
from compile_helpers import DEVICES, NOT_UNDER_INTERPRETER, assert_close, requires_cuda

pytestmark = NOT_UNDER_INTERPRETER

H, K, W, T, N = 2, 8, 4, 8, 6
D = 3 * H * K
R = T + 4  # the deferred schedule's record positions


def tree_step(x, g, beta, parent, accepted, accepted_path, query_start_loc, state_indices,
              conv_weight, A_log, dt_bias, state, conv_state, correction, key_gate,
              pending=None):
    schedule = {} if pending is None else dict(pending=pending, spec_len=T)
    mixed = kda_ops.conv_update(x, conv_state, conv_weight, None, query_start_loc,
                                state_indices, parent=parent)
    q, k, v = (t.reshape(-1, H, K) for t in mixed.split(H * K, dim=-1))
    out = kda_ops.verify(q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate,
                         query_start_loc, state_indices, lower_bound=-5.0, parent=parent,
                         **schedule)
    kda_ops.commit(accepted, state_indices, query_start_loc, state=state,
                   conv_state=conv_state, correction=correction, key_gate=key_gate,
                   A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, accepted_path=accepted_path,
                   **schedule)
    return out


def step_args(device, seed, lens=(5, 8, 3), deferred=False):
    """A step's inputs: random trees, a random root path accepted per window;
    `deferred`: records of R positions and random pending counts (each
    leaving room for a window)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    parents, paths = [], []
    for length in lens:
        window = [-1] + [rng.randrange(t) for t in range(1, length)]
        node = rng.randrange(length)
        path = [node]
        while window[path[-1]] >= 0:
            path.append(window[path[-1]])
        paths.append(path[::-1] + [0] * (T - len(path)))
        parents += window
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    n = int(qsl[-1])
    args = (rand(n, D), rand(n, H, K), rand(n, H),
            torch.tensor(parents, dtype=torch.int32),
            torch.tensor([sum(1 for i, p in enumerate(path) if i == 0 or p)
                          for path in paths], dtype=torch.int32),
            torch.tensor(paths, dtype=torch.int32), qsl,
            torch.tensor([1, 3, 4][:len(lens)], dtype=torch.int32),
            rand(D, W), rand(H) * 0.5, rand(H, K), rand(N, H, K, K), rand(N, D, W - 1 + T - 1))
    records = R if deferred else T
    args += (rand(N, H, records, K), rand(N, H, records, 2 * K))
    if deferred:
        args += (torch.randint(0, R - T + 1, (N,), generator=gen, dtype=torch.int32),)
    return [a.to(device) for a in args]


def clone(args):
    return [a.clone() for a in args]


@pytest.mark.parametrize("device", DEVICES)
def test_tree_step_compiles_once_as_trees_change(device):
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(tree_step, backend=counter, fullgraph=True)
    for seed in range(3):
        compiled(*step_args(device, seed))
    assert counter.frame_count == 1
    for seed, lens in ((3, (4, 7, 2)), (4, (6, 1, 8)), (5, (2, 2, 5))):
        compiled(*step_args(device, seed, lens))
    assert counter.frame_count <= 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("deferred", [False, True])
def test_tree_step_under_inductor_matches_eager(device, deferred):
    torch._dynamo.reset()
    compiled = torch.compile(tree_step, fullgraph=True)
    for seed in range(2):
        args = step_args(device, 10 + seed, deferred=deferred)
        eager_args, compiled_args = clone(args), clone(args)
        expected = tree_step(*eager_args)
        out = compiled(*compiled_args)
        assert_close(out, expected, name="out")
        written = (("state", 11), ("conv_state", 12), ("correction", 13)) + (
            (("pending", 15),) if deferred else ())
        for name, index in written:
            assert_close(compiled_args[index], eager_args[index], name=name)
        if deferred:  # the tree's commit folded every committed block's pending records
            assert not compiled_args[15][compiled_args[7].long()].any()


class TreeStep(torch.nn.Module):
    def forward(self, *args):
        return tree_step(*args)


def test_tree_step_exports():
    args = step_args("cpu", 20)
    program = torch.export.export(TreeStep(), tuple(clone(args)))
    targets = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert {"kda_ops.conv_update.default", "kda_ops.verify.default",
            "kda_ops.commit.default"} <= targets
    eager_args, exported_args = clone(args), clone(args)
    assert_close(program.module()(*exported_args), tree_step(*eager_args), name="out")


@requires_cuda
def test_one_cuda_graph_replays_changing_trees():
    """A step captured once on fixed buffers (eager ops, no host sync) serves
    every tree of the same token counts: each replay's new parents, paths,
    inputs and caches copied in, its outputs and caches against eager."""
    static = step_args("cuda", 30)
    tree_step(*clone(static))  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tree_step(*static)
    for seed in (31, 32, 33):
        fresh = step_args("cuda", seed)
        for buffer, value in zip(static, fresh):
            buffer.copy_(value)
        eager_args = clone(fresh)
        expected = tree_step(*eager_args)
        graph.replay()
        assert_close(out, expected, name="out")
        for name, index in (("state", 11), ("conv_state", 12), ("correction", 13)):
            assert_close(static[index], eager_args[index], name=name)
