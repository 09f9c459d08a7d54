"""A/B timing of versions of the Gluon decode kernel under the installed launcher, in one process.

    python benchmarks/ab_gluon.py NAME=VERSION [NAME=VERSION ...] [--shapes 8x32768 ...] [--rounds 3]
        [--out benchmarks/history]

Each VERSION is a file or a git revision of kernels/decode_attention_gluon.py (`landed=HEAD`, `variant=9398208`,
`probe=/tmp/probe.py`); it is loaded as a module of its own and swapped in as the launcher's Gluon kernel, so that
everything else (the launcher, its tuning, the Triton split and merge kernels) is the installed code. The first arm is
the baseline. For every shape (bench_decode_attention.py's inputs: Hq=32 / Hkv=8 / D=128, 64 residual tokens, enough
input sets to exceed 4x the L2 cache): each arm's relative error against the float32 reference on the first set
(where it fits), then `--rounds` rounds of CUDA-graph medians with the arms interleaved, so that a drift of the GPU's
clocks or of another tenant's load falls on every arm alike. Differences smaller than the spread of one arm's rounds
are noise.

Writes `ab_gluon_<gpu>_<names>_<commit>.json` under --out (device, versions, commit, each arm's version and the git
blob hash of its file, per-round times, medians, ratios to the baseline, errors) and prints a table last. The
benchmark's records (`results/decode_attention_<gpu>.json`) are what the README quotes; this is for measuring a kernel
change before it lands, or a deliberately wrong probe (an arm whose error is reported, not enforced).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
import triton
from oscar_hf.kernels import decode_attention
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
import bench_decode_attention as bench  # noqa: E402  (its inputs, timing and reference helpers)

from oscar_hf.config import OscarConfig  # noqa: E402
from oscar_hf.reference import decode_attention as decode_attention_reference  # noqa: E402

KERNEL_PATH = "kernels/decode_attention_gluon.py"


def load_arm(version: str):
    """The Gluon module of `version` (a file, or a git revision of KERNEL_PATH) and its git blob hash."""
    path = Path(version)
    if path.is_file():
        source = path.read_bytes()
    else:
        git = subprocess.run(["git", "show", f"{version}:{KERNEL_PATH}"], capture_output=True)
        if git.returncode:
            raise SystemExit(f"{version!r} is neither a file nor a revision of {KERNEL_PATH}: {git.stderr.decode()}")
        source = git.stdout
    blob = hashlib.sha1(b"blob %d\0" % len(source) + source).hexdigest()  # = git hash-object of that file
    with tempfile.NamedTemporaryFile("wb", suffix=".py", delete=False) as copy:
        copy.write(source)
    spec = importlib.util.spec_from_file_location(f"gluon_arm_{blob[:12]}", copy.name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, blob


def measure_shape(batch: int, context: int, arms: dict, rounds: int, gen: torch.Generator, progress) -> dict:
    """One shape: every arm's error against the float32 reference on the first input set (where it fits), then
    `rounds` rounds of CUDA-graph medians over all input sets, the arms interleaved."""
    config, scale = OscarConfig(), 1 / math.sqrt(bench.HEAD_DIM)
    data, _, _ = bench.timed_sets(batch, context, config, torch.cuda.get_device_properties(0).L2_cache_size, gen)
    sets = len(data)
    reference = None
    if batch * context <= bench.REFERENCE_TOKENS:
        inputs = (data[0][k] for k in ("q", "quantized", "rk", "rv"))
        reference = decode_attention_reference(*inputs, None, scale, config)

    def call():
        for s in data:
            bench.fused(s, config, scale)

    errors, times = {}, {name: [] for name in arms}
    installed = decode_attention._gluon
    try:
        for name, module in arms.items():
            decode_attention._gluon = module
            if reference is not None:
                errors[name] = bench.rel_err(bench.fused(data[0], config, scale), reference)
        for _ in range(rounds):
            for name, module in arms.items():
                decode_attention._gluon = module
                times[name].append(bench.timed(call, sets)["us_graph"])
                progress.update()
    finally:
        decode_attention._gluon = installed
    medians = {name: statistics.median(t) for name, t in times.items()}
    baseline = medians[next(iter(arms))]
    return {
        "batch": batch,
        "context": context,
        "input_sets": sets,
        "rel_err_vs_fp32_reference": errors,
        "us_graph_rounds": times,
        "us_graph_median": medians,
        "ratio_to_baseline": {name: median / baseline for name, median in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arms", nargs="+", help="NAME=VERSION (a file or a git revision); the first is the baseline")
    parser.add_argument("--shapes", nargs="+", default=["8x32768", "8x131072", "1x32768", "1x131072", "8x4096"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "history"))
    args = parser.parse_args()
    if not torch.cuda.is_available() or decode_attention._gluon is None:
        raise SystemExit("ab_gluon needs a CUDA GPU and a Triton with Gluon (triton.experimental.gluon)")

    arms, versions = {}, {}
    for spec in args.arms:
        name, _, version = spec.partition("=")
        if not version:
            raise SystemExit(f"arm {spec!r}: write NAME=VERSION (e.g. landed=HEAD)")
        arms[name], blob = load_arm(version)
        versions[name] = {"version": version, "blob": blob}
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    with tqdm(total=len(args.shapes) * args.rounds * len(arms), desc="ab_gluon", unit="timing") as progress:
        for shape in args.shapes:
            batch, context = map(int, shape.split("x"))
            rows.append(measure_shape(batch, context, arms, args.rounds, gen, progress))
            torch.cuda.empty_cache()

    device = torch.cuda.get_device_name()
    record = {
        "device": device,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": bench.git_commit(),
        "timing": "CUDA-graph medians (do_bench_cudagraph) per call, arms interleaved in each round",
        "shape": {"q_heads": bench.Q_HEADS, "kv_heads": bench.KV_HEADS, "head_dim": bench.HEAD_DIM},
        "arms": versions,
        "shapes": rows,
    }
    out = Path(args.out) / f"ab_gluon_{bench.gpu_slug(device)}_{'_'.join(arms)}_{record['git_commit'] or 'nogit'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")

    print(f"\n{device}, us (CUDA-graph medians of {args.rounds} interleaved rounds), ratio to {next(iter(arms))}:")
    print(f"{'shape':>11}  " + " ".join(f"{name:>17}" for name in arms) + "   rel. error")
    for row in rows:
        cells = " ".join(f"{row['us_graph_median'][n]:9.2f} ({row['ratio_to_baseline'][n]:.3f})" for n in arms)
        errors = " ".join(f"{n}:{e:.2e}" for n, e in row["rel_err_vs_fp32_reference"].items())
        print(f"B={row['batch']:<3} {row['context']:>7}  {cells}   {errors}")
    print(f"record: {out}")


if __name__ == "__main__":
    main()
