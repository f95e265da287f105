"""Random metadata, valid or not, through a whole step with the value checks
on (docs/semantics.md#10-value-checks): conv_update and verify, or
conv_verify, then commit (and flush, under the deferred schedule); chains or
trees, immediate or deferred, in align mode or not, float32, bfloat16 or
float16 activations and a float32 or bfloat16 state, every tensor dense or
laid out at random in a padded buffer. Each case starts from valid metadata
and breaks zero to two of its preconditions at random. A call
the checks refuse must write nothing, every break they must see is refused,
and valid metadata is accepted. A call they accept must give, on this path
(the PyTorch path on CPU, the Triton kernels under TRITON_INTERPRET=1 and on
CUDA), what the float64 reference gives: outputs, records, states,
convolution history and pending counts. So whatever the checks let through,
every path computes alike."""

import random

import pytest
import torch

import kda_ops
from kda_ops import naive

from helpers import DEVICES, INTERPRET, TOLERANCE, assert_rel_close
from test_misuse import assert_unchanged, snapshot

H, K, V, WIDTH = 2, 16, 8, 3
D = H * (2 * K + V)
LOWER_BOUND = -5.0
CASES = 60 if INTERPRET else 200  # about 20 s interpreted, 4 s on the PyTorch path


def valid_case(rng):
    """Metadata that meets every precondition, as a dict of plain Python values."""
    T = rng.randint(1, 4)
    deferred, align = rng.random() < 0.5, rng.random() < 0.4
    R = T + rng.randint(1, 4) if deferred else T
    B = rng.randint(1, 5)
    lens = [rng.randint(0, T) for _ in range(B)]
    block_size = rng.randint(2, 5)
    columns = (3 * T) // block_size + 2
    if align:
        # Disjoint table rows; the source block holds token computed - 1.
        first = 1
        table, computed, indices = [], [], []
        for _ in range(B):
            table.append(list(range(first, first + columns)))
            first += columns
            computed.append(rng.randint(0, block_size * columns - 2 * T))
            indices.append(table[-1][max(computed[-1] - 1, 0) // block_size])
        num_blocks = first + rng.randint(0, 2)
    else:
        table = computed = None
        num_blocks = B + 1 + rng.randint(0, 3)
        indices = rng.sample(range(1, num_blocks), B)
    for row in range(B):
        if rng.random() < 0.15:
            indices[row] = rng.choice([0, -1])  # a padding row
    pending = [rng.randint(0, R - T) if deferred else 0 for _ in range(num_blocks)]
    accepted = [rng.randint(0, n) for n in lens]
    parents = paths = None
    if rng.random() < 0.35:  # a tree per row, and an accepted path down it
        parents, paths = [], []
        for row, n in enumerate(lens):
            parents.append([-1] + [rng.randrange(t) for t in range(1, n)] if n else [])
            path = [0] if n else []
            while path:
                children = [t for t in range(n) if parents[row][t] == path[-1]]
                if not children:
                    break
                path.append(rng.choice(children))
            paths.append(path)
            accepted[row] = rng.randint(0, len(path))
    return dict(T=T, R=R, deferred=deferred, align=align, lens=lens, indices=indices,
                accepted=accepted, parents=parents, paths=paths, fused=rng.random() < 0.3,
                num_blocks=num_blocks, prefix=rng.randint(0, 2), suffix=rng.randint(0, 2),
                pending=pending, eager_fold=rng.choice([None, False]), block_size=block_size,
                table=table, computed=computed, layouts=rng.random() < 0.5,
                dtypes=(rng.choice([torch.float32] * 3 + [torch.bfloat16, torch.float16]),
                        rng.choice([torch.float32] * 2 + [torch.bfloat16])),
                commit_gate_scale=1.0, nan_token=None,
                broken=[], maybe_broken=[])


def _live_rows(c):
    return [r for r, i in enumerate(c["indices"]) if 0 < i < c["num_blocks"]]


def break_one(c, rng):
    """Breaks one precondition, if this case has what it needs. Breaks that the
    checks must refuse go to c["broken"]; a table entry goes to c["maybe_broken"]:
    the checks refuse it only where this step's commit writes that block."""
    live = _live_rows(c)
    with_tokens = [r for r in live if c["lens"][r] > 0]
    choices = ["window_decreases", "index_past_cache", "gate_mismatch"]
    if c["prefix"] + sum(c["lens"]) > 0:
        choices.append("tokens_too_few")
    if len(live) >= 2 and not c["align"]:
        choices.append("shared_block")
    if live:
        choices += ["window_too_long", "accepted_too_many", "accepted_negative"]
    if with_tokens:
        choices.append("non_finite_input")
    if c["deferred"] and with_tokens:  # a count past R is clamped (semantics.md, section 11)
        choices.append("records_full")
    # Tree breaks within each row's tree as drawn (a window made longer continues as a chain).
    rooted = [r for r in live if c["parents"] is not None and c["parents"][r]]
    if rooted:
        choices.append("root_has_a_parent")
        if any(len(c["parents"][r]) > 1 for r in rooted):
            choices.append("parent_out_of_order")
        on_path = [r for r in rooted if 0 < c["accepted"][r] <= len(c["paths"][r])]
        if any(c["lens"][r] > 1 for r in on_path):
            choices.append("path_not_from_the_root")
        if any(c["accepted"][r] > 1 for r in on_path):
            choices.append("path_off_the_tree")
    if c["align"] and live:
        choices += ["table_null_block", "table_past_cache"]
        if len(c["table"]) >= 2:
            choices.append("table_block_shared")
    what = rng.choice(choices)
    row = rng.choice(live) if live else 0
    if what == "window_too_long":
        c["lens"][row] = c["T"] + 1
        c["accepted"][row] = min(c["accepted"][row], c["T"])
    elif what == "window_decreases":
        c["decreasing_row"] = rng.randrange(len(c["lens"]))
    elif what == "tokens_too_few":
        c["suffix"] = -1
    elif what == "index_past_cache":
        c["indices"][rng.randrange(len(c["indices"]))] = c["num_blocks"] + rng.randint(0, 1)
    elif what == "root_has_a_parent":
        c["parents"][rng.choice(rooted)][0] = 0
    elif what == "parent_out_of_order":
        row = rng.choice([r for r in rooted if len(c["parents"][r]) > 1])
        node = rng.randrange(1, len(c["parents"][row]))
        c["parents"][row][node] = rng.choice([node, -1, c["lens"][row] + 1])
    elif what == "path_not_from_the_root":
        row = rng.choice([r for r in on_path if c["lens"][r] > 1])
        c["paths"][row][0] = rng.randrange(1, c["lens"][row])
    elif what == "path_off_the_tree":
        row = rng.choice([r for r in on_path if c["accepted"][r] > 1])
        step = rng.randrange(1, c["accepted"][row])
        # A node that is not a child of the path's previous one, or one past the window.
        elsewhere = [t for t, parent in enumerate(c["parents"][row])
                     if parent != c["paths"][row][step - 1]] + [c["lens"][row]]
        c["paths"][row][step] = rng.choice(elsewhere)
    elif what == "gate_mismatch":
        c["commit_gate_scale"] = 1.5
    elif what == "non_finite_input":
        row = rng.choice(with_tokens)
        start = c["prefix"] + sum(c["lens"][:row])
        c["nan_token"] = start + rng.randrange(min(c["lens"][row], c["T"]))
    elif what == "shared_block":
        other = rng.choice([r for r in live if r != row])
        c["indices"][row] = c["indices"][other]
    elif what == "accepted_too_many":
        c["accepted"][row] = c["lens"][row] + 1
    elif what == "accepted_negative":
        c["accepted"][row] = -1
    elif what == "records_full":
        row = rng.choice(with_tokens)
        block = c["indices"][row]
        c["pending"][block] = c["R"] - c["lens"][row] + 1
    else:
        column = rng.randrange(len(c["table"][row]))
        if what == "table_block_shared":
            other = (row + 1 + rng.randrange(len(c["table"]) - 1)) % len(c["table"])
            c["table"][row][column] = c["table"][other][column]
        else:
            c["table"][row][column] = 0 if what == "table_null_block" else c["num_blocks"]
        c["maybe_broken"].append(what)
        return
    c["broken"].append(what)


def tensors(c, gen, device):
    """The case's metadata and random inputs and caches, on `device`."""
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    starts = [c["prefix"]]
    for n in c["lens"]:
        starts.append(starts[-1] + n)
    if "decreasing_row" in c:  # this row's window ends before it starts
        r = c["decreasing_row"]
        starts[r + 1] = starts[r] - 1
    num_tokens = max(starts[-1] + c["suffix"], 0)
    T, N = c["T"], c["num_blocks"]
    x = rand(num_tokens, D)
    if c["nan_token"] is not None and c["nan_token"] < num_tokens:
        x[c["nan_token"], (c["nan_token"] * 7) % D] = float("nan")
    act, state_dtype = c["dtypes"]
    t = dict(
        x=x.to(act), conv_state=rand(1, N, D, WIDTH - 1 + T - 1).to(act),
        weight=rand(D, WIDTH) * 0.5, bias=rand(D) * 0.1, g=rand(num_tokens, H, K).to(act),
        beta=rand(num_tokens, H).to(act), A_log=rand(H) * 0.5, dt_bias=rand(H, K),
        state=rand(1, N, H, V, K).to(state_dtype), correction=rand(1, N, H, c["R"], V),
        key_gate=rand(1, N, H, c["R"], 2 * K).to(act), out=rand(num_tokens, H, V).to(act),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        state_indices=torch.tensor(c["indices"], dtype=torch.int32),
        accepted=torch.tensor(c["accepted"], dtype=torch.int32),
        pending=torch.tensor([c["pending"]], dtype=torch.int32) if c["deferred"] else None)
    if c["parents"] is not None:
        parent = torch.full((num_tokens,), -1, dtype=torch.int32)
        for row, parents in enumerate(c["parents"]):
            start = max(starts[row], 0)
            end = max(min(starts[row + 1], num_tokens), start)
            # A window made longer than its tree continues it as a chain.
            nodes = parents + list(range(len(parents) - 1, end - start - 1))
            parent[start:end] = torch.tensor(nodes[:end - start], dtype=torch.int32)
        t["parent"] = parent
        t["accepted_path"] = torch.tensor([(path + [0] * T)[:T] for path in c["paths"]],
                                          dtype=torch.int32)
    else:
        t["parent"] = t["accepted_path"] = None
    if c["align"]:
        t["block_table"] = torch.tensor(c["table"], dtype=torch.int32)
        t["num_computed_tokens"] = torch.tensor(c["computed"], dtype=torch.int32)
    return {name: None if v is None else v.to(device) for name, v in t.items()}


def random_layout(t, rng, paddings):
    """`t`'s values in a view of a larger buffer whose dims lie in memory in a
    random order, each padded by 0 to 2 elements, and at times every other
    element of it (no dim of unit stride); the rest of the buffer is NaN (the
    largest int32 in index tensors), and `paddings` gets it, to check that
    nothing reads it into a result or writes it."""
    order = list(range(t.dim()))
    rng.shuffle(order)  # memory order, outermost first
    padded = [t.shape[d] + rng.choice([0, 0, 1, 2]) for d in order] + [rng.choice([1, 2])]
    fill = float("nan") if t.is_floating_point() else torch.iinfo(t.dtype).max
    buffer = torch.full(padded, fill, dtype=t.dtype, device=t.device)
    inside = torch.zeros(padded, dtype=torch.bool, device=t.device)
    back = [order.index(d) for d in range(t.dim())]
    region = tuple(slice(0, n) for n in t.shape)
    view = buffer[..., 0].permute(back)[region]
    view.copy_(t)
    inside[..., 0].permute(back)[region] = True
    paddings.append((buffer, ~inside))
    return view


def refused(call, *written):
    """Runs `call`; True if the value checks refused it, having written nothing."""
    before = snapshot(*written)
    try:
        call()
    except ValueError:
        assert_unchanged(before, *written)
        return True
    return False


def run_case(c, device, seed):
    """The step on `device` and in the reference; returns the op the checks
    refused, or "accepted"."""
    gen = torch.Generator().manual_seed(seed)
    t, paddings = tensors(c, gen, device), []
    if c["layouts"]:
        rng = random.Random(seed)
        t = {name: v if v is None or rng.random() < 0.3 else random_layout(v, rng, paddings)
             for name, v in t.items()}
    outcome = _step(c, t)
    for buffer, padding in paddings:
        fill = buffer[padding]
        assert (fill.isnan().all() if buffer.is_floating_point()
                else (fill == torch.iinfo(buffer.dtype).max).all()), "a padding was written"
    return outcome


def _step(c, t):
    cpu = {name: None if v is None else v.cpu().clone() for name, v in t.items()}
    T = c["T"]
    tree = dict(parent=t["parent"]) if c["parents"] is not None else {}
    tree_ref = dict(parent=cpu["parent"]) if tree else {}
    deferred = dict(pending=t["pending"][0], spec_len=T) if c["deferred"] else {}
    deferred_ref = dict(pending=cpu["pending"][0], spec_len=T) if c["deferred"] else {}
    caches = [t[n][0] for n in ("state", "correction", "key_gate")]
    caches_ref = [cpu[n][0] for n in ("state", "correction", "key_gate")]
    gates, gates_ref = (t["A_log"], t["dt_bias"]), (cpu["A_log"], cpu["dt_bias"])

    if c["fused"]:  # conv_verify
        def conv_verify():
            kda_ops.conv_verify(t["x"], t["conv_state"][0], t["weight"], t["bias"], t["g"],
                                t["beta"], *gates, *caches, t["query_start_loc"],
                                t["state_indices"], lower_bound=LOWER_BOUND, out=t["out"],
                                **deferred, **tree)
        if refused(conv_verify, t["conv_state"], t["out"], t["correction"], t["key_gate"]):
            return "conv_verify"
        out_ref, conv_ref, corr_ref, kg_ref = naive.conv_verify(
            cpu["x"], cpu["conv_state"][0], cpu["weight"], cpu["bias"], cpu["g"], cpu["beta"],
            *gates_ref, *caches_ref, cpu["query_start_loc"], cpu["state_indices"],
            lower_bound=LOWER_BOUND, out=cpu["out"], **deferred_ref, **tree_ref)
    else:  # conv_update, then verify of its output
        convolved = {}

        def conv():
            convolved["y"] = kda_ops.conv_update(t["x"], t["conv_state"][0], t["weight"],
                                                 t["bias"], t["query_start_loc"],
                                                 t["state_indices"], **tree)
        if refused(conv, t["conv_state"]):
            return "conv_update"
        y_ref, conv_ref = naive.conv_update(cpu["x"], cpu["conv_state"][0], cpu["weight"],
                                            cpu["bias"], cpu["query_start_loc"],
                                            cpu["state_indices"], **tree_ref)
        live_tokens = ~torch.isnan(y_ref)
        assert_rel_close(convolved["y"].cpu()[live_tokens], y_ref[live_tokens].float(),
                         name="conv_update out")
        y = convolved["y"]
        q, k, v = (part.unflatten(-1, (H, -1)) for part in y.split([H * K, H * K, H * V], -1))

        def verify():
            kda_ops.verify(q, k, v, t["g"], t["beta"], *gates, *caches, t["query_start_loc"],
                           t["state_indices"], lower_bound=LOWER_BOUND, out=t["out"],
                           **deferred, **tree)
        if refused(verify, t["out"], t["correction"], t["key_gate"]):
            return "verify"
        out_ref, corr_ref, kg_ref = naive.verify(
            *(part.cpu() for part in (q, k, v)), cpu["g"], cpu["beta"], *gates_ref,
            *caches_ref, cpu["query_start_loc"], cpu["state_indices"], lower_bound=LOWER_BOUND,
            out=cpu["out"], **deferred_ref, **tree_ref)
    assert torch.equal(t["conv_state"][0].cpu(), conv_ref), "conv history"
    assert_rel_close(t["out"].cpu(), out_ref.float(), name="verify out")
    if c["fused"]:
        # Its q, k, v: the convolution rounded to x's dtype, from float32 here and from
        # float64 in the reference; records as accurate as that rounding.
        assert_rel_close(t["correction"][0].cpu(), corr_ref.float(),
                         tol=TOLERANCE[t["x"].dtype], name="correction")
        assert_rel_close(t["key_gate"][0].cpu(), kg_ref.float(), name="key_gate")
    else:
        assert_rel_close(t["correction"][0].cpu(), corr_ref.float(), name="correction")
        assert torch.equal(t["key_gate"][0].cpu(), kg_ref), "key_gate"

    # commit, of the records as the step left them
    scale = c["commit_gate_scale"]
    align = dict(block_table=t["block_table"], num_computed_tokens=t["num_computed_tokens"],
                 block_size=c["block_size"]) if c["align"] else {}
    schedule = (dict(pending=t["pending"], spec_len=T, eager_fold=c["eager_fold"])
                if c["deferred"] else {})
    path = dict(accepted_path=t["accepted_path"]) if tree else {}
    inputs_ref = {n: t[n].cpu().clone() for n in ("state", "conv_state", "correction",
                                                    "key_gate")}

    def commit():
        kda_ops.commit(t["accepted"], t["state_indices"], t["query_start_loc"],
                       state=t["state"], conv_state=t["conv_state"],
                       correction=t["correction"], key_gate=t["key_gate"],
                       A_log=t["A_log"][None] * scale, dt_bias=t["dt_bias"][None],
                       lower_bound=LOWER_BOUND, **align, **schedule, **path)
    if refused(commit, t["state"], t["conv_state"], t["pending"]):
        return "commit"
    on_cpu = lambda d: {n: v.cpu() if isinstance(v, torch.Tensor) else v  # noqa: E731
                        for n, v in d.items()}
    result = naive.commit(cpu["accepted"], cpu["state_indices"], cpu["query_start_loc"],
                          **inputs_ref, A_log=cpu["A_log"][None] * scale,
                          dt_bias=cpu["dt_bias"][None], lower_bound=LOWER_BOUND,
                          **on_cpu(align), **on_cpu(path),
                          **(dict(schedule, pending=cpu["pending"]) if schedule else {}))
    assert_rel_close(t["state"].cpu(), result[0].float(), name="committed state")
    assert torch.equal(t["conv_state"].cpu(), result[1]), "compacted conv history"
    if not c["deferred"]:
        return "accepted"
    assert torch.equal(t["pending"].cpu(), result[2]), "pending counts"

    # flush every block the batch named
    blocks = t["state_indices"].clamp(min=0).unique()
    state_in = t["state"].cpu().clone()

    def flush():
        kda_ops.flush(blocks, state=t["state"], correction=t["correction"],
                      key_gate=t["key_gate"], pending=t["pending"], A_log=t["A_log"][None],
                      dt_bias=t["dt_bias"][None], lower_bound=LOWER_BOUND)
    if refused(flush, t["state"], t["pending"]):
        return "flush"
    flushed, pending_ref = naive.flush(
        blocks.cpu(), state=state_in.double(), correction=t["correction"].cpu(),
        key_gate=t["key_gate"].cpu(), pending=result[2], A_log=cpu["A_log"][None],
        dt_bias=cpu["dt_bias"][None], lower_bound=LOWER_BOUND)
    assert_rel_close(t["state"].cpu(), flushed.float(), name="flushed state")
    assert torch.equal(t["pending"].cpu(), pending_ref), "pending counts after flush"
    return "accepted"


@pytest.mark.parametrize("device", DEVICES)
def test_whatever_the_value_checks_accept_matches_the_reference(device):
    rng = random.Random(2026)
    outcomes, broken_and_accepted = {}, []
    for case in range(CASES):
        c = valid_case(rng)
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            break_one(c, rng)
        with kda_ops.value_checks():
            try:
                outcome = run_case(c, device, seed=case)
            except AssertionError as error:
                raise AssertionError(f"case {case} {c}: {error}") from error
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if c["broken"] and outcome == "accepted":
            broken_and_accepted.append((case, c["broken"]))
        assert c["broken"] or c["maybe_broken"] or outcome == "accepted", (
            f"case {case}: valid metadata refused in {outcome}: {c}")
    # Every broken precondition must be refused, and both outcomes must occur.
    assert not broken_and_accepted, f"broken and accepted: {broken_and_accepted}"
    assert outcomes.get("accepted", 0) >= CASES // 4, outcomes
    assert sum(n for o, n in outcomes.items() if o != "accepted") >= CASES // 4, outcomes
