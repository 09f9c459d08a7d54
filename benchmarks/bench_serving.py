"""Serving through transformers' continuous batching (`generate_batch`): the stock bf16 pool against the 2-bit pool.

    python benchmarks/bench_serving.py                                   # Llama-3.1-8B shape, the issue's load
    python benchmarks/bench_serving.py --requests 32 --min-prompt 2048 --max-prompt 8192 --new-tokens 64
    python benchmarks/bench_serving.py --quick --model tiny-llama --device cpu --num-blocks 64

One process runs every cache of `--caches` (rows of one run, one `run` id) on the same seeded request set: `--requests`
prompts of lengths drawn uniformly from [`--min-prompt`, `--max-prompt`] (random token ids), `--new-tokens` new tokens
each (no end-of-sequence token: every request generates them all), greedy. `bf16`: transformers' `PagedAttentionCache`
(the model's dtype, sdpa attention, no CUDA graphs: transformers' default there); `oscar`: `cache_implementation=
"oscar"` (the 2-bit pool, `--cache-config`; its decode-only forwards replay CUDA graphs, its default on a GPU);
`oscar-async`: the same with the next batch prepared while one computes (`use_async_batching=True`); `oscar-eager`:
without CUDA graphs (`use_cuda_graph=False`); `oscar-gluon`, `oscar-triton`: the same with its pages read by the Gluon
kernel where it applies, or by the Triton kernel alone (`decode_paged.GLUON_PAGES` on or off for that row: the A/B of
the paged decode kernels in one process; the row's `cache` is "oscar", its `variant` the name). Every pool is sized by
transformers' memory handler from the same free memory (`--max-memory-percent`, or `--num-blocks` blocks each, for the
CPU). Each row first runs the set's first `--warmup` requests untimed, with 2 new tokens each (the process's first
compiles of that row's kernels and its attention's plans: without it, the first 2-bit row paid them and the second did
not). Models: bench_generate.py's (random bf16 weights, sdpa). `--quick`: 8 requests of 100-700 tokens and 8 new tokens,
to check the path (no timing means anything there).

Per cache, a row: `pool_tokens` (the tokens its pages can hold: `pool_tokens`), `peak_concurrent` (the most requests
active at once), `output_tokens_per_s` (generated tokens over the whole `generate_batch`), `ttft_p50_s`/`ttft_p99_s`
(first token's time after submission, every request submitted at once), `peak_gib`, and over the steps whose batch is
all decode tokens: `decode_step_ms` (median of the steps' times, `StepClock`: from the previous step's end to this one's
on the GPU, so the GPU's waits on the host count), `roof_ms` (median of the bytes such a step must read, the weights and
the pool's used bytes, over the copy bandwidth measured in this process) and `roof_fraction` (their sums' ratio: the
steps' share of their byte roof; weights as `records.weight_bytes` counts them). `prompt_step_ms` (median) and
`prompt_steps_s` (sum) over the other steps; `setup_s`: the time before the first step (transformers' warmup, its graph
captures). `--profile-steps N`: N steps of `--profile-kind` (all-decode, or `prompt`: with prompt tokens) after the
first `PROFILE_AFTER` are profiled and not timed (the row's `profile`: wall and GPU-busy time per step, GPU idle time
and the host operators in it, the kernels by GPU time); the profiler runs over the whole generation loop, so such a
row's other timings carry its overhead: a profile's row says where time goes, not how fast. Ratios: the 2-bit pool's
over every other row's.

Record: benchmarks/results/serving_<gpu>.json (`runs: {run: header}`, `rows`, `ratios`; records.py's layout).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import bench_generate as bench
import profile_generate
import records
import torch
from oscar_hf.kernels import decode_paged
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import ContinuousBatchingConfig, GenerationConfig
from transformers.generation.continuous_batching.continuous_api import (
    ContinuousBatchingAsyncIOs,
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)

CACHES = ("bf16", "oscar", "oscar-async", "oscar-eager", "oscar-gluon", "oscar-triton")
PAGED_KERNELS = {"oscar-gluon": True, "oscar-triton": False}  # a variant's `decode_paged.GLUON_PAGES`
QUICK = dict(requests=8, min_prompt=100, max_prompt=700, new_tokens=8)
PROFILE_AFTER = 2  # steps of the profiled kind run before the profiled ones (the first ones compile Triton's kernels)
PROFILE_KINDS = ("decode", "prompt")
PROFILED_STEP = "bench_serving::profiled_step"  # the profiler's range around each profiled step


@dataclasses.dataclass
class Step:
    """One `generate_batch` step as the instrumentation saw it."""

    decode: bool  # every request in the batch brought one token
    used_bytes: int  # the pool's bytes in use
    active: int  # requests active (holding cache)
    end: torch.cuda.Event | float  # its computation's end: an event on the forwards' stream, or the host's clock
    profiled: bool = False  # run under the profiler: not timed
    seconds: float | None = None  # since the previous step's end (`StepClock.finish`); None: not timed


def request_set(count: int, shortest: int, longest: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` random prompts of lengths uniform in [shortest, longest] (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


class StepClock:
    """Times every continuous-batching step while it is entered: wraps `ContinuousBatchProcessor._generation_step` in
    this process, for the benchmark's instrumentation only. A step's time runs from the end of the previous step's
    computation to the end of its own, marked by events on the forwards' stream (on a CPU, the host's clock after each
    step): its GPU time and the time the GPU waited on the host before it (preparing the batch, and the previous
    batch's update, which asynchronous batching overlaps with the previous computation); nothing is synchronised. With
    `profile_steps`, the steps of `profile_kind` (all-decode, or with prompt tokens) after the first `PROFILE_AFTER` are
    marked for the profiler (`PROFILED_STEP`), that many, and not timed. The profiler runs from the generation loop's
    start (after transformers' warmup) to the end, started and stopped on this thread (CUPTI refuses a start on the
    loop's thread once it registered on this one), so the row's other timings are taken under it; a profiled step is
    synchronised before and after (for the profiler's windows), so neither it nor the step after it is timed.
    `first_step`: when the first step began (the host's clock)."""

    def __init__(self, device: torch.device, profile_steps: int = 0, profile_kind: str = "decode"):
        self.device, self.steps, self.pool_tokens, self.first_step, self.first_mark = device, [], None, None, None
        self.profile_steps, self.profile_kind, self.profiled_wall = profile_steps, profile_kind, 0.0
        self.profiler, self.profiling = None, False
        if profile_steps:  # the loop's thread's operators too
            every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            self.profiler = profile(activities=activities, experimental_config=every_thread)

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _mark(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event | float:
        """Now, on `stream` (the forwards') on a GPU, else on the host's clock."""
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def finish(self) -> None:
        """Each step's `seconds` (after the run): since the end of the previous step's computation (the first step's:
        since it began), none for a profiled step and the one after it."""
        self._sync()
        previous = self.first_mark
        for index, step in enumerate(self.steps):
            after_profiled = index and self.steps[index - 1].profiled
            if not (step.profiled or after_profiled):
                cuda = isinstance(step.end, torch.cuda.Event)
                step.seconds = previous.elapsed_time(step.end) / 1000 if cuda else step.end - previous
            previous = step.end

    def __enter__(self):
        self.original = ContinuousBatchProcessor._generation_step, ContinuousBatchingManager.start
        original_step, original_start = self.original
        clock = self

        def timed(processor, model):
            cache, ios = processor.cache, processor.inputs_and_outputs
            clock.pool_tokens = pool_tokens(cache)
            if isinstance(ios, ContinuousBatchingAsyncIOs):  # the pair the step runs on
                ios = ios.io_pairs[ios.current_pair].host_io
            used = cache.num_sectors * cache.bytes_per_sector - cache.compute_free_capacity(relative=False)
            decode = all(future.query_length == 1 for future in ios.requests_in_batch)
            profiled = decode == (clock.profile_kind == "decode") and clock._profiled_next()
            stream = processor.inputs_and_outputs.compute_stream
            if clock.first_step is None:
                clock.first_step, clock.first_mark = time.perf_counter(), clock._mark(stream)
            if profiled:
                clock._sync()
            start = time.perf_counter()
            with record_function(PROFILED_STEP) if profiled else contextlib.nullcontext():
                original_step(processor, model)
                if profiled:
                    clock._sync()
            clock.profiled_wall += time.perf_counter() - start if profiled else 0.0
            active = len(processor.scheduler.active_requests)
            clock.steps.append(Step(decode, int(used), active, clock._mark(stream), profiled))

        def start_profiled(manager):
            clock.profiler.start()
            clock.profiling = True
            original_start(manager)

        ContinuousBatchProcessor._generation_step = timed
        if self.profiler is not None:
            ContinuousBatchingManager.start = start_profiled
        return self

    def _profiled_next(self) -> bool:
        """Whether the next step of the profiled kind is one of the profiled ones."""
        seen = sum(step.decode == (self.profile_kind == "decode") for step in self.steps)
        return PROFILE_AFTER <= seen < PROFILE_AFTER + self.profile_steps

    def __exit__(self, *exc):
        ContinuousBatchProcessor._generation_step, ContinuousBatchingManager.start = self.original
        if self.profiling:
            self.profiler.stop()
            self.profiling = False

    def profile_summary(self, top: int = 15) -> dict | None:
        """Where the profiled steps' time went: wall and GPU-busy time per step, the kernels by GPU time, and the GPU's
        idle time with the outermost host operators of the step running in it (profile_generate.py's accounting, over
        each step's own events)."""
        steps = sum(step.profiled for step in self.steps)
        if not steps:
            return None
        events = self.profiler.events()
        marks = [e for e in events if e.name == PROFILED_STEP and e.device_type == torch.autograd.DeviceType.CPU]
        windows = [(e.time_range.start, e.time_range.end) for e in marks]  # not the range's GPU-side twin
        if len(windows) != steps:
            raise RuntimeError(f"the profiler recorded {len(windows)} of the {steps} profiled steps")
        kernels, idle_ms, idle_operators = {}, 0.0, {}
        for lo, hi in windows:
            inside = [e for e in events if lo <= e.time_range.start <= hi and e.name != PROFILED_STEP]
            for e in filter(profile_generate.is_kernel, inside):
                time_and_calls = kernels.setdefault(e.name, [0.0, 0])
                time_and_calls[0] += e.time_range.elapsed_us()
                time_and_calls[1] += 1
            ms, operators = profile_generate.idle_host_time(
                inside, 1, top, outermost=lambda e: e.cpu_parent is not None and e.cpu_parent.name == PROFILED_STEP
            )
            idle_ms += ms
            for operator in operators:
                idle_operators[operator["name"]] = idle_operators.get(operator["name"], 0.0) + operator["us_per_step"]
        by_time = sorted(kernels.items(), key=lambda item: -item[1][0])
        return {
            "steps": steps,
            "wall_ms": 1000 * self.profiled_wall / steps,
            "gpu_busy_ms": sum(us for us, _ in kernels.values()) / steps / 1000,
            "gpu_idle_ms": idle_ms / steps,
            "kernels": [
                {"name": name, "us_per_step": us / steps, "calls_per_step": calls / steps}
                for name, (us, calls) in by_time[:top]
            ],
            "idle_host_operators": [
                {"name": name, "us_per_step": us / steps}
                for name, us in sorted(idle_operators.items(), key=lambda item: -item[1])[:top]
            ],
        }


def pool_tokens(cache) -> int:
    """The tokens a pool's pages can hold: its blocks, all of one kind (transformers' `max_tokens_read` for its own
    pool; the 2-bit pool, read in place, sets that to what a batch reads through transformers' indices)."""
    return max(allocator.tokens_per_page * allocator.num_blocks for allocator in cache.cache_allocators.values())


def paged_kernel(cache: str):
    """What reads the 2-bit pool's pages for `cache`'s row: `GLUON_PAGES` on for "oscar-gluon" and off for
    "oscar-triton" while the row runs, else the library's default."""
    return mock.patch.object(decode_paged, "GLUON_PAGES", PAGED_KERNELS.get(cache, decode_paged.GLUON_PAGES))


def run_cache(model, cache: str, prompts, args, bandwidth: dict) -> dict:
    """One `generate_batch` of the request set with `cache`; its row's measurements."""
    device = model.device
    oscar = {"cache_implementation": "oscar", "cache_config": dict(args.cache_config)} if cache != "bf16" else {}
    generation = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, **oscar)
    # sdpa for both pools (transformers would switch bf16 models to flash where installed: the 2-bit pool reads sdpa);
    # CUDA graphs as transformers and the pool choose them (none for bf16 sdpa, the decode-only forwards for the 2-bit
    # pool), none for "oscar-eager"; asynchronous batching for "oscar-async" only (transformers' default with sdpa)
    options = {"max_batch_tokens": args.max_batch_tokens, "auto_switch_to_flash": False}
    if cache == "oscar-eager":
        options["use_cuda_graph"] = False
    if cache == "oscar-async":
        options["use_async_batching"] = True
    if args.num_blocks is not None:
        options["num_blocks"] = args.num_blocks
    if args.max_memory_percent is not None:
        options["max_memory_percent"] = args.max_memory_percent
    bench.release(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with StepClock(device, args.profile_steps, args.profile_kind) as clock, torch.inference_mode(), paged_kernel(cache):
        start = time.perf_counter()
        outputs = model.generate_batch(
            prompts,
            generation_config=generation,
            continuous_batching_config=ContinuousBatchingConfig(**options),
            record_timestamps=True,
        )
        wall = time.perf_counter() - start
    failed = [o.error for o in outputs.values() if o.error is not None]
    if len(outputs) != len(prompts) or failed:
        raise RuntimeError(f"{len(prompts) - len(outputs)} requests missing, {len(failed)} failed: {failed[:1]}")
    ttft = sorted(o.timestamps[0] - o.created_time for o in outputs.values())
    clock.finish()
    decode = [s for s in clock.steps if s.decode and s.seconds is not None]
    prompt = [s for s in clock.steps if not s.decode and s.seconds is not None]
    weights, bytes_per_s = records.weight_bytes(model), bandwidth["GBps"] * 1e9
    roofs = [(weights + s.used_bytes) / bytes_per_s for s in decode]
    return {
        "pool_tokens": clock.pool_tokens,
        "peak_concurrent": max(s.active for s in clock.steps),
        "output_tokens_per_s": sum(len(o.generated_tokens) for o in outputs.values()) / wall,
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "decode_step_ms": 1000 * statistics.median(s.seconds for s in decode) if decode else None,
        "roof_ms": 1000 * statistics.median(roofs) if decode else None,
        "roof_fraction": sum(roofs) / sum(s.seconds for s in decode) if decode else None,
        "steps": len(clock.steps),
        "decode_steps": len(decode),
        "prompt_step_ms": 1000 * statistics.median(s.seconds for s in prompt) if prompt else None,
        "prompt_steps_s": sum(s.seconds for s in prompt),
        "setup_s": clock.first_step - start,
        "wall_s": wall,
        "profile": clock.profile_summary(),
    }


RATIO_FIELDS = {
    "pool_tokens": "pool_tokens_ratio",
    "output_tokens_per_s": "tokens_per_s_ratio",
    "ttft_p99_s": "ttft_p99_ratio",
    "peak_concurrent": "concurrent_ratio",
}


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(bench.MODELS), default="llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=["bf16", "oscar"])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--min-prompt", type=int, default=8192)
    parser.add_argument("--max-prompt", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--quick", action="store_true", help="a few short requests: " + str(QUICK))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-tokens", type=int, default=8192, help="tokens per batch (transformers' default)")
    parser.add_argument("--max-memory-percent", type=float, default=None, help="of free memory, for each pool")
    parser.add_argument("--num-blocks", type=int, default=None, help="blocks per pool instead (CPU runs)")
    parser.add_argument("--cache-config", type=bench_json, default={"bits": 2}, help="the 2-bit pool's cache_config")
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help=f"profile that many steps of --profile-kind (after {PROFILE_AFTER})",
    )
    parser.add_argument("--profile-kind", choices=PROFILE_KINDS, default="decode", help="all-decode or prompt steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed requests each row runs first (its compiles)")
    parser.add_argument("--budget-s", type=float, default=480, help="no cache starts after this many seconds")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="the records' folder")
    args = parser.parse_args(argv)
    if args.quick:
        vars(args).update(QUICK)
    started = time.perf_counter()
    device = torch.device(args.device)
    bandwidth = records.copy_bandwidth(device)  # before the model: an empty GPU
    model = bench.build_model(args.model, args.device)
    prompts = request_set(args.requests, args.min_prompt, args.max_prompt, model.config.vocab_size, args.seed)
    header = records.header("serving", device)
    run = header["run"]
    path = args.out / f"serving_{records.gpu_slug(header['device'])}.json"
    keys = ("model", "requests", "min_prompt", "max_prompt", "new_tokens", "max_batch_tokens")
    record = records.start_run(
        path,
        header,
        **{k: getattr(args, k) for k in keys},
        max_memory_percent=args.max_memory_percent,
        num_blocks=args.num_blocks,
        warmup=args.warmup,
        cache_config=args.cache_config,
        copy_bandwidth=bandwidth,
    )
    warmup = argparse.Namespace(**{**vars(args), "new_tokens": 2, "profile_steps": 0})
    rows = []
    for cache in args.caches:
        kind = "oscar" if cache in PAGED_KERNELS else cache  # a paged kernel's row is the 2-bit pool's (ratios)
        row = {"run": run, "cache": kind, "variant": cache, **{k: getattr(args, k) for k in keys}}
        if time.perf_counter() - started > args.budget_s:
            row["error"] = f"not started: --budget-s {args.budget_s} passed"
        else:
            try:
                if args.warmup:
                    run_cache(model, cache, prompts[: args.warmup], warmup, bandwidth)
                row.update(run_cache(model, cache, prompts, args, bandwidth))
            except Exception as error:  # a row says what failed, and the run goes on
                row.update(bench.failure(error))
        rows.append(row)
        record["rows"].append(row)
        records.write_record(path, record)
        print(summary(row), flush=True)
    ratios = bench.oscar_ratios(rows, ("model", "requests"), RATIO_FIELDS)
    record["ratios"].extend(ratios)
    records.write_record(path, record)
    print(f"run {run} on {header['device']} -> {path}")
    return path


def bench_json(text: str) -> dict:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object of OscarConfig fields")
    return value


def summary(row: dict) -> str:
    if row.get("error"):
        return f"{row['variant']}: {row['error']}"
    peak = "" if row["peak_gib"] is None else f", peak {row['peak_gib']:.1f} GiB"
    roof = "" if row["roof_fraction"] is None else f", {100 * row['roof_fraction']:.0f} % of roof"
    return (
        f"{row['variant']}: {row['output_tokens_per_s']:.1f} tokens/s, pool {row['pool_tokens']} tokens, "
        f"{row['peak_concurrent']} at once, first token p50 {row['ttft_p50_s']:.2f} s, "
        f"p99 {row['ttft_p99_s']:.2f} s{peak}{roof}; setup {row['setup_s']:.1f} s, prompt steps "
        f"{row['prompt_steps_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
