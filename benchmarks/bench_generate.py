"""End-to-end decode with a Llama-3.1-8B-shaped model (random bf16 weights): bf16 DynamicCache vs OScaR, one run.

    python benchmarks/bench_generate.py [--batch 8] [--context 32768] [--steps 32]

For each cache: prefill the context (in chunks, so activations stay bounded), then time decode steps (one forward
of one token per row, what `generate` runs per step) with CUDA events, and record the peak GPU memory of the whole
run. Prints a table and writes benchmarks/results/generate_<gpu>.json. Random weights run at the real cost; the
tokens they produce are meaningless.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import oscar_hf
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


def run(model, cache, batch: int, context: int, steps: int, chunk: int) -> dict:
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (batch, context), device="cuda")
    if isinstance(cache, OscarCache):
        cache.reserve(context + steps)  # as generate() does with its max length
    with torch.inference_mode():
        for start in tqdm(range(0, context, chunk), desc="prefill", leave=False):
            out = model(ids[:, start : start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        times = []
        for _ in tqdm(range(steps), desc="decode", leave=False):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            out = model(token, past_key_values=cache, use_cache=True)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
            token = out.logits[:, -1:].argmax(-1)
    warm = times[3:]  # the first steps compile/tune kernels
    return {
        "decode_step_ms_median": statistics.median(warm),
        "decode_step_ms_p20_p80": [statistics.quantiles(warm, n=5)[0], statistics.quantiles(warm, n=5)[-1]],
        "tokens_per_s": batch * 1000 / statistics.median(warm),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "kv_cache": {k: v for k, v in vars(oscar_hf.kv_memory(cache)).items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens per forward)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_31_8B)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    caches = {
        "bf16 DynamicCache (sdpa)": lambda: DynamicCache(config=model.config),
        "oscar int2 (fused)": lambda: OscarCache(model.config, OscarConfig(attention="fused", method="paper")),
        "oscar int2 (portable)": lambda: OscarCache(model.config, OscarConfig(attention="portable", method="paper")),
    }
    results = {}
    for name, make in caches.items():
        try:
            results[name] = run(model, make(), args.batch, args.context, args.steps, args.chunk)
        except torch.OutOfMemoryError as error:
            results[name] = {"error": f"out of memory: {error}".splitlines()[0]}
    baseline = results["bf16 DynamicCache (sdpa)"].get("decode_step_ms_median")
    for entry in results.values():
        if baseline and "decode_step_ms_median" in entry:
            entry["speedup_vs_bf16"] = baseline / entry["decode_step_ms_median"]

    gpu = torch.cuda.get_device_name()
    # The GPU machine gets a copy of the tree without .git: OSCAR_GIT_COMMIT names the commit there.
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    commit = commit or os.environ.get("OSCAR_GIT_COMMIT")
    record = {
        "benchmark": "decode step, Llama-3.1-8B shape, random bf16 weights",
        "device": gpu,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "shape": {"batch": args.batch, "context": args.context, "decode_steps_timed": args.steps - 3, **LLAMA_31_8B},
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    slug = gpu.lower().replace("nvidia", "").strip().replace(" ", "-")
    path = args.out / f"generate_{slug}_b{args.batch}_ctx{args.context}.json"
    path.write_text(json.dumps(record, indent=2))
    print(f"\n{gpu}, B={args.batch}, context={args.context} ({path})")
    print(f"{'cache':28s} {'step ms':>9s} {'tok/s':>8s} {'peak GiB':>9s} {'vs bf16':>8s}")
    for name, entry in results.items():
        if "error" in entry:
            print(f"{name:28s} {entry['error']}")
            continue
        print(
            f"{name:28s} {entry['decode_step_ms_median']:9.2f} {entry['tokens_per_s']:8.1f} "
            f"{entry['peak_memory_gib']:9.1f} {entry.get('speedup_vs_bf16', float('nan')):7.2f}x"
        )


if __name__ == "__main__":
    main()
