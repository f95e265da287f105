"""A small reference model: one speculative decode step through a stack of KDA layers.

This is the code a model author writes on top of `kda_ops`; the compile tests,
the end-to-end checks and the benchmark drive it. Per layer `l`:

    hidden --in-proj--> mixed [tokens, D], g [tokens, H, K], beta [tokens, H]
    mixed, g, beta --kda_ops.conv_verify(conv_state[l], state[l], correction[l],
                                         key_gate[l])--> out      (D = H*(2K+V))
    hidden = hidden + out @ out-proj

(conv_verify is conv_update of mixed into q | k | v, then verify of them; with
`use_conv_verify=False` the layer makes those two calls itself).

and after sampling, ONE `kda_ops.commit` folds the accepted prefix into the
checkpoints and compacts the convolution history of every layer at once (the
caches are stacked `[num_layers, num_blocks, ...]`, each layer uses its slice).
With `cache_layout="per_layer"` each layer's caches are separate tensors
instead, and the commit runs the single-layer form once per layer.

With `projections=False` (what the benchmark uses) there are no matmuls: the
input row is `[mixed | g | beta]` (width D + H*K + H), every layer reads the
same row, and `forward` returns the last layer's output `[tokens, H*V]`.

The caches are registered buffers (what `torch.compile(mode="reduce-overhead")`
and CUDA graphs want: fixed addresses), or can be passed in as a `KDACaches`
tuple instead (mark them with `torch._dynamo.mark_static_address` before
compiling with CUDA graphs). Parameters never require grad: inference only.

Shapes (per-token inputs are packed "varlen", docs/semantics.md#1-cache-layout):

    hidden            [num_tokens, E]         E = hidden_size
    query_start_loc   [B + 1] int32           request b owns tokens qsl[b]:qsl[b+1] (1..T of them)
    state_indices     [B] int32               state block of request b (<= 0: padding row)
    num_accepted      [B] int32               accepted tokens of each request's window

    caches.state        [L, N, H, V, K]   state_dtype (float32 default)
    caches.conv_state   [L, N, D, W-1+T-1] ("dim_first") or [L, N, W-1+T-1, D] ("token_first")
    caches.correction   [L, N, H, T, V]   float32
    caches.key_gate     [L, N, H, T, 2K]  activation dtype
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from . import api


class KDACaches(NamedTuple):
    """The per-block caches of every layer: each field a tensor stacked on a
    leading layer dim (`cache_layout="stacked"`), or a tuple of one tensor per
    layer (`"per_layer"`); `caches.state[l]` is layer l's either way.

    `conv_state` is the storage in the model's `conv_layout`;
    `KDADecodeStep.conv_state_dim_first(caches)` gives the `[(L,) N, D, cols]`
    views the ops take."""

    state: Tensor
    conv_state: Tensor
    correction: Tensor
    key_gate: Tensor


class DeferredKDACaches(NamedTuple):
    """KDACaches of the deferred schedule (`record_len > spec_len`): the
    records hold R positions, and `pending` (int32 `[(L,) N]`) counts the
    tokens recorded but not yet folded into each block's checkpoint."""

    state: Tensor
    conv_state: Tensor
    correction: Tensor
    key_gate: Tensor
    pending: Tensor


class KDADecodeStep(nn.Module):
    """A stack of `num_layers` KDA layers running one speculative decode step.

    Args:
        num_layers: L.
        num_heads: H.
        head_dim: K (and V unless `value_dim` is given).
        spec_len: T = 1 + number of draft tokens (window capacity).
        conv_width: W of the causal depthwise convolution.
        num_blocks: N state blocks per layer (block 0 is the null block).
        value_dim: V (default K).
        projections: per-layer input/output projections and a residual stream
            (default); False: no matmuls, see the module docstring.
        hidden_size: E with projections (default H*V).
        dtype: activation dtype (inputs, weights, conv state, key/gate record).
        state_dtype: checkpoint dtype (float32 or bfloat16).
        conv_layout: "dim_first" stores conv state `[L, N, D, cols]`; "token_first"
            stores an engine-like `[L, N, cols, D]` and passes it transposed.
        cache_layout: "stacked" keeps each cache as one `[L, N, ...]` tensor
            (one commit launch covers every layer); "per_layer" keeps one
            tensor per layer (buffers `state_0`, `state_1`, ...) and commits
            layer by layer.
        lower_bound: the KDA gate's lower bound (negative float) or None.
        record_len: R, the record positions per block (default T: every commit
            folds). R > T runs the deferred schedule: commits count accepted
            tokens as pending and fold them when the records run out of room;
            `flush` writes every pending token back.
        eager_fold: under the deferred schedule, commit's `eager_fold` (None:
            its default, folding every commit below
            DEFERRED_EAGER_FOLD_BELOW_BATCH requests).
        use_conv_verify: each layer runs `kda_ops.conv_verify` (default); False:
            `conv_update`, then `verify`.
        seed: seeds the parameter initialisation (CPU generator, so the same
            parameters on every device).
        device: where parameters and caches live.

    Methods:
        forward(hidden, query_start_loc, state_indices, caches=None) -> Tensor
            conv_verify for every layer; checkpoints are not modified.
        commit(num_accepted_tokens, state_indices, query_start_loc, caches=None)
            one kda_ops.commit for all layers.
        flush(state_indices, caches=None)
            under the deferred schedule, folds the listed blocks' pending
            records into their checkpoints.
        decode_step(hidden, query_start_loc, state_indices, num_accepted_tokens, caches=None)
            forward, then the commit of `num_accepted_tokens` of those windows, in
            one call: one graph to compile or capture (the acceptance counts are
            a device tensor given up front, e.g. computed on device or replayed).
            `step` is an alias.
    """

    def __init__(self, num_layers: int = 2, num_heads: int = 2, head_dim: int = 16,
                 spec_len: int = 4, conv_width: int = 4, num_blocks: int = 8, *,
                 value_dim: Optional[int] = None, projections: bool = True,
                 hidden_size: Optional[int] = None, dtype: torch.dtype = torch.float32,
                 state_dtype: torch.dtype = torch.float32, conv_layout: str = "dim_first",
                 cache_layout: str = "stacked", lower_bound: Optional[float] = None,
                 record_len: Optional[int] = None, eager_fold: Optional[bool] = None,
                 use_conv_verify: bool = True, seed: int = 0,
                 device: torch.device | str | None = None):
        super().__init__()
        self.use_conv_verify = use_conv_verify
        if conv_layout not in ("dim_first", "token_first"):
            raise ValueError(f"conv_layout must be 'dim_first' or 'token_first', got {conv_layout!r}")
        if cache_layout not in ("stacked", "per_layer"):
            raise ValueError(f"cache_layout must be 'stacked' or 'per_layer', got {cache_layout!r}")
        if num_layers < 1 or spec_len < 1 or conv_width < 2 or num_blocks < 2:
            raise ValueError("need num_layers >= 1, spec_len >= 1, conv_width >= 2, num_blocks >= 2")
        record_len = spec_len if record_len is None else record_len
        if record_len < spec_len:
            raise ValueError(f"record_len must be at least spec_len = {spec_len}, got {record_len}")
        self.record_len = record_len
        self.deferred = record_len > spec_len
        if eager_fold is not None and not self.deferred:
            raise ValueError("eager_fold needs the deferred schedule (record_len > spec_len)")
        self.eager_fold = eager_fold
        self.caches_type = DeferredKDACaches if self.deferred else KDACaches
        L, H, K = num_layers, num_heads, head_dim
        V = K if value_dim is None else value_dim
        self.num_layers, self.num_heads, self.key_dim, self.value_dim = L, H, K, V
        self.spec_len, self.conv_width, self.num_blocks = spec_len, conv_width, num_blocks
        self.conv_dim = H * (2 * K + V)
        self.conv_cols = conv_width - 1 + spec_len - 1
        self.projections = projections
        if projections:
            self.hidden_size = hidden_size or H * V
        else:
            self.hidden_size = self.conv_dim + H * K + H
            if hidden_size not in (None, self.hidden_size):
                raise ValueError(f"without projections the input width is D + H*K + H = "
                                 f"{self.hidden_size}, got hidden_size={hidden_size}")
        self.dtype, self.state_dtype, self.conv_layout = dtype, state_dtype, conv_layout
        self.cache_layout = cache_layout
        self.lower_bound = lower_bound
        E, D = self.hidden_size, self.conv_dim

        gen = torch.Generator().manual_seed(seed)

        def param(*shape, scale=1.0, dtype=dtype):
            value = torch.randn(shape, generator=gen) * scale
            return nn.Parameter(value.to(device=device, dtype=dtype), requires_grad=False)

        if projections:
            self.w_mixed = param(L, E, D, scale=E ** -0.5)         # -> conv input (q|k|v)
            self.w_gate = param(L, E, H * K, scale=E ** -0.5)      # -> raw gate g
            self.w_beta = param(L, E, H, scale=E ** -0.5)          # -> beta (pre-sigmoid)
            self.w_out = param(L, H * V, E, scale=0.5 * (H * V) ** -0.5)
        self.conv_weight = param(L, D, conv_width, scale=conv_width ** -0.5)
        self.conv_bias = param(L, D, scale=0.1)
        # A = exp(A_log) in [1, 16) as in KDA's initialisation; dt_bias around 0. fp32.
        a = torch.empty(L, H).uniform_(1.0, 16.0, generator=gen)
        self.A_log = nn.Parameter(torch.log(a).to(device), requires_grad=False)
        self.dt_bias = param(L, H, K, scale=0.5, dtype=torch.float32)

        for name, value in self.empty_caches(device=device)._asdict().items():
            if cache_layout == "stacked":
                self.register_buffer(name, value)
            else:
                for layer, tensor in enumerate(value):
                    self.register_buffer(f"{name}_{layer}", tensor)

    @classmethod
    def for_benchmark(cls, shape, device, *, num_blocks: Optional[int] = None,
                      seed: int = 0) -> "KDADecodeStep":
        """A model without projections for a `kda_ops.bench.Shape` (batch,
        spec_len, layers, heads, key_dim, value_dim, conv_width, act_dtype,
        state_dtype, record_len, eager_fold): engine-like token-first conv state, lower
        bound -5, `num_blocks` state blocks (default one per request, N =
        batch + 1), random caches."""
        num_blocks = shape.batch + 1 if num_blocks is None else num_blocks
        model = cls(shape.layers, shape.heads, shape.key_dim, shape.spec_len, shape.conv_width,
                    num_blocks, value_dim=shape.value_dim, projections=False,
                    dtype=shape.act_dtype, state_dtype=shape.state_dtype,
                    conv_layout="token_first", lower_bound=-5.0,
                    record_len=shape.record_len, eager_fold=shape.eager_fold, seed=seed,
                    device=device)
        model.randomize_caches(seed)
        return model

    # ------------------------------------------------------------------ caches
    def _apply(self, fn, recurse=True):
        """`module.to(dtype)`, `.half()` and `.bfloat16()` convert the parameters
        and the activation caches (`conv_state`, `key_gate`: they hold
        activations, and verify takes `key_gate` in k's dtype) but keep the
        dtypes of `state` (a checkpoint cast to bf16 would lose precision
        silently) and `correction` (float32 always). A move to float64 converts
        those too, since a float64 model runs every op in float64
        (docs/semantics.md#12-float64), and a move from float64 returns them
        to `state_dtype` and float32. Device moves apply to all."""
        kept = {name: buffer for name, buffer in self._buffers.items()
                if name.split("_")[0] in ("state", "correction")}
        super()._apply(fn, recurse)
        self.dtype = self.conv_weight.dtype
        for name, before in kept.items():
            after = self._buffers[name]
            if self.dtype == torch.float64:
                wanted = torch.float64
            elif before.dtype == torch.float64:
                wanted = self.state_dtype if name.startswith("state") else torch.float32
            else:
                wanted = before.dtype
            if after.dtype != wanted:
                self._buffers[name] = before.to(device=after.device, dtype=wanted)
        return self

    def cache_shapes(self) -> KDACaches:
        L, N, H, K, V = self.num_layers, self.num_blocks, self.num_heads, self.key_dim, self.value_dim
        R = self.record_len
        conv = ((L, N, self.conv_dim, self.conv_cols) if self.conv_layout == "dim_first"
                else (L, N, self.conv_cols, self.conv_dim))
        shapes = ((L, N, H, V, K), conv, (L, N, H, R, V), (L, N, H, R, 2 * K))
        return self.caches_type(*shapes, *([(L, N)] if self.deferred else []))

    def cache_dtypes(self) -> KDACaches:
        float64 = torch.float64 in (self.dtype, self.state_dtype)
        dtypes = (torch.float64 if float64 else self.state_dtype, self.dtype,
                  torch.float64 if float64 else torch.float32, self.dtype)
        return self.caches_type(*dtypes, *([torch.int32] if self.deferred else []))

    def _in_layout(self, stacked: KDACaches) -> KDACaches:
        """Stacked caches as this model keeps them (per layer: one tensor each)."""
        if self.cache_layout == "stacked":
            return stacked
        return self.caches_type(*(tuple(t[layer].clone() for layer in range(self.num_layers))
                                  for t in stacked))

    def _new_caches(self, fill, device) -> KDACaches:
        """Caches of this model's shapes from `fill(shape, dtype)`, in its layout."""
        return self._in_layout(self.caches_type(*(
            fill(shape, dtype).to(device=device, dtype=dtype)
            for shape, dtype in zip(self.cache_shapes(), self.cache_dtypes()))))

    def empty_caches(self, device=None) -> KDACaches:
        """New zero caches of this model's shapes and layout (a set separate from
        the buffers); no token pending."""
        device = self.A_log.device if device is None else device
        return self._new_caches(lambda shape, dtype: torch.zeros(shape), device)

    def random_caches(self, seed: int = 0, device=None) -> KDACaches:
        """New caches filled with N(0, 1) values, and pending counts random in
        [0, R - T] (each leaves room for a window), drawn on CPU: the same values
        on every device and in either layout. Tests compare on such data, never
        on zeros."""
        gen = torch.Generator().manual_seed(seed)
        room = self.record_len - self.spec_len + 1

        def fill(shape, dtype):
            if dtype == torch.int32:
                return torch.randint(0, room, shape, generator=gen)
            return torch.randn(shape, generator=gen)

        device = self.A_log.device if device is None else device
        return self._new_caches(fill, device)

    @torch.no_grad()
    def randomize_caches(self, seed: int = 0, caches: Optional[KDACaches] = None) -> None:
        """Fills the registered buffers (or `caches`) in place as `random_caches`
        draws them, on the model's device (no host copy; for large caches)."""
        gen = torch.Generator(device=self.A_log.device).manual_seed(seed)
        for buffer in cache_tensors(caches if caches is not None else self.buffers_as_caches()):
            if buffer.dtype == torch.int32:
                buffer.random_(0, self.record_len - self.spec_len + 1, generator=gen)
            else:
                buffer.normal_(generator=gen)

    def buffers_as_caches(self) -> KDACaches:
        """The registered buffers (the caches used when `caches=None`)."""
        names = self.caches_type._fields
        if self.cache_layout == "stacked":
            return self.caches_type(*(getattr(self, name) for name in names))
        return self.caches_type(*(tuple(getattr(self, f"{name}_{layer}")
                                        for layer in range(self.num_layers))
                                  for name in names))

    @torch.no_grad()
    def load_caches(self, caches: KDACaches) -> None:
        """Copies `caches` (this model's layout) into the registered buffers (in
        place: addresses stay)."""
        for buffer, value in zip(cache_tensors(self.buffers_as_caches()), cache_tensors(caches)):
            buffer.copy_(value)

    def conv_state_dim_first(self, caches: Optional[KDACaches] = None):
        """The `[L, N, D, W-1+T-1]` view of the conv state that the ops take
        (per layer: a tuple of `[N, D, W-1+T-1]` views)."""
        conv = (caches if caches is not None else self.buffers_as_caches()).conv_state
        if self.conv_layout == "dim_first":
            return conv
        if self.cache_layout == "stacked":
            return conv.transpose(-1, -2)
        return tuple(layer.transpose(-1, -2) for layer in conv)

    # ------------------------------------------------------------------ step
    def forward(self, hidden: Tensor, query_start_loc: Tensor, state_indices: Tensor,
                caches: Optional[KDACaches] = None) -> Tensor:
        """Runs every layer over the packed windows. Returns the new hidden
        `[num_tokens, E]` (without projections: the last layer's output
        `[num_tokens, H*V]`). Writes the conv state (extended window) and the
        correction / key-gate records; the checkpoints are not modified.
        Tokens outside every window get unspecified values."""
        c = caches if caches is not None else self.buffers_as_caches()
        conv = self.conv_state_dim_first(c)
        H, K, V, D = self.num_heads, self.key_dim, self.value_dim, self.conv_dim
        num_tokens = hidden.shape[0]
        out = hidden
        for layer in range(self.num_layers):
            if self.projections:
                mixed = hidden @ self.w_mixed[layer]                            # [tokens, D]
                g = (hidden @ self.w_gate[layer]).view(num_tokens, H, K)
                beta = hidden @ self.w_beta[layer]                              # [tokens, H]
            else:
                mixed, g, beta = hidden.split([D, H * K, H], dim=-1)
                g = g.view(num_tokens, H, K)
            caches = (self.A_log[layer], self.dt_bias[layer], c.state[layer],
                      c.correction[layer], c.key_gate[layer], query_start_loc, state_indices)
            if self.use_conv_verify:
                out = api.conv_verify(mixed, conv[layer], self.conv_weight[layer],
                                      self.conv_bias[layer], g, beta, *caches,
                                      lower_bound=self.lower_bound, **self._deferred(c, layer))
            else:
                mixed = api.conv_update(mixed, conv[layer], self.conv_weight[layer],
                                        self.conv_bias[layer], query_start_loc, state_indices,
                                        activation="silu")
                q, k, v = mixed.split([H * K, H * K, H * V], dim=-1)
                out = api.verify(q.view(num_tokens, H, K), k.view(num_tokens, H, K),
                                 v.view(num_tokens, H, V), g, beta, *caches,
                                 lower_bound=self.lower_bound, **self._deferred(c, layer))
            out = out.view(num_tokens, H * V)
            if self.projections:
                hidden = hidden + out @ self.w_out[layer]
        return hidden if self.projections else out

    def commit(self, num_accepted_tokens: Tensor, state_indices: Tensor,
               query_start_loc: Tensor, caches: Optional[KDACaches] = None) -> None:
        """Folds each request's accepted prefix of its last window into its
        checkpoint and compacts its conv history: all layers in one op, or one
        op per layer with per-layer caches."""
        c = caches if caches is not None else self.buffers_as_caches()
        conv = self.conv_state_dim_first(c)
        if self.cache_layout == "stacked":
            api.commit(num_accepted_tokens, state_indices, query_start_loc, state=c.state,
                       conv_state=conv, correction=c.correction, key_gate=c.key_gate,
                       A_log=self.A_log, dt_bias=self.dt_bias, lower_bound=self.lower_bound,
                       **self._deferred(c, slice(None), commit=True))
            return
        for layer in range(self.num_layers):
            api.commit(num_accepted_tokens, state_indices, query_start_loc,
                       state=c.state[layer], conv_state=conv[layer],
                       correction=c.correction[layer], key_gate=c.key_gate[layer],
                       A_log=self.A_log[layer], dt_bias=self.dt_bias[layer],
                       lower_bound=self.lower_bound, **self._deferred(c, layer, commit=True))

    def _deferred(self, caches, layer, commit=False) -> dict:
        """The deferred schedule's arguments of verify (or commit) for `layer`
        (an index or a slice); none under the immediate schedule."""
        if not self.deferred:
            return {}
        args = dict(pending=caches.pending[layer], spec_len=self.spec_len)
        if commit and self.eager_fold is not None:
            args.update(eager_fold=self.eager_fold)
        return args

    def flush(self, state_indices: Tensor, caches: Optional[KDACaches] = None) -> None:
        """Under the deferred schedule, folds the pending records of the blocks
        `state_indices` into their checkpoints (every layer), so that each holds
        the exact state after every accepted token; a no-op otherwise."""
        if not self.deferred:
            return
        c = caches if caches is not None else self.buffers_as_caches()
        layers = [slice(None)] if self.cache_layout == "stacked" else range(self.num_layers)
        for layer in layers:
            api.flush(state_indices, state=c.state[layer], correction=c.correction[layer],
                      key_gate=c.key_gate[layer], pending=c.pending[layer],
                      A_log=self.A_log[layer], dt_bias=self.dt_bias[layer],
                      lower_bound=self.lower_bound)

    def decode_step(self, hidden: Tensor, query_start_loc: Tensor, state_indices: Tensor,
                    num_accepted_tokens: Tensor, caches: Optional[KDACaches] = None) -> Tensor:
        """`forward`, then `commit(num_accepted_tokens)` of the same windows."""
        out = self.forward(hidden, query_start_loc, state_indices, caches)
        self.commit(num_accepted_tokens, state_indices, query_start_loc, caches)
        return out

    step = decode_step

    # ------------------------------------------------------------------ helpers
    def example_inputs(self, batch: int, *, seed: int = 0):
        """Benchmark-style inputs on the model's device: `batch` full windows of T
        tokens, blocks 1..batch, every token accepted. Returns (hidden,
        query_start_loc, state_indices, num_accepted_tokens)."""
        if batch > self.num_blocks - 1:
            raise ValueError(f"{batch} requests need {batch + 1} blocks, the model has "
                             f"{self.num_blocks}")
        device = self.A_log.device
        T = self.spec_len
        gen = torch.Generator(device=device).manual_seed(seed)
        hidden = torch.randn(batch * T, self.hidden_size, generator=gen, device=device).to(self.dtype)
        qsl = torch.arange(batch + 1, device=device, dtype=torch.int32) * T
        indices = torch.arange(1, batch + 1, device=device, dtype=torch.int32)
        accepted = torch.full((batch,), T, device=device, dtype=torch.int32)
        return hidden, qsl, indices, accepted

    def extra_repr(self) -> str:
        return (f"layers={self.num_layers}, heads={self.num_heads}, key_dim={self.key_dim}, "
                f"value_dim={self.value_dim}, spec_len={self.spec_len}, "
                f"conv_width={self.conv_width}, num_blocks={self.num_blocks}, "
                f"projections={self.projections}, hidden={self.hidden_size}, dtype={self.dtype}, "
                f"conv_layout={self.conv_layout}, cache_layout={self.cache_layout}, "
                f"lower_bound={self.lower_bound}, record_len={self.record_len}, "
                f"eager_fold={self.eager_fold}, "
                f"use_conv_verify={self.use_conv_verify}")


def cache_tensors(caches: KDACaches) -> list[Tensor]:
    """Every tensor of `caches`, in field order (then layer order, per layer)."""
    return [t for field in caches for t in ((field,) if isinstance(field, Tensor) else field)]


def make_step_inputs(model: KDADecodeStep, window_lens, *, seed: int = 0,
                     state_indices=None, device=None):
    """Random inputs for one step: (hidden, query_start_loc, state_indices,
    num_accepted_tokens), drawn on CPU (the same values on every device).
    `window_lens` are the per-request window lengths (1..T); state indices
    default to distinct random valid blocks (so the batch must be < N);
    accepted counts are random in 1..L."""
    gen = torch.Generator().manual_seed(seed)
    device = model.A_log.device if device is None else device
    lens = torch.tensor(list(window_lens), dtype=torch.int64)
    batch = lens.numel()
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[1:] = lens.cumsum(0).to(torch.int32)
    num_tokens = int(lens.sum())
    hidden = torch.randn(num_tokens, model.hidden_size, generator=gen).to(model.dtype)
    if state_indices is None:
        if batch > model.num_blocks - 1:
            raise ValueError(f"{batch} requests need distinct blocks; the model has "
                             f"{model.num_blocks - 1} usable (raise num_blocks)")
        state_indices = (torch.randperm(model.num_blocks - 1, generator=gen) + 1)[:batch]
    state_indices = torch.as_tensor(state_indices, dtype=torch.int32)
    accepted = (torch.rand(batch, generator=gen) * lens).floor().to(torch.int32) + 1
    accepted = torch.minimum(accepted, lens.to(torch.int32).clamp(min=1))
    return tuple(t.to(device) for t in (hidden, qsl, state_indices, accepted))


__all__ = ["KDACaches", "DeferredKDACaches", "KDADecodeStep", "cache_tensors", "make_step_inputs"]
