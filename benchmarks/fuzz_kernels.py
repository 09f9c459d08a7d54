"""Fuzz the fused decode-attention kernel against the float64 reference on the GPU.

    python benchmarks/fuzz_kernels.py [--cases 1000] [--minutes 8.5] [--workers 12] [--seed 0] [--out DIR]

Each case is drawn by `oscar_hf.testing.random_decode_case` (batch 1-64, GQA 1/2/4/5/8, head_dim 64/128/256,
quantized and residual lengths that are multiples of nothing but the group size, 1-128 residual tokens, 1-16 query
tokens, left padding, strided capacity views, bf16/fp16, 2, 3 or 4 bits for keys and values each, rotation and token
scaling on or off, fp16/fp32 scales) and checked with the kernel tests' tolerances (`TOLERANCES`, same module); CI
runs a seeded slice of the same sampler under Triton's interpreter (`test_fuzz_slice`). Writes
`kernel_fuzz_<gpu>.json` (under benchmarks/results by default): cases, failures (with their ids and messages), the
worst relative error, and the seed, so any failure is reproducible.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import records
import torch
from tqdm import tqdm

from oscar_hf.testing import TOLERANCES, Case, check_decode_case, random_decode_case


def _run_cases(cases: list[tuple[int, Case]], seed: int, minutes: float) -> list[dict]:
    """Worker: check (index, case) pairs until the deadline; one result per case run."""
    deadline = time.monotonic() + 60 * minutes
    results = []
    for index, case in cases:
        if time.monotonic() > deadline:
            break
        try:
            results.append({"index": index, "case": case.id, "rel_rmse": check_decode_case(case, seed + index)})
        except Exception as exc:  # a tolerance breach, or the kernel raising: both are findings to record
            results.append({"index": index, "case": case.id, "error": f"{type(exc).__name__}: {exc}"[:500]})
        torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--minutes", type=float, default=8.5, help="workers stop drawing cases after this long")
    parser.add_argument("--workers", type=int, default=12, help="processes (each compiles the variants it draws)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=1 << 17, help="bound on batch * KV heads * length")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fuzz_kernels.py needs a CUDA device (CI runs a slice under the interpreter instead).")

    rng = random.Random(args.seed)
    cases = [(index, random_decode_case(rng, args.max_tokens)) for index in range(args.cases)]
    shards = [cases[w :: args.workers] for w in range(args.workers)]
    results = []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        futures = [pool.submit(_run_cases, shard, args.seed * 100_003, args.minutes) for shard in shards]
        for future in tqdm(as_completed(futures), total=len(futures), desc="fuzz workers"):
            results.extend(future.result())
    failures = [r for r in results if "error" in r]
    passed = [r for r in results if "error" not in r]
    worst = max(passed, key=lambda r: r["rel_rmse"], default=None)

    record = {
        **records.header("kernel_fuzz"),
        "seed": args.seed,
        "cases": len(results),
        "failures": len(failures),
        "failed_cases": sorted(failures, key=lambda r: r["index"]),
        "worst_rel_rmse": worst,
        "tolerances": {str(k).removeprefix("torch."): v for k, v in TOLERANCES.items()},
    }
    path = args.out / f"kernel_fuzz_{records.gpu_slug(record['device'])}.json"
    records.write_record(path, record)
    print(f"{len(results)} cases, {len(failures)} failures, worst relative RMSE: {worst}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
