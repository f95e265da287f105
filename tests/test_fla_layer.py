"""docs/integration.md section 6's recipe for fla's KimiDeltaAttention layer,
run against the layer's own forward: on CUDA with fla's kernels; on the CPU
with fla's reference recurrence and gate in place of its recurrent Triton
kernel, and plain PyTorch in place of its convolution and gated-norm kernels
(fla runs its kernels on GPUs only, also under TRITON_INTERPRET=1)."""

import types

import pytest
import torch
import torch.nn.functional as F

import kda_ops

from helpers import DEVICES, INTERPRET, assert_rel_close

fla_layers = pytest.importorskip("fla.layers")
fla_kda_layer = pytest.importorskip("fla.layers.kda")
fla_naive = pytest.importorskip("fla.ops.kda.naive")
fla_gate = pytest.importorskip("fla.ops.kda.gate")

H, K, HIDDEN, TOKENS = 2, 16, 64, 5


def reference_recurrence(q, k, v, g, beta, A_log, dt_bias, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel,
                         use_beta_sigmoid_in_kernel, lower_bound, state_v_first, **unused):
    """fla's fused_recurrent_kda with the layer's flags, from fla's own
    reference recurrence and gates."""
    assert use_qk_l2norm_in_kernel and use_gate_in_kernel and use_beta_sigmoid_in_kernel
    normalise = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    gate = (fla_gate.naive_kda_gate(g, A_log, dt_bias) if lower_bound is None else
            fla_gate.naive_kda_lowerbound_gate(g, A_log, dt_bias, lower_bound))
    state = initial_state.transpose(-1, -2) if state_v_first and initial_state is not None \
        else initial_state
    out, final = fla_naive.naive_recurrent_kda(normalise(q.float()), normalise(k.float()),
                                               v.float(), gate, torch.sigmoid(beta.float()),
                                               initial_state=state,
                                               output_final_state=output_final_state)
    if final is not None and state_v_first:
        final = final.transpose(-1, -2)
    return out.to(q.dtype), final


def depthwise_conv(self, x, cache=None, output_final_state=False, cu_seqlens=None, **unused):
    """fla's ShortConvolution on a whole sequence from an empty cache."""
    assert cache is None and cu_seqlens is None
    width = self.weight.shape[-1]
    y = F.conv1d(x.transpose(1, 2), self.weight, self.bias, padding=width - 1,
                 groups=self.weight.shape[0])[..., :x.shape[1]]
    return F.silu(y).transpose(1, 2), None


def gated_rms_norm(self, x, gate, **unused):
    """fla's FusedRMSNormGated (sigmoid gate) in plain PyTorch; the layer and
    the recipe both call it."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
    return (normed * self.weight.float() * torch.sigmoid(gate.float())).to(x.dtype)


def kimi_delta_attention(device, lower_bound, conv_bias, monkeypatch):
    torch.manual_seed(0)
    layer = fla_layers.KimiDeltaAttention(hidden_size=HIDDEN, head_dim=K, num_heads=H,
                                          mode="fused_recurrent", lower_bound=lower_bound,
                                          conv_bias=conv_bias).to(device).eval()
    with torch.no_grad():  # away from the initialisation's zeros and ones
        for parameter in layer.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.1)
    if device == "cpu":
        monkeypatch.setattr(fla_kda_layer, "fused_recurrent_kda", reference_recurrence)
        for conv in (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d):
            conv.forward = types.MethodType(depthwise_conv, conv)
        assert layer.o_norm.activation == "sigmoid"
        layer.o_norm.forward = types.MethodType(gated_rms_norm, layer.o_norm)
    return layer


@pytest.mark.skipif(INTERPRET, reason="fla's layer runs the same on the CPU either way: "
                                      "the CPU run covers it")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("conv_bias", [False, True])
def test_kimi_delta_attention_recipe_matches_the_layer(device, lower_bound, conv_bias,
                                                       monkeypatch):
    layer = kimi_delta_attention(device, lower_bound, conv_bias, monkeypatch)
    hidden = torch.randn(1, TOKENS, HIDDEN, device=device)
    with torch.no_grad():
        expected = layer(hidden)[0][0]

        # docs/integration.md section 6, for one request in block 1 of a cache of 3.
        h = hidden[0]
        V = layer.head_v_dim
        N, W = 3, layer.q_conv1d.weight.shape[-1]
        D = H * (2 * K + V)
        conv_state = torch.zeros(N, D, W - 1 + TOKENS - 1, device=device)
        state = torch.zeros(N, H, V, K, device=device)
        correction = torch.zeros(N, H, TOKENS, V, device=device)
        key_gate = torch.zeros(N, H, TOKENS, 2 * K, device=device)
        qsl = torch.tensor([0, TOKENS], dtype=torch.int32, device=device)
        state_indices = torch.tensor([1], dtype=torch.int32, device=device)

        x = torch.cat([layer.q_proj(h), layer.k_proj(h), layer.v_proj(h)], dim=-1)
        weight = torch.cat([layer.q_conv1d.weight, layer.k_conv1d.weight,
                            layer.v_conv1d.weight]).squeeze(1)
        bias = (torch.cat([layer.q_conv1d.bias, layer.k_conv1d.bias, layer.v_conv1d.bias])
                if layer.conv_bias else None)
        x = kda_ops.conv_update(x, conv_state, weight, bias, qsl, state_indices,
                                activation="silu")
        q, k, v = x.split([H * K, H * K, H * V], dim=-1)
        o = kda_ops.verify(q.view(-1, H, K), k.view(-1, H, K), v.view(-1, H, V),
                           layer.f_proj(h).view(-1, H, K), layer.b_proj(h), layer.A_log,
                           layer.dt_bias, state, correction, key_gate, qsl, state_indices,
                           lower_bound=layer.lower_bound)
        o = layer.o_norm(o, layer.g_proj(h).view(-1, H, V))
        out = layer.o_proj(o.view(-1, H * V))
    assert_rel_close(out, expected, tol=1e-5, name="output")
