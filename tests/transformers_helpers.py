"""Tiny random Kimi Linear models, a float64 oracle of them, and the
near-tie rule that the transformers tests compare token chains with."""

import copy
import types
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from kda_ops.transformers import KDACache  # noqa: E402

# transformers warns at every call that its KDA and convolution kernels fall
# back to PyTorch on the CPU.
transformers_logging.set_verbosity_error()

KDA, ATTENTION = "linear_attention", "full_attention"
VOCAB = 256


@dataclass(frozen=True)
class Config:
    layer_types: tuple
    num_heads: int
    head_dim: int
    conv_width: int

    def __str__(self):
        kinds = "".join("K" if kind == KDA else "A" for kind in self.layer_types)
        return f"{kinds}-H{self.num_heads}-K{self.head_dim}-W{self.conv_width}"


CONFIGS = {
    "A": Config((KDA, ATTENTION), 4, 32, 4),
    "B": Config((ATTENTION, KDA, KDA), 2, 16, 2),
    "C": Config((KDA, KDA, ATTENTION, KDA), 2, 64, 3),
}


def kimi_linear(config: Config, *, seed=0, copying=False, dtype=torch.float64):
    """A random KimiLinearForCausalLM with weights scaled by 3 (logits far from
    ties). `copying` scales every mixer's output projection by 0.005 more: the
    greedy chain then falls into cycles that prompt lookup drafts right, while
    the KDA layers still move the logits by 1 to 10."""
    torch.manual_seed(seed)
    n = len(config.layer_types)
    hf_config = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=n,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32,
        layer_types=list(config.layer_types), mlp_layer_types=["dense"] * n,
        linear_head_dim=config.head_dim, linear_num_heads=config.num_heads,
        linear_conv_kernel_dim=config.conv_width, pad_token_id=0, bos_token_id=1,
        eos_token_id=None)
    model = KimiLinearForCausalLM(hf_config).to(torch.float64).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3.0)
        if copying:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.005)
    return model.to(dtype)


def _oracle_kda_forward(self, hidden_states, *args, attention_mask=None, **kwargs):
    """One KDA layer over a whole sequence from a zero state, token by token in
    float64 (the recurrence of docs/semantics.md#2-the-recurrence); stores the
    final state and the last W-1 convolution inputs on the module."""
    h = hidden_states.double()
    if attention_mask is not None and attention_mask.dim() == 2:
        h = h * attention_mask[:, :, None]
    B, S, _ = h.shape
    H, K = self.num_heads, self.head_dim
    mixed = torch.cat([self.q_proj(h), self.k_proj(h), self.v_proj(h)], dim=-1)
    weight = self.conv1d.weight[:, 0].double()                             # [D, W]
    W = weight.shape[1]
    seq = torch.cat([mixed.new_zeros(B, W - 1, mixed.shape[-1]), mixed], dim=1)
    conv = sum(weight[:, j] * seq[:, j:j + S] for j in range(W))
    q, k, v = (t.view(B, S, H, K) for t in torch.nn.functional.silu(conv).split(H * K, -1))
    gate = self.forget_gate
    x = gate.f_b_proj(gate.f_a_proj(h)).view(B, S, H, K) + gate.dt_bias.double().view(H, K)
    softplus = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    decay = torch.exp(-torch.exp(gate.A_log.double().view(H, 1)) * softplus)
    beta = torch.sigmoid(self.b_proj(h))
    kn = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    qn = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * K ** -0.5
    state = h.new_zeros(B, H, K, K)                                        # [B, H, V, K]
    out = h.new_zeros(B, S, H, K)
    for t in range(S):
        state = state * decay[:, t, :, None, :]
        u = (v[:, t] - torch.einsum("bhvk,bhk->bhv", state, kn[:, t])) * beta[:, t, :, None]
        state = state + u[..., None] * kn[:, t, :, None, :]
        out[:, t] = torch.einsum("bhvk,bhk->bhv", state, qn[:, t])
    self._oracle_state = state
    self._oracle_conv_history = seq[:, S:].transpose(1, 2)               # [B, D, W-1]
    output_gate = self.g_b_proj(self.g_a_proj(h)).view(B, S, H, K)
    return self.o_proj(self.o_norm(out, output_gate).reshape(B, S, H * K))


class Oracle:
    """`model` in float64 with every KDA layer computed by `_oracle_kda_forward`,
    on the model's device: its other layers run as the model's do there (on
    CUDA transformers routes some to fla's kernels, which round a float64
    model to about float32: a CPU oracle's first KDA state differed by 1e-7),
    so that the oracle differs from the model in the KDA layers only. Takes
    and returns CPU tensors."""

    def __init__(self, model):
        self.model = copy.deepcopy(model).to(torch.float64)
        self.kda = [layer.self_attn for layer, kind in
                    zip(self.model.model.layers, self.model.config.layer_types) if kind == KDA]
        for module in self.kda:
            module.forward = types.MethodType(_oracle_kda_forward, module)

    @torch.no_grad()
    def __call__(self, ids, attention_mask=None):
        """(logits [B, S, vocab], {layer: state [B, H, V, K]}, {layer: conv history})."""
        device = self.model.device
        mask = None if attention_mask is None else attention_mask.to(device)
        logits = self.model(ids.to(device), attention_mask=mask).logits.cpu()
        return (logits, {m.layer_idx: m._oracle_state.cpu() for m in self.kda},
                {m.layer_idx: m._oracle_conv_history.cpu() for m in self.kda})


def explained_by_near_ties(chosen, logits, oracle_logits, start):
    """The positions p >= start - 1 where `chosen[p + 1]` is not the oracle's
    argmax and the oracle's gap between the two tokens is not below twice the
    largest error of `logits` there (a flip the numerics cannot explain).
    `chosen [S]`, `logits` and `oracle_logits` `[S, vocab]`."""
    unexplained = []
    for p in range(start - 1, chosen.shape[0] - 1):
        want = int(oracle_logits[p].argmax())
        got = int(chosen[p + 1])
        if got == want:
            continue
        gap = (oracle_logits[p, want] - oracle_logits[p, got]).item()
        error = (logits[p].double() - oracle_logits[p]).abs().max().item()
        if gap >= 2 * error:
            unexplained.append((p, want, got, gap, error))
    return unexplained


class RecordingCache(KDACache):
    """A KDACache that logs each rollback: (window length, tokens removed)."""

    def __init__(self, model, **kwargs):
        super().__init__(model, **kwargs)
        self.rollbacks = []

    def crop(self, tokens_to_remove):
        self.rollbacks.append((self._window, -tokens_to_remove))
        super().crop(tokens_to_remove)

    def drafted_and_accepted(self):
        drafted = sum(window - 1 for window, _ in self.rollbacks)
        return drafted, drafted - sum(removed for _, removed in self.rollbacks)
