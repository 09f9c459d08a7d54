"""Serving throughput: the largest batch each cache holds at a context, and its decode tokens/s and time to first token.

    python benchmarks/bench_throughput.py --contexts 32768                # Llama-3.1-8B shape, 3 caches, one context
    python benchmarks/bench_throughput.py --contexts 131072 --max-batch 32
    python benchmarks/bench_throughput.py --model gemma-3-4b --contexts 32768 131072 --budget-s 500

Caches (`--caches`): `static-compiled` (bf16 StaticCache, generate's automatic compile, chunked prefill),
`dynamic` (bf16 DynamicCache, eager, unchunked: the plain HF baseline), `oscar-compiled` (OScaR, automatic compile,
chunked prefill); chunks of `--prefill-chunk-size` tokens (generate's `prefill_chunk_size`). Same models and timing as
bench_generate.py (random bf16 weights, a streamer synchronising per token, step = median of the second half).

Finding the largest batch: a full doubling/bisection search would prefill hundreds of long prompts (an OScaR batch of
~60 at 32K alone takes minutes), so the search measures instead of guessing. Two probes (B=1 and B=2: prefill + 2 decode
steps, eager, same chunking) give the peak memory's fixed part and its part per sequence (everything that grows with the
batch, cache and prefill transients alike, is linear in it); the predicted batch fills `--memory-fraction` of the GPU,
capped by `--max-batch`. The timed run at that batch is the check: if it runs out of memory, the next try steps down to
`BACKOFF` of it until one fits, then the search bisects between the largest batch known to fit and the smallest that
failed until they are adjacent (at most `--tries` timed runs). Run as a script, it sets
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True unless the caller set it (`ALLOCATOR` says why; the run records it).
`max_batch` is the largest batch that ran; `predicted_batch`, `capped` and `oom_batches` say how it was found (with
tries left over, the largest batch that fits lies below the smallest of `oom_batches`).

A cache that fails otherwise (e.g. a compile error) is recorded with its `error` and the run goes on; so is a job not
started because `--budget-s` seconds had passed: one invocation always leaves a record. Past that budget a search
starts no further timed run either (`out_of_time` in its row: the largest batch found so far, not proven largest);
a running generate is not interrupted, so leave a few minutes between the budget and any limit on the call.

Record: benchmarks/results/throughput_<gpu>.json, rewritten after every job, same layout as generate_<gpu>.json:
`runs: {run: {date, commit, device, versions, copy_bandwidth, weight_bytes, ...}}`, `rows: [{run, model, context,
cache, variant, compiled, prefill_chunk_size, max_batch, tokens_per_s, step_ms, prefill_s, peak_gib, cache_bytes,
roof_ms, roof_fraction, bf16_roof_ms, ...}]` (the byte roof of the step at `max_batch`, as bench_generate.py's),
`ratios: [{run, model, context, oscar, baseline, tokens_per_s_ratio, max_batch_ratio, prefill_ratio}]` (OScaR over
each baseline, one run only).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import bench_generate as bench  # models, generate options, timing
import records
import torch
from tqdm import tqdm

CACHES = ("static-compiled", "dynamic", "oscar-compiled")
CHUNKED = {"static-compiled", "oscar-compiled"}  # the plain DynamicCache baseline prefills the whole prompt at once
PROBE_TOKENS = 3  # prefill + 2 decode steps
# After a timed run at the predicted batch runs out of memory, and before any fits, the next try takes this fraction
# of it: what the eager probes do not show (compiled prefill and decode, CUDA graphs) is a few percent of the peak.
BACKOFF = 0.85
# The allocator setting the records run with (this script's own process only; a setting the caller made stands): at
# the largest batch the caching allocator's fragmentation, not the cache, decided the batch without it (H200, OScaR
# B=87 at 32K: a 9.5 GiB MLP activation refused with 24 GiB reserved but unallocated).
ALLOCATOR = "expandable_segments:True"


@dataclasses.dataclass
class Search:
    """How `largest_batch` found its batch."""

    predicted_batch: int | None = None
    capped: bool = False
    fixed_gib: float | None = None  # the memory model: peak = fixed + batch x per_sequence
    per_sequence_gib: float | None = None
    oom_batches: list[int] = dataclasses.field(default_factory=list)
    out_of_time: bool = False  # the search stopped early, `--budget-s` having passed


def largest_batch(
    probe: Callable[[int], dict],
    timed: Callable[[int], dict],
    capacity_gib: float | None,
    max_batch: int,
    tries: int,
    out_of_time: Callable[[], bool] = lambda: False,
) -> tuple[int, dict | None, Search]:
    """The largest batch (up to `max_batch`) whose `timed` run fits, and that run's result (None: even B=1 does not).

    `probe(b)` and `timed(b)` run a short and the measured generate at batch b (result: timed_generate's); both raise
    torch.OutOfMemoryError when b does not fit. Without a capacity (CPU) or a peak, the prediction is `max_batch`.
    A timed run after the first starts only while `out_of_time()` is False (one search can outlast a call's limit)."""
    search = Search()
    peaks = {}  # batch -> peak GiB of its probe
    try:
        for batch in (1, 2)[: min(max_batch, 2)]:
            peaks[batch] = probe(batch)["peak_gib"]
    except torch.OutOfMemoryError:
        search.oom_batches.append(len(peaks) + 1)
        if not peaks:
            return 0, None, search
    fits = max(peaks)
    guess = max_batch if fits == 2 else 1
    if capacity_gib is not None and len(peaks) == 2 and None not in peaks.values():
        search.per_sequence_gib = peaks[2] - peaks[1]
        search.fixed_gib = peaks[1] - search.per_sequence_gib
        if search.per_sequence_gib > 0:
            guess = min(max_batch, max(2, math.floor((capacity_gib - search.fixed_gib) / search.per_sequence_gib)))
    search.predicted_batch, search.capped = guess, guess == max_batch
    best, failed = None, None  # the largest timed run that fitted (batch, result); the smallest batch that did not
    for attempt in range(tries):
        if attempt and out_of_time():
            search.out_of_time = True
            break
        try:
            best = guess, timed(guess)
        except torch.OutOfMemoryError:  # the next timed run frees what this one left (timed_generate collects first)
            search.oom_batches.append(guess)
            if guess <= fits:
                break  # a batch that fitted in its probe failed timed: nothing is known to fit
            failed = guess
        low = best[0] if best else fits
        if failed is None or failed - low <= 1:
            break  # the prediction (or the cap) fitted, or the largest batch that fits is found
        if best is not None:  # bisect between the largest batch known to fit and the smallest that failed
            guess = (low + failed) // 2
        elif attempt == tries - 2:  # a last try with no timed run that fitted takes the batch known to fit
            guess = low
        else:  # a missed prediction is off by a few percent, not by half: step down from it
            guess = max(low, min(failed - 1, math.floor(BACKOFF * failed)))
    return (*best, search) if best else (0, None, search)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(bench.MODELS), default="llama-3.1-8b")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES))
    parser.add_argument("--prefill-chunk-size", type=int, default=4096)
    parser.add_argument("--max-batch", type=int, default=128, help="the largest batch tried (bounds the time)")
    parser.add_argument("--memory-fraction", type=float, default=0.9, help="of the GPU's memory the prediction fills")
    parser.add_argument("--tries", type=int, default=4, help="timed runs per job at most (bisecting after an OOM)")
    parser.add_argument("--new-tokens", type=int, default=16, help="of the timed run; at least 4")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds after which no job or timed run starts")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.new_tokens < 4:
        parser.error("--new-tokens must be at least 4")
    started = time.perf_counter()

    def out_of_time() -> bool:
        return time.perf_counter() - started > args.budget_s

    header = records.header("serving throughput at the largest batch that fits, random bf16 weights", args.device)
    run, bandwidth = header["run"], records.copy_bandwidth(args.device)  # before the model: an empty GPU
    model = bench.build_model(args.model, args.device)
    weights = records.weight_bytes(model)
    path = args.out / f"throughput_{records.gpu_slug(header['device'])}.json"
    capacity = None
    if model.device.type == "cuda":
        capacity = args.memory_fraction * torch.cuda.get_device_properties(model.device).total_memory / 2**30
    record = records.start_run(
        path,
        header,
        model=args.model,
        model_config=bench.MODELS[args.model][2],
        new_tokens=args.new_tokens,
        capacity_gib=capacity,
        allocator=os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        copy_bandwidth=bandwidth,
        weight_bytes=weights,
        argv=sys.argv[1:] if argv is None else argv,
    )
    blockers = bench.oscar_compile_blockers(model)
    tqdm.write(f"run {run}: {args.model} on {header['device']} -> {path}")

    rows = []
    jobs = [(context, name) for context in args.contexts for name in args.caches]
    for context, name in (bar := tqdm(jobs, desc="throughput", unit="job")):
        variant = bench.VARIANTS[name]
        chunk = args.prefill_chunk_size if name in CHUNKED else None
        compiled = variant.compiled and not (variant.cache == "oscar" and blockers)
        row = {
            "run": run,
            "model": args.model,
            "context": context,
            "variant": name,
            "cache": variant.cache,
            "compiled": compiled,
            "prefill_chunk_size": chunk,
            "max_batch": None,
            "tokens_per_s": None,
            "step_ms": None,
            "prefill_s": None,
            "peak_gib": None,
        }
        if variant.cache == "oscar" and blockers:
            row["compile_blockers"] = blockers  # generate decodes it eagerly: recorded as such
        bar.set_postfix_str(f"{name} {context}")
        if out_of_time():
            row["skipped"] = f"time budget: {args.budget_s:.0f} s had passed"
        else:
            probe_options = bench.generate_options(dataclasses.replace(variant, compiled=False), chunk)
            options = bench.generate_options(variant, chunk)

            label = f"{name} {context}"
            probe = functools.partial(_generate_at, model, f"{label} probe", context, PROBE_TOKENS, probe_options)
            timed = functools.partial(_generate_at, model, f"{label} timed", context, args.new_tokens, options)
            try:
                batch, result, search = largest_batch(probe, timed, capacity, args.max_batch, args.tries, out_of_time)
                row.update(dataclasses.asdict(search), max_batch=batch, oom=result is None)
                if result is not None:
                    row.update(result)
                    row.update(bench.roof(row, weights, bandwidth))
            except Exception as error:  # noqa: BLE001  (recorded: one call always leaves a record)
                row.update(bench.failure(error))
            bench.release(model.device)
        rows.append(row)
        record["rows"].append(row)
        record["ratios"] = [r for r in record["ratios"] if r["run"] != run] + bench.oscar_ratios(
            rows, ("model", "context"), RATIO_FIELDS
        )
        records.write_record(path, record)
        tqdm.write(f"{name} {context}: {summary(row)}")

    print(f"\nrun {run}, {args.model}, {header['device']} ({path})")
    print(
        f"{'context':>8s} {'variant':>16s} {'max B':>6s} {'tok/s':>8s} {'step ms':>8s} {'TTFT s':>7s} {'peak GiB':>9s} "
        f"{'roof ms':>8s} {'of roof':>7s} {'bf16 roof ms':>12s}"
    )
    for row in rows:
        print(f"{row['context']:8d} {row['variant']:>16s} {summary(row)}")
    for r in record["ratios"]:
        if r["run"] == run:
            print(
                f"{r['context']}: {r['oscar']} / {r['baseline']}: tokens/s {bench._x(r['tokens_per_s_ratio'])}, "
                f"max batch {bench._x(r['max_batch_ratio'])}, TTFT {bench._x(r['prefill_ratio'])}"
            )
    return path


def _generate_at(model, label: str, context: int, new_tokens: int, options: dict, batch: int) -> dict:
    tqdm.write(f"  {label} B={batch} ...")
    result = bench.timed_generate(model, batch, context, new_tokens, options)
    tqdm.write(
        f"    prefill {result['prefill_s']:.1f} s, peak {result['peak_gib']} GiB, step {result['step_ms']:.1f} ms"
    )
    return result


RATIO_FIELDS = {"tokens_per_s": "tokens_per_s_ratio", "max_batch": "max_batch_ratio", "prefill_s": "prefill_ratio"}


def summary(row: dict) -> str:
    if row["tokens_per_s"] is None:
        return row.get("error") or row.get("skipped") or f"out of memory at B={row.get('oom_batches')}"
    peak = f"{row['peak_gib']:9.1f}" if row["peak_gib"] is not None else f"{'-':>9s}"
    return (
        f"{row['max_batch']:6d} {row['tokens_per_s']:8.1f} {row['step_ms']:8.2f} {row['prefill_s']:7.2f} {peak} "
        f"{row['roof_ms']:8.2f} {100 * row['roof_fraction']:6.1f}% {row['bf16_roof_ms']:12.2f}"
        + (" (capped)" if row.get("capped") else "")
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR)  # read at CUDA's first use, which main() makes
    main()
