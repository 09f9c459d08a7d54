"""Perplexity after a long prompt: what a user's cache scores once a long prompt is prefilled (issue 66).

For each document: its first `--prompt` tokens are prefilled in one call, the cache chooses its widths as `generate`
does after its prefill (`OscarCache.choose_bits()`; other caches do nothing), then the next `--scored` tokens are read
in `--chunk`-token chunks, each attending to what the cache holds; the perplexity of the tokens those chunks predict
(`ids[prompt + 1 : prompt + scored + 1]`) is compared with a DynamicCache run through the same calls ("bf16": the
model's dtype, float32 here). The documents are the suite's own perplexity texts: the 4k `pg_ppl` documents of
eval_configs/build_data.py (Paul Graham's essays, `perplexity_docs`), the first `--docs` of them.

Every row: the method, its stored bits per K/V element (`stored_bits`: `avg_bits`, or an OscarCache's measured
`average_bits()` after its choice, mean over documents), its effective bits (everything its cache holds per K/V element
of a full-attention layer in a 16-bit model, exact tokens included: `effective_avg_bits`) at the record's context
(prompt + scored tokens) and at 4K, the perplexity and its change against bf16 in percent, and the standard error of
that change over the 64-token chunks (`se_pct`: the paired per-chunk NLL differences, chunks of all documents as
units; chunks of one document are not independent, so it is a floor), and the change per document (`doc_change_pct`).

    python benchmarks/long_prompt_ppl.py --models smollm2-135m --docs 4
    python benchmarks/long_prompt_ppl.py --models gemma-3-270m --methods bf16 oscar-auto-3.2-sinks4 oscar-k4v2

Rows go to benchmarks/results/long_prompt_<model>.json (runs layout, `records.start_run`; `RECORD`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import sys
import time
from pathlib import Path

import records
import torch
import torch.nn.functional as F
from tqdm import tqdm

from oscar_hf import OscarCache, OscarConfig, OscarLayer, cache_kwargs
from oscar_hf.cache import layer_bits
from oscar_hf.integrations.lm_eval import avg_bits, effective_avg_bits, kv_heads_and_dim, make_cache
from oscar_hf.methods import METHODS
from oscar_hf.offline_models import load_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Each model's record (`str.format` of the model's name); three_bit_probe.py keeps its rows apart, since its methods are
# no names of `METHODS` outside it (run_accuracy.py tabulates this file's latest runs).
RECORD = "long_prompt_{}.json"
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m", "qwen2.5-1.5b"]
# The default; the fixed configs a budget of about its bits or of 4.1 bits could choose, with and without sinks; the
# budgets 3.6, 3.9 (4.1 effective bits at 4K with its sinks) and 4.1; the peers at about those bits (KIVI as our cache
# without rotation and token scaling, and as transformers' QuantizedCache; tiny-turboquant's two presets).
DEFAULT_METHODS = [
    "bf16",
    "oscar-auto-3.2-sinks4",
    "oscar-int2-sinks4",
    "oscar-int2",
    "oscar-k4v2",
    "oscar-auto-3.6",
    "oscar-auto-3.9-sinks4",
    "oscar-auto-4.1-sinks4",
    "oscar-int4",
    "kivi-int2",
    "hf-quanto-int2",
    "hf-quanto-int4",
    "tiny-turboquant-k3v2",
    "tiny-turboquant-k4v4",
]
EFFECTIVE_CONTEXT = 4096  # the context of the plot's x axis (accuracy.png)


def build_data():
    """eval_configs/build_data.py as a module (eval_configs is no package)."""
    spec = importlib.util.spec_from_file_location("build_data", ROOT / "eval_configs" / "build_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def documents(tokenizer, count: int, tokens: int) -> list[torch.Tensor]:
    """The first `tokens` tokens (`[1, tokens]`) of each of the first `count` 4k perplexity documents of the suite."""
    data = build_data()
    texts = [row["text"] for row in data.perplexity_docs(data.load_essays(), data.LENGTHS["4k"], count)]
    ids = [tokenizer(text, return_tensors="pt").input_ids[:, :tokens] for text in texts]
    short = [i for i, doc in enumerate(ids) if doc.shape[1] < tokens]
    if short:
        raise ValueError(f"documents {short} have fewer than {tokens} tokens: lower --prompt or --scored.")
    return ids


@torch.no_grad()
def continuation_nll(
    model, ids: torch.Tensor, cache, prompt: int, chunk: int, before_choice: int | None = None
) -> torch.Tensor:
    """The NLL `[N]` of each token of `ids[:, prompt + 1:]`: `ids[:, :prompt]` prefilled into `cache` in one call,
    `cache.choose_bits()` where the cache has it (an OscarCache: what generate does after its prefill), then the
    rest but the last token read `chunk` tokens at a time, each position predicting the next token.
    `before_choice` (the `@direct` rows): the prompt's first tokens, fed before the choice, the rest of the prompt
    after it in one call, so that the prompt is quantized at the chosen widths directly (no 4-bit round trip; the
    first tokens must stay exact: fewer than one window after the sinks)."""
    split = prompt if before_choice is None else before_choice
    model(ids[:, :split], **cache_kwargs(cache), logits_to_keep=1)
    if isinstance(cache, OscarCache):
        cache.choose_bits()
    if split < prompt:
        model(ids[:, split:prompt], **cache_kwargs(cache), logits_to_keep=1)
    nll = []
    for start in range(prompt, ids.shape[1] - 1, chunk):
        end = min(start + chunk, ids.shape[1] - 1)
        logits = model(ids[:, start:end], **cache_kwargs(cache)).logits[0].float()
        nll.append(F.cross_entropy(logits, ids[0, start + 1 : end + 1], reduction="none"))
    return torch.cat(nll)


@contextlib.contextmanager
def pinned_widths(widths: list[tuple[int, int]] | None):
    """While active, bits="auto" chooses `widths` (one (key_bits, value_bits) per OScaR layer) whatever its costs
    (this script's own diagnosis: the 4-bit prompt's requantization, or a choice, at widths given); None: as it
    chooses."""
    if widths is None:
        yield
        return
    original = layer_bits.choose_layer_bits
    layer_bits.choose_layer_bits = lambda *args: widths
    try:
        yield
    finally:
        layer_bits.choose_layer_bits = original


def chosen_widths(cache: OscarCache) -> list[tuple[int, int]]:
    """Each OScaR layer's (key_bits, value_bits)."""
    return [(layer.config.key_bits, layer.config.value_bits) for layer in cache.layers if isinstance(layer, OscarLayer)]


def parse_widths(name: str) -> tuple[int, int]:
    """A diagnosis row's widths: `K4V2` is (4, 2)."""
    key_bits, value_bits = (int(x) for x in name.removeprefix("K").split("V"))
    return key_bits, value_bits


def document_nll(model, method: str, ids: torch.Tensor, prompt: int, chunk: int):
    """One document through `method`'s cache (`continuation_nll`). A diagnosis row names a bits="auto" method and a
    suffix: `@K2V2`, `@K4V2`, ...: every layer at those widths, through the 4-bit prompt and its requantization as the
    method runs (`@K2V2/9=K4V2`: but OScaR layer 9 at K4V2, the per-layer sweep of docs/accuracy.md); `@direct`: the
    widths the method chooses for this prompt (from one prefill and `choose_bits`), the prompt quantized at them
    directly."""
    name, _, variant = method.partition("@")
    options = METHODS[name][1]
    widths = None
    if variant:
        if not OscarConfig(**options).auto_bits:
            raise ValueError(f"{method}: a diagnosis row (@...) is for a bits='auto' method, not {name!r}.")
        probe = make_cache(name, options, model.config)
        if variant == "direct":
            model(ids[:, :prompt], **cache_kwargs(probe), logits_to_keep=1)
            probe.choose_bits()
            widths = chosen_widths(probe)
        else:  # "K2V2": every layer; "K2V2/9=K4V2": every layer but the 10th OScaR layer, at K4V2
            every, *exceptions = variant.split("/")
            widths = [parse_widths(every)] * sum(isinstance(layer, OscarLayer) for layer in probe.layers)
            for exception in exceptions:
                layer, _, chosen = exception.partition("=")
                widths[int(layer)] = parse_widths(chosen)
    cache = make_cache(name, options, model.config)
    before = chunk if variant == "direct" else None
    with pinned_widths(widths):
        return continuation_nll(model, ids, cache, prompt, chunk, before), cache


def compare(nll: list[torch.Tensor], reference: list[torch.Tensor], chunk: int) -> dict:
    """A method's perplexity over all documents' scored tokens (`nll`, one tensor per document), its change against
    `reference`'s in percent, the standard error of that change over chunks (the mean NLL difference of each
    `chunk`-token chunk of each document a unit; first order: d(ppl ratio) = ratio x d(mean NLL)), and the change per
    document."""
    tokens, base = torch.cat(nll).double(), torch.cat(reference).double()
    ratio = math.exp((tokens.mean() - base.mean()).item())
    units = torch.stack([d.mean() for a, b in zip(nll, reference) for d in (a.double() - b.double()).split(chunk)])
    se = units.std().item() / math.sqrt(len(units)) if len(units) > 1 else 0.0
    return {
        "ppl": math.exp(tokens.mean().item()),
        "ppl_change_pct": 100 * (ratio - 1),
        "se_pct": 100 * ratio * se,
        "chunks": len(units),
        "doc_change_pct": [100 * math.expm1((a.double() - b.double()).mean().item()) for a, b in zip(nll, reference)],
    }


def widths(cache: OscarCache) -> list[str]:
    """Each OScaR layer's widths ("K4V2")."""
    return [f"K{key_bits}V{value_bits}" for key_bits, value_bits in chosen_widths(cache)]


def measure(model, methods: list[str], docs: list[torch.Tensor], prompt: int, chunk: int) -> dict[str, dict]:
    """Each method's row: `compare` against "bf16" (a DynamicCache through the same calls), its stored bits (an
    OscarCache's own, mean over documents), its effective bits at the documents' length and at 4K, each document's
    layer widths (an OscarCache) and the seconds it took."""
    heads, dim = kv_heads_and_dim(model.config)
    context = docs[0].shape[1] - 1  # the tokens a cache holds after the last chunk
    nll, rows = {}, {}
    for method in methods:
        start, name = time.perf_counter(), method.partition("@")[0]
        options = METHODS[name][1]
        nll[method], bits, layer_widths = [], [], []
        for ids in tqdm(docs, desc=method, leave=False):
            doc_nll, cache = document_nll(model, method, ids, prompt, chunk)
            nll[method].append(doc_nll)
            if isinstance(cache, OscarCache):
                bits.append(cache.average_bits())
                layer_widths.append(widths(cache))
        stored = sum(bits) / len(bits) if bits else avg_bits(name, options, dim, heads)
        rows[method] = {
            "method": method,
            "stored_bits": stored,
            "effective_bits": effective_avg_bits(name, options, dim, heads, context, stored),
            f"effective_bits_{EFFECTIVE_CONTEXT // 1024}k": effective_avg_bits(
                name, options, dim, heads, EFFECTIVE_CONTEXT, stored
            ),
            "widths": layer_widths or None,
            "seconds": round(time.perf_counter() - start, 1),
        }
    for method, row in rows.items():
        row.update(compare(nll[method], nll["bf16"], chunk))
    return rows


def runs_on(method: str, model_config) -> bool:
    """transformers' QuantizedCache refuses models with sliding-window layers (Gemma 3)."""
    sliding = "sliding_attention" in (getattr(model_config.get_text_config(), "layer_types", None) or [])
    return not (sliding and METHODS[method.partition("@")[0]][0] == "quantized")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS[:3], choices=MODELS)
    parser.add_argument(
        "--methods", nargs="+", default=DEFAULT_METHODS, help="names of oscar_hf.methods.METHODS; diagnosis rows: "
        "a bits='auto' method with @direct (its widths, no 4-bit round trip) or @K2V2, @K4V2, ... (widths pinned; "
        "@K2V2/9=K4V2: one layer apart)",
    )  # fmt: skip
    parser.add_argument("--docs", type=int, default=4, help="documents (the first of the suite's 4k texts)")
    parser.add_argument("--prompt", type=int, default=1536, help="tokens prefilled in one call")
    parser.add_argument("--scored", type=int, default=1536, help="tokens scored after the prompt")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the machine may be shared)")
    args = parser.parse_args()
    records.commit()  # read now: the rows name the commit the run started from
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    unknown = [m for m in args.methods if m.partition("@")[0] not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}: use names of oscar_hf.methods.METHODS, e.g. {DEFAULT_METHODS[1]}")
    methods = ["bf16"] + [m for m in args.methods if m != "bf16"]  # the reference first
    for name in args.models:  # one after another: each is CPU-bound
        model, tokenizer = load_model(name, dtype=torch.float32)
        docs = documents(tokenizer, args.docs, args.prompt + args.scored + 1)
        ran = [m for m in methods if runs_on(m, model.config)]
        start = time.perf_counter()
        rows = measure(model, ran, docs, args.prompt, args.chunk)
        header = records.header("perplexity after a long prompt", "cpu")
        path = RESULTS / RECORD.format(name)
        record = records.start_run(
            path, header, model=name, dtype="float32", machine=records.machine(), docs=len(docs), prompt=args.prompt,
            scored=args.scored, chunk=args.chunk, seconds=round(time.perf_counter() - start, 1),
        )  # fmt: skip
        record["rows"] += [{"run": header["run"], **row} for row in rows.values()]
        records.write_record(path, record)
        for row in rows.values():
            print(
                f"{name} {row['method']}: {row['stored_bits']:.3f} stored / {row['effective_bits']:.3f} effective "
                f"bits, ppl {row['ppl']:.4f} ({row['ppl_change_pct']:+.2f} ± {row['se_pct']:.2f} %), "
                f"{row['seconds']} s",
                file=sys.stderr,
            )


if __name__ == "__main__":
    main()
