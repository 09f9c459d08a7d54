"""Two GPUs: `device_map="auto"` (the layers split over 2 GPUs) and tensor parallel (`tp_plan="auto"` under torchrun),
with a Llama-3.1-8B-shaped model (the real shape: 32 layers, 32 query / 8 KV heads, head_dim 128; random bf16
weights), the OScaR cache against DynamicCache, greedy tokens compared with the single-GPU run.

    python benchmarks/bench_multigpu.py [--context 4096] [--new-tokens 32] [--dtype bfloat16|float32] [--append]
    python benchmarks/bench_multigpu.py --dtype float32 --modes tp --append   # re-run one GPU + TP only

One command runs everything (the tensor-parallel part launches `torchrun --nproc-per-node 2` on this script itself):

1. the random-weight model is saved once (seed 0, `--model-dir`), so that every run loads the same weights;
2. single GPU (cuda:0): greedy `generate`, DynamicCache and `cache_implementation="oscar"`: the reference tokens;
3. `device_map="auto"` with GPU 0 capped at about half the weights, so the layers split over both GPUs; every OScaR
   layer must hold its storage on its own layer's device;
4. tensor parallel: each rank holds 4 of the 8 KV heads of every layer, and the OScaR layers all-reduce their token
   norms over the TP group (oscar_hf/cache/layer.py, `OscarLayer.head_group`).

`step_ms` is the median time of a decode step inside `generate` (time between consecutive stopping-criteria calls,
after a device synchronisation), warm-up run excluded. Writes benchmarks/results/multigpu_<gpu>.json with one row per
(mode, cache). `tokens_equal_single_gpu` compares the new tokens with the single-GPU run of the same cache.
device_map runs the same kernels on the same shapes, so its tokens should be bit-identical. Tensor parallel sums the
row-parallel projections across ranks in another order, so even DynamicCache may diverge from one GPU on random
weights (near-uniform logits); its row is the yardstick for the OScaR row. `--dtype float32` runs the same bf16
weights in float32, where the reordered sums differ by ~1e-7 instead of ~1e-3, and `--append` adds those rows to the
record (each row names its dtype).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import records
import torch
from bench_generate import LLAMA_31_8B  # the model shape every end-to-end benchmark uses
from transformers import (
    AutoModelForCausalLM,
    DistributedConfig,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    StoppingCriteria,
)

from oscar_hf import OscarLayer, cache_kwargs

CACHES = ("dynamic", "oscar")


class StepTimer(StoppingCriteria):
    """Called by `generate` once per step, after the forward: records the wall time of each step."""

    def __init__(self):
        self.stamps = []

    def __call__(self, input_ids, scores, **kwargs):
        if input_ids.is_cuda:
            torch.cuda.synchronize(input_ids.device)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_ms(self) -> float:
        steps = [1000 * (b - a) for a, b in zip(self.stamps, self.stamps[1:])]  # decode steps (the first is prefill)
        return statistics.median(steps)


def prompt(vocab: int, context: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, context), generator=torch.Generator().manual_seed(1))


def generate(model, ids: torch.Tensor, cache: str, new_tokens: int) -> tuple[list[int], float, object, list[float]]:
    """Greedy new tokens, median decode step time, the cache and each step's logit margin (top-1 minus top-2); a
    short warm-up first (Triton compiles, cuBLAS tunes; 256 tokens quantize one block, so the OScaR kernels are
    compiled before the timed run)."""

    def options() -> dict:
        # Eager steps for both caches (OscarCache could compile its steps on one GPU; this compares placements)
        common = dict(do_sample=False, return_dict_in_generate=True, disable_compile=True)
        if cache == "oscar":
            return dict(cache_implementation="oscar", **common)
        return dict(**cache_kwargs(DynamicCache(config=model.config)), **common)

    model.generate(ids[:, :256], max_new_tokens=4, **options())
    timer = StepTimer()
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        stopping_criteria=[timer],
        output_logits=True,
        **options(),
    )
    margins = [float(top[0, 0] - top[0, 1]) for top in (logits.float().topk(2).values for logits in out.logits)]
    return out.sequences[0, ids.shape[1] :].tolist(), timer.step_ms(), out.past_key_values, margins


def prompt_codes(cache, context: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's K and V codes of the quantized prompt tokens (`[B, Hkv, tokens, D]` uint8, on the CPU): what a
    TP rank's quantizer must reproduce for its heads."""
    codes = []
    for layer in cache.layers:
        stored, layout = layer.quantized(), layer.layout
        tokens = min(layer.quantized_length, context)
        codes.append(
            tuple(
                layout.unpack_codes(words, bits).cpu()[:, :, :tokens]
                for words, bits in ((stored.key_codes, layout.key_bits), (stored.value_codes, layout.value_bits))
            )
        )
    return codes


def check_layers_on_their_devices(model, cache) -> list[str]:
    """Every OScaR layer's residual window and quantized storage sit on the device of its model layer."""
    devices = []
    for index, layer in enumerate(cache.layers):
        device = model.model.layers[index].self_attn.k_proj.weight.device
        devices.append(str(device))
        if not isinstance(layer, OscarLayer):
            continue
        tensors = [layer.residual_keys, layer.residual_values, *(t for t in layer.quantized() if t is not None)]
        wrong = {str(t.device) for t in tensors if t.device != device}
        if wrong:
            raise AssertionError(f"OscarLayer {index} stores on {sorted(wrong)}, its model layer is on {device}")
    return devices


def first_divergence(tokens: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)


def tp_worker(args) -> None:
    """One rank of `torchrun --nproc-per-node 2`: tp_plan="auto", both caches; rank 0 writes the results."""
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():  # (the CPU runs this worker too, with gloo, to check the script)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=getattr(torch, args.dtype), distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    ids = prompt(model.config.vocab_size, args.context).to(model.device)
    results = {}
    for cache in CACHES:
        tokens, step_ms, kv, _ = generate(model, ids, cache, args.new_tokens)
        results[cache] = dict(tokens=tokens, step_ms=step_ms, **_kernels(kv))
        if cache == "oscar":
            layer = kv.layers[0]
            held, total = layer.residual_keys.shape[1], model.config.num_key_value_heads
            if layer.head_group is None or held * torch.distributed.get_world_size() != total:
                raise AssertionError(f"rank {rank}: layer 0 holds {held} of {total} KV heads, group {layer.head_group}")
            heads = slice(rank * held, (rank + 1) * held)
            counts = torch.zeros(2, dtype=torch.int64, device=model.device)  # differing codes, compared codes
            for mine, single in zip(prompt_codes(kv, args.context), torch.load(args.single_codes)):
                for a, b in zip(mine, single):
                    counts += torch.tensor([(a != b[:, heads]).sum(), a.numel()], device=counts.device)
            torch.distributed.all_reduce(counts)
            results[cache]["codes_differing_fraction"] = counts[0].item() / counts[1].item()
    if rank == 0:
        Path(args.tp_worker).write_text(json.dumps(results))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "oscar-llama-3.1-8b-random")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="compute dtype")
    parser.add_argument("--append", action="store_true", help="keep the record's rows of other dtypes or modes")
    parser.add_argument(
        "--modes", nargs="+", choices=("device_map", "tp"), default=("device_map", "tp"), help="besides one GPU"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--tp-worker", help=argparse.SUPPRESS)  # internal: run as a torchrun rank, write here
    parser.add_argument(  # internal: the single-GPU run's prompt codes, for the TP ranks to compare with
        "--single-codes",
        type=Path,
        default=Path(tempfile.gettempdir()) / "oscar-single-gpu-codes.pt",
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.tp_worker:
        return tp_worker(args)
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"bench_multigpu needs 2 CUDA devices, found {torch.cuda.device_count()}.")

    if not (args.model_dir / "config.json").exists():
        print(f"saving the random-weight model to {args.model_dir}")
        torch.manual_seed(0)
        with torch.device("cuda:0"):
            model = LlamaForCausalLM._from_config(LlamaConfig(**LLAMA_31_8B), dtype=torch.bfloat16)
        model.save_pretrained(args.model_dir)
        del model
        torch.cuda.empty_cache()

    benchmark = (
        "greedy generate on 2 GPUs (device_map='auto', tp_plan='auto') vs 1 GPU, Llama-3.1-8B shape, random bf16 "
        "weights (run in each row's dtype), eager decode steps"
    )
    record = records.header(benchmark, "cuda:0")
    path = args.out / f"multigpu_{records.gpu_slug(record['device'])}.json"
    record.update(
        device=f"2x {record['device']}",
        shape={"batch": 1, "context": args.context, "new_tokens": args.new_tokens, **LLAMA_31_8B},
    )
    kept = []
    if args.append and path.exists():
        rerun = {"single", *args.modes}
        kept = [
            row
            for row in json.loads(path.read_text())["results"]
            if row.get("dtype") != args.dtype or row["mode"] not in rerun
        ]
    rows, reference = [], {}

    def save():
        """Write the record after every mode, so the modes that finished survive a later failure."""
        for row in rows:  # rows kept by --append come from earlier runs: each row names its own commit and run
            row.update(dtype=args.dtype, commit=record["commit"], run=record["run"])
        records.write_record(path, {**record, "results": kept + rows})

    ids = prompt(LLAMA_31_8B["vocab_size"], args.context)

    print("single GPU")
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, device_map="cuda:0").eval()
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for cache in CACHES:
        tokens, step_ms, kv, margins = generate(model, ids.to("cuda:0"), cache, args.new_tokens)
        reference[cache] = tokens, margins
        if cache == "oscar":
            torch.save(prompt_codes(kv, args.context), args.single_codes)
        rows.append(
            dict(mode="single", cache=cache, gpus=1, tokens_equal_single_gpu=True, step_ms=step_ms, **_kernels(kv))
        )
    del model
    torch.cuda.empty_cache()
    save()

    if "device_map" in args.modes:
        device_map_run(args, dtype, weight_bytes, ids, reference, rows, record)
        save()
    if "tp" in args.modes:
        tp_run(args, ids, reference, rows)
        save()
    print_rows(record, args, path, rows)


def device_map_run(args, dtype, weight_bytes, ids, reference, rows, record) -> None:
    print("device_map='auto' over 2 GPUs")
    cap = {0: f"{weight_bytes * 0.55 / 2**30:.1f}GiB", 1: f"{torch.cuda.mem_get_info(1)[1] * 0.9 / 2**30:.0f}GiB"}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype, device_map="auto", max_memory=cap).eval()
    placed = sorted({str(d) for d in model.hf_device_map.values()})
    if len(placed) < 2:
        raise AssertionError(f"device_map='auto' with max_memory={cap} placed everything on {placed}")
    for cache in CACHES:
        tokens, step_ms, kv, _ = generate(model, ids.to(model.device), cache, args.new_tokens)
        row = dict(mode="device_map", cache=cache, gpus=2, step_ms=step_ms, **_kernels(kv))
        if cache == "oscar":
            row["layer_devices"] = sorted(set(check_layers_on_their_devices(model, kv)))
        rows.append(_compare(row, tokens, reference[cache]))
    record["device_map_max_memory"] = cap
    del model
    torch.cuda.empty_cache()


def tp_run(args, ids, reference, rows) -> None:
    print("tensor parallel (torchrun --nproc-per-node 2)")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__]
        options = [
            "--context",
            str(args.context),
            "--new-tokens",
            str(args.new_tokens),
            "--model-dir",
            str(args.model_dir),
            "--dtype",
            args.dtype,
            "--single-codes",
            str(args.single_codes),
        ]
        subprocess.run([*command, *options, "--tp-worker", out.name], check=True)
        tp = json.loads(Path(out.name).read_text())
    for cache in CACHES:
        tokens = tp[cache].pop("tokens")
        row = dict(mode="tp", cache=cache, gpus=2, **tp[cache])  # step_ms, fused_kernels, codes_differing_fraction
        rows.append(_compare(row, tokens, reference[cache]))


def print_rows(record, args, path, rows) -> None:
    print(f"\n{record['device']}, context {args.context}, {args.new_tokens} new tokens ({path})")
    print(f"{'mode':11s} {'cache':8s} {'gpus':>4s} {'step ms':>8s}  tokens equal to 1 GPU")
    for row in rows:
        diverged = "" if row["tokens_equal_single_gpu"] else f" (first differs at {row['first_divergence']})"
        print(
            f"{row['mode']:11s} {row['cache']:8s} {row['gpus']:4d} {row['step_ms']:8.2f}  "
            f"{row['tokens_equal_single_gpu']}{diverged}"
        )


def _kernels(cache) -> dict:
    """Whether the OScaR layers decode with the fused Triton kernels (absent for DynamicCache)."""
    layer = cache.layers[0]
    return {"fused_kernels": layer.use_kernels} if isinstance(layer, OscarLayer) else {}


def _compare(row: dict, tokens: list[int], reference: tuple[list[int], list[float]]) -> dict:
    """Tokens against the single-GPU run's; where they diverge, how close that run's top two logits were there
    (a near tie is flipped by rounding-order differences, a bug would not need one)."""
    reference_tokens, margins = reference
    diverged = first_divergence(tokens, reference_tokens)
    row = dict(row, tokens_equal_single_gpu=diverged is None, first_divergence=diverged)
    if diverged is not None:
        row.update(
            single_gpu_margin_at_divergence=margins[diverged], single_gpu_median_margin=statistics.median(margins)
        )
    return row


if __name__ == "__main__":
    main()
