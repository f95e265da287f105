"""Tree drafts (docs/semantics.md#13-tree-drafts): verify and conv_update of
tree windows, commit of an accepted path, against the float64 oracle (each
node decoded along its own path) and against sequential decoding of the
accepted tokens over a long run."""

import random

import pytest
import torch

import kda_ops
from kda_ops import naive
from kda_ops.kernels.dispatch import kernel_choices, verify_config

from helpers import DEVICES, INTERPRET, assert_rel_close, long_run_steps, query_start_loc

H, K, V, W = 2, 8, 4, 3
D = H * (2 * K + V)


def tree_parents(shape, nodes, rng):
    """Window parents of one tree of `nodes` nodes (root first, -1)."""
    if shape == "chain":
        return [-1] + list(range(nodes - 1))
    if shape == "star":
        return [-1] + [0] * (nodes - 1)
    if shape == "binary":
        return [-1] + [(t - 1) // 2 for t in range(1, nodes)]
    if shape == "deep":  # a long trunk with a few short side branches
        return [-1] + [t - 1 if t % 4 else max(t - 3, 0) for t in range(1, nodes)]
    return [-1] + [rng.randrange(t) for t in range(1, nodes)]


SHAPES = ("chain", "star", "binary", "deep", "random")


def tree_batch(rng, T, lens, shapes):
    """Packed parents of windows of `lens` nodes: trees of `shapes`; windows
    past T keep their extra tokens' parents in range (they are not read)."""
    parents = []
    for length, shape in zip(lens, shapes):
        nodes = tree_parents(shape, max(length, 1), rng)[:length]
        parents += nodes
    return torch.tensor(parents, dtype=torch.int32)


def random_path(parents, rng):
    """A root path of a window: to a random node, cut at a random length >= 1."""
    path = naive.tree_path(parents, rng.randrange(len(parents)))
    return path[:rng.randint(1, len(path))]


def decode_path(truth, path, bos, q, k, v, g, beta, A_log, dt_bias):
    """Sequential float64 decoding of a window's accepted nodes `path` (its
    tokens from `bos`) into one block's states `truth [H, V, K]`."""
    for h in range(H):
        for node in path:
            token = bos + node
            truth[h], _, _ = naive.step(truth[h], q[token, h], k[token, h], v[token, h],
                                        g[token, h], beta[token, h], A_log[h], dt_bias[h], -5.0,
                                        K ** -0.5)


def problem(device, seed, T=16, lens=(16, 7, 1, 12, 0, 16, 5), indices=(1, 2, 3, 0, 4, 5, 9),
            shapes=("random", "binary", "chain", "star", "chain", "deep", "random"), N=8,
            layers=2, K=K, V=V):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    qsl = query_start_loc(lens, "cpu")
    n = int(qsl[-1])
    args = dict(q=rand(n, H, K), k=rand(n, H, K), v=rand(n, H, V), g=rand(n, H, K),
                beta=rand(n, H), A_log=rand(layers, H) * 0.5, dt_bias=rand(layers, H, K),
                state=rand(layers, N, H, V, K), correction=rand(layers, N, H, T, V),
                key_gate=rand(layers, N, H, T, 2 * K), conv_state=rand(layers, N, D, W - 1 + T - 1),
                x=rand(n, D), weight=rand(D, W), bias=rand(D), query_start_loc=qsl,
                state_indices=torch.tensor(indices, dtype=torch.int32),
                parent=tree_batch(rng, T, lens, shapes))
    paths, accepted = [], []
    starts = qsl.tolist()
    for b in range(len(lens)):
        window = args["parent"][starts[b]:starts[b + 1]][:T].tolist()
        path = random_path(window, rng) if window else [0]
        accepted.append(len(path))
        paths.append(path + [0] * (T - len(path)))
    args["accepted_path"] = torch.tensor(paths, dtype=torch.int32)
    args["num_accepted_tokens"] = torch.tensor(accepted, dtype=torch.int32)
    return {name: t.to(device) for name, t in args.items()}, rng


VERIFY = ("q", "k", "v", "g", "beta")


def verify_layer(a, layer, **kwargs):
    return kda_ops.verify(*(a[name] for name in VERIFY), a["A_log"][layer], a["dt_bias"][layer],
                          a["state"][layer], a["correction"][layer], a["key_gate"][layer],
                          a["query_start_loc"], a["state_indices"], parent=a["parent"],
                          **kwargs)


def cpu(a, *names):
    return [a[name].cpu() for name in names]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_tree_verify_matches_the_oracle(device, lower_bound):
    """Trees of every shape beside chains, a one-node window, an empty one, a
    null row, a row past the cache; every node along its own path."""
    a, _ = problem(device, seed=1)
    expected_out, expected_corr, expected_kg = naive.verify(
        *cpu(a, *VERIFY), a["A_log"][0].cpu(), a["dt_bias"][0].cpu(), a["state"][0].cpu(),
        a["correction"][0].cpu(), a["key_gate"][0].cpu(), a["query_start_loc"].cpu(),
        a["state_indices"].cpu(), lower_bound=lower_bound, parent=a["parent"].cpu())
    out = verify_layer(a, 0, lower_bound=lower_bound)
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], name="out")
    assert_rel_close(a["correction"][0].cpu(), expected_corr, name="correction")
    assert torch.equal(a["key_gate"][0].cpu(), expected_kg)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form, link, T", [
    ("closed_form", None, 16), ("closed_form", None, 3), ("tensor_cores", None, 16),
    ("tensor_cores", None, 6), ("separate_terms", None, 16), ("separate_terms", True, 8),
    ("separate_terms", False, 8)])
@pytest.mark.parametrize("deferred", [False, True])
def test_tree_verify_in_every_kernel_form(device, form, link, T, deferred):
    """Every form the kernels take trees in (all but the token loop), at 16
    nodes and fewer: K = 16 for the tensor cores, V = 40 a partial value
    tile; windows longer than T get zero outputs past T. `deferred`: records
    of R = T + 5 positions after random pending counts (some 0)."""
    lens = (T, T // 2, 1, T + 2, 0, T, 3)
    a, _ = problem(device, seed=11 + T, T=T, lens=lens, K=16, V=40)
    schedule = {}
    if deferred:
        gen = torch.Generator().manual_seed(T)
        R, N = T + 5, a["state"].shape[1]
        a["correction"] = torch.randn(1, N, H, R, 40, generator=gen).to(device)
        a["key_gate"] = torch.randn(1, N, H, R, 32, generator=gen).to(device)
        pending = torch.randint(0, R - T + 1, (N,), generator=gen, dtype=torch.int32)
        pending[1] = 0
        schedule = dict(pending=pending.to(device), spec_len=T)
    with kernel_choices(verify_form=form, link_on_tensor_cores=link):
        if device != "cpu" or INTERPRET:
            assert verify_config(16, 40, len(lens) * H, T, deferred, tree=True).form == form
        out = verify_layer(a, 0, lower_bound=-5.0, **schedule)
    expected_out, expected_corr, _ = naive.verify(
        *cpu(a, *VERIFY), a["A_log"][0].cpu(), a["dt_bias"][0].cpu(), a["state"][0].cpu(),
        a["correction"][0].cpu(), a["key_gate"][0].cpu(), a["query_start_loc"].cpu(),
        a["state_indices"].cpu(), lower_bound=-5.0, parent=a["parent"].cpu(),
        **{name: t.cpu() if isinstance(t, torch.Tensor) else t for name, t in schedule.items()})
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], name="out")
    assert_rel_close(a["correction"][0].cpu(), expected_corr, name="correction")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["closed_form", "tensor_cores", "separate_terms"])
def test_out_of_range_parents_start_nodes_from_the_checkpoint(device, form):
    """A parent outside 0 .. t-1 (-1 past node 0, t itself, past the window)
    makes node t a root: its output, record and convolution start from the
    checkpoint and the history (docs/semantics.md#13-tree-drafts)."""
    T = 8
    a, _ = problem(device, seed=21, T=T, lens=(8, 6, 5), indices=(1, 2, 3), K=16, V=40)
    a["parent"] = torch.tensor([-1, 0, -1, 2, 3, 5, 1, 7] + [-1, -1, 1, -1, 9, 3]
                               + [-1, 0, 0, -1, 3], dtype=torch.int32, device=device)
    with kernel_choices(verify_form=form):
        out = verify_layer(a, 0, lower_bound=-5.0)
    expected_out, expected_corr, _ = naive.verify(
        *cpu(a, *VERIFY), a["A_log"][0].cpu(), a["dt_bias"][0].cpu(), a["state"][0].cpu(),
        a["correction"][0].cpu(), a["key_gate"][0].cpu(), a["query_start_loc"].cpu(),
        a["state_indices"].cpu(), lower_bound=-5.0, parent=a["parent"].cpu())
    assert_rel_close(out.cpu(), expected_out, name="out")
    assert_rel_close(a["correction"][0].cpu(), expected_corr, name="correction")
    conv_state = a["conv_state"][0]
    expected_conv, expected_history = naive.conv_update(
        a["x"].cpu(), conv_state.cpu(), a["weight"].cpu(), a["bias"].cpu(),
        a["query_start_loc"].cpu(), a["state_indices"].cpu(), parent=a["parent"].cpu())
    conv_out = kda_ops.conv_update(a["x"], conv_state, a["weight"], a["bias"],
                                   a["query_start_loc"], a["state_indices"], parent=a["parent"])
    assert_rel_close(conv_out.cpu(), expected_conv, name="conv out")
    assert torch.equal(conv_state.cpu(), expected_history)


def test_trees_take_the_closed_forms_only():
    """No token loop for trees (it carries one chain's state): the closed form
    where a chain would loop, the tensor cores up to 16 nodes (in two kernels
    up to 8); forcing the loop on a tree is refused; the tensor-core link up
    to 8 nodes."""
    assert verify_config(128, 128, 32, 16).form == "token_loop"
    assert verify_config(128, 128, 32, 16, tree=True).form == "closed_form"
    assert verify_config(128, 128, 32 * 64, 8, tree=True).form == "separate_terms"
    assert verify_config(128, 128, 32 * 8, 8, tree=True).form == "tensor_cores"
    assert verify_config(128, 128, 32 * 64, 16, tree=True).form == "tensor_cores"
    assert verify_config(128, 128, 32 * 64, 24, tree=True).form == "closed_form"
    with kernel_choices(verify_form="token_loop"), pytest.raises(ValueError, match="chains only"):
        verify_config(128, 128, 32, 8, tree=True)
    # Linked on tensor cores up to 8 nodes, even when asked for (16 lost accuracy).
    with kernel_choices(link_on_tensor_cores=True):
        assert verify_config(128, 128, 32 * 64, 8, tree=True).link_on_tensor_cores
        assert not verify_config(128, 128, 32 * 64, 16, tree=True).link_on_tensor_cores


@pytest.mark.parametrize("device", DEVICES)
def test_a_chain_given_as_a_tree_is_the_chain(device):
    a, _ = problem(device, seed=2, shapes=("chain",) * 7)
    chain = {name: t.clone() for name, t in a.items()}
    tree_out = verify_layer(a, 1)
    chain_out = kda_ops.verify(*(chain[name] for name in VERIFY), chain["A_log"][1],
                               chain["dt_bias"][1], chain["state"][1], chain["correction"][1],
                               chain["key_gate"][1], chain["query_start_loc"],
                               chain["state_indices"])
    assert_rel_close(tree_out, chain_out, tol=1e-5, name="out")
    assert_rel_close(a["correction"], chain["correction"], tol=1e-5, name="correction")


@pytest.mark.parametrize("device", DEVICES)
def test_tree_conv_update_matches_the_oracle(device):
    a, _ = problem(device, seed=3)
    conv_state = a["conv_state"][0]
    expected_out, expected_state = naive.conv_update(
        a["x"].cpu(), conv_state.cpu(), a["weight"].cpu(), a["bias"].cpu(),
        a["query_start_loc"].cpu(), a["state_indices"].cpu(), parent=a["parent"].cpu())
    out = kda_ops.conv_update(a["x"], conv_state, a["weight"], a["bias"], a["query_start_loc"],
                              a["state_indices"], parent=a["parent"])
    written = ~torch.isnan(expected_out)
    assert_rel_close(out.cpu()[written], expected_out[written], name="out")
    assert torch.equal(conv_state.cpu(), expected_state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stacked", [True, False])
def test_commit_of_an_accepted_path_matches_the_oracle(device, stacked):
    a, _ = problem(device, seed=4)
    layer = slice(None) if stacked else 0
    caches = {name: a[name][layer] for name in ("state", "conv_state", "correction",
                                                "key_gate", "A_log", "dt_bias")}
    expected_state, expected_conv = naive.commit(
        *cpu(a, "num_accepted_tokens", "state_indices", "query_start_loc"),
        accepted_path=a["accepted_path"].cpu(), **{n: t.cpu() for n, t in caches.items()})
    kda_ops.commit(a["num_accepted_tokens"], a["state_indices"], a["query_start_loc"],
                   accepted_path=a["accepted_path"], **caches)
    assert_rel_close(caches["state"].cpu(), expected_state, name="state")
    assert torch.equal(caches["conv_state"].cpu(), expected_conv)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_of_a_path_in_align_mode(device):
    """Paths that cross a block boundary: the boundary state is the path's
    state after `recovery` path tokens."""
    a, _ = problem(device, seed=5, lens=(16, 9, 12), indices=(1, 2, 3),
                   shapes=("random", "deep", "binary"))
    table = torch.tensor([[1, 4], [2, 5], [3, 6]], dtype=torch.int32, device=device)
    computed = torch.tensor([6, 7, 4], dtype=torch.int32, device=device)
    caches = {name: a[name] for name in ("state", "conv_state", "correction", "key_gate",
                                         "A_log", "dt_bias")}
    align = dict(block_table=table, num_computed_tokens=computed, block_size=8)
    expected_state, expected_conv = naive.commit(
        *cpu(a, "num_accepted_tokens", "state_indices", "query_start_loc"),
        accepted_path=a["accepted_path"].cpu(), **{n: t.cpu() for n, t in caches.items()},
        **{n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in align.items()})
    kda_ops.commit(a["num_accepted_tokens"], a["state_indices"], a["query_start_loc"],
                   accepted_path=a["accepted_path"], **caches, **align)
    assert_rel_close(caches["state"].cpu(), expected_state, name="state")
    assert torch.equal(caches["conv_state"].cpu(), expected_conv)


@pytest.mark.parametrize("device", DEVICES)
def test_long_run_of_random_trees_against_sequential_decoding(device):
    """200 steps (30 interpreted or under the sanitizer); each drafts a random
    tree per request (1 to 16 nodes, mixed with chains) and accepts a random
    root path. States after every step against sequential float64 decoding
    of the accepted tokens."""
    rng = random.Random(6)
    gen = torch.Generator().manual_seed(6)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    T, N, B = 16, 5, 3
    A_log, dt_bias = rand(H) * 0.5, rand(H, K)
    state = torch.zeros(N, H, V, K)
    truth = torch.zeros(N, H, V, K, dtype=torch.float64)
    correction, key_gate = torch.zeros(N, H, T, V), torch.zeros(N, H, T, 2 * K)
    blocks = torch.tensor([1, 2, 3], dtype=torch.int32)
    moved = [t.to(device) for t in (state, correction, key_gate, A_log, dt_bias, blocks)]
    state_d, correction_d, key_gate_d, A_log_d, dt_bias_d, blocks_d = moved
    for step in range(long_run_steps(200, 30)):
        lens = [rng.randint(1, T) for _ in range(B)]
        shapes = [rng.choice(SHAPES) for _ in range(B)]
        parents = tree_batch(rng, T, lens, shapes)
        qsl = query_start_loc(lens, "cpu")
        n = int(qsl[-1])
        q, k, g, v, beta = rand(n, H, K), rand(n, H, K), rand(n, H, K), rand(n, H, V), rand(n, H)
        kda_ops.verify(*(t.to(device) for t in (q, k, v, g, beta)), A_log_d, dt_bias_d,
                       state_d, correction_d, key_gate_d, qsl.to(device), blocks_d,
                       lower_bound=-5.0, parent=parents.to(device))
        paths, accepted = [], []
        for b in range(B):
            path = random_path(parents[qsl[b]:qsl[b + 1]].tolist(), rng)
            accepted.append(len(path))
            paths.append(path + [0] * (T - len(path)))
            decode_path(truth[b + 1], path, int(qsl[b]), q, k, v, g, beta, A_log, dt_bias)
        kda_ops.commit(torch.tensor(accepted, dtype=torch.int32, device=device), blocks_d,
                       qsl.to(device), state=state_d, correction=correction_d,
                       key_gate=key_gate_d, A_log=A_log_d, dt_bias=dt_bias_d, lower_bound=-5.0,
                       accepted_path=torch.tensor(paths, dtype=torch.int32, device=device))
        assert_rel_close(state_d.cpu(), truth, tol=1e-4, name=f"state after step {step}")


def deferred_tree_problem(device, seed, T=6, R=13, align=False):
    """A deferred step of trees: records of R > T positions, random pending
    counts leaving room for a window (some 0), trees of every shape, a one-node
    and an empty window, a null row, a row past the cache, a window longer
    than T; in align mode every request's table blocks are its own."""
    lens = (T, 4, 1, T + 2, 0, T, 3)
    N = 24
    a, rng = problem("cpu", seed, T=T, lens=lens, indices=(1, 2, 3, 6, 4, 0, N + 6), N=N)
    gen = torch.Generator().manual_seed(seed)
    layers = a["state"].shape[0]
    a["correction"] = torch.randn(layers, N, H, R, V, generator=gen)
    a["key_gate"] = torch.randn(layers, N, H, R, 2 * K, generator=gen)
    a["pending"] = torch.randint(0, R - T + 1, (layers, N), generator=gen, dtype=torch.int32)
    a["pending"][:, 2] = 0
    a["pending"][:, 3] = 1  # row 2's one-node path then stays pending (eager_fold=False)
    # Each window's path to its last node: most leave the chain 0, 1, 2, ...
    starts = a["query_start_loc"].tolist()
    paths = [naive.tree_path(a["parent"][starts[b]:starts[b + 1]][:T].tolist(),
                             min(lens[b], T) - 1) if lens[b] else [0] for b in range(len(lens))]
    a["num_accepted_tokens"] = torch.tensor([len(path) for path in paths], dtype=torch.int32)
    a["accepted_path"] = torch.tensor([path + [0] * (T - len(path)) for path in paths],
                                      dtype=torch.int32)
    if align:
        B = len(lens)
        a["block_table"] = torch.arange(8, 8 + B * 2, dtype=torch.int32).view(B, 2)
        a["num_computed_tokens"] = torch.tensor([9, 14, 4, 0, 7, 12, 2], dtype=torch.int32)
    return {name: t.to(device) for name, t in a.items()}, rng


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("eager_fold", [None, False])
def test_trees_under_the_deferred_schedule_match_the_oracle(device, stacked, align, eager_fold):
    """verify of tree windows after pending records (each node along its path
    from the checkpoint folded with them, recorded after them), then the
    tree's commit: a path that leaves the chain 0, 1, ... folds at once (the
    pending records, then the path's), one along it stays pending as a
    chain's would (eager_fold=False; None folds everything at this batch).
    Outputs, records, states, conv history and counts against the oracle."""
    T, R = 6, 13
    a, _ = deferred_tree_problem(device, seed=21 + stacked + 2 * align, T=T, R=R, align=align)
    for layer in range(a["state"].shape[0]):
        expected = naive.verify(
            *cpu(a, *VERIFY), *(a[name][layer].cpu() for name in (
                "A_log", "dt_bias", "state", "correction", "key_gate")),
            a["query_start_loc"].cpu(), a["state_indices"].cpu(), lower_bound=-5.0,
            out=torch.zeros(a["v"].shape), pending=a["pending"][layer].cpu(), spec_len=T,
            parent=a["parent"].cpu())
        out = verify_layer(a, layer, lower_bound=-5.0, pending=a["pending"][layer], spec_len=T,
                           out=torch.zeros(a["v"].shape, device=device))
        assert_rel_close(out.cpu(), expected[0].float(), name=f"out, layer {layer}")
        assert_rel_close(a["correction"][layer].cpu(), expected[1].float(),
                         name=f"correction, layer {layer}")
        assert torch.equal(a["key_gate"][layer].cpu(), expected[2])
    layer = slice(None) if stacked else 1
    caches = {name: a[name][layer] for name in ("state", "conv_state", "correction",
                                                "key_gate", "A_log", "dt_bias", "pending")}
    align_args = ({name: a[name] for name in ("block_table", "num_computed_tokens")}
                  | dict(block_size=8) if align else {})
    on_cpu = lambda d: {n: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
                        for n, t in d.items()}
    expected_state, expected_conv, expected_pending = naive.commit(
        *cpu(a, "num_accepted_tokens", "state_indices", "query_start_loc"),
        accepted_path=a["accepted_path"].cpu(), lower_bound=-5.0, spec_len=T,
        eager_fold=eager_fold, **on_cpu(caches), **on_cpu(align_args))
    pending_before = caches["pending"].clone()
    kda_ops.commit(a["num_accepted_tokens"], a["state_indices"], a["query_start_loc"],
                   accepted_path=a["accepted_path"], lower_bound=-5.0, spec_len=T,
                   eager_fold=eager_fold, **caches, **align_args)
    assert_rel_close(caches["state"].cpu(), expected_state.float(), name="state")
    assert torch.equal(caches["conv_state"].cpu(), expected_conv)
    assert torch.equal(caches["pending"].cpu(), expected_pending)
    committed = torch.tensor([1, 2, 3, 4, 6], device=device)
    assert pending_before[..., committed].any()
    if eager_fold is None:
        assert not caches["pending"][..., committed].any()
    elif not align:  # in align mode a block boundary may fold it
        assert (caches["pending"][..., 3] == 2).all(), "the path [0] stays pending"
        assert not caches["pending"][..., [2, 6]].any(), "paths off the chain fold"


@pytest.mark.parametrize("device", DEVICES)
def test_long_run_of_trees_and_chains_under_the_deferred_schedule(device):
    """200 steps (30 interpreted or under the sanitizer) on one set of caches,
    every commit with eager_fold=False: a step drafts random trees (1 to T
    nodes) or chains, chosen at random. A tree row whose path leaves the
    chain 0, 1, ... folds at once; one along it stays pending, as chains do.
    Every step, the checkpoints with their pending records folded in (a
    flush of copies) against sequential float64 decoding of the accepted
    tokens."""
    rng = random.Random(26)
    gen = torch.Generator().manual_seed(26)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    T, R, N, B = 5, 12, 5, 3
    A_log, dt_bias = rand(H) * 0.5, rand(H, K)
    truth = torch.zeros(N, H, V, K, dtype=torch.float64)
    caches = dict(state=torch.zeros(N, H, V, K), correction=torch.zeros(N, H, R, V),
                  key_gate=torch.zeros(N, H, R, 2 * K),
                  pending=torch.zeros(N, dtype=torch.int32))
    caches = {name: t.to(device) for name, t in caches.items()}
    gate = dict(A_log=A_log.to(device), dt_bias=dt_bias.to(device), lower_bound=-5.0)
    blocks = torch.tensor([1, 2, 3], dtype=torch.int32, device=device)
    trees = kept = 0
    for step in range(long_run_steps(200, 30)):
        tree = rng.random() < 0.5
        trees += tree
        lens = [rng.randint(1, T) for _ in range(B)]
        parents = tree_batch(rng, T, lens, [rng.choice(SHAPES) if tree else "chain"
                                            for _ in range(B)])
        qsl = query_start_loc(lens, "cpu")
        n = int(qsl[-1])
        q, k, g, v, beta = rand(n, H, K), rand(n, H, K), rand(n, H, K), rand(n, H, V), rand(n, H)
        kda_ops.verify(*(t.to(device) for t in (q, k, v, g, beta)), gate["A_log"],
                       gate["dt_bias"], caches["state"], caches["correction"],
                       caches["key_gate"], qsl.to(device), blocks, lower_bound=-5.0,
                       pending=caches["pending"], spec_len=T,
                       parent=parents.to(device) if tree else None)
        paths, accepted, off_chain = [], [], []
        for b in range(B):
            window = parents[qsl[b]:qsl[b + 1]].tolist()
            path = random_path(window, rng) if tree else list(range(rng.randint(0, lens[b])))
            accepted.append(len(path))
            paths.append(path + [0] * (T - len(path)))
            off_chain.append(path != list(range(len(path))))
            decode_path(truth[b + 1], path, int(qsl[b]), q, k, v, g, beta, A_log, dt_bias)
        tree_args = (dict(accepted_path=torch.tensor(paths, dtype=torch.int32, device=device))
                     if tree else {})
        kda_ops.commit(torch.tensor(accepted, dtype=torch.int32, device=device), blocks,
                       qsl.to(device), state=caches["state"], correction=caches["correction"],
                       key_gate=caches["key_gate"], pending=caches["pending"], spec_len=T,
                       eager_fold=False, **gate, **tree_args)
        if tree:
            counts = caches["pending"][blocks.long()].tolist()
            assert not any(count for count, off in zip(counts, off_chain) if off), (
                f"a path off the chain folds at once (step {step})")
            kept += sum(1 for count, off in zip(counts, off_chain) if count and not off)
        flushed = {name: t.clone() for name, t in caches.items()}
        kda_ops.flush(blocks, **flushed, **gate)
        assert_rel_close(flushed["state"].cpu(), truth, tol=1e-4,
                         name=f"state after step {step}")
    assert 0 < trees < long_run_steps(200, 30) and kept > 0


@pytest.mark.parametrize("mutate, message", [
    (lambda a: a["parent"].__setitem__(0, 0), r"`parent` \[0\] = 0 \(row 0's node 0\) must be "
                                              r"-1 \(the root\)"),
    (lambda a: a["parent"].__setitem__(5, 5), r"`parent` \[5\] = 5 \(row 0's node 5\) must be "
                                              r"in 0..4"),
])
def test_value_checks_catch_trees_out_of_order(mutate, message):
    a, _ = problem("cpu", seed=8, indices=(1, 2, 3, 0, 4, 5, 6))
    mutate(a)
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=message):
            verify_layer(a, 0)
        with pytest.raises(ValueError, match=message):
            kda_ops.conv_update(a["x"], a["conv_state"][0], a["weight"], a["bias"],
                                a["query_start_loc"], a["state_indices"], parent=a["parent"])


def test_value_checks_catch_paths_that_leave_the_tree():
    a, _ = problem("cpu", seed=9, lens=(6,), indices=(1,), shapes=("binary",))
    commit_args = dict(state=a["state"][0], correction=a["correction"][0],
                       key_gate=a["key_gate"][0], A_log=a["A_log"][0], dt_bias=a["dt_bias"][0])
    with kda_ops.value_checks():
        verify_layer(a, 0)
        for path, message in (([0, 1, 2], r"\[0, 2\] = 2 \(row 0\) is a child of node 0, not "
                                          r"of the path's previous node 1"),
                              ([1, 3], r"\[0, 0\] = 1 \(row 0\) must be 0, the root")):
            accepted_path = torch.zeros(1, 16, dtype=torch.int32)
            accepted_path[0, :len(path)] = torch.tensor(path)
            with pytest.raises(ValueError, match=rf"`accepted_path` {message}"):
                kda_ops.commit(torch.tensor([len(path)], dtype=torch.int32),
                               a["state_indices"], a["query_start_loc"],
                               accepted_path=accepted_path, **commit_args)


def test_value_checks_match_the_commit_to_the_windows_verify_ran():
    """A path over a chain verify, and a chain commit (no path) over a tree
    verify, fold records computed against other states: refused; a chain over
    a chain passes."""
    a, _ = problem("cpu", seed=10, lens=(6,), indices=(1,), shapes=("binary",))
    commit_args = dict(state=a["state"][0], correction=a["correction"][0],
                       key_gate=a["key_gate"][0], A_log=a["A_log"][0], dt_bias=a["dt_bias"][0])
    accepted = torch.tensor([3], dtype=torch.int32)
    path = torch.zeros(1, 16, dtype=torch.int32)
    path[0, :3] = torch.tensor([0, 2, 5])  # binary: 2's parent is 0, 5's is 2
    with kda_ops.value_checks():
        verify_layer(a, 0)
        with pytest.raises(ValueError, match=r"`accepted_path` is not given, so row 0's first 3 "
                                             r"nodes fold as a chain, but verify ran its window "
                                             r"as a tree: node 2's parent is 0"):
            kda_ops.commit(accepted, a["state_indices"], a["query_start_loc"], **commit_args)
        verify_layer(dict(a, parent=None), 0)
        with pytest.raises(ValueError, match=r"`accepted_path` \[0, 1\] = 2 \(row 0\) is a "
                                             r"child of node 1"):
            kda_ops.commit(accepted, a["state_indices"], a["query_start_loc"],
                           accepted_path=path, **commit_args)
        kda_ops.commit(accepted, a["state_indices"], a["query_start_loc"], **commit_args)


@pytest.mark.parametrize("pending", [None, 3])
def test_value_checks_read_a_tree_commit_s_records_along_its_path(pending):
    """A non-finite record at a path node past the first c positions (after
    the pending records, under the deferred schedule) is refused before the
    state is written."""
    a, _ = problem("cpu", seed=11, lens=(6,), indices=(1,), shapes=("binary",))
    T = 16 if pending is None else 6
    path = torch.zeros(1, T, dtype=torch.int32)
    path[0, :2] = torch.tensor([0, 2])
    schedule = {} if pending is None else dict(
        pending=torch.full((8,), pending, dtype=torch.int32), spec_len=T)
    with kda_ops.value_checks():
        verify_layer(a, 0, **schedule)
    a["correction"][0, 1, 1, (pending or 0) + 2, 3] = float("nan")  # block 1, head 1, node 2
    before = a["state"][0].clone()
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`correction` holds nan in block 1 \(row 0\) "
                                             r"given to commit"):
            kda_ops.commit(torch.tensor([2], dtype=torch.int32), a["state_indices"],
                           a["query_start_loc"], state=a["state"][0],
                           correction=a["correction"][0], key_gate=a["key_gate"][0],
                           A_log=a["A_log"][0], dt_bias=a["dt_bias"][0], accepted_path=path,
                           **schedule)
    assert torch.equal(a["state"][0], before)


# ---------------------------------------------------------------- planner
def test_parents_from_lists_and_from_sglang_retrieve_arrays():
    from kda_ops.planner import parents_from_lists, parents_from_retrieve
    trees = [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 0, 4]]
    packed = parents_from_lists(trees)
    assert packed.dtype == torch.int32 and packed.tolist() == trees[0] + trees[1]
    # The same trees as first-child / next-sibling arrays.
    next_token = torch.tensor([[1, 3, 5, -1, -1, -1], [1, 2, 3, -1, 5, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, 4, -1, -1], [-1, 4, -1, -1, -1, -1]])
    assert parents_from_retrieve(next_token, next_sibling).tolist() == trees[0] + trees[1]


@pytest.mark.parametrize("batch", [1, 3])
def test_parents_from_retrieve_arrays_of_random_trees(batch):
    """Random trees of 1 to 16 nodes, each node's children listed in a random
    order; one request included (its views of the parents are contiguous)."""
    from kda_ops.planner import parents_from_retrieve
    rng = random.Random(batch)
    for _ in range(20):
        T = rng.randint(1, 16)
        trees = [[-1] + [rng.randrange(t) for t in range(1, T)] for _ in range(batch)]
        next_token = torch.full((batch, T), -1, dtype=torch.int32)
        next_sibling = torch.full((batch, T), -1, dtype=torch.int32)
        for b, tree in enumerate(trees):
            for node in range(T):
                children = [t for t in range(T) if tree[t] == node]
                rng.shuffle(children)
                if children:
                    next_token[b, node] = children[0]
                for elder, younger in zip(children, children[1:]):
                    next_sibling[b, elder] = younger
        assert parents_from_retrieve(next_token, next_sibling).tolist() == sum(trees, [])


def test_accepted_path_from_packed_indices():
    from kda_ops.planner import accepted_path_from_indices
    qsl = torch.tensor([0, 6, 12], dtype=torch.int32)
    accept_index = torch.tensor([[0, 1, 3, -1], [6, 7, -1, -1]])
    counts, paths = accepted_path_from_indices(accept_index, qsl)
    assert counts.tolist() == [3, 2] and paths.tolist() == [[0, 1, 3, 0], [0, 1, 0, 0]]
    # SGLang's accept_index is [B, draft steps + 1], narrower than the T nodes.
    counts, paths = accepted_path_from_indices(accept_index[:, :3], qsl, spec_len=6)
    assert counts.tolist() == [3, 2]
    assert paths.tolist() == [[0, 1, 3, 0, 0, 0], [0, 1, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="`spec_len` must be an int of at least"):
        accepted_path_from_indices(accept_index, qsl, spec_len=3)


def test_planner_carries_tree_metadata_to_the_ops_and_the_graph_buffers():
    """plan_batch picks the speculative rows' parents out of the batch's; its
    commit arguments and the staged buffers carry the accepted paths."""
    from kda_ops.planner import SpecDecodeGraphBuffers, parents_from_lists, plan_batch
    T = 4
    trees = [[-1, 0, 0, 1], [-1, 0, 1], [-1], [-1, 0]]
    qsl_cpu = torch.tensor([0, 4, 7, 8, 10], dtype=torch.int32)
    plan = plan_batch(qsl_cpu, qsl_cpu.clone(), is_prefilling=torch.tensor([False, True, False,
                                                                            False]),
                      block_table=torch.tensor([[1], [2], [3], [4]], dtype=torch.int32),
                      spec_len=T, num_draft_tokens=torch.tensor([3, -1, 0, 1]),
                      parent=parents_from_lists(trees))
    assert plan.spec.rows_cpu.tolist() == [0, 2, 3]
    assert plan.spec_parent.tolist() == trees[0] + trees[2] + trees[3]
    paths = torch.tensor([[0, 1, 3, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]],
                         dtype=torch.int32)
    args = plan.commit_arguments(torch.tensor([3, 1, 1, 2], dtype=torch.int32), paths)
    assert args["accepted_path"] is paths and args["request_indices"].tolist() == [0, 2, 3]

    first_rows = plan_batch(qsl_cpu[:2], qsl_cpu[:2].clone(), torch.tensor([False]),
                            torch.tensor([[1]], dtype=torch.int32), spec_len=T,
                            num_draft_tokens=torch.tensor([3]),
                            parent=parents_from_lists(trees[:1]))
    buffers = SpecDecodeGraphBuffers(3, "cpu", spec_len=T)
    staged = buffers.stage_plan(first_rows, 2, torch.tensor([3], dtype=torch.int32), paths[:1])
    assert staged.parent.shape == (8,) and staged.parent[:4].tolist() == trees[0]
    assert staged.accepted_path.tolist() == [[0, 1, 3, 0], [0, 0, 0, 0]]
    assert staged.num_accepted_tokens.tolist() == [3, 1]
