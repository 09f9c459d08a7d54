"""Fast screen of INT2 key-treatment candidates on the offline models: token perplexity after a quantized history.

Per document: one exact prefill of the first `--prefix` tokens (shared by all methods); each method's cache is filled
from it by its own `update` (as the prefill forward would), then the next `--score` tokens are fed through the cache
in chunks of the residual length (128), so every scored token sees the quantized history plus 1-128 exact recent
tokens, as in decoding. Reported: the token perplexity change vs the exact (bf16) cache, paired per document, with
its standard error over documents. Resumable: results go to benchmarks/results/ per
(model, method, document), in screen_<model>.json.

    python benchmarks/screen_methods.py --models smollm2-135m --docs 8
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache
from transformers.modeling_utils import AttentionInterface

from oscar_hf import OscarCache, OscarConfig, OscarLayer
from oscar_hf.offline_models import load_model
from oscar_hf.reference import fake_quantize_keys, key_rotation_choice

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DTYPE = torch.float32  # bf16 matmuls are several times slower on this CPU (no AVX512-BF16)
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m", "qwen2.5-1.5b"]
# Candidates by OscarConfig options. Screened earlier and dropped (their rows stay in the JSON records): key-rotation
# choices weighting the error by the key channels' energy E[k^2] ("auto-energy", always rotated on Gemma 3), mean^2
# ("auto-mean2"), variance ("auto-var"), or unweighted ("auto-frob"); block-diagonal Hadamard rotations of 16 and 32
# channels ("block16", "block32"); and "auto-white" = today's method="oscar", "auto-both" (rotate only if both the
# energy and the variance weighting agree; it chose as auto-white). Code of those variants: commit 9242c06.
CANDIDATES: dict[str, dict | None] = {
    "bf16": None,
    "paper": {"method": "paper"},
    "kivi": {"rotation": False, "token_scaling": False},
    "scaling-only": {"rotation": False},
    "oscar": {},
}
# Per-head key-rotation choices from the prompt's own queries (method="oscar" storage, the choice made here): keep the
# round trip with the smaller attention-logit error sum_i sum_t (q_i . (e_t - mean_t e_t))^2, e = k^ - k, over the
# prompt's queries i of each KV head's query group and its quantized keys t; "q-all" uses every prompt query,
# "q-last128" the last 128 (the ones nearest to decoding).
QUERY_RULES: dict[str, int | None] = {"q-all": None, "q-last128": 128}
RESIDUAL = 128  # the cache's residual length: the prefill quantizes its first (S - 1) // 128 * 128 tokens


@contextlib.contextmanager
def query_moments(moments: dict, last: list[int | None]):
    """While active, every sdpa attention call stores, under its layer index, the second moments of its queries per
    KV head, sum over the group's query heads and the prompt's positions of q q^T, `[B, Hkv, D, D]` float64: one
    per entry of `last` (all positions for None, else the last n)."""
    original = AttentionInterface._global_mapping["sdpa"]

    def capturing(module, query, key, *args, **kwargs):
        batch, heads, length, dim = query.shape
        q = query.double().view(batch, key.shape[1], heads // key.shape[1], length, dim)
        moments[module.layer_idx] = [
            torch.einsum("bhgsd,bhgse->bhde", q[..., -(n or length) :, :], q[..., -(n or length) :, :]) for n in last
        ]
        return original(module, query, key, *args, **kwargs)

    AttentionInterface.register("sdpa", capturing)
    try:
        yield
    finally:
        AttentionInterface.register("sdpa", original)


def query_rule_choice(keys: torch.Tensor, moment: torch.Tensor, config: OscarConfig) -> torch.Tensor:
    """`[B, Hkv]` bool: rotate where that gives the smaller centred logit error tr(E_c^T E_c M) with the queries'
    second moment M (the same as summing (q_i . e_t)^2 over queries and keys, with e centred over the keys)."""
    k = keys.double()
    costs = []
    for rotated in (True, False):
        error = fake_quantize_keys(k, rotated, config) - k
        error = error - error.mean(-2, keepdim=True)  # a shift of all of a query's logits leaves softmax unchanged
        costs.append((error.transpose(-1, -2) @ error * moment).sum((-2, -1)))
    return costs[0] < costs[1]


@torch.no_grad()
def score(
    model,
    exact: DynamicCache,
    tokens: list[int],
    prefix: int,
    options: dict | None,
    chunk: int,
    key_rotated: dict[int, torch.Tensor] | None = None,
) -> float:
    """Summed log-likelihood of tokens[prefix + 1:] given everything before, through a cache of `options`;
    `key_rotated` fixes the per-head key rotation of each OScaR layer (method="oscar") in place of its own rule."""
    if options is None:
        cache = copy.deepcopy(exact)
    else:
        cache = OscarCache(model.config, OscarConfig(**options))
        for idx, (layer, prefilled) in enumerate(zip(cache.layers, exact.layers, strict=True)):
            if type(layer) is type(prefilled):
                cache.layers[idx] = copy.deepcopy(prefilled)
            else:
                if key_rotated is not None:
                    layer.key_rotated = key_rotated[idx]  # a layer with a choice keeps it (OscarLayer._quantize)
                cache.update(prefilled.keys, prefilled.values, idx)
    total = 0.0
    for start in range(prefix, len(tokens) - 1, chunk):
        inputs = tokens[start : min(start + chunk, len(tokens) - 1)]
        logits = model(torch.tensor([inputs]), past_key_values=cache).logits[0]
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(inputs)])
        total += float(F.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).sum())
    return total


def rotated_fraction(cache_layers, choices: dict[int, torch.Tensor]) -> float:
    chosen = [choices[i].float().mean().item() for i, layer in enumerate(cache_layers) if isinstance(layer, OscarLayer)]
    return sum(chosen) / len(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--methods", nargs="+", default=list(CANDIDATES) + list(QUERY_RULES))
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=1536)
    parser.add_argument("--score", type=int, default=256)
    parser.add_argument("--data", default="pg_ppl_2k")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    results = {}
    rows = [json.loads(x) for x in (ROOT / "eval_configs" / "data" / f"{args.data}.jsonl").read_text().splitlines()]
    for name in args.models:
        out = RESULTS / f"screen_{name}.json"
        done = results[name] = json.loads(out.read_text()) if out.exists() else {}
        todo = [(d, m) for d in range(args.docs) for m in args.methods if str(d) not in done.get(m, {})]
        if not todo:
            continue
        model, tokenizer = load_model(name, dtype=DTYPE)
        if model.config.get_text_config()._attn_implementation != "sdpa":
            raise ValueError("screen_methods.py reads the prompt's queries through the sdpa attention entry")
        current, exact = None, None
        quantized = (args.prefix - 1) // RESIDUAL * RESIDUAL
        layers = OscarCache(model.config, OscarConfig()).layers
        for d, m in tqdm(todo, desc=name):
            tokens = tokenizer(rows[d]["text"])["input_ids"][: args.prefix + args.score + 1]
            if current != d:
                exact, moments = DynamicCache(config=model.config), {}
                with query_moments(moments, list(QUERY_RULES.values())):
                    model(torch.tensor([tokens[: args.prefix]]), past_key_values=exact)
                current = d
                choices = {  # the key-only rule (method="oscar"), to compare how many heads each rule rotates
                    i: key_rotation_choice(exact.layers[i].keys[:, :, :quantized], OscarConfig(method="oscar"))
                    for i, layer in enumerate(layers)
                    if isinstance(layer, OscarLayer)
                }
                done.setdefault("_rotated", {}).setdefault("oscar", {})[str(d)] = rotated_fraction(layers, choices)
            if m in QUERY_RULES:
                which = list(QUERY_RULES).index(m)
                config = OscarConfig(method="oscar")
                choices = {
                    i: query_rule_choice(exact.layers[i].keys[:, :, :quantized], moments[i][which], config)
                    for i, layer in enumerate(layers)
                    if isinstance(layer, OscarLayer)
                }
                done.setdefault("_rotated", {}).setdefault(m, {})[str(d)] = rotated_fraction(layers, choices)
                done.setdefault(m, {})[str(d)] = score(
                    model, exact, tokens, args.prefix, {"method": "oscar"}, 128, choices
                )
            else:
                done.setdefault(m, {})[str(d)] = score(model, exact, tokens, args.prefix, CANDIDATES[m], 128)
            out.write_text(json.dumps(done, indent=1) + "\n")
        del model
    for name in args.models:
        base = results[name]["bf16"]
        print(f"\n{name} (token ppl change vs bf16, mean over docs +- SE, {args.score} tokens after {args.prefix})")
        for m in args.methods:
            docs = sorted(set(results[name].get(m, {})) & set(base), key=int)
            deltas = [(results[name][m][d] - base[d]) / -args.score for d in docs]  # mean NLL increase per token
            if len(docs) > 1:
                mean, se = statistics.mean(deltas), statistics.stdev(deltas) / math.sqrt(len(docs))
                rotated = results[name].get("_rotated", {}).get(m, {}).values()
                share = f", heads rotated {statistics.mean(rotated):.2f}" if rotated else ""
                print(f"  {m:14s} {100 * math.expm1(mean):+7.2f}% +- {100 * se:.2f}  (n={len(docs)}){share}")


if __name__ == "__main__":
    main()
