"""A compiled model forward (`model.forward = torch.compile(model.forward)`)
during transformers' assisted generation with `KDACache`: no graph break,
and the tokens of the eager forward."""

import pytest
import torch
from torch._dynamo.utils import counters

from compile_helpers import DEVICES, NOT_UNDER_INTERPRETER

transformers = pytest.importorskip("transformers")
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
from transformers.utils import logging as transformers_logging  # noqa: E402

from kda_ops.transformers import KDACache  # noqa: E402

pytestmark = NOT_UNDER_INTERPRETER
transformers_logging.set_verbosity_error()  # its CPU fallback warnings, at every call


def tiny_kimi_linear(dtype, device):
    """KDA, attention, KDA; random weights scaled by 3 (logits far from ties)."""
    layers = ["linear_attention", "full_attention", "linear_attention"]
    config = KimiLinearConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, layer_types=layers,
        mlp_layer_types=["dense"] * 3, linear_head_dim=32, linear_num_heads=4,
        linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(3.0)
    return model.to(device=device, dtype=dtype)


# float64 on the CPU; on CUDA transformers' own layers call fla's kernels,
# which take no float64.
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_forward_in_prompt_lookup_generation(device):
    dtype = torch.float64 if device == "cpu" else torch.float32
    model = tiny_kimi_linear(dtype, device)
    pattern = torch.randint(2, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    ids = pattern.repeat(1, 4).to(device)  # prompt lookup drafts from the repeats

    rollbacks = []

    class RecordingCache(KDACache):
        def crop(self, tokens_to_remove):
            rollbacks.append(-tokens_to_remove)
            super().crop(tokens_to_remove)

    def generate():
        return model.generate(ids, max_new_tokens=24, do_sample=False,
                              prompt_lookup_num_tokens=4, cache=RecordingCache(model))

    eager = generate()
    assert rollbacks, "no speculative window was verified"
    torch._dynamo.reset()
    counters.clear()
    model.forward = torch.compile(model.forward)
    compiled = generate()
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.equal(compiled, eager)
