"""What every benchmark's record shares: its header (benchmark, run, device, date, commit, versions), the GPU's copy
bandwidth, the byte roof of a decode step, and reading and writing record files.

A record is one JSON file under benchmarks/results/ per benchmark and device (`gpu_slug`). A benchmark that adds runs
to its record keeps them in the runs layout (`start_run`: `{benchmark, runs: {run: header}, rows, ratios}`, rows
naming their run); the others write one run per file, the header at the top. Ratios are only taken between rows of
one run: one process, one GPU.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import secrets
import statistics
import subprocess
import timeit
from pathlib import Path

import torch
import transformers
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from oscar_hf import OscarCache

ROOT = Path(__file__).resolve().parents[1]
# The GPU machine runs a copy of the tree whose .git is stale: this variable names the commit there.
COMMIT_VARIABLE = "OSCAR_GIT_COMMIT"


def new_run() -> str:
    """A run id: UTC time and a random suffix (the time orders runs; rows of one run share a process and a device)."""
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%SZ}-{secrets.token_hex(3)}"


@functools.cache
def commit() -> str | None:
    """The commit this process runs (`OSCAR_GIT_COMMIT` where set, else the checkout's HEAD; None outside a git
    checkout), read once: commits made while a long benchmark runs are not its code."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return os.environ.get(COMMIT_VARIABLE) or head.stdout.strip() or None


def versions() -> dict:
    """The versions of the libraries a measurement depends on (triton: None where it is not installed)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__}


def device_name(device: str | torch.device = "cuda") -> str:
    """The GPU's name ("NVIDIA H200") or the device type ("cpu")."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def machine() -> str:
    """The host's processor and torch's thread count: what a CPU benchmark's numbers depend on."""
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def header(benchmark: str, device: str | torch.device = "cuda") -> dict:
    """The fields every record starts with; `run` is a new run id (one per invocation)."""
    return {
        "benchmark": benchmark,
        "run": new_run(),
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "versions": versions(),
    }


def gpu_slug(device: str) -> str:
    """ "NVIDIA H200" -> "h200": the record file's suffix."""
    return device.lower().replace("nvidia", "").strip().replace(" ", "-")


def start_run(path: Path, run_header: dict, **fields) -> dict:
    """The runs-layout record at `path` (a new one if there is none) with this run added: `runs[run]` holds the
    header's fields but `benchmark` and `run`, then `fields`."""
    if path.exists():
        record = json.loads(path.read_text())
        if "runs" not in record:
            raise SystemExit(f"{path} is not a record of runs (an older format): move it aside or pass another --out")
    else:
        record = {"benchmark": run_header["benchmark"], "runs": {}, "rows": [], "ratios": []}
    record["runs"][run_header["run"]] = {
        **{k: v for k, v in run_header.items() if k not in ("benchmark", "run")},
        **fields,
    }
    return record


def write_record(path: Path, record: dict | list, indent: int = 2) -> None:
    """Write a record whole (benchmarks rewrite theirs after every row, so an interrupted run keeps its rows)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=indent) + "\n")


def append_rows(path: Path, rows: list[dict]) -> None:
    """Add rows to a record kept as a JSON list of rows (the CPU accuracy benchmarks')."""
    write_record(path, (json.loads(path.read_text()) if path.exists() else []) + rows, indent=1)


def copy_bandwidth(device: str | torch.device = "cuda") -> dict:
    """The device's copy roof: a large buffer copied onto another, `bytes` read and written in the median `us`
    (triton's do_bench on a GPU, 2 GiB; a CPU run, a test of its script, copies 64 MiB)."""
    device = torch.device(device)
    moved, ms = _time_copy(device, 1 << 31 if device.type == "cuda" else 1 << 26)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the benchmark's own allocations start from an empty pool
    return {"bytes": moved, "us": ms * 1e3, "GBps": moved / ms / 1e6}


def _time_copy(device: torch.device, size: int) -> tuple[int, float]:
    """Bytes moved by one copy of `size` bytes (read and written) and its median milliseconds."""
    source = torch.randn(size // 4, device=device)
    target = torch.empty_like(source)
    if device.type == "cuda":
        from triton.testing import do_bench

        ms = do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")
    else:
        ms = 1e3 * statistics.median(timeit.repeat(lambda: target.copy_(source), number=1, repeat=7))
    return source.nbytes + target.nbytes, ms


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a decode step reads: every parameter (a tied one once) but the input embedding table, unless
    the output head shares it (the step gathers one row of it per sequence)."""
    total = sum(p.nbytes for p in model.parameters())
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embedding.weight:
        total -= embedding.weight.nbytes
    return total


def cache_bytes(cache) -> tuple[int, int]:
    """Bytes a transformers cache holds, and what its tokens would take in bf16: an OscarCache's
    `memory_footprint()` (quantized region, exact windows, other layers); for transformers' Dynamic, Static and
    Quantized caches each layer's key and value tensors, a QuantizedLayer's quantized ones included (a Static layer's
    tensors are its whole capacity, as its attention reads them)."""
    if isinstance(cache, OscarCache):
        memory = cache.memory_footprint()
        return memory.total_bytes, memory.bf16_bytes
    held = bf16 = 0
    for layer in cache.layers:
        # `_quantized_*`: QuantizedLayer's quantized tokens (transformers names them only privately)
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            tensor = getattr(layer, name, None)
            if torch.is_tensor(tensor):
                held += _stored_bytes(tensor)
                bf16 += 2 * tensor.numel()
    return held, bf16


def _stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor stores: a tensor subclass's (quanto's packed codes, scales and shifts) summed over its inner
    tensors, whose own `nbytes` would count the logical dtype."""
    if is_traceable_wrapper_subclass(tensor):
        return sum(_stored_bytes(getattr(tensor, name)) for name in tensor.__tensor_flatten__()[0])
    return tensor.nbytes


def roof(step_ms: float | None, weights: int, held: int, held_bf16: int, bandwidth: dict) -> dict:
    """A decode step's byte roof beside its time: the bytes it must read (`weights` and the `held` bytes of its cache,
    `weight_bytes` and `cache_bytes`) over the copy bandwidth measured in the same process (`copy_bandwidth`), and the
    roof of a bf16 engine at the memory limit (the same weights, the same tokens' K/V in bf16: `held_bf16`).
    `roof_fraction` = roof_ms / step_ms, the share of its roof the step reaches."""
    bytes_per_ms = bandwidth["GBps"] * 1e6
    roof_ms = (weights + held) / bytes_per_ms
    return {
        "roof_ms": roof_ms,
        "bf16_roof_ms": (weights + held_bf16) / bytes_per_ms,
        "roof_fraction": roof_ms / step_ms if step_ms else None,
    }
