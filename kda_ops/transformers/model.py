"""What the integration reads of a transformers Kimi Linear model, and how its
KDA layers are routed to a cache.

Only the module tree that the model's checkpoint names fix is read
(`model.layers.{i}.self_attn.{q_proj, ...}`, the config's `layer_types`), and
nothing of the model is changed but the `forward` of each KDA layer: it calls
the cache when given a `KDACache` and the layer's own forward otherwise.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

from torch import nn

MODEL_TYPE = "kimi_linear"
KDA_LAYER_TYPE = "linear_attention"
# The submodules and attributes a KDA layer's window is computed from.
LAYER_PARTS = ("q_proj", "k_proj", "v_proj", "conv1d", "forget_gate", "b_proj", "g_a_proj",
               "g_b_proj", "o_norm", "o_proj", "num_heads", "head_dim", "activation")
GATE_PARTS = ("f_a_proj", "f_b_proj", "A_log", "dt_bias")
CACHE_ARGUMENTS = ("cache", "past_key_values", "cache_params")


@dataclass(frozen=True)
class KDAShape:
    num_layers: int  # KDA layers
    num_heads: int
    head_dim: int  # K = V
    conv_width: int
    layer_indices: tuple  # each KDA layer's index in the model


def text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def kda_layers(model: nn.Module) -> list:
    """The KDA attention modules of a Kimi Linear model, in layer order; raises
    a ValueError naming what does not match."""
    config = text_config(model)
    if getattr(config, "model_type", None) != MODEL_TYPE:
        raise ValueError(f"kda_ops.transformers: `model` must be a Kimi Linear model "
                         f"(config.model_type {MODEL_TYPE!r}), got "
                         f"{getattr(config, 'model_type', None)!r}")
    decoder = model.base_model
    layer_types = list(getattr(config, "layer_types", None) or ())
    if not hasattr(decoder, "layers") or len(decoder.layers) != len(layer_types):
        raise ValueError("kda_ops.transformers: `model` must have one decoder layer per entry "
                         "of config.layer_types (model.layers)")
    modules = [decoder.layers[i].self_attn for i, kind in enumerate(layer_types)
               if kind == KDA_LAYER_TYPE]
    for module in modules:
        missing = [name for name in LAYER_PARTS if not hasattr(module, name)]
        missing += [f"forget_gate.{name}" for name in GATE_PARTS
                    if not hasattr(getattr(module, "forget_gate", None), name)]
        if missing:
            raise ValueError(f"kda_ops.transformers: the KDA layer {module.layer_idx} has no "
                             f"{', '.join(missing)}: this transformers version's Kimi Linear "
                             f"is not supported (docs/integration.md#10-hugging-face-transformers)")
        if module.activation != "silu":
            raise ValueError(f"kda_ops.transformers: the short convolution's activation must be "
                             f"'silu' (config.hidden_act), got {module.activation!r}")
    return modules


def kda_shape(modules: list) -> KDAShape:
    first = modules[0]
    for module in modules[1:]:
        if (module.num_heads, module.head_dim, module.conv1d.kernel_size) != (
                first.num_heads, first.head_dim, first.conv1d.kernel_size):
            raise ValueError("kda_ops.transformers: every KDA layer must have the same heads, "
                             "head dim and convolution width")
    return KDAShape(len(modules), first.num_heads, first.head_dim, first.conv1d.kernel_size[0],
                    tuple(module.layer_idx for module in modules))


def find_cache(args, kwargs, cache_type):
    cache = next((kwargs[name] for name in CACHE_ARGUMENTS if name in kwargs), None)
    if cache is None:
        cache = next((a for a in args if isinstance(a, cache_type)), None)
    return cache if isinstance(cache, cache_type) else None


def route_kda_layers(model: nn.Module, modules: list, routed_forward, before_forward) -> None:
    """Makes `routed_forward(module, *args, **kwargs)` each KDA layer's forward
    (the layer's own stays as `module._kda_ops_layer_forward`) and registers
    `before_forward` as a pre-hook (with kwargs) of the model's forward;
    idempotent. Both are module-level functions and the forward is bound per
    module, so a copy of the model routes its own layers."""
    for module in modules:
        if "_kda_ops_layer_forward" in module.__dict__:
            continue
        module._kda_ops_layer_forward = module.forward
        module.forward = types.MethodType(routed_forward, module)
    decoder = model.base_model
    if not getattr(decoder, "_kda_ops_forward_hook", False):
        decoder.register_forward_pre_hook(before_forward, with_kwargs=True)
        decoder._kda_ops_forward_hook = True
