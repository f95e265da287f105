"""`KDACache`: a transformers `Cache` whose Kimi Linear KDA layers run every
token through kda_ops (docs/integration.md#10-hugging-face-transformers).

Per KDA layer and sequence the cache keeps one checkpoint, the convolution
history and the records of one window, stacked over the KDA layers in
kda_ops' layout (block b + 1 holds sequence b; block 0 is the null block):

    state       [L, B+1, H, V, K]      float32 (float64 for a float64 model)
    conv_state  [L, B+1, D, W-1+T-1]   the model's dtype, D = 3 H K
    correction  [L, B+1, H, T, V]      the state's precision
    key_gate    [L, B+1, H, T, 2K]     the model's dtype

A forward of S tokens runs its last min(S, T) tokens as a window through
`conv_verify`; the tokens before them (a prompt) run in windows
of up to PREFILL_WINDOW tokens that are committed at once. The last window stays pending:
`crop(-n)` (transformers' rollback after verification) commits its first
L - n tokens for every KDA layer in one `commit`, and the next forward
commits all of it first. The attention layers keep transformers' own
dynamic cache layers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache

from .. import api
from .model import find_cache, kda_layers, kda_shape, route_kda_layers, text_config

# A prompt's tokens run in windows of up to this many (fewer launches than windows
# of T); the records sized for it last only until the next forward.
PREFILL_WINDOW = 64


class _KDACacheLayer:
    """Stands for one KDA layer in `Cache.layers`: its state lives in the
    KDACache's stacked buffers, which answers for it."""

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False
    keys = values = None

    def __init__(self, cache: "KDACache"):
        self._cache = cache

    def get_seq_length(self) -> int:
        return self._cache._seq_len

    def get_max_length(self) -> int:
        return -1

    def __repr__(self):
        return "KDACacheLayer"


class KDACache(Cache):
    """A transformers cache for Kimi Linear whose KDA layers run through
    kda_ops: pass it to `generate` (`cache=KDACache(model)`; transformers
    5.25 also takes it as `past_key_values=`), with or without
    `prompt_lookup_num_tokens` or `assistant_model`.

    Creating it routes `model`'s KDA layers through kda_ops whenever they are
    given a KDACache (with any other cache, or none, they run their own
    forward, unchanged); the model's weights and config are not touched.

    Args:
        model: a transformers `KimiLinearForCausalLM` (or `KimiLinearModel`).
        spec_len: T, the longest window kept for rollback (default 1, raised
            to 1 + the draft length when generation asks the cache to record,
            and to any longer window a recording generation then sends).
        state_dtype: the checkpoints' dtype: float32 (default), bfloat16, or
            float64 (the default for a float64 model; its records are float64
            too and every op runs in float64).

    Like transformers' caches, a KDACache that holds a sequence continues it:
    `generate` with a prompt that extends that sequence prefills only the new
    tokens; call `reset()` before an unrelated prompt. Assisted generation
    feeds its whole prompt to its first forward: there (the first forward
    after `activate_past_recording`, when its positions start at 0) the cache
    starts a new sequence by itself.
    """

    def __init__(self, model, *, spec_len: int = 1, state_dtype: Optional[torch.dtype] = None):
        modules = kda_layers(model)
        if not modules:
            raise ValueError("kda_ops.transformers: `model` has no KDA layer "
                             "(config.layer_types has no 'linear_attention')")
        if not isinstance(spec_len, int) or isinstance(spec_len, bool) or spec_len < 1:
            raise ValueError(f"kda_ops.transformers: `spec_len` must be a positive int, "
                             f"got {spec_len!r}")
        if state_dtype not in (None, torch.float32, torch.bfloat16, torch.float64):
            raise ValueError(f"kda_ops.transformers: `state_dtype` must be torch.float32, "
                             f"torch.bfloat16 or torch.float64, got {state_dtype!r}")
        self._config = text_config(model)
        self._modules = modules
        self._shape = kda_shape(modules)
        self._slots = {index: slot for slot, index in enumerate(self._shape.layer_indices)}
        super().__init__(layers=self._new_layers())
        self._spec_len = spec_len
        self._state_dtype = state_dtype
        self._buffers: Optional[dict] = None
        self._window_starts: dict = {}  # (batch, length, device) -> query_start_loc
        self._recording = None  # activate_past_recording's arguments, once called
        self._armed = False  # the next forward may restart the sequence
        self._clear_sequence()
        route_kda_layers(model, modules, _routed_forward, _before_model_forward)

    # ----------------------------------------------------------------- layers
    def _new_layers(self) -> list:
        attention = DynamicCache(config=self._config).layers
        return [_KDACacheLayer(self) if index in self._slots else layer
                for index, layer in enumerate(attention)]

    def _attention_layers(self):
        return [layer for layer in self.layers if not isinstance(layer, _KDACacheLayer)]

    def _clear_sequence(self) -> None:
        self._seq_len = 0  # tokens in the cache, the pending window's included
        self._window = 0  # the pending window's length (0: none)
        self._verified = 0  # KDA layers that have run the pending window
        self._fresh = True  # no token yet: the blocks hold zeros

    @property
    def spec_len(self) -> int:
        """T, the longest window the cache keeps for rollback now."""
        return self._spec_len

    @property
    def is_linear(self) -> list:
        return [isinstance(layer, _KDACacheLayer) or getattr(layer, "is_linear", False)
                for layer in self.layers]

    @property
    def batch_size(self) -> int:
        return -1 if self._buffers is None else self._buffers["state"].shape[1] - 1

    # ---------------------------------------------------------------- buffers
    def _allocate(self, batch: int, dtype: torch.dtype, device: torch.device) -> None:
        """Zeroed buffers for `batch` sequences in the model's dtype."""
        s = self._shape
        state_dtype = self._state_dtype or (torch.float64 if dtype == torch.float64
                                            else torch.float32)
        record_dtype = torch.float64 if state_dtype == torch.float64 else torch.float32
        if (state_dtype == torch.float64) != (dtype == torch.float64):
            raise ValueError(f"kda_ops.transformers: a float64 state needs a float64 model and "
                             f"a float64 model a float64 state, got state_dtype {state_dtype} "
                             f"for a {dtype} model")
        L, N, H, T = s.num_layers, batch + 1, s.num_heads, self._spec_len
        K = V = s.head_dim
        zeros = lambda *shape, dtype: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self._buffers = dict(
            state=zeros(L, N, H, V, K, dtype=state_dtype),
            conv_state=zeros(L, N, H * (2 * K + V), s.conv_width - 1 + T - 1, dtype=dtype),
            correction=zeros(L, N, H, T, V, dtype=record_dtype),
            key_gate=zeros(L, N, H, T, 2 * K, dtype=dtype))
        self._index_sequences(N - 1, device)

    def _index_sequences(self, batch: int, device) -> None:
        """Block indices of the sequences: 1..batch in every layer's slice of
        the stacked buffers (`state_indices`), and the same blocks in the
        buffers viewed as one layer of L * (batch + 1) blocks, a row per
        layer (`layer_indices`, see _layer_caches)."""
        L = self._shape.num_layers
        indices = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
        layers = torch.arange(L, dtype=torch.int32, device=device)[:, None] * (batch + 1)
        self._buffers.update(state_indices=indices, layer_indices=indices + layers)

    def _layer_caches(self, slot: int):
        """(state, conv_state, correction, key_gate, block indices) of one KDA
        layer for the single-layer ops: the stacked buffers flattened into
        one layer of L * (batch + 1) blocks, and the layer's blocks in it. A
        layer's slice `buffer[slot]` would be a view at a nonzero offset,
        which Inductor mishandles in a graph with dynamic shapes when an op
        writes it (torch 2.13 on the CPU: wrong caches from the second KDA
        layer on); the flattened views start where their buffers do."""
        b = self._buffers
        return (*(b[name].flatten(0, 1) for name in ("state", "conv_state", "correction",
                                                      "key_gate")),
                b["layer_indices"][slot])

    def _resize_records(self, capacity: int) -> None:
        """Records and convolution columns for windows of up to `capacity`
        tokens; the convolution history carries over. Only between windows."""
        b = self._buffers
        L, N, H, _, K = b["correction"].shape
        history = self._shape.conv_width - 1
        conv = b["conv_state"].new_zeros(L, N, b["conv_state"].shape[2], history + capacity - 1)
        conv[..., :history] = b["conv_state"][..., :history]
        b["conv_state"] = conv
        b["correction"] = b["correction"].new_zeros(L, N, H, capacity, K)
        b["key_gate"] = b["key_gate"].new_zeros(L, N, H, capacity, 2 * K)

    def _windows(self, batch: int, length: int, device) -> Tensor:
        """query_start_loc of `batch` windows of `length` tokens each, made once
        per shape: every KDA layer of a forward takes the same."""
        key = (batch, length, device)
        if key not in self._window_starts:
            self._window_starts[key] = torch.arange(0, (batch + 1) * length, length,
                                                    dtype=torch.int32, device=device)
        return self._window_starts[key]

    def _gate_parameters(self, slot: Optional[int] = None):
        """(A_log [H], dt_bias [H*K]) of one KDA layer, or stacked over all."""
        if slot is not None:
            gate = self._modules[slot].forget_gate
            return gate.A_log.reshape(-1), gate.dt_bias.reshape(-1)
        pairs = [self._gate_parameters(s) for s in range(len(self._modules))]
        return torch.stack([a for a, _ in pairs]), torch.stack([d for _, d in pairs])

    def _commit(self, accepted: int, slot: Optional[int] = None, window: Optional[int] = None):
        """Folds the first `accepted` tokens of the window just verified into
        every KDA layer's checkpoint (one commit), or into one layer's."""
        b = self._buffers
        device = b["state"].device
        batch = b["state"].shape[1] - 1
        window = self._window if window is None else window
        if slot is None:
            caches = [b[name] for name in ("state", "conv_state", "correction", "key_gate",
                                           "state_indices")]
        else:
            caches = self._layer_caches(slot)
        state, conv_state, correction, key_gate, indices = caches
        A_log, dt_bias = self._gate_parameters(slot)
        api.commit(torch.full((batch,), accepted, dtype=torch.int32, device=device),
                   indices, self._windows(batch, window, device), state=state,
                   conv_state=conv_state, correction=correction, key_gate=key_gate,
                   A_log=A_log, dt_bias=dt_bias)

    def _settle(self, remove: int = 0) -> None:
        """Commits the pending window but its last `remove` tokens."""
        if self._window:
            if self._verified != len(self._modules):
                raise RuntimeError("kda_ops.transformers: the cache's last forward did not run "
                                   "every KDA layer; call reset() before using it again")
            self._commit(self._window - remove)
            self._window = 0

    # ---------------------------------------------------------------- forward
    def _begin_forward(self, hidden_states: Tensor) -> None:
        """At the first KDA layer of a forward: commit the pending window,
        size the buffers, and account for the forward's tokens."""
        batch, length = hidden_states.shape[:2]
        self._settle()
        if self._buffers is None or self._fresh:
            if self._buffers is None or self._buffers["state"].shape[1] != batch + 1 or \
                    self._buffers["key_gate"].dtype != hidden_states.dtype or \
                    self._buffers["state"].device != hidden_states.device:
                self._allocate(batch, hidden_states.dtype, hidden_states.device)
            else:
                for buffer in ("state", "conv_state"):
                    self._buffers[buffer].zero_()
        elif self._buffers["state"].shape[1] != batch + 1:
            raise ValueError(f"kda_ops.transformers: the cache holds {self.batch_size} "
                             f"sequences, the forward brings {batch}: reset() it first")
        # A recording generation rolls back up to a whole window after a
        # forward that continues the sequence: T must hold it. A longer
        # forward is a prompt (a later generation continuing the cache): T
        # stays, rather than growing for good with the prompt.
        if self._recording is not None and not self._fresh and length <= PREFILL_WINDOW:
            self._spec_len = max(self._spec_len, length)
        self._window = min(length, self._spec_len)
        # The tokens before the window (a prompt) run in windows of up to
        # PREFILL_WINDOW tokens, which the records then hold until the next forward.
        prefix = length - self._window
        capacity = max(self._spec_len, min(prefix, PREFILL_WINDOW))
        if capacity != self._buffers["correction"].shape[3]:
            self._resize_records(capacity)
        self._verified = 0
        self._seq_len += length
        self._fresh = False

    def start_forward(self, position_ids: Optional[Tensor]) -> None:
        """Before a model forward (the routing's hook). Assisted generation
        starts with `activate_past_recording` and then feeds its whole
        prompt, at positions from 0: that forward drops what the cache holds
        (one read of a position, once per generation, only for a used cache)."""
        if self._armed:
            self._armed = False
            if position_ids is not None and self._seq_len > 0 and \
                    int(position_ids.reshape(-1)[0]) == 0:
                self.reset()

    def layer_forward(self, module, hidden_states: Tensor, *args, attention_mask=None,
                      **kwargs) -> Tensor:
        """A KDA layer's forward (called by the routed layer): the prompt part
        in windows committed at once, then the pending window."""
        slot = self._slots[module.layer_idx]
        if slot == 0:
            self._begin_forward(hidden_states)
        if attention_mask is not None and attention_mask.dim() == 2:
            # Padding tokens enter the recurrence as zeros, as in the layer's own forward.
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        length = hidden_states.shape[1]
        prefix = length - self._window
        capacity = self._buffers["correction"].shape[3]
        outputs = []
        for start in range(0, prefix, capacity):
            chunk = hidden_states[:, start:min(start + capacity, prefix)]
            outputs.append(self._run_window(module, slot, chunk))
            self._commit(chunk.shape[1], slot=slot, window=chunk.shape[1])
        outputs.append(self._run_window(module, slot, hidden_states[:, prefix:]))
        self._verified += 1
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)

    def _run_window(self, module, slot: int, hidden_states: Tensor) -> Tensor:
        """`conv_verify` of one layer over each sequence's next
        `hidden_states.shape[1]` tokens (records written, checkpoint read)."""
        state, conv_state, correction, key_gate, indices = self._layer_caches(slot)
        batch, length, _ = hidden_states.shape
        H, K = self._shape.num_heads, self._shape.head_dim
        windows = self._windows(batch, length, hidden_states.device)
        tokens = hidden_states.reshape(batch * length, -1)
        mixed = torch.cat([module.q_proj(tokens), module.k_proj(tokens), module.v_proj(tokens)],
                          dim=-1)
        gate = module.forget_gate
        raw_gate = gate.f_b_proj(gate.f_a_proj(tokens)).view(-1, H, K)
        A_log, dt_bias = self._gate_parameters(slot)
        out = api.conv_verify(mixed, conv_state, module.conv1d.weight.squeeze(1),
                              module.conv1d.bias, raw_gate, module.b_proj(tokens), A_log,
                              dt_bias, state, correction, key_gate, windows, indices)
        output_gate = module.g_b_proj(module.g_a_proj(tokens)).view(-1, H, K)
        out = module.o_norm(out, output_gate).reshape(batch, length, H * K)
        return module.o_proj(out)

    # ------------------------------------------------------- Cache interface
    def crop(self, tokens_to_remove: int) -> None:
        """Drops the last `-tokens_to_remove` tokens (transformers passes a
        count <= 0): commits the rest of the pending window for every KDA
        layer in one `commit`, and crops the attention layers."""
        if tokens_to_remove > 0:
            raise ValueError(f"kda_ops.transformers: `crop` takes the number of tokens to "
                             f"remove as a negative int, got {tokens_to_remove}")
        remove = -tokens_to_remove
        limit = max(self._window - 1, 0)
        if remove > limit:
            raise ValueError(f"kda_ops.transformers: `crop` can remove at most {limit} of the "
                             f"{self._window} tokens of the last forward's window: a KDA layer "
                             f"keeps no earlier state, and the window's first input has "
                             f"replaced the oldest of its convolution history; got {remove}")
        self._settle(remove)
        self._seq_len -= remove
        for layer in self._attention_layers():
            layer.crop(tokens_to_remove)

    def activate_past_recording(self, recurrent_states_to_keep: Optional[int] = None,
                                **kwargs) -> None:
        """Generation will roll back up to `recurrent_states_to_keep` tokens of
        each forward: windows of 1 + that many tokens are kept."""
        self._recording = dict(kwargs, recurrent_states_to_keep=recurrent_states_to_keep)
        self._armed = True
        if recurrent_states_to_keep is not None:
            self._spec_len = max(self._spec_len, int(recurrent_states_to_keep) + 1)
        self._record_attention_layers()

    def _record_attention_layers(self) -> None:
        for layer in self._attention_layers():
            if self._recording is not None and hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**self._recording)

    def is_recording_past(self, layer_idx: int) -> bool:
        # The KDA layers' rollback is the cache's own: their forward never records states.
        return False if layer_idx in self._slots else super().is_recording_past(layer_idx)

    def get_recurrent_states_to_keep(self, layer_idx: Optional[int] = None) -> int:
        if layer_idx in self._slots:
            return 0
        return max([getattr(layer, "recurrent_states_to_keep", 0)
                    for layer in self._attention_layers()
                    if getattr(layer, "record_past", False)] + [0])

    def reset(self) -> None:
        """Forgets the sequence (the buffers are kept and zeroed at the next forward)."""
        self._clear_sequence()
        self.layers = self._new_layers()
        self._record_attention_layers()

    def has_previous_state(self, layer_idx: Optional[int] = None,
                           state_idx: Optional[int] = None) -> bool:
        return self._seq_len > 0

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Optional[Tensor]:
        """The state of KDA layer `layer_idx` after every token in the cache,
        `[B, H, K, V]` as transformers lays it out (a copy), or None before
        the first token."""
        slot = self._kda_slot(layer_idx)
        if self._fresh:
            return None
        self._settle()
        return self._buffers["state"][slot, 1:].transpose(-1, -2).clone()

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Optional[Tensor]:
        """The last W-1 inputs of KDA layer `layer_idx`'s short convolution,
        `[B, 3 H K, W-1]` (a copy), or None before the first token."""
        slot = self._kda_slot(layer_idx)
        if self._fresh:
            return None
        self._settle()
        history = self._shape.conv_width - 1
        return self._buffers["conv_state"][slot, 1:, :, :history].clone()

    def update_conv_state(self, *args, **kwargs):
        raise NotImplementedError("kda_ops.transformers: a KDACache's KDA layers run through "
                                  "kda_ops, which keeps their state")

    update_recurrent_state = update_conv_state

    def _kda_slot(self, layer_idx: int) -> int:
        if layer_idx not in self._slots:
            raise ValueError(f"kda_ops.transformers: layer {layer_idx} is not a KDA layer "
                             f"(KDA layers: {sorted(self._slots)})")
        return self._slots[layer_idx]

    def _select_sequences(self, rows: Tensor) -> None:
        """Keeps sequences `rows` (with repeats), in that order."""
        if self._buffers is None or self._fresh:
            return
        self._settle()
        rows = rows.to(self._buffers["state"].device).long()
        blocks = torch.cat([rows.new_zeros(1), rows + 1])
        for name in ("state", "conv_state", "correction", "key_gate"):
            self._buffers[name] = self._buffers[name][:, blocks].contiguous()
        self._index_sequences(rows.shape[0], rows.device)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select_sequences(beam_idx)
        for layer in self._attention_layers():
            layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self._select_sequences(indices)
        for layer in self._attention_layers():
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self._buffers is not None:
            self._select_sequences(torch.arange(self.batch_size).repeat_interleave(repeats))
        for layer in self._attention_layers():
            layer.batch_repeat_interleave(repeats)


def _routed_forward(self, *args, **kwargs):
    """A KDA layer's forward: through the KDACache it is given, else its own."""
    cache = find_cache(args, kwargs, KDACache)
    if cache is None:
        return self._kda_ops_layer_forward(*args, **kwargs)
    return cache.layer_forward(self, *args, **kwargs)


def _before_model_forward(module, args, kwargs):
    """Hands a model forward's position ids to its KDACache (`start_forward`)."""
    cache = find_cache(args, kwargs, KDACache)
    if cache is not None:
        cache.start_forward(kwargs.get("position_ids"))
