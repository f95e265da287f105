"""Benchmark: greedy generation of a Kimi Linear model in transformers, plain,
with transformers' own prompt-lookup decoding, and with prompt lookup through
`KDACache`; tokens per second, acceptance and speculative state bytes.

    python -m kda_ops.transformers.bench [--layers 20] [--kda-every 5] [--heads 16]
                                         [--hidden 2048] [--draft 4] [--new-tokens 256]
                                         [--json out.json]
    python -m kda_ops.transformers.bench --table out.json

The model has random weights (bf16, hidden 2048, KDA heads of K = V = 128,
every `--kda-every`-th layer full attention, mixers' and MLPs' outputs scaled
down),
except its output head: each token's row is the embedding of the token that
precedes it in the prompt's repeating pattern, so that the greedy text goes on
repeating the pattern, which prompt lookup drafts right: the acceptance of
repetitive text. Each mode generates `--new-tokens` tokens from the
same prompt `--repeats` times after a warm-up; the row is the median
throughput (prefill included, CUDA synchronised). Acceptance is tokens per
target forward. Speculative state is what each cache holds per KDA layer and
sequence for rolling back a window, at its largest after a verification
forward (the prompt's forward excluded): transformers' recorded states and
grown convolution state, or kda_ops' records and extra convolution columns.
"""

import argparse
import json
import statistics
import time

import torch

from .._cli import exit_unless_cuda_runs, positive_int
from .cache import KDACache

MODES = ("plain", "transformers_lookup", "kda_ops_lookup")


def random_kimi_linear(opts, device, pattern):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
    layer_types = ["full_attention" if (i + 1) % opts.kda_every == 0 else "linear_attention"
                   for i in range(opts.layers)]
    config = KimiLinearConfig(
        vocab_size=opts.vocab, hidden_size=opts.hidden, intermediate_size=2 * opts.hidden,
        num_hidden_layers=opts.layers, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, layer_types=layer_types, mlp_layer_types=["dense"] * opts.layers,
        linear_head_dim=128, linear_num_heads=opts.heads, linear_conv_kernel_dim=4,
        pad_token_id=0, bos_token_id=1, eos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = KimiLinearForCausalLM(config)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays near the token's embedding
            layer.self_attn.o_proj.weight.mul_(opts.mixer_scale)
            layer.mlp.down_proj.weight.mul_(opts.mixer_scale)
        # Next token = the pattern's successor of the current one (others: itself).
        successor = torch.arange(opts.vocab, device=device)
        successor[pattern] = pattern.roll(-1)
        model.lm_head.weight.copy_(model.model.embed_tokens.weight[successor.argsort()])
    return model


def state_bytes(cache, layer_idx):
    """Bytes a cache holds for one KDA layer and sequence beyond its checkpoint
    and W-1 convolution inputs: what it keeps to roll a window back."""
    if isinstance(cache, KDACache):
        b = cache._buffers
        slot = cache._slots[layer_idx]
        history = cache._shape.conv_width - 1
        records = b["correction"][slot, 1] .nbytes + b["key_gate"][slot, 1].nbytes
        conv = b["conv_state"][slot, 1, :, history:]
        return records + conv.nbytes
    layer = cache.layers[layer_idx]
    recorded = sum(t[0].nbytes for t in layer.recurrent_states_history.get(0, []))
    conv = layer.conv_states[0]
    extra_columns = max(conv.shape[-1] - layer.conv_kernel_size[0], 0)
    return recorded + conv[0].nbytes * extra_columns // conv.shape[-1]


def generate(model, ids, mode, new_tokens, draft):
    from transformers import DynamicCache
    cache = KDACache(model) if mode == "kda_ops_lookup" else DynamicCache(config=model.config)
    forwards = []
    handle = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    peak = []
    if mode != "plain":
        # The speculative state at its largest: right after each verification
        # forward (every forward but the prompt's).
        hook = model.register_forward_hook(lambda *args: peak.append(state_bytes(
            cache, model.config.layer_types.index("linear_attention"))) if len(forwards) > 1
            else None)
    options = {} if mode == "plain" else dict(prompt_lookup_num_tokens=draft)
    synchronize = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache=cache,
                         **options)
    synchronize()
    seconds = time.perf_counter() - start
    handle.remove()
    if mode != "plain":
        hook.remove()
    return out, seconds, len(forwards), max(peak, default=0)


def run(opts):
    device = torch.device("cuda")
    pattern = (torch.randperm(opts.vocab - 2, generator=torch.Generator().manual_seed(0))
               [:opts.prompt // 4] + 2).to(device)
    model = random_kimi_linear(opts, device, pattern)
    ids = pattern.repeat(1, 4)
    rows, reference = [], None
    for mode in MODES:
        generate(model, ids, mode, min(opts.new_tokens, 32), opts.draft)  # warm-up
        runs = [generate(model, ids, mode, opts.new_tokens, opts.draft)
                for _ in range(opts.repeats)]
        out, _, forwards, peak = runs[0]
        reference = out if reference is None else reference
        new = out.shape[1] - ids.shape[1]
        rows.append(dict(
            mode=mode, tokens_per_s=statistics.median(new / seconds for _, seconds, _, _ in runs),
            acceptance=new / forwards, speculative_state_bytes=peak,
            same_tokens_as_plain=bool(torch.equal(out, reference))))
        print(f"{mode}: {rows[-1]}", flush=True)
    return rows


def markdown_table(saved):
    meta = saved["meta"]
    lines = [f"{meta['gpu']}, torch {meta['torch']}, transformers {meta['transformers']}, "
             f"{meta['date']}: {meta['model']}", "",
             "| mode | tokens/s | tokens per forward | speculative state per KDA layer "
             "and sequence | same tokens as plain |", "|---|---|---|---|---|"]
    for row in saved["rows"]:
        state = (f"{row['speculative_state_bytes'] / 1024:.0f} KiB"
                 if row["mode"] != "plain" else "-")
        lines.append(f"| {row['mode']} | {row['tokens_per_s']:.1f} | {row['acceptance']:.2f} | "
                     f"{state} | {'yes' if row['same_tokens_as_plain'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m kda_ops.transformers.bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=positive_int, default=20)
    parser.add_argument("--kda-every", type=positive_int, default=5,
                        help="every this-many-th layer is full attention (default: %(default)s)")
    parser.add_argument("--heads", type=positive_int, default=16, help="KDA heads")
    parser.add_argument("--hidden", type=positive_int, default=2048)
    parser.add_argument("--vocab", type=positive_int, default=32000)
    parser.add_argument("--mixer-scale", type=float, default=0.05,
                        help="scales every mixer's and MLP's output projection (default: %(default)s)")
    parser.add_argument("--prompt", type=positive_int, default=64)
    parser.add_argument("--draft", type=positive_int, default=4,
                        help="prompt_lookup_num_tokens (default: %(default)s)")
    parser.add_argument("--new-tokens", type=positive_int, default=256)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", default="bench_transformers.json")
    parser.add_argument("--table", type=str, metavar="JSON",
                        help="print a saved run as a markdown table and exit")
    opts = parser.parse_args(argv)
    if opts.table:
        with open(opts.table) as f:
            print(markdown_table(json.load(f)))
        return
    exit_unless_cuda_runs(parser.prog, "timing generation", "--table prints a saved run")
    import transformers
    rows = run(opts)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                transformers=transformers.__version__, date=time.strftime("%Y-%m-%d"),
                model=f"{opts.layers} layers ({opts.layers - opts.layers // opts.kda_every} "
                      f"KDA, H = {opts.heads}, K = V = 128), hidden {opts.hidden}, bf16 "
                      f"activations, fp32 state; prompt {opts.prompt}, "
                      f"{opts.new_tokens} new tokens, {opts.draft} draft tokens")
    saved = dict(meta=meta, rows=rows, options=vars(opts))
    with open(opts.json, "w") as f:
        json.dump(saved, f, indent=1)
    print(markdown_table(saved))


if __name__ == "__main__":
    main()
