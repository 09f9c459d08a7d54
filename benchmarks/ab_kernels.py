"""A/B timing of versions of the decode kernels (launcher, Triton and Gluon kernels, merge), in one process.

    python benchmarks/ab_kernels.py NAME=VERSION [NAME=VERSION ...] [--shapes 8x32768 ...] [--rounds 3]
        [--residual 64] [--shared-kv] --out DIR

Each VERSION is a git revision (`landed=HEAD`, `variant=1b430fc`: its `kernels/` tree) or a directory holding a copy of
`kernels/` (a probe, one file edited). Each is loaded as a package of its own, and its `decode_attention_triton` is
timed; everything it imports from `oscar_hf` (the config, the storage layout) is the installed tree's. The first arm is
the baseline. For every shape (bench_decode_attention.py's inputs: Hq=32 / Hkv=8 / D=128, `--residual` tokens in the
residual window, enough input sets to exceed 4x the L2 cache): each arm's relative error against the float32
reference on the first set (where it fits), then `--rounds` rounds of CUDA-graph medians with the arms interleaved,
so that a drift of the GPU's clocks or of another tenant's load falls on every arm alike. Differences smaller than the
spread of one arm's rounds are noise.

`--shared-kv` times every (batch, KV head) reading the quantized data of the first one (strides 0: the same grid and
work per program, but the codes stay in L2). That separates a kernel's own speed from the GPU's memory: on an H100 the
decode call at B=8 32K reads close to its copy bandwidth, so a faster loop shows there only in part, while on an H200
(1.4x the bandwidth) the same loop is bound by its instructions, as it is here with the data in L2
(docs/kernels.md).

Writes `ab_kernels_<gpu>_<names>[_r<residual>][_sharedkv]_<run>.json` under --out (device, versions, commit, run, each
arm's version and the git tree hash of its `kernels/`, per-round times, medians, ratios to the baseline, errors) and
prints a table last. The benchmark's records (`results/decode_attention_<gpu>.json`) are what the README quotes; this is
for measuring a kernel change before it lands, or a deliberately wrong probe (an arm whose error is reported, not
enforced).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_decode_attention as bench  # its inputs, timing and reference helpers
import records
import torch
from tqdm import tqdm

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV
from oscar_hf.reference import decode_attention as decode_attention_reference

KERNELS = "kernels"


def _git_object(kind: bytes, body: bytes) -> str:
    return hashlib.sha1(b"%s %d\0" % (kind, len(body)) + body).hexdigest()


def tree_hash(files: dict[str, bytes]) -> str:
    """The git tree hash of a folder of regular files {name: content}: `git rev-parse REV:kernels` for a revision's."""
    entries = (
        b"100644 %s\0" % name.encode() + bytes.fromhex(_git_object(b"blob", files[name])) for name in sorted(files)
    )
    return _git_object(b"tree", b"".join(entries))


def _files(version: str) -> dict[str, bytes]:
    path = Path(version)
    if path.is_dir():
        return {f.name: f.read_bytes() for f in path.iterdir() if f.is_file() and f.suffix == ".py"}
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{version}:{KERNELS}"], capture_output=True, text=True)
    if listing.returncode:
        raise SystemExit(f"{version!r} is neither a folder nor a revision with a {KERNELS}/ tree: {listing.stderr}")
    return {
        name: subprocess.run(["git", "show", f"{version}:{KERNELS}/{name}"], capture_output=True, check=True).stdout
        for name in listing.stdout.split()
    }


def load_arm(version: str):
    """The kernels package of `version` (a folder holding a copy of kernels/, or a git revision), loaded as a package
    of its own (its `decode_attention_triton` the arm's launcher), and the git tree hash of its kernels/ files."""
    files = _files(version)
    tree = tree_hash(files)
    root = Path(tempfile.mkdtemp()) / f"oscar_ab_kernels_{tree[:12]}"
    root.mkdir()
    for name, content in files.items():
        (root / name).write_bytes(content)
    spec = importlib.util.spec_from_file_location(
        root.name, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[root.name] = package  # so that the package's relative imports resolve
    spec.loader.exec_module(package)
    return package, tree


def shared_across_heads(quantized: QuantizedKV) -> QuantizedKV:
    """`quantized` with every (batch, KV head) viewing the data of the first (strides 0; shapes unchanged)."""
    return quantized._make(None if t is None else t[:1, :1].expand(t.shape) for t in quantized)


def measure_shape(
    batch: int, context: int, residual: int, arms: dict, rounds: int, gen, progress, shared_kv: bool = False
) -> dict:
    """One shape: every arm's error against the float32 reference on the first input set (where it fits), then
    `rounds` rounds of CUDA-graph medians over all input sets, the arms interleaved; with `shared_kv` every KV head
    reads the first one's quantized data (`shared_across_heads`)."""
    config, scale = OscarConfig(bits=2), 1 / math.sqrt(bench.HEAD_DIM)
    if shared_kv:  # one input set: its codes are meant to stay in L2
        data = bench.make_sets(batch, context, config, 1, gen, residual)
        data = [{**s, "quantized": shared_across_heads(s["quantized"])} for s in data]
    else:
        l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
        data, _, _ = bench.timed_sets(batch, context, config, l2_bytes, gen, residual)
    inputs = [(s["q"], s["quantized"], s["rk"], s["rv"], None, scale, config) for s in data]
    errors = {}
    if batch * context <= bench.REFERENCE_TOKENS:
        reference = decode_attention_reference(*inputs[0])
        errors = {name: bench.rel_err(arm.decode_attention_triton(*inputs[0]), reference) for name, arm in arms.items()}
        del reference
    times = {name: [] for name in arms}
    for _ in range(rounds):
        for name, arm in arms.items():
            times[name].append(
                bench.timed(lambda arm=arm: [arm.decode_attention_triton(*i) for i in inputs], len(data))["us_graph"]
            )
            progress.update()
    medians = {name: statistics.median(t) for name, t in times.items()}
    baseline = medians[next(iter(arms))]
    return {
        "batch": batch,
        "context": context,
        "residual": residual,
        "input_sets": len(data),
        "rel_err_vs_fp32_reference": errors,
        "us_graph_rounds": times,
        "us_graph_median": medians,
        "ratio_to_baseline": {name: median / baseline for name, median in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "arms", nargs="+", help="NAME=VERSION (a copy of kernels/ or a git revision); the first is the baseline"
    )
    parser.add_argument("--shapes", nargs="+", default=["8x32768", "8x131072", "1x32768", "1x131072", "8x4096"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--residual", type=int, default=bench.RESIDUAL, help="tokens in the residual window")
    parser.add_argument(
        "--shared-kv", action="store_true", help="every KV head reads the first one's quantized data (kept in L2)"
    )
    # A/B records measure a change before it lands; they are not a benchmark's current record (benchmarks/results)
    parser.add_argument("--out", required=True, help="a folder for the record")
    args = parser.parse_args()
    if not torch.cuda.is_available() or importlib.util.find_spec("triton.experimental.gluon") is None:
        raise SystemExit("ab_kernels needs a CUDA GPU and a Triton with Gluon (triton.experimental.gluon)")

    arms, versions = {}, {}
    for spec in args.arms:
        name, _, version = spec.partition("=")
        if not version:
            raise SystemExit(f"arm {spec!r}: write NAME=VERSION (e.g. landed=HEAD)")
        arms[name], tree = load_arm(version)
        versions[name] = {"version": version, "tree": tree}
    gen = torch.Generator("cuda").manual_seed(0)
    rows = []
    with tqdm(total=len(args.shapes) * args.rounds * len(arms), desc="ab_kernels", unit="timing") as progress:
        for shape in args.shapes:
            batch, context = map(int, shape.split("x"))
            rows.append(measure_shape(batch, context, args.residual, arms, args.rounds, gen, progress, args.shared_kv))
            torch.cuda.empty_cache()

    record = {
        **records.header("ab_kernels"),  # its `run`: one process, every ratio in the record within it
        "timing": "CUDA-graph medians (do_bench_cudagraph) per call, arms interleaved in each round",
        "shared_kv": args.shared_kv,
        "shape": {"q_heads": bench.Q_HEADS, "kv_heads": bench.KV_HEADS, "head_dim": bench.HEAD_DIM},
        "arms": versions,
        "shapes": rows,
    }
    window = f"_r{args.residual}" if args.residual != bench.RESIDUAL else ""
    window += "_sharedkv" if args.shared_kv else ""
    record_name = f"ab_kernels_{records.gpu_slug(record['device'])}_{'_'.join(arms)}{window}_{record['run']}.json"
    out = Path(args.out) / record_name
    records.write_record(out, record)

    shared = ", every KV head reading the first one's codes" if args.shared_kv else ""
    baseline = next(iter(arms))
    rounds = f"us (CUDA-graph medians of {args.rounds} interleaved rounds)"
    print(f"\n{record['device']}{shared}, {rounds}, ratio to {baseline}:")
    print(f"{'shape':>17}  " + " ".join(f"{name:>17}" for name in arms) + "   rel. error")
    for row in rows:
        cells = " ".join(f"{row['us_graph_median'][n]:9.2f} ({row['ratio_to_baseline'][n]:.3f})" for n in arms)
        errors = " ".join(f"{n}:{e:.2e}" for n, e in row["rel_err_vs_fp32_reference"].items())
        print(f"B={row['batch']:<3} {row['context']:>7} R={row['residual']:<3} {cells}   {errors}")
    print(f"record: {out}")


if __name__ == "__main__":
    main()
