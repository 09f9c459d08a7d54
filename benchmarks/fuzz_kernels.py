"""Fuzz the fused decode-attention kernel against the float64 reference on the GPU.

    python benchmarks/fuzz_kernels.py [--cases 1000] [--minutes 8.5] [--workers 12] [--seed 0] [--out DIR]

Each case is drawn by `random_case` of tests/kernels/test_decode_attention.py (batch 1-64, GQA 1/2/4/5/8, head_dim
64/128/256, quantized and residual lengths that are multiples of nothing but the group size, 1-128 residual tokens,
1-16 query tokens, left padding, strided capacity views, bf16/fp16, 2 or 4 bits for keys and values each, rotation
and token scaling on or off, fp16/fp32 scales) and checked with that module's tolerances; CI runs a seeded slice of
the same sampler under Triton's interpreter (`test_fuzz_slice`). Writes `kernel_fuzz_<gpu>.json` (under
benchmarks/results by default): cases, failures (with their ids and messages), the worst relative error, and the
seed, so any failure is reproducible.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import multiprocessing
import random
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import bench_generate as records  # noqa: E402  (record header and GPU slug)

_TESTS = Path(__file__).resolve().parents[1] / "tests" / "kernels" / "test_decode_attention.py"


def _load_test_module():
    sys.path.insert(0, str(_TESTS.parent))  # its reference checks (tests/kernels/reference_checks.py)
    spec = importlib.util.spec_from_file_location("test_decode_attention", _TESTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _tolerances() -> dict:
    """The unit tests' tolerances (tests/kernels/reference_checks.py, on the path once the test module is loaded)."""
    return importlib.import_module("reference_checks").TOLERANCES


def _run_cases(cases: list[tuple[int, dict]], seed: int, minutes: float) -> list[dict]:
    """Worker: check (index, case fields) pairs until the deadline; one result per case run (cases travel as dicts:
    the test module is loaded from its path, so its classes cannot be unpickled by name)."""
    tests = _load_test_module()
    deadline = time.monotonic() + 60 * minutes
    results = []
    for index, fields in cases:
        if time.monotonic() > deadline:
            break
        case = tests.Case(**fields)
        try:
            results.append({"index": index, "case": case.id, "rel_rmse": tests.check_random_case(case, seed + index)})
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

    tests = _load_test_module()
    rng = random.Random(args.seed)
    cases = [(index, dataclasses.asdict(tests.random_case(rng, args.max_tokens))) for index in range(args.cases)]
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
        **records.record_header("kernel_fuzz"),
        "seed": args.seed,
        "cases": len(results),
        "failures": len(failures),
        "failed_cases": sorted(failures, key=lambda r: r["index"]),
        "worst_rel_rmse": worst,
        "tolerances": {str(k).removeprefix("torch."): v for k, v in _tolerances().items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"kernel_fuzz_{records.gpu_slug(record['device'])}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"{len(results)} cases, {len(failures)} failures, worst relative RMSE: {worst}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
