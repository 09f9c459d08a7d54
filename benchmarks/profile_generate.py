"""Where a `model.generate` decode step's time goes: GPU time per kernel vs the step's wall time.

    python benchmarks/profile_generate.py --batch 1 --context 32768 --cache oscar static
    python benchmarks/profile_generate.py --batch 1 --context 32768 --cache oscar dynamic --eager
    python benchmarks/profile_generate.py --batch 1 --context 32768 --cache oscar dynamic --eager --prefill
    python benchmarks/profile_generate.py --batch 4 --cache oscar static --prefill --prefill-chunk-size 4096

Same model and options as bench_generate.py (Llama-3.1-8B shape, random bf16 weights, generate's automatic
compile, or none with `--eager`). The profiler (CUPTI: kernels inside CUDA graphs included) records a window of
steady decode steps (`--prefill`: the prefill, in a warm process), started and stopped from the streamer; the
GPU-busy share of the window tells launch/host overhead from kernel time. Prints the kernels by total GPU time per
step and writes benchmarks/results/profile_generate_<gpu>.json (`--eager`: profile_generate_eager_<gpu>.json,
`--prefill`: profile_generate_prefill_<gpu>.json; `rows: [{batch, context, cache, compiled, wall_ms, gpu_busy_ms,
gpu_idle_ms, kernels, runtime_calls, host_operators: [{name, us_per_step, calls_per_step}], oscar_regions: [{name,
host_us_per_step, gpu_us_per_step, calls_per_step}], idle_host_operators: [{name, us_per_step}], inductor_counters,
prefill_chunk_size}]`; wall_ms is measured under the profiler, which slows the host side). The
runtime calls tell a replayed CUDA graph (one cudaGraphLaunch) from kernels launched one by one. gpu_idle_ms is the
time per step with no kernel running between the window's first and last kernel, and idle_host_operators the
outermost host operators running in that time: what the GPU waits for.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import records
import torch
from bench_generate import LLAMA_31_8B
from torch.profiler import ProfilerActivity, profile
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation import CompileConfig

import oscar_hf  # noqa: F401  (registers cache_implementation="oscar")
from oscar_hf.cache import cache as oscar_cache
from oscar_hf.cache import history, key_rotation, layer, layer_bits, storage
from oscar_hf.integrations import fused_attention

# The cache's own jobs, timed as labelled ranges (`oscar::<name>`: host time and the GPU time of the kernels they
# launch) so that a prefill's profile says what the cache adds to the model's forward.
REGIONS = (
    ("update", layer.OscarLayer, "update"),
    ("rotation_choice", key_rotation.KeyRotation, "choose"),
    ("query_moment", fused_attention, "query_moment"),  # the prefill's queries, handed over by the sdpa entry
    ("query_moment", layer, "query_moment"),  # queries handed over by hand (`OscarLayer.observe_queries`)
    ("append_quantize", storage.KVStorage, "append"),
    ("decode_attention", history.DecodeHistory, "attention"),
    ("chunk_attention", history.ChunkHistory, "attention"),
    ("model_sdpa", fused_attention, "sdpa_attention_forward"),  # transformers' sdpa, called by the sdpa entry
    ("bits_observe", layer_bits.LayerBits, "observe"),  # bits="auto": the prompt's cost sums
    ("bits_choice", oscar_cache.OscarCache, "choose_bits"),  # bits="auto": the widths chosen, every layer converted
    ("bits_costs", layer_bits.LayerBits, "costs"),
    ("bits_convert", layer.OscarLayer, "set_widths"),
)
# --cache: the cache_implementation and cache_config of each choice ("oscar": the default config).
CACHES = {
    "oscar": ("oscar", {"attention": "auto"}),
    "oscar-int2": ("oscar", {"attention": "auto", "bits": 2, "sink_tokens": 0}),  # 2 bits everywhere, no sinks
    "static": ("static", None),
    "dynamic": ("dynamic", None),
}


def _label_regions() -> None:
    """Wrap each of `REGIONS` in a `torch.profiler.record_function` range (this process only)."""
    for name, owner, attr in REGIONS:
        function = getattr(owner, attr)

        def labelled(*args, _function=function, _name=f"oscar::{name}", **kwargs):
            with torch.profiler.record_function(_name):
                return _function(*args, **kwargs)

        setattr(owner, attr, labelled)


class _ProfileWindow:
    """A generate streamer that profiles new tokens `start` to `stop` (the first ones compile)."""

    def __init__(self, start: int, stop: int):
        self.start, self.stop, self.seen = start, stop, -1  # the first call carries the prompt
        self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self.wall = 0.0

    def put(self, value):
        torch.cuda.synchronize()
        self.seen += 1
        if self.seen == self.start:
            self.profiler.__enter__()
            self.wall = time.perf_counter()
        elif self.seen == self.stop:
            self.wall = time.perf_counter() - self.wall
            self.profiler.__exit__(None, None, None)

    def end(self):
        pass


def is_kernel(event) -> bool:
    """A GPU activity (kernel, copy, memset), not the GPU-side span of one of `REGIONS`' labels: a span covers the
    gaps between its kernels, so counting it would hide idle time and count busy time twice."""
    return event.device_type == torch.autograd.DeviceType.CUDA and not event.key.startswith("oscar::")


def idle_host_time(events, steps: int, top: int, outermost=lambda event: event.cpu_parent is None):
    """The GPU's idle time per step (gaps between kernels, first to last kernel of the window) and the outermost host
    operators (`outermost(event)`) overlapping those gaps, by time per step; the rest of the idle time is Python
    between operators."""
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if is_kernel(e))
    if not kernels:  # a CPU run
        return 0.0, []
    gaps, busy_until = [], kernels[0][1]
    for start, end in kernels[1:]:
        if start > busy_until:
            gaps.append((busy_until, start))
        busy_until = max(busy_until, end)
    overlap: dict[str, float] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and outermost(e):
            lo, hi = e.time_range.start, e.time_range.end
            inside = sum(max(0.0, min(hi, b) - max(lo, a)) for a, b in gaps)
            if inside > 0:
                overlap[e.name] = overlap.get(e.name, 0.0) + inside
    by_time = sorted(overlap.items(), key=lambda item: -item[1])[:top]
    idle_ms = sum(b - a for a, b in gaps) / steps / 1000
    return idle_ms, [{"name": name, "us_per_step": us / steps} for name, us in by_time]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--cache", nargs="+", default=["oscar", "static"], choices=list(CACHES))
    parser.add_argument("--eager", action="store_true", help="disable_compile=True: where an eager step's time goes")
    parser.add_argument("--prefill", action="store_true", help="profile the prefill (time to the first token) instead")
    parser.add_argument("--prefill-chunk-size", type=int, default=None, help="generate's chunked prefill")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    _label_regions()
    benchmark = "where a compiled model.generate decode step's time goes, Llama-3.1-8B shape, random bf16 weights"
    record = {**records.header(benchmark), "rows": []}

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(LlamaConfig(**LLAMA_31_8B), dtype=torch.bfloat16).eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.context), device="cuda")
    start, stop = (0, 1) if args.prefill else (16, 24)  # the streamer's first call carries the prompt, before prefill
    for cache in args.cache:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        window = _ProfileWindow(start, stop)
        implementation, cache_config = CACHES[cache]
        options = dict(max_new_tokens=stop + 2, min_new_tokens=stop + 2, do_sample=False, streamer=window,
                       cache_implementation=implementation)  # fmt: skip
        if args.eager:
            options["disable_compile"] = True
        else:
            options["compile_config"] = CompileConfig(fullgraph=True)
        if cache_config is not None:
            options["cache_config"] = cache_config
        if args.prefill_chunk_size:
            options["prefill_chunk_size"] = args.prefill_chunk_size
        if args.prefill:  # a warm process: Triton's kernels compiled, as for bench_generate's time to first token
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), **{**options, "streamer": None})
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), **options)
        steps = stop - start
        averages = window.profiler.key_averages()
        events = [e for e in averages if is_kernel(e)]
        gpu_us = sum(e.self_device_time_total for e in events) / steps
        mode = "eager" if args.eager else "compiled"
        print(f"\n{cache} {mode}, B={args.batch} context={args.context}: wall {1000 * window.wall / steps:.2f} ms "
              f"per step, GPU busy {gpu_us / 1000:.2f} ms per step")  # fmt: skip
        kernels = [
            {"name": e.key, "us_per_step": e.self_device_time_total / steps, "calls_per_step": e.count // steps}
            for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]
        ]
        for k in kernels:
            print(f"  {k['us_per_step']:9.1f} us  {k['calls_per_step']:4d}x  {k['name'][:100]}")
        # The host side: CUDA runtime/driver calls per step (kernels launched one by one vs one graph launch, the
        # per-step synchronisations) and the host operators that take the most time.
        host = [e for e in averages if e.device_type == torch.autograd.DeviceType.CPU]
        runtime = [
            {"name": e.key, "us_per_step": e.self_cpu_time_total / steps, "calls_per_step": e.count / steps}
            for e in sorted(host, key=lambda e: -e.self_cpu_time_total)
            if e.key.startswith(("cuda", "cu"))
        ][: args.top]
        operators = [
            {"name": e.key, "us_per_step": e.cpu_time_total / steps, "calls_per_step": e.count / steps}
            for e in sorted(host, key=lambda e: -e.cpu_time_total)
            if not e.key.startswith(("cuda", "cu", "oscar::"))
        ][: args.top]
        regions = [
            {"name": e.key, "host_us_per_step": e.cpu_time_total / steps,
             "gpu_us_per_step": e.device_time_total / steps, "calls_per_step": e.count / steps}
            for e in sorted(host, key=lambda e: -e.cpu_time_total)
            if e.key.startswith("oscar::")
        ]  # fmt: skip
        idle_ms, idle_operators = idle_host_time(window.profiler.events(), steps, args.top)
        print(f"  GPU idle {idle_ms:.2f} ms per step; outermost host operators in that time:")
        for k in idle_operators:
            print(f"  {k['us_per_step']:9.1f} us  {k['name'][:100]}")
        inductor_counters = dict(torch._dynamo.utils.counters["inductor"])  # a cudagraph skip would show here
        print(f"  host: Inductor counters {inductor_counters}")
        for k in runtime + operators:
            print(f"  {k['us_per_step']:9.1f} us  {k['calls_per_step']:6.1f}x  {k['name'][:100]}")
        for k in regions:
            print(f"  {k['name']:24s} host {k['host_us_per_step']:10.1f} us, GPU {k['gpu_us_per_step']:10.1f} us, "
                  f"{k['calls_per_step']:6.1f}x")  # fmt: skip
        record["rows"].append(
            dict(
                batch=args.batch,
                context=args.context,
                cache=cache,
                compiled=not args.eager,
                wall_ms=1000 * window.wall / steps,
                gpu_busy_ms=gpu_us / 1000,
                gpu_idle_ms=idle_ms,
                kernels=kernels,
                runtime_calls=runtime,
                prefill_chunk_size=args.prefill_chunk_size,
                host_operators=operators,
                oscar_regions=regions,
                idle_host_operators=idle_operators,
                inductor_counters=inductor_counters,
            )  # fmt: skip
        )
    slug = records.gpu_slug(record["device"])
    name = f"profile_generate_{'prefill_' if args.prefill else 'eager_' if args.eager else ''}{slug}.json"
    records.write_record(args.out / name, record)


if __name__ == "__main__":
    main()
