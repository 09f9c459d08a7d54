"""`model.generate` with a Llama-3.1-8B-shaped model (random bf16 weights): the user's path, one process.

    python benchmarks/bench_generate.py            # rows B=1 32K, B=1 128K, B=8 32K, B=4 128K
    python benchmarks/bench_generate.py --quick    # rows B=1 32K and B=8 32K, 24 new tokens
    python benchmarks/bench_generate.py --rows 1x131072 4x131072 --append   # add rows to the existing record
    python benchmarks/bench_generate.py --rows 1x32768 --variants static-compiled oscar-compiled --append

Caches per row: bf16 DynamicCache; bf16 StaticCache with generate's automatic compile (`fullgraph=True`, CUDA
graphs); OScaR eager (`cache_implementation="oscar"`, `disable_compile=True`); OScaR with generate's automatic
compile (run only where `OscarCache.is_compileable`; otherwise recorded as skipped with the reason). A streamer
synchronises the GPU at every token: the prefill time is the time to the first new token, the step time the median
over the second half of the new tokens (the first ones compile and capture CUDA graphs). Peak memory covers the
whole `generate` call. An out-of-memory run is recorded as such. Random weights run at the real cost; their tokens
are meaningless.

Writes benchmarks/results/generate_<gpu>.json after every run (a partial record survives an interrupted run):
`rows: [{batch, context, cache, compiled, step_ms, tokens_per_s, peak_gib, prefill_s, steady_steps_ms}]`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import oscar_hf  # noqa: F401  (registers cache_implementation="oscar")
from oscar_hf import OscarCache, OscarConfig

LLAMA_31_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rope_theta=500000.0,
)
ROWS = ["1x32768", "1x131072", "8x32768", "4x131072"]
QUICK_ROWS = ["1x32768", "8x32768"]
# name: (cache label, generate's cache_implementation, compiled)
VARIANTS = {
    "dynamic": ("dynamic", "dynamic", False),
    "static-compiled": ("static", "static", True),
    "oscar": ("oscar", "oscar", False),
    "oscar-compiled": ("oscar", "oscar", True),
}


class _TokenClock:
    """A generate streamer that synchronises the GPU as each token arrives and records the time."""

    def __init__(self):
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        torch.cuda.synchronize()
        if self.prompt_seen:  # the first call carries the prompt
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


def run(model, batch: int, context: int, new_tokens: int, cache_implementation: str, compiled: bool) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    clock = _TokenClock()
    options = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        streamer=clock,
        cache_implementation=cache_implementation,
    )
    if compiled:  # generate's automatic compile of the decode steps: Inductor, CUDA graphs, one graph
        options["compile_config"] = CompileConfig(fullgraph=True)
        torch._dynamo.reset()  # each row compiles for its own static shapes (and never hits the recompile limit)
    else:
        options["disable_compile"] = True
    if cache_implementation == "oscar":
        options["cache_config"] = {"attention": "auto"}
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), **options)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    steady = steps[len(steps) // 2 :]
    step_ms = 1000 * statistics.median(steady)
    return {
        "step_ms": step_ms,
        "step_ms_p20_p80": [1000 * q for q in statistics.quantiles(steady, n=5)[::3]],
        "tokens_per_s": batch * 1000 / step_ms,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "prefill_s": clock.times[0] - start,
        "steps_timed": len(steady),
        "steady_steps_ms": [round(1000 * step, 2) for step in steady],  # shows a bimodal baseline for what it is
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=None, help="BATCHxCONTEXT entries (default: the four rows)")
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS}, 24 new tokens")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument(
        "--append",
        action="store_true",
        help="keep the record's other rows (a run split in two); rows measured again go to earlier_runs",
    )
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    shapes = [tuple(int(x) for x in row.split("x")) for row in rows]  # (batch, context)
    new_tokens = 24 if args.quick and args.new_tokens == 40 else args.new_tokens

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_31_8B)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0

    record = {
        **record_header("model.generate decode step, Llama-3.1-8B shape, random bf16 weights, greedy"),
        "model": LLAMA_31_8B,
        "new_tokens": new_tokens,
        "rows": [],
    }
    gpu = record["device"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"generate_{gpu_slug(gpu)}.json"
    if args.append and path.exists():
        earlier = json.loads(path.read_text())
        rerun = {(b, c, *VARIANTS[v][::2]) for b, c in shapes for v in args.variants}
        for row in earlier["rows"]:
            row.setdefault("commit", earlier["commit"])  # rows from before rows named their commit
        replaced = [r for r in earlier["rows"] if (r["batch"], r["context"], r["cache"], r["compiled"]) in rerun]
        record["rows"] = [r for r in earlier["rows"] if r not in replaced]
        record["earlier_runs"] = [
            *earlier.get("earlier_runs", []),
            {
                **{k: earlier[k] for k in ("date", "commit", "new_tokens")},
                # what this run measures again, as it was: a rerun never hides an earlier number
                "replaced_rows": [
                    {k: r.get(k) for k in ("batch", "context", "cache", "compiled", "commit", "step_ms", "error")}
                    for r in replaced
                ],
            },
        ]
    probe = OscarCache(model.config, OscarConfig())
    probe.reserve(1)  # generate reserves its maximum length
    oscar_blockers = probe.compile_blockers()
    for batch, context in shapes:
        for cache, implementation, compiled in (VARIANTS[v] for v in args.variants):
            # Rows kept by --append come from earlier runs: each row names its commit (compare rows of one commit).
            entry = {
                "batch": batch,
                "context": context,
                "cache": cache,
                "compiled": compiled,
                "commit": record["commit"],
            }
            print(f"B={batch} context={context} {cache}{' compiled' if compiled else ''} ...", flush=True)
            if cache == "oscar" and compiled and oscar_blockers:
                entry["skipped"] = f"OscarCache is not compileable here: {'; '.join(oscar_blockers)}"
            else:
                try:
                    entry.update(run(model, batch, context, new_tokens, implementation, compiled))
                except torch.OutOfMemoryError as error:
                    entry["error"] = f"out of memory: {error}".splitlines()[0]
            record["rows"].append(entry)
            path.write_text(json.dumps(record, indent=2))
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{gpu} ({path})")
    print(f"{'B':>3s} {'context':>8s} {'cache':>8s} {'compiled':>8s} {'step ms':>8s} {'tok/s':>8s} {'peak GiB':>9s}")
    for e in record["rows"]:
        head = f"{e['batch']:3d} {e['context']:8d} {e['cache']:>8s} {str(e['compiled']):>8s}"
        if "step_ms" in e:
            print(f"{head} {e['step_ms']:8.2f} {e['tokens_per_s']:8.1f} {e['peak_gib']:9.1f}")
        else:
            print(f"{head} {e.get('error') or e.get('skipped')}")


def record_header(benchmark: str) -> dict:
    """The fields every record of these GPU benchmarks starts with (profile_generate.py uses it too)."""
    # The GPU machine's copy of the tree carries a stale .git: OSCAR_GIT_COMMIT names the commit there.
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {
        "benchmark": benchmark,
        "device": torch.cuda.get_device_name(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": os.environ.get("OSCAR_GIT_COMMIT") or commit,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "triton": _triton()},
    }


def gpu_slug(device: str) -> str:
    """ "NVIDIA H200" -> "h200": the record file's suffix."""
    return device.lower().replace("nvidia", "").strip().replace(" ", "-")


def _triton() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
