"""The deferred schedule (records kept pending, the fold written back when
the records run out of room or on a flush) against sequential float64
decoding, over long runs."""

import pytest
import torch

from kda_ops import naive
from kda_ops.kernels.dispatch import kernel_choices

from helpers import DEVICES, long_run_steps, query_start_loc

H, K, V = 2, 8, 4


def sequential_window(S, q, k, v, g, beta, A_log, dt_bias, lower_bound):
    """Outputs of every window token from the states S[h] (not advanced)."""
    outs = torch.zeros(q.shape[0], H, V, dtype=torch.float64)
    for h in range(H):
        state = S[h]
        for t in range(q.shape[0]):
            state, _, outs[t, h] = naive.step(state, q[t, h], k[t, h], v[t, h], g[t, h],
                                              beta[t, h], A_log[h], dt_bias[h], lower_bound,
                                              K ** -0.5)
    return outs


def random_step(gen, batch, spec_len):
    """One step's random windows of 1..T tokens, accepted counts 0..L and token
    inputs: (accepted, query_start_loc, q, k, g, v, beta)."""
    lens = torch.randint(1, spec_len + 1, (batch,), generator=gen)
    accepted = torch.stack([torch.randint(0, int(n) + 1, (), generator=gen) for n in lens])
    qsl = query_start_loc(lens.tolist(), "cpu")
    n = int(qsl[-1])
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    return accepted, qsl, rand(n, H, K), rand(n, H, K), rand(n, H, K), rand(n, H, V), rand(n, H)


def advance(S, k, v, g, beta, A_log, dt_bias, lower_bound, count):
    q = torch.zeros(K)
    for h in range(H):
        for t in range(count):
            S[h], _, _ = naive.step(S[h], q, k[t, h], v[t, h], g[t, h], beta[t, h], A_log[h],
                                    dt_bias[h], lower_bound, K ** -0.5)


@pytest.mark.parametrize("eager_fold", [False, None])
@pytest.mark.parametrize("T, R", [(3, 3), (3, 7), (4, 9), (2, 8)])
def test_naive_deferred_matches_sequential_decoding(T, R, eager_fold):
    """Outputs every step and states after each flush; eager_fold=None folds
    every commit at this batch of 3 (nothing stays pending)."""
    gen = torch.Generator().manual_seed(T * 100 + R)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    N, B, lower_bound = 6, 3, -5.0
    A_log, dt_bias = rand(H) * 0.5, rand(H, K)
    state = rand(N, H, V, K)
    truth = {block: [state[block, h].double() for h in range(H)] for block in range(1, N)}
    correction, key_gate = rand(N, H, R, V), rand(N, H, R, 2 * K)
    pending = torch.zeros(N, dtype=torch.int32)
    blocks = torch.tensor([1, 2, 3], dtype=torch.int32)
    steps_left_pending = 0
    for step in range(200):
        accepted, qsl, q, k, g, v, beta = random_step(gen, B, T)
        out, correction, key_gate = naive.verify(
            q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate, qsl, blocks,
            lower_bound=lower_bound, pending=pending)
        for b in range(B):
            window = slice(int(qsl[b]), int(qsl[b + 1]))
            expected = sequential_window(truth[int(blocks[b])], q[window], k[window], v[window],
                                         g[window], beta[window], A_log, dt_bias, lower_bound)
            torch.testing.assert_close(out[window], expected, rtol=1e-9, atol=1e-9)
            advance(truth[int(blocks[b])], k[window], v[window], g[window], beta[window], A_log,
                    dt_bias, lower_bound, int(accepted[b]))
        state, _, pending = naive.commit(
            accepted.int(), blocks, qsl, state=state, conv_state=None, correction=correction,
            key_gate=key_gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            pending=pending, spec_len=T, eager_fold=eager_fold)
        assert int(pending.max()) + T <= R, "the next window would not fit"
        steps_left_pending += int(pending.max()) > 0
        if step % 37 == 5:  # a request flushed mid-run (e.g. preempted): its state is exact
            flushed = blocks[step % B:step % B + 1]
            state, pending = naive.flush(flushed, state=state, correction=correction,
                                         key_gate=key_gate, pending=pending, A_log=A_log,
                                         dt_bias=dt_bias, lower_bound=lower_bound)
            block = int(flushed[0])
            assert int(pending[block]) == 0
            torch.testing.assert_close(state[block], torch.stack(truth[block]), rtol=1e-9,
                                       atol=1e-9)
    state, pending = naive.flush(blocks, state=state, correction=correction, key_gate=key_gate,
                                 pending=pending, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound)
    for block in blocks.tolist():
        torch.testing.assert_close(state[block], torch.stack(truth[block]), rtol=1e-9, atol=1e-9)
    if eager_fold is None or R == T:
        assert steps_left_pending == 0
    else:
        assert steps_left_pending > 100, "most commits must leave tokens pending"


@pytest.mark.parametrize("T, R, block_size", [(3, 3, 4), (3, 8, 4), (2, 6, 5), (4, 9, 4)])
def test_naive_deferred_align_mode_keeps_every_finished_block_exact(T, R, block_size):
    """Align mode: each block a request has filled holds the exact state at its
    end as soon as the commit that filled it returns (what prefix caching
    reads), whatever is pending; the outputs match sequential decoding."""
    gen = torch.Generator().manual_seed(T * 1000 + R * 10 + block_size)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    B, columns, lower_bound = 2, 150, None
    N = 1 + B * columns
    A_log, dt_bias = rand(H) * 0.5, rand(H, K)
    table = (torch.arange(B * columns, dtype=torch.int32) + 1).view(B, columns)
    state = rand(N, H, V, K)
    correction, key_gate = rand(N, H, R, V), rand(N, H, R, 2 * K)
    pending = torch.zeros(N, dtype=torch.int32)
    computed = torch.tensor([1, 3], dtype=torch.int32)  # tokens in each checkpoint
    truth = [[state[int(table[b, 0]), h].double() for h in range(H)] for b in range(B)]
    for step in range(120):
        accepted, qsl, q, k, g, v, beta = random_step(gen, B, T)
        blocks = torch.stack([table[b, max((int(computed[b]) - 1) // block_size, 0)]
                              for b in range(B)])
        out, correction, key_gate = naive.verify(
            q, k, v, g, beta, A_log, dt_bias, state, correction, key_gate, qsl, blocks,
            lower_bound=lower_bound, pending=pending)
        for b in range(B):
            window = slice(int(qsl[b]), int(qsl[b + 1]))
            expected = sequential_window(truth[b], q[window], k[window], v[window], g[window],
                                         beta[window], A_log, dt_bias, lower_bound)
            torch.testing.assert_close(out[window], expected, rtol=1e-9, atol=1e-9)
        state, _, pending = naive.commit(
            accepted.int(), blocks, qsl, state=state, conv_state=None, correction=correction,
            key_gate=key_gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound,
            block_table=table, num_computed_tokens=computed, block_size=block_size,
            pending=pending, spec_len=T, eager_fold=False)
        for b in range(B):
            window = slice(int(qsl[b]), int(qsl[b + 1]))
            before = int(computed[b])
            for t in range(int(accepted[b])):
                one = slice(window.start + t, window.start + t + 1)
                advance(truth[b], k[one], v[one], g[one], beta[one], A_log, dt_bias,
                        lower_bound, 1)
                position = before + t + 1
                if position % block_size == 0:  # a block just filled: it must be exact now
                    block = int(table[b, position // block_size - 1])
                    torch.testing.assert_close(state[block], torch.stack(truth[b]), rtol=1e-9,
                                               atol=1e-9, msg=f"block {block} at {position}")
                    assert int(pending[block]) == 0
            computed[b] += int(accepted[b])
    blocks = torch.stack([table[b, max((int(computed[b]) - 1) // block_size, 0)]
                          for b in range(B)])
    state, pending = naive.flush(blocks, state=state, correction=correction, key_gate=key_gate,
                                 pending=pending, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound)
    for b in range(B):
        torch.testing.assert_close(state[int(blocks[b])], torch.stack(truth[b]), rtol=1e-9,
                                   atol=1e-9)


def deferred_problem(seed, *, stacked, align, T=3, R=7, N=24, L=2, D=12, W=4, block_size=4,
                     V=V):
    """One step's arguments with random pending counts (each leaving room for
    a window), ragged windows, a null row and an out-of-range index; in align
    mode every request's table blocks are its own."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    lead = (L,) if stacked else ()
    lens = [3, 1, 2, 0, 3, 2]
    indices = [1, 2, 3, 0, 4, N + 6]
    B = len(lens)
    qsl = query_start_loc(lens, "cpu")
    n = int(qsl[-1])
    pending = torch.randint(0, R - T + 1, lead + (N,), generator=gen, dtype=torch.int32)
    args = dict(
        q=rand(n, H, K), k=rand(n, H, K), v=rand(n, H, V), g=rand(n, H, K), beta=rand(n, H),
        state=rand(*lead, N, H, V, K), correction=rand(*lead, N, H, R, V),
        key_gate=rand(*lead, N, H, R, 2 * K), conv_state=rand(*lead, N, D, W - 1 + T - 1),
        A_log=rand(*lead, H) * 0.5, dt_bias=rand(*lead, H, K), pending=pending,
        query_start_loc=qsl, state_indices=torch.tensor(indices, dtype=torch.int32),
        accepted=torch.tensor([3, 1, 0, 2, 2, 1], dtype=torch.int32))
    align_args = {}
    if align:
        align_args = dict(block_table=torch.arange(5, 5 + B * 3, dtype=torch.int32).view(B, 3),
                          num_computed_tokens=torch.tensor([3, 6, 4, 0, 7, 2], dtype=torch.int32),
                          block_size=block_size)
    return args, align_args


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("value_dim", [V, 40])
@pytest.mark.parametrize("eager_fold", [False, None, True])
def test_deferred_ops_match_the_reference(stacked, align, value_dim, eager_fold, device):
    """verify with pending records and the deferred commit, through the ops,
    against the float64 reference: outputs, records, states, conv history and
    pending counts; V = 40 spans two state tiles of the kernels, the last one
    partial, and commits without conv history (whose launch otherwise writes
    the counts). eager_fold=None folds everything pending at this batch of 6,
    as True does at any."""
    import kda_ops
    from helpers import assert_rel_close

    T = 3
    a, align_args = deferred_problem(7 + 2 * stacked + align, stacked=stacked, align=align, T=T,
                                     V=value_dim)
    a = {name: t.to(device) for name, t in a.items()}
    align_args = {name: t.to(device) if isinstance(t, torch.Tensor) else t
                  for name, t in align_args.items()}
    layer = (lambda t: t[1]) if stacked else (lambda t: t)
    verify_args = (a["q"], a["k"], a["v"], a["g"], a["beta"], layer(a["A_log"]),
                   layer(a["dt_bias"]), layer(a["state"]), layer(a["correction"]),
                   layer(a["key_gate"]), a["query_start_loc"], a["state_indices"])
    expected_out, expected_corr, expected_kg = naive.verify(
        *(t.cpu() for t in verify_args), lower_bound=-5.0, out=torch.zeros(a["v"].shape),
        pending=layer(a["pending"]).cpu())
    out = kda_ops.verify(*verify_args, lower_bound=-5.0,
                         out=torch.zeros(a["v"].shape, device=device),
                         pending=layer(a["pending"]), spec_len=T)
    assert_rel_close(out.cpu(), expected_out.float(), name="out")
    assert_rel_close(layer(a["correction"]).cpu(), expected_corr.float(), name="correction")
    assert torch.equal(layer(a["key_gate"]).cpu(), expected_kg)

    history = a["conv_state"] if value_dim == V else None
    commit_kwargs = dict(state=a["state"], conv_state=history,
                         correction=a["correction"], key_gate=a["key_gate"], A_log=a["A_log"],
                         dt_bias=a["dt_bias"], lower_bound=-5.0, spec_len=T,
                         eager_fold=eager_fold, **align_args)
    on_cpu = lambda kwargs: {name: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731
                             for name, t in kwargs.items()}
    expected_state, expected_conv, expected_pending = naive.commit(
        a["accepted"].cpu(), a["state_indices"].cpu(), a["query_start_loc"].cpu(),
        pending=a["pending"].cpu(), **on_cpu(commit_kwargs))
    pending = a["pending"].clone()
    kda_ops.commit(a["accepted"], a["state_indices"], a["query_start_loc"], pending=pending,
                   **commit_kwargs)
    assert torch.equal(pending.cpu(), expected_pending)
    if history is not None:
        assert torch.equal(history.cpu(), expected_conv)
    assert_rel_close(a["state"].cpu(), expected_state.float(), name="state")
    committed = a["state_indices"][(a["state_indices"] > 0)
                                   & (a["state_indices"] < pending.shape[-1])].long()
    left_pending = pending[..., committed]
    if eager_fold is not False:
        assert not left_pending.any(), "every commit folds below the eager batch"
    elif not align:  # here every align-mode request crosses a block and folds
        assert left_pending.any(), "something must stay pending"

    flush_kwargs = dict(state=a["state"], correction=a["correction"], key_gate=a["key_gate"],
                        A_log=a["A_log"], dt_bias=a["dt_bias"], lower_bound=-5.0)
    expected_state, expected_pending = naive.flush(
        a["state_indices"].cpu(), pending=pending.cpu(), **on_cpu(flush_kwargs))
    kda_ops.flush(a["state_indices"], pending=pending, **flush_kwargs)
    assert torch.equal(pending.cpu(), expected_pending)
    assert_rel_close(a["state"].cpu(), expected_state.float(), name="flushed state")


@pytest.mark.parametrize("eager_fold", [False, None])
@pytest.mark.parametrize("cache_layout", ["stacked", "per_layer"])
def test_model_schedules_agree_over_a_long_run(cache_layout, eager_fold):
    """KDADecodeStep with record_len = R > T (eager_fold=None: folding every
    commit at this batch of 3) against the immediate schedule,
    200 steps (18 interpreted or under the sanitizer, both flushes) of ragged windows and random
    acceptance (0 to L) with conv history and projections, requests flushed
    mid-run: the same outputs every step, the same conv history, and the same
    checkpoints after each flush."""
    from kda_ops.models import KDADecodeStep, make_step_inputs

    T, R, layers = 3, 8, 2
    # Interpreted, each step's kernels make 200 steps take minutes.
    steps = long_run_steps(200, 18)
    kwargs = dict(num_layers=layers, num_heads=2, head_dim=8, spec_len=T, num_blocks=8,
                  cache_layout=cache_layout, lower_bound=-5.0)
    immediate = KDADecodeStep(**kwargs)
    deferred = KDADecodeStep(**kwargs, record_len=R, eager_fold=eager_fold)
    immediate.randomize_caches(9)
    deferred.randomize_caches(9)  # random records too; nothing pending at the start
    for name, buffer in deferred.named_buffers():
        if name.startswith("pending"):
            buffer.zero_()
        elif name.startswith(("state", "conv_state")):
            buffer.copy_(immediate.get_buffer(name))
    gen = torch.Generator().manual_seed(10)
    blocks = [1, 2, 3]
    for step in range(steps):
        lens = torch.randint(1, T + 1, (len(blocks),), generator=gen).tolist()
        hidden, qsl, indices, _ = make_step_inputs(immediate, lens, seed=step,
                                                   state_indices=blocks)
        accepted = torch.stack([torch.randint(0, n + 1, (), generator=gen) for n in lens]).int()
        with torch.no_grad():
            expected = immediate.decode_step(hidden, qsl, indices, accepted)
            out = deferred.decode_step(hidden, qsl, indices, accepted)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        if step % 41 == 7 or step == 17:
            flushed = indices[step % 3:step % 3 + 1]
            deferred.flush(flushed)
            block = int(flushed[0])
            for layer in range(layers):
                torch.testing.assert_close(deferred.buffers_as_caches().state[layer][block],
                                           immediate.buffers_as_caches().state[layer][block],
                                           rtol=1e-5, atol=1e-5)
    deferred.flush(indices)
    for field in ("state", "conv_state"):
        for layer in range(layers):
            torch.testing.assert_close(getattr(deferred.buffers_as_caches(), field)[layer],
                                       getattr(immediate.buffers_as_caches(), field)[layer],
                                       rtol=1e-5, atol=1e-5)


def test_value_checks_under_the_deferred_schedule():
    """The value checks take T from `spec_len` (not the records' R) and check
    that each window fits after its block's pending records."""
    import kda_ops
    from kda_ops.models import KDADecodeStep, make_step_inputs

    model = KDADecodeStep(num_layers=2, num_heads=2, head_dim=8, spec_len=3, num_blocks=8,
                          record_len=7, lower_bound=-5.0)
    model.randomize_caches(4)  # pending counts in [0, R - T]
    with kda_ops.value_checks(), torch.no_grad():
        for step in range(5):
            model.decode_step(*make_step_inputs(model, [3, 1, 2], seed=step))
        model.pending[0, 1] = 6  # one position left for a window of 3
        hidden, qsl, _, accepted = make_step_inputs(model, [3], seed=9)
        with pytest.raises(ValueError, match="`pending` leaves 1 of the records' 7 positions "
                                             "to row 0's window of 3 tokens"):
            model.decode_step(hidden, qsl, torch.tensor([1], dtype=torch.int32), accepted)


def test_value_checks_fit_commit_s_windows_after_the_pending_records():
    """commit checks the room its pending records leave, in every layer, as
    verify does: a window longer would lose tokens."""
    import kda_ops

    a, _ = deferred_problem(12, stacked=True, align=False)
    a["state_indices"][5] = 0  # its block past the cache, which the checks refuse first
    a["pending"][1, 1] = 6  # layer 1, row 0's block: one of R = 7 positions left for 3 tokens
    before = a["state"].clone(), a["pending"].clone()
    with kda_ops.value_checks():
        with pytest.raises(ValueError, match=r"`pending` leaves 1 of the records' 7 positions "
                                             r"to row 0's window of 3 tokens \(block 1 has 6 "
                                             r"pending in layer 1\)"):
            kda_ops.commit(a["accepted"], a["state_indices"], a["query_start_loc"],
                           **{name: a[name] for name in ("state", "conv_state", "correction",
                                                         "key_gate", "A_log", "dt_bias",
                                                         "pending")}, spec_len=3)
    assert torch.equal(a["state"], before[0]) and torch.equal(a["pending"], before[1])


@pytest.mark.parametrize("op", ["verify", "commit"])
def test_spec_len_misuse_names_the_argument(op):
    """T must come with `pending` (kernels unroll over it), fit the records,
    and without `pending` equal the records' length."""
    import kda_ops

    T, R = 3, 7
    a, _ = deferred_problem(5, stacked=False, align=False, T=T, R=R)
    if op == "verify":
        def call(**kw):
            kda_ops.verify(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A_log"], a["dt_bias"],
                           a["state"], a["correction"], a["key_gate"], a["query_start_loc"],
                           a["state_indices"], **kw)
    else:
        def call(**kw):
            kda_ops.commit(a["accepted"], a["state_indices"], a["query_start_loc"],
                           state=a["state"], correction=a["correction"], key_gate=a["key_gate"],
                           A_log=a["A_log"], dt_bias=a["dt_bias"], **kw)
    with pytest.raises(ValueError, match="`spec_len` is required with `pending`"):
        call(pending=a["pending"])
    with pytest.raises(ValueError, match="`spec_len` must be at most the records' 7 positions"):
        call(pending=a["pending"], spec_len=R + 1)
    with pytest.raises(ValueError, match="`spec_len` must be the records' length 7 without"):
        call(spec_len=T)
    call(spec_len=R)  # the immediate schedule's T, spelled out


def test_eager_fold_misuse_names_the_argument():
    """eager_fold is a bool of the deferred schedule's commit."""
    import kda_ops
    from kda_ops.models import KDADecodeStep

    T, R = 3, 7
    a, _ = deferred_problem(6, stacked=False, align=False, T=T, R=R)

    def call(**kw):
        kda_ops.commit(a["accepted"], a["state_indices"], a["query_start_loc"], state=a["state"],
                       correction=a["correction"], key_gate=a["key_gate"], A_log=a["A_log"],
                       dt_bias=a["dt_bias"], **kw)
    with pytest.raises(ValueError, match="`eager_fold` applies to the deferred schedule only"):
        call(eager_fold=True)
    with pytest.raises(ValueError, match="`eager_fold` must be True, False or None, got 1"):
        call(pending=a["pending"], spec_len=T, eager_fold=1)
    with pytest.raises(ValueError, match="eager_fold needs the deferred schedule"):
        KDADecodeStep(spec_len=T, eager_fold=False)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("align", [False, True])
def test_deferred_ops_follow_the_reference_over_a_long_run(align, device):
    """The ops (the Triton kernels on CUDA and under TRITON_INTERPRET=1, the
    PyTorch path on CPU) against the float64 reference, step after step:
    two stacked layers, ragged windows, acceptance 0 to L, a null row every
    few steps, requests that finish (flushed) and new ones that join, and in
    align mode windows crossing block boundaries. Outputs, pending counts and
    the conv history every step; every state after each step and each flush.
    The Triton commit alternates its two forms (a program per tile; the fold
    plan and its persistent grid) from step to step; every fourth commit folds
    eagerly (eager_fold's default at this batch of 3), the others only when the
    records run out of room."""
    import kda_ops
    from helpers import assert_rel_close

    T, R, L, D, W, block_size, slots, columns = 3, 8, 2, 6, 3, 4, 3, 40
    steps = long_run_steps(200, 30)  # short: one finish and join, at step 24
    gen = torch.Generator().manual_seed(31 + align)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    # Blocks 1..: a table row per request and join, so that every request owns its blocks.
    joins = 2 + steps // 25
    N = 1 + slots * joins * columns
    A_log, dt_bias = rand(L, H) * 0.5, rand(L, H, K)
    state = rand(L, N, H, V, K)
    conv_state = rand(L, N, D, W - 1 + T - 1)
    correction, key_gate = rand(L, N, H, R, V), rand(L, N, H, R, 2 * K)
    pending = torch.zeros(L, N, dtype=torch.int32)
    fresh_rows = iter((torch.arange(slots * joins * columns, dtype=torch.int32) + 1)
                      .view(slots * joins, columns))
    table = torch.stack([next(fresh_rows) for _ in range(slots)])
    computed = torch.zeros(slots, dtype=torch.int32)
    reference = dict(state=state.double(), conv_state=conv_state.clone(),
                     correction=correction.double(), key_gate=key_gate.clone(),
                     pending=pending.clone())
    ours = {name: t.to(device) for name, t in
            dict(state=state, conv_state=conv_state, correction=correction, key_gate=key_gate,
                 pending=pending).items()}
    A_dev, dt_dev = A_log.to(device), dt_bias.to(device)

    def checkpoint_blocks():
        if not align:
            return table[:, 0].clone()
        return torch.stack([table[b, max((int(computed[b]) - 1) // block_size, 0)]
                            for b in range(slots)])

    steps_left_pending = 0
    for step in range(steps):
        accepted, qsl, q, k, g, v, beta = random_step(gen, slots, T)
        blocks = checkpoint_blocks()
        if step % 7 == 3:
            blocks[step % slots] = 0  # a padding row: zero outputs, nothing committed
        for layer in range(L):
            expected_out, corr_ref, kg_ref = naive.verify(
                q, k, v, g, beta, A_log[layer], dt_bias[layer], reference["state"][layer],
                reference["correction"][layer], reference["key_gate"][layer], qsl, blocks,
                lower_bound=-5.0, out=torch.zeros(v.shape), pending=reference["pending"][layer],
                spec_len=T)
            reference["correction"][layer], reference["key_gate"][layer] = corr_ref, kg_ref
            out = kda_ops.verify(
                q.to(device), k.to(device), v.to(device), g.to(device), beta.to(device),
                A_dev[layer], dt_dev[layer], ours["state"][layer], ours["correction"][layer],
                ours["key_gate"][layer], qsl.to(device), blocks.to(device), lower_bound=-5.0,
                out=torch.zeros(v.shape, device=device), pending=ours["pending"][layer],
                spec_len=T)
            assert_rel_close(out.cpu(), expected_out.float(), name=f"out, step {step}")
        align_args = (dict(block_table=table, num_computed_tokens=computed,
                           block_size=block_size) if align else {})
        eager_fold = None if step % 4 == 3 else False
        commit_args = dict(correction=reference["correction"], key_gate=reference["key_gate"],
                           A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, spec_len=T,
                           eager_fold=eager_fold)
        reference["state"], reference["conv_state"], reference["pending"] = naive.commit(
            accepted.int(), blocks, qsl, state=reference["state"],
            conv_state=reference["conv_state"], pending=reference["pending"], **commit_args,
            **align_args)
        with kernel_choices(listed_folds=step % 2 == 1):
            kda_ops.commit(accepted.int().to(device), blocks.to(device), qsl.to(device),
                           state=ours["state"], conv_state=ours["conv_state"],
                           correction=ours["correction"], key_gate=ours["key_gate"],
                           A_log=A_dev, dt_bias=dt_dev, lower_bound=-5.0,
                           pending=ours["pending"], spec_len=T, eager_fold=eager_fold,
                           **{name: t.to(device) if isinstance(t, torch.Tensor) else t
                              for name, t in align_args.items()})
        steps_left_pending += int(reference["pending"].sum() > 0)
        if eager_fold is None:
            assert not reference["pending"][:, blocks[blocks > 0].long()].any()
        live = blocks > 0
        computed += torch.where(live, torch.minimum(accepted, qsl[1:] - qsl[:-1]), 0).int()
        if step % 25 == 24:  # a request finishes: flushed, then a new one takes its slot
            slot = (step // 25) % slots
            finished = checkpoint_blocks()[slot:slot + 1]
            reference["state"], reference["pending"] = naive.flush(
                finished, state=reference["state"], correction=reference["correction"],
                key_gate=reference["key_gate"], pending=reference["pending"], A_log=A_log,
                dt_bias=dt_bias, lower_bound=-5.0)
            kda_ops.flush(finished.to(device), state=ours["state"],
                          correction=ours["correction"], key_gate=ours["key_gate"],
                          pending=ours["pending"], A_log=A_dev, dt_bias=dt_dev,
                          lower_bound=-5.0)
            assert int(ours["pending"][:, int(finished)].abs().sum()) == 0
            table[slot] = next(fresh_rows)
            computed[slot] = 0
        assert torch.equal(ours["pending"].cpu(), reference["pending"]), f"step {step}"
        assert torch.equal(ours["conv_state"].cpu(), reference["conv_state"]), f"step {step}"
        assert_rel_close(ours["state"].cpu(), reference["state"].float(),
                         name=f"state, step {step}")
    # Kept pending after about 3 commits in 4, half as often in align mode, which folds
    # whenever one of its blocks of 4 fills (76-79% and 44-56% of 200 steps over 10 seeds).
    assert steps_left_pending > steps // 3, "commits must often leave tokens pending"
