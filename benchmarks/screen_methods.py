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
import copy
import json
import math
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig, cache_kwargs
from oscar_hf.integrations.fused_attention import recording_query_moments
from oscar_hf.offline_models import load_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DTYPE = torch.float32  # bf16 matmuls are several times slower on this CPU (no AVX512-BF16)
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m", "qwen2.5-1.5b"]
# Candidates by OscarConfig options. Screened earlier and dropped (their rows stay in the JSON records): key-rotation
# choices weighting the key error by the key channels' energy E[k^2] ("auto-energy", always rotated on Gemma 3), mean^2
# ("auto-mean2"), variance ("auto-var"; "auto-white" = "key-only": 1 / Var_t(k_c), the rule method="oscar" had before
# the query rule, which rotated no head of these models), or unweighted ("auto-frob"); "auto-both" (energy and
# variance agreeing); block-diagonal Hadamard rotations of 16 and 32 channels ("block16", "block32"); code: commit
# 9242c06. The query rule as first screened, outside the cache: "q-all" (every prompt query; = "oscar" now) and
# "q-last128" (the last 128 prompt queries, the same within noise); code: commit 445ab61.
CANDIDATES: dict[str, dict | None] = {
    "bf16": None,
    "paper": {"method": "paper"},
    "kivi": {"rotation": False, "token_scaling": False},
    "scaling-only": {"rotation": False},
    "oscar": {"method": "oscar"},
}


@torch.no_grad()
def score(
    model, exact: DynamicCache, moments: dict, tokens: list[int], prefix: int, options: dict | None, chunk: int
) -> tuple[float, float | None]:
    """Summed log-likelihood of tokens[prefix + 1:] given everything before, through a cache of `options` filled from
    the exact prefill (its K/V, and for method="oscar" the second moments of its queries, as its attention would hand
    them over); and the share of KV heads whose keys that cache rotates (method="oscar", else None)."""
    if options is None:
        cache = copy.deepcopy(exact)
    else:
        cache = OscarCache(model.config, OscarConfig(bits=2, sink_tokens=0, **options))  # the INT2 screen
        for idx, (layer, prefilled) in enumerate(zip(cache.layers, exact.layers, strict=True)):
            if type(layer) is type(prefilled):
                cache.layers[idx] = copy.deepcopy(prefilled)
            else:
                cache.update(prefilled.keys, prefilled.values, idx)
                layer.observe_query_moment(moments[idx])
    chosen = [
        layer.key_rotated.float().mean().item()
        for layer in cache.layers
        if getattr(layer, "key_rotated", None) is not None
    ]
    total = 0.0
    for start in range(prefix, len(tokens) - 1, chunk):
        inputs = tokens[start : min(start + chunk, len(tokens) - 1)]
        logits = model(torch.tensor([inputs]), **cache_kwargs(cache)).logits[0]
        targets = torch.tensor(tokens[start + 1 : start + 1 + len(inputs)])
        total += float(F.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).sum())
    return total, (sum(chosen) / len(chosen) if chosen else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--methods", nargs="+", default=list(CANDIDATES))
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
        current, exact = None, None
        for d, m in tqdm(todo, desc=name):
            tokens = tokenizer(rows[d]["text"])["input_ids"][: args.prefix + args.score + 1]
            if current != d:
                exact, moments = DynamicCache(config=model.config), {}
                with recording_query_moments(moments):
                    model(torch.tensor([tokens[: args.prefix]]), **cache_kwargs(exact))
                current = d
            done.setdefault(m, {})[str(d)], rotated = score(
                model, exact, moments, tokens, args.prefix, CANDIDATES[m], 128
            )
            if rotated is not None:
                done.setdefault("_rotated", {}).setdefault(m, {})[str(d)] = rotated
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
