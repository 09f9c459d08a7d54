"""`model.generate` with a real model's shape (random bf16 weights): the user's path, one process, one run.

    python benchmarks/bench_generate.py                                   # Llama-3.1-8B, B=1 and B=4 at 32K
    python benchmarks/bench_generate.py --model gemma-3-4b --batches 1 4 8 --contexts 32768 131072
    python benchmarks/bench_generate.py --variants static-compiled oscar-compiled --new-tokens 64
    python benchmarks/bench_generate.py --batches 4 --variants dynamic oscar oscar-compiled --prefill-chunk-size 4096
    PYTHONPATH=DIR python benchmarks/bench_generate.py      # DIR: optimum-quanto (pip install --no-deps --target DIR)

Models (`--model`): `llama-3.1-8b` (32 layers, 32 q / 8 kv heads, head_dim 128: full attention only) and
`gemma-3-4b` (Gemma 3 4B's text model: 34 layers, 5 sliding-window (1024) : 1 full, 8 q / 4 kv heads, head_dim 256);
`tiny-llama` and `tiny-gemma` are 2-layer versions for the CPU tests. Random weights run at the real cost; their
tokens are meaningless.

Caches (`--variants`), each row for every batch x context:
- `dynamic`: bf16 DynamicCache, eager;
- `static-compiled`: bf16 StaticCache with generate's automatic compile (`fullgraph=True`, CUDA graphs);
- `quantized-quanto-int2`: transformers' QuantizedCache (`cache_implementation="quantized"`, quanto backend, 2 bits),
  eager; needs optimum-quanto importable (not on the GPU image: install its wheel with `pip install --no-deps
  --target DIR` and put DIR on PYTHONPATH); without it the row is skipped with the reason;
- `oscar`: OScaR eager (`cache_implementation="oscar"`, `disable_compile=True`);
- `oscar-compiled`: OScaR with generate's automatic compile, run only where `OscarCache.compile_blockers()` is empty
  (otherwise skipped with the blockers);
- `oscar-int2`, `oscar-int2-compiled`: the same with 2-bit keys and values everywhere and no sinks (`bits=2,
  sink_tokens=0`), against which the default's layer-wise widths and sinks are measured;
- `oscar-avg4.1-compiled`: compiled with a 4.1-bit budget (`avg_bits=4.1`: K4V2's memory, 4-bit keys or values where
  the prompt says they pay).

Timing: before each row, its cache runs one eager warm-up generate of the row's shape (same batch and prompt length,
a few new tokens), so that Triton/cuBLAS first-call costs and the caching allocator's first growth to that shape stay
out of the rows (a warm process, as a server is). A streamer synchronises the device at every token:
`prefill_s` is the time to the first new token, `step_ms` the median over the second half of the decode steps (the
first ones compile and capture CUDA graphs), `peak_gib` the peak allocated memory of the whole `generate` call.
`graphs_compiled` counts the graphs torch.compile built during the row (0: the row ran eager).
The byte roof beside each step (records.py): `cache_bytes` is what the cache holds as generate leaves it (its own
count: `memory_footprint()` for OScaR, the K/V tensors for transformers' caches; new_tokens more than the prompt),
`cache_bf16_bytes` the same tokens' K/V in bf16; with the run's `weight_bytes` and the copy bandwidth measured at the
start of the run, `roof_ms` is the time reading them takes (the step at the memory limit), `roof_fraction` = roof_ms /
step_ms, and `bf16_roof_ms` what a bf16 engine at the memory limit would take for the same batch and context.
`--prefill-chunk-size N` prefills every variant but `dynamic` (the unchunked baseline) in chunks of N tokens
(generate's `prefill_chunk_size`; each row records its `prefill_chunk_size`), so that `prefill_ratio` compares chunked
prefill's time to first token with the unchunked DynamicCache's. An out-of-memory row
is recorded with `oom: true`, any other failure with its `error`: one invocation always leaves a record.

Record: benchmarks/results/generate_<gpu>.json, rewritten after every row (an interrupted run keeps its rows).
Each invocation is one run with its own id: `runs: {run: {date, commit, device, versions, model, model_config,
new_tokens, copy_bandwidth, weight_bytes, argv}}`, `rows: [{run, model, batch, context, new_tokens, variant, cache,
compiled, oom, step_ms, prefill_s, peak_gib, tokens_per_s, cache_bytes, roof_ms, roof_fraction, bf16_roof_ms, ...}]`
(earlier runs' rows stay), `ratios: [{run, model, batch, context, oscar,
baseline, step_ratio, prefill_ratio, peak_ratio}]`: OScaR over each baseline (below 1: OScaR is faster / smaller),
only between rows of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import statistics
import sys
import time
import traceback
from pathlib import Path

import records
import torch
from torch._dynamo.utils import counters as dynamo_counters
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import oscar_hf  # noqa: F401  (registers cache_implementation="oscar")
from oscar_hf import OscarCache, OscarConfig
from oscar_hf.integrations.transformers import CACHE_KWARG

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
GEMMA_3_4B = dict(  # the text model of google/gemma-3-4b-it
    vocab_size=262208,
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=34,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    sliding_window=1024,
    layer_types=[("full_attention" if (i + 1) % 6 == 0 else "sliding_attention") for i in range(34)],
    max_position_embeddings=131072,
)
_TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
# name: (config class, model class, config); the tiny ones run the same code on the CPU in the tests
MODELS = {
    "llama-3.1-8b": (LlamaConfig, LlamaForCausalLM, LLAMA_31_8B),
    "gemma-3-4b": (Gemma3TextConfig, Gemma3ForCausalLM, GEMMA_3_4B),
    "tiny-llama": (LlamaConfig, LlamaForCausalLM, dict(_TINY, num_hidden_layers=2, head_dim=64)),
    "tiny-gemma": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        dict(
            _TINY,
            num_hidden_layers=2,
            head_dim=64,
            sliding_window=64,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    cache: str  # the row's `cache` label
    implementation: str  # generate's cache_implementation
    compiled: bool  # generate's automatic compile of the decode steps
    cache_config: dict | None = None


VARIANTS = {
    "dynamic": Variant("dynamic", "dynamic", False),
    "static-compiled": Variant("static", "static", True),
    "quantized-quanto-int2": Variant("quantized-quanto-int2", "quantized", False, {"backend": "quanto", "nbits": 2}),
    "oscar": Variant("oscar", "oscar", False, {"attention": "auto"}),
    "oscar-compiled": Variant("oscar", "oscar", True, {"attention": "auto"}),
    # the 2-bit cache without sinks (the default before bits="auto" and 4 sinks): what the default's choice costs
    "oscar-int2": Variant("oscar-int2", "oscar", False, {"attention": "auto", "bits": 2, "sink_tokens": 0}),
    "oscar-int2-compiled": Variant("oscar-int2", "oscar", True, {"attention": "auto", "bits": 2, "sink_tokens": 0}),
    # avg_bits=4.1: K4V2's memory, widths per layer (the budget that meets issue 39's perplexity goal)
    "oscar-avg4.1-compiled": Variant("oscar-avg4.1", "oscar", True, {"attention": "auto", "avg_bits": 4.1}),
}
WARMUP_TOKENS = 4


class _TokenClock:
    """A generate streamer that synchronises the device as each token arrives and records the time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self.prompt_seen:  # the first call carries the prompt
            self.times.append(time.perf_counter())
        self.prompt_seen = True

    def end(self):
        pass


def build_model(name: str, device: str) -> torch.nn.Module:
    """The model `name` of MODELS with random bf16 weights (seeded), sdpa attention, on `device`."""
    config_class, model_class, shape = MODELS[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config_class(**shape), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.generation_config.pad_token_id = 0
    return model.eval()


def generate_options(variant: Variant, prefill_chunk_size: int | None = None) -> dict:
    """generate's keyword arguments for `variant` (greedy decoding is the caller's)."""
    options: dict = {"cache_implementation": variant.implementation}
    if variant.cache_config is not None:
        options["cache_config"] = dict(variant.cache_config)
    if variant.compiled:  # Inductor, CUDA graphs, one graph for the whole generation
        options["compile_config"] = CompileConfig(fullgraph=True)
    else:
        options["disable_compile"] = True
    if prefill_chunk_size is not None:
        options["prefill_chunk_size"] = prefill_chunk_size
    return options


def timed_generate(model, batch: int, context: int, new_tokens: int, options: dict) -> dict:
    """One greedy `generate` of `new_tokens` tokens after a random `batch` x `context` prompt, timed per token, and
    the bytes its cache holds at the end (`records.cache_bytes`)."""
    device = model.device
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    if "compile_config" in options:
        torch._dynamo.reset()  # each row compiles for its own static shapes (and never hits the recompile limit)
    graphs_before = dynamo_counters["stats"]["unique_graphs"]
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device=device)
    clock = _TokenClock(device)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            streamer=clock,
            return_dict_in_generate=True,
            **options,
        )
    held, held_bf16 = records.cache_bytes(getattr(output, CACHE_KWARG))
    del output
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
    steady = steps[len(steps) // 2 :]
    step_ms = 1000 * statistics.median(steady)
    return {
        "step_ms": step_ms,
        "step_ms_p20_p80": [1000 * q for q in statistics.quantiles(steady, n=5)[::3]] if len(steady) > 1 else None,
        "tokens_per_s": batch * 1000 / step_ms,
        "prefill_s": clock.times[0] - start,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,  # no allocator stats on CPU
        "graphs_compiled": dynamo_counters["stats"]["unique_graphs"] - graphs_before,
        "steps_timed": len(steady),
        "steady_steps_ms": [round(1000 * step, 2) for step in steady],  # shows a bimodal baseline for what it is
        "cache_bytes": held,
        "cache_bf16_bytes": held_bf16,
    }


def release(device: torch.device) -> None:
    """Free what a finished (or failed) generate left behind before the next one measures its peak."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def failure(error: BaseException) -> dict:
    """A row's fields for a failed measurement: `oom` and the error's first line (the traceback goes to stderr)."""
    oom = isinstance(error, torch.OutOfMemoryError)
    if not oom:
        traceback.print_exc()
    message = (str(error).strip().splitlines() or [""])[0][:300]
    return {"oom": oom, "error": f"{type(error).__name__}: {message}"}


def oscar_compile_blockers(model) -> list[str]:
    """Why generate's automatic compile would not take an OscarCache for this model (empty: it would)."""
    probe = OscarCache(model.config, OscarConfig())
    probe.reserve(1)  # generate reserves its maximum length
    return probe.compile_blockers()


def quanto_missing() -> str | None:
    """Why transformers' quanto QuantizedCache cannot run here (None: it can)."""
    try:
        importlib.import_module("optimum.quanto")
    except Exception as error:  # noqa: BLE001  (ImportError, or quanto failing in its own import)
        return (
            f"optimum-quanto is not importable ({type(error).__name__}: {error}); install its wheel with "
            "`pip install --no-deps --target DIR optimum_quanto-*.whl` and put DIR on PYTHONPATH"
        )
    return None


def oscar_ratios(rows: list[dict], keys: tuple[str, ...], fields: dict[str, str]) -> list[dict]:
    """OScaR's measurements over every baseline's at the same `keys` (rows of one run): field -> ratio name."""
    measured = [r for r in rows if r.get(next(iter(fields))) is not None]
    ratios = []
    for oscar in (r for r in measured if r["cache"] == "oscar"):
        for base in (r for r in measured if r["cache"] != "oscar" and all(r[k] == oscar[k] for k in keys)):
            entry = {k: oscar[k] for k in ("run", *keys)}
            entry.update(oscar=oscar["variant"], baseline=base["variant"])
            for field, name in fields.items():
                both = oscar.get(field) is not None and base.get(field) is not None and base[field] > 0
                entry[name] = oscar[field] / base[field] if both else None
            ratios.append(entry)
    return ratios


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="llama-3.1-8b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768])
    parser.add_argument("--new-tokens", type=int, default=32, help="at least 4 (the median takes the second half)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--prefill-chunk-size", type=int, default=None, help="chunked prefill but for `dynamic`")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    if args.new_tokens < 4:
        parser.error("--new-tokens must be at least 4")

    header = records.header("model.generate decode step, real models' shapes, random bf16 weights, greedy", args.device)
    run, bandwidth = header["run"], records.copy_bandwidth(args.device)  # before the model: an empty GPU
    model = build_model(args.model, args.device)
    weights = records.weight_bytes(model)
    path = args.out / f"generate_{records.gpu_slug(header['device'])}.json"
    record = records.start_run(
        path,
        header,
        model=args.model,
        model_config=MODELS[args.model][2],
        new_tokens=args.new_tokens,
        warmup=f"one eager generate of each row's cache and shape, {WARMUP_TOKENS} new tokens",
        copy_bandwidth=bandwidth,
        weight_bytes=weights,
        argv=sys.argv[1:] if argv is None else argv,
    )
    skipped = {}
    compiled_oscar = [
        name for name in args.variants if VARIANTS[name].implementation == "oscar" and VARIANTS[name].compiled
    ]
    if compiled_oscar and (blockers := oscar_compile_blockers(model)):
        skipped.update(dict.fromkeys(compiled_oscar, f"OscarCache is not compileable here: {'; '.join(blockers)}"))
    if "quantized-quanto-int2" in args.variants and (missing := quanto_missing()):
        skipped["quantized-quanto-int2"] = missing
    print(f"run {run}: {args.model} on {header['device']} -> {path}", flush=True)

    rows = []
    for batch in args.batches:
        for context in args.contexts:
            for name in args.variants:
                variant = VARIANTS[name]
                chunk = args.prefill_chunk_size if name != "dynamic" else None
                row = {
                    "run": run,
                    "model": args.model,
                    "batch": batch,
                    "context": context,
                    "new_tokens": args.new_tokens,
                    "variant": name,
                    "cache": variant.cache,
                    "compiled": variant.compiled,
                    "prefill_chunk_size": chunk,
                    "oom": False,
                    "step_ms": None,
                    "prefill_s": None,
                    "peak_gib": None,
                }
                print(f"B={batch} context={context} {name} ...", flush=True)
                if name in skipped:
                    row["skipped"] = skipped[name]
                else:
                    try:
                        eager = generate_options(dataclasses.replace(variant, compiled=False), chunk)
                        timed_generate(model, batch, context, WARMUP_TOKENS, eager)
                        options = generate_options(variant, chunk)
                        row.update(timed_generate(model, batch, context, args.new_tokens, options))
                        row.update(roof(row, weights, bandwidth))
                    except Exception as error:  # noqa: BLE001  (recorded: one call always leaves a record)
                        row.update(failure(error))
                    release(model.device)
                rows.append(row)
                record["rows"].append(row)
                record["ratios"] = [r for r in record["ratios"] if r["run"] != run] + oscar_ratios(
                    rows, ("model", "batch", "context"), RATIO_FIELDS
                )
                records.write_record(path, record)
                print("   " + summary(row), flush=True)

    print(f"\nrun {run}, {args.model}, {header['device']} ({path})")
    print(
        f"{'B':>3s} {'context':>8s} {'variant':>22s} {'step ms':>8s} {'prefill s':>9s} {'peak GiB':>9s} graphs "
        f"{'roof ms':>8s} {'of roof':>7s} {'bf16 roof ms':>12s}"
    )
    for row in rows:
        print(f"{row['batch']:3d} {row['context']:8d} {row['variant']:>22s} {summary(row)}")
    for r in record["ratios"]:
        if r["run"] == run:
            print(
                f"B={r['batch']} {r['context']}: {r['oscar']} / {r['baseline']}: step {_x(r['step_ratio'])}, "
                f"prefill {_x(r['prefill_ratio'])}, peak {_x(r['peak_ratio'])}"
            )
    return path


RATIO_FIELDS = {"step_ms": "step_ratio", "prefill_s": "prefill_ratio", "peak_gib": "peak_ratio"}


def roof(row: dict, weights: int, bandwidth: dict) -> dict:
    """A measured row's byte roof fields (`records.roof`)."""
    return records.roof(row["step_ms"], weights, row["cache_bytes"], row["cache_bf16_bytes"], bandwidth)


def summary(row: dict) -> str:
    if row["step_ms"] is None:
        return "out of memory" if row["oom"] else row.get("error") or row.get("skipped", "")
    peak = f"{row['peak_gib']:9.1f}" if row["peak_gib"] is not None else f"{'-':>9s}"
    return (
        f"{row['step_ms']:8.2f} {row['prefill_s']:9.2f} {peak} {row['graphs_compiled']:6d} {row['roof_ms']:8.2f} "
        f"{100 * row['roof_fraction']:6.1f}% {row['bf16_roof_ms']:12.2f}"
    )


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


if __name__ == "__main__":
    main()
