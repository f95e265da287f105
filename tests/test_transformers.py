"""Kimi Linear in transformers through `kda_ops.transformers.KDACache`:
speculative generation (prompt lookup and an assistant model) against a
float64 oracle of the model, transformers' own greedy generation and its
full-forward argmax chain, over 100+ new tokens; states against the oracle's.

transformers 5.25 computes a float64 Kimi Linear's KDA layers in float32 (its
gate and recurrence cast to float32): its logits sit up to a few 1e-3 from the
oracle's. Where its tokens differ from ours, the test measures that the
oracle's gap between the two tokens is below that error (a near tie)."""

import copy

import pytest
import torch

from helpers import DEVICES, INTERPRET, rel_error

from transformers_helpers import (CONFIGS, KDA, Oracle, RecordingCache, explained_by_near_ties,
                                  kimi_linear, transformers)
from kda_ops.transformers import KDACache  # noqa: E402  (after the importorskip above)

NEW_TOKENS = 100
PROMPT = 16
float64_only_on_cpu = pytest.mark.skipif(
    INTERPRET, reason="float64 runs the PyTorch path on every device: the CPU run covers it")


def prompt(seed, batch=1):
    return torch.randint(2, 256, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def repeating_prompt(seed):
    """A prompt of one 4-token pattern: prompt lookup drafts it, the model rejects it."""
    return prompt(seed)[:, :4].repeat(1, PROMPT // 4)


def transformers_own(model):
    """The model for transformers' own forward and generate: on CUDA its KDA
    layers call fla's Triton kernels (when installed), which take no float64,
    so a float64 model's own runs go to a CPU copy."""
    if model.dtype == torch.float64 and model.device.type != "cpu":
        return copy.deepcopy(model).cpu()
    return model


def kda_states(cache, model):
    return {i: cache.get_recurrent_state(i).transpose(-1, -2)
            for i, kind in enumerate(model.config.layer_types) if kind == KDA}


def check_generation(model, ids, generated, cache, oracle, *, device="cpu"):
    """Our tokens are the oracle's argmax chain (or near ties of our own
    error), transformers' tokens differ from ours only at near ties of its
    error, and the cache's states are the oracle's."""
    generated = generated.cpu()
    length = cache.get_seq_length()
    oracle_logits, oracle_states, oracle_conv = oracle(generated[:, :length])
    # Our logits over the same tokens, teacher-forced through a fresh cache
    # (in windows of 16 tokens: fewer launches than the generation's).
    with torch.no_grad():
        ours = model(generated[:, :-1].to(device), cache=KDACache(model, spec_len=16)).logits.cpu()
        own = transformers_own(model)
        theirs = own(generated[:, :-1].to(own.device)).logits.cpu()
    full_oracle, _, _ = oracle(generated[:, :-1])
    for row in range(generated.shape[0]):
        assert not explained_by_near_ties(generated[row], ours[row], full_oracle[row],
                                          ids.shape[1])
        # transformers' full-forward argmax chain, teacher-forced on ours.
        assert not explained_by_near_ties(generated[row], theirs[row], full_oracle[row],
                                          ids.shape[1]) or model.dtype != torch.float64
    tight = 1e-10 if model.dtype == torch.float64 else 1e-4
    states = kda_states(cache, model)
    for layer, expected in oracle_states.items():
        assert rel_error(states[layer], expected) <= tight, f"layer {layer} state"
        history = cache.get_conv_state(layer).cpu()
        assert rel_error(history, oracle_conv[layer]) <= tight, f"layer {layer} conv history"
    return oracle_logits


def check_against_plain_generate(model, ids, generated, oracle, **kwargs):
    """transformers' own greedy `generate` gives our tokens, or its first
    different token is a near tie of its own error."""
    own = transformers_own(model)
    plain = own.generate(ids.to(own.device), max_new_tokens=generated.shape[1] - ids.shape[1],
                         do_sample=False, **kwargs).cpu()
    generated = generated.cpu()
    differs = (plain != generated).any(0).nonzero()
    if differs.numel():
        first = int(differs[0])
        with torch.no_grad():
            theirs = own(plain[:, :first].to(own.device)).logits[:, -1].cpu()
        expected, _, _ = oracle(plain[:, :first])
        for row in range(plain.shape[0]):
            want, got = int(expected[row, -1].argmax()), int(plain[row, first])
            gap = (expected[row, -1, want] - expected[row, -1, int(generated[row, first])]).abs()
            error = (theirs[row].double() - expected[row, -1]).abs().max()
            assert got != want and gap < 2 * error, (
                f"transformers differs at token {first} where the oracle's gap {gap:.3e} is "
                f"not below its error {error:.3e}")


# (config, draft length, copying model: long accepted runs, seed). The seeds
# are ones where the copying models accept at least 60% of the drafts and
# the others reject every one.
LOOKUP_CASES = [
    ("A", 4, True, 0), ("A", 1, False, 0), ("B", 2, True, 0), ("A", 8, False, 0),
    ("C", 3, True, 2), ("C", 5, False, 0), ("A", 6, True, 0), ("B", 7, True, 0),
    ("C", 2, False, 0), ("C", 8, True, 2)]


@float64_only_on_cpu
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, draft, copying, seed", LOOKUP_CASES)
def test_prompt_lookup_in_float64(device, name, draft, copying, seed):
    model = kimi_linear(CONFIGS[name], seed=seed, copying=copying).to(device)
    ids = (prompt(seed) if copying else repeating_prompt(seed)).to(device)
    cache = RecordingCache(model)
    generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                               prompt_lookup_num_tokens=draft, cache=cache)
    assert generated.shape[1] == PROMPT + NEW_TOKENS
    drafted, accepted = cache.drafted_and_accepted()
    if copying:  # long runs: most drafts accepted, whole windows included
        assert accepted >= 0.6 * drafted and (draft + 1, 0) in cache.rollbacks
    else:  # drafts proposed and every one rejected
        assert drafted > 0 and accepted == 0
    oracle = Oracle(model)
    check_generation(model, ids, generated, cache, oracle, device=device)
    check_against_plain_generate(model, ids, generated, oracle)


def assistant_for(model, draft, *, same=True):
    """An assistant drafting `draft` tokens each round with no confidence
    stop: a copy of the target (its drafts are accepted) or another random
    model of the same vocabulary (they are mostly rejected)."""
    # On CUDA transformers runs a Kimi Linear prefill through fla's chunked kernels,
    # which take no float64; the assistant only proposes token ids.
    dtype = (torch.float32 if model.device.type == "cuda" and model.dtype == torch.float64
             else model.dtype)
    assistant = (copy.deepcopy(model) if same else kimi_linear(
        CONFIGS["A"], seed=99, dtype=dtype)).to(device=model.device, dtype=dtype)
    assistant.generation_config.num_assistant_tokens = draft
    assistant.generation_config.assistant_confidence_threshold = 0.0
    return assistant


@float64_only_on_cpu
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, draft, same", [("A", 3, True), ("B", 1, False), ("C", 8, True),
                                               ("B", 5, True), ("A", 2, False)])
def test_assistant_model_in_float64(device, name, draft, same):
    model = kimi_linear(CONFIGS[name], seed=10 + draft).to(device)
    ids = prompt(draft).to(device)
    cache = RecordingCache(model)
    generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                               assistant_model=assistant_for(model, draft, same=same),
                               cache=cache)
    drafted, accepted = cache.drafted_and_accepted()
    assert drafted > 0 and (accepted >= 0.8 * drafted if same else accepted < drafted)
    oracle = Oracle(model)
    check_generation(model, ids, generated, cache, oracle, device=device)
    check_against_plain_generate(model, ids, generated, oracle)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, draft, copying, assistant", [
    ("A", 4, True, False), ("B", 3, False, False), ("C", 2, False, True)])
def test_speculative_generation_in_float32(device, name, draft, copying, assistant):
    """float32 through the kernels (the PyTorch path on the CPU, Triton under
    the interpreter and on CUDA): our tokens are the oracle's argmax chain but
    for near ties of our measured error, and transformers' differ from ours
    only at near ties; states within float32 rounding of the oracle's."""
    model = kimi_linear(CONFIGS[name], seed=20 + draft, copying=copying,
                        dtype=torch.float32).to(device)
    ids = (prompt(draft) if copying or assistant else repeating_prompt(draft)).to(device)
    cache = RecordingCache(model)
    options = (dict(assistant_model=assistant_for(model, draft)) if assistant
               else dict(prompt_lookup_num_tokens=draft))
    generated = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, cache=cache,
                               **options)
    drafted, _ = cache.drafted_and_accepted()
    assert drafted > 0
    oracle = Oracle(model)
    check_generation(model, ids, generated, cache, oracle, device=device)
    check_against_plain_generate(model, ids, generated, oracle)


@float64_only_on_cpu
@pytest.mark.parametrize("device", DEVICES)
def test_batched_generation_with_padding(device):
    """A batch of two left-padded prompts (plain greedy: transformers' assisted
    generation takes one sequence), each row against the oracle of its own
    unpadded prompt."""
    model = kimi_linear(CONFIGS["B"], seed=5).to(device)
    ids = prompt(5, batch=2)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0
    cache = KDACache(model)
    generated = model.generate(ids.to(device), attention_mask=mask.to(device),
                               max_new_tokens=40, do_sample=False, cache=cache).cpu()
    own = transformers_own(model)
    stock = own.generate(ids.to(own.device), attention_mask=mask.to(own.device),
                         max_new_tokens=40, do_sample=False).cpu()
    oracle = Oracle(model)
    states = kda_states(cache, model)
    for row, start in ((0, 0), (1, 5)):
        tokens = generated[row:row + 1, start:]
        expected, oracle_states, _ = oracle(tokens[:, :-1])
        assert not explained_by_near_ties(tokens[0], expected[0], expected[0], PROMPT - start)
        for layer, state in oracle_states.items():
            assert rel_error(states[layer][row:row + 1], state) <= 1e-10
        assert torch.equal(generated[row], stock[row]) or not explained_by_near_ties(
            stock[row, start:], own(stock[row:row + 1, start:-1].to(own.device)).logits[0].cpu(),
            oracle(stock[row:row + 1, start:-1])[0][0], PROMPT - start)


def test_assisted_generation_of_a_batch_is_refused_by_transformers():
    model = kimi_linear(CONFIGS["A"])
    with pytest.raises(ValueError, match="batch_size = 1"):
        model.generate(prompt(0, batch=2), max_new_tokens=4, do_sample=False,
                       prompt_lookup_num_tokens=2, cache=KDACache(model))


@float64_only_on_cpu
def test_one_cache_for_two_generations():
    """Assisted generation restarts from its prompt; plain generation continues
    the cached sequence (as transformers' caches do) or, after reset(), starts
    afresh: each equals generation with a new cache."""
    model = kimi_linear(CONFIGS["C"], seed=7)
    first, second = prompt(1), prompt(2)[:, :11]
    fresh = {name: model.generate(ids, max_new_tokens=30, do_sample=False,
                                  prompt_lookup_num_tokens=3, cache=KDACache(model))
             for name, ids in (("first", first), ("second", second))}
    cache = KDACache(model)
    for name, ids in (("first", first), ("second", second), ("first", first)):
        again = model.generate(ids, max_new_tokens=30, do_sample=False,
                               prompt_lookup_num_tokens=3, cache=cache)
        assert torch.equal(again, fresh[name])

    cache = KDACache(model)
    out = model.generate(first, max_new_tokens=20, do_sample=False, cache=cache)
    longer = torch.cat([out, second], dim=1)
    continued = model.generate(longer, max_new_tokens=20, do_sample=False, cache=cache)
    assert torch.equal(continued, model.generate(longer, max_new_tokens=20, do_sample=False,
                                                 cache=KDACache(model)))
    cache.reset()
    assert torch.equal(model.generate(second, max_new_tokens=20, do_sample=False, cache=cache),
                       model.generate(second, max_new_tokens=20, do_sample=False,
                                      cache=KDACache(model)))


def test_the_model_is_unchanged_without_a_kda_cache():
    """Routing the KDA layers changes nothing for other caches: the same bits
    with no cache and with transformers' own, weights and config untouched; a
    copy of the model routes its own layers."""
    model = kimi_linear(CONFIGS["A"], seed=3)
    reference = copy.deepcopy(model)
    weights = {name: t.clone() for name, t in model.state_dict().items()}
    config = model.config.to_dict()
    KDACache(model)
    ids = prompt(3)
    assert torch.equal(model(ids).logits, reference(ids).logits)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False),
                       reference.generate(ids, max_new_tokens=12, do_sample=False))
    assert all(torch.equal(t, weights[name]) for name, t in model.state_dict().items())
    assert model.config.to_dict() == config

    other = copy.deepcopy(model)
    with torch.no_grad():
        for module in (layer.self_attn for layer in other.model.layers):
            module.o_proj.weight.mul_(0.5)
    logits = other(ids, cache=KDACache(other)).logits
    assert rel_error(logits, Oracle(other)(ids)[0]) < 1e-10
    assert rel_error(logits, Oracle(model)(ids)[0]) > 1e-3


def test_a_prompt_after_assisted_generation_keeps_the_window_length():
    """After assisted generation, a plain generation whose prompt continues
    the cache by more than the 64-token prefill window runs it in prefill
    windows (T stays); a shorter continuation may be rolled back whole (T
    grows to it). Both give a fresh cache's tokens."""
    model = kimi_linear(CONFIGS["A"], seed=3)
    cache = KDACache(model)
    out = model.generate(prompt(0)[:, :16], max_new_tokens=8, do_sample=False,
                         prompt_lookup_num_tokens=3, cache=cache)
    assert cache.spec_len == 4
    for extra in (70, 9):
        more = torch.randint(2, 256, (1, extra), generator=torch.Generator().manual_seed(extra))
        longer = torch.cat([out, more], dim=1)
        out = model.generate(longer, max_new_tokens=4, do_sample=False, cache=cache)
        assert torch.equal(out, model.generate(longer, max_new_tokens=4, do_sample=False,
                                               cache=KDACache(model)))
        assert cache.spec_len == (4 if extra == 70 else extra + 1)


def test_crop_rolls_back_only_within_the_last_window():
    model = kimi_linear(CONFIGS["A"])
    cache = KDACache(model, spec_len=4)
    with torch.no_grad():
        model(prompt(0)[:, :10], cache=cache)
        model(prompt(1)[:, :3], cache=cache)
    for remove in (4, 3):  # the window's first input replaced the history's oldest
        with pytest.raises(ValueError, match="at most 2 of the 3 tokens"):
            cache.crop(-remove)
    with pytest.raises(ValueError, match="negative int"):
        cache.crop(2)
    cache.crop(-2)
    assert cache.get_seq_length() == 11


def test_kda_cache_refuses_other_models_by_name():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="`model` must be a Kimi Linear model"):
        KDACache(llama)
    with pytest.raises(ValueError, match="`spec_len` must be a positive int"):
        KDACache(kimi_linear(CONFIGS["A"]), spec_len=0)


def test_benchmark_counts_the_speculative_state_of_each_cache():
    """The transformers benchmark's state column (run on the CPU here): after
    a verification forward, transformers keeps a state per draft token and a
    grown convolution state; KDACache one window's records (a float32
    correction and the key and gate per token) and T - 1 convolution columns."""
    from kda_ops.transformers import bench
    config = CONFIGS["A"]
    model = kimi_linear(config, seed=3, copying=True, dtype=torch.float32)
    ids = prompt(3)
    draft, H, K = 4, config.num_heads, config.head_dim
    T, D = draft + 1, 3 * H * K
    _, _, forwards, ours = bench.generate(model, ids, "kda_ops_lookup", 12, draft)
    assert forwards < 12
    assert ours == H * T * (K * 4 + 2 * K * 4) + D * (T - 1) * 4
    _, _, _, theirs = bench.generate(model, ids, "transformers_lookup", 12, draft)
    assert theirs >= draft * H * K * K * 4
