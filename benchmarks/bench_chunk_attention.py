"""Attention of one prefill chunk over the 2-bit history, per layer on the GPU: the fused chunk kernel vs dequantize +
transformers' sdpa (issue 37).

    python benchmarks/bench_chunk_attention.py [--batch 4] [--histories 8192 32768] [--chunks 4096] [--sweep]
        [--out benchmarks/results]

Shape: Llama-3.1-8B's attention (Hq=32, Hkv=8, D=128), bf16, method="oscar" (keys rotated per head, here alternating),
a quantized history of H tokens followed by a 64-token exact window, then the chunk's own T tokens. Paths:

- `dequant_sdpa`: what the cache did before the chunk kernel (`KVStorage.history` + the model's sdpa): the dense
  history in one new bf16 buffer, the quantized region dequantized into it (`dequantize_kv_triton`), then
  transformers' `sdpa_attention_forward` with the 4D bool causal mask a chunk with history gets (it expands K/V to the
  query heads, `repeat_kv`, since a mask rules out SDPA's GQA path on CUDA);
- `fused_chunk`: the fused kernel (`ChunkHistory` with padding or a short chunk): the exact window and the chunk
  concatenated (`KVStorage.exact`), `chunk_attention_triton` over the packed history in place;
- `flash_pieces`: the same exact tokens, `chunk_attention_flash`: flash attention over them and over the history
  dequantized piece by piece (`ChunkHistory` for a long chunk without padding; `chunk_attention` picks between the
  two at `FLASH_MIN_QUERIES`, where these rows cross);
- `sdpa_dense_bf16`: the sdpa call of `dequant_sdpa` alone, on dense K/V already there (what a bf16 cache's chunk costs
  in attention): a reference point, not a path of the cache;
- `flash_dense_bf16`: the same attention by torch's flash attention on dense K/V already there (`causal_lower_right`,
  GQA without expanding K/V: no mask tensor), and `dequant_flash` the dequantization followed by it: what
  dequantize-then-flash would cost, whose transient grows with the history unless it runs piece by piece.

Each row: the median time of `triton.testing.do_bench` (ms) and the peak memory the call allocates beyond its inputs
(`transient_mib`, from `torch.cuda.max_memory_allocated`). The causal mask (built once per forward by transformers,
shared by the layers: `mask_mib`) is an input here. Kernel and flash rows carry their error against `dequant_sdpa`
(relative RMSE; both bf16). `--sweep` also times the kernel's launch variants (`ChunkTuning`). Rows are appended to
`chunk_attention_<gpu>.json` under --out, each with this process's `run` id.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import records
import torch
from oscar_hf.kernels import dequantize_kv_triton, quantize_kv_triton
from oscar_hf.kernels.chunk_attention import (
    ChunkTuning,
    chunk_attention_flash,
    chunk_attention_triton,
    default_chunk_tuning,
)
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from triton.testing import do_bench

from oscar_hf.config import OscarConfig

Q_HEADS, KV_HEADS, HEAD_DIM, WINDOW = 32, 8, 128, 64
SWEEP = (
    ChunkTuning(128, 64, 8, 2),
    ChunkTuning(128, 64, 8, 3),
    ChunkTuning(128, 32, 4, 2),
    ChunkTuning(128, 128, 8, 2),
    ChunkTuning(128, 128, 8, 3),
    ChunkTuning(256, 64, 16, 2),  # twice the query rows per dequantized K/V tile (4 warpgroups)
    ChunkTuning(256, 128, 16, 2),
    ChunkTuning(64, 64, 4, 2),
    ChunkTuning(64, 64, 4, 3),
)


def make_inputs(batch: int, history: int, chunk: int, config: OscarConfig, device: str) -> dict:
    """A quantized history of `history` tokens (quantized in 4096-token pieces, as the cache does), the exact
    window, the chunk's K/V and queries (HF's [B, T, H, D] layout, transposed), the per-head flags."""
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    key_rotated = (torch.arange(batch * KV_HEADS, device=device) % 2 == 0).view(batch, KV_HEADS)
    pieces = []
    for start in range(0, history, 4096):
        size = min(4096, history - start)
        pieces.append(
            quantize_kv_triton(
                randn(batch, KV_HEADS, size, HEAD_DIM), randn(batch, KV_HEADS, size, HEAD_DIM), config, key_rotated
            )
        )
    quantized = type(pieces[0])(*(None if p[0] is None else torch.cat(p, dim=2) for p in zip(*pieces)))
    return dict(
        quantized=quantized,
        key_rotated=key_rotated,
        window=(randn(batch, KV_HEADS, WINDOW, HEAD_DIM), randn(batch, KV_HEADS, WINDOW, HEAD_DIM)),
        new=(randn(batch, KV_HEADS, chunk, HEAD_DIM), randn(batch, KV_HEADS, chunk, HEAD_DIM)),
        query=randn(batch, chunk, Q_HEADS, HEAD_DIM).transpose(1, 2),
    )


def causal_mask(batch: int, history: int, chunk: int, device: str) -> torch.Tensor:
    """The mask transformers builds for a chunk with history and no padding: bool [1, 1, T, H + window + T]."""
    total = history + WINDOW + chunk
    positions = torch.arange(total, device=device)
    return (positions[None, :] <= positions[total - chunk :, None])[None, None]


def dequant_sdpa(inputs: dict, config: OscarConfig, mask: torch.Tensor, scale: float) -> torch.Tensor:
    history = dense_history(inputs, config)
    return sdpa_dense(inputs, history, mask, scale)


def dense_history(inputs: dict, config: OscarConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """`KVStorage.history`: one new buffer each for K and V, the quantized region dequantized into it."""
    (wk, wv), (nk, nv) = inputs["window"], inputs["new"]
    length = inputs["quantized"].value_scale.shape[2]
    total = length + WINDOW + nk.shape[2]
    keys, values = (wk.new_empty(*wk.shape[:2], total, HEAD_DIM) for _ in range(2))
    dequantize_kv_triton(
        inputs["quantized"], config, inputs["key_rotated"], (keys[:, :, :length], values[:, :, :length])
    )
    for dense, window, new in ((keys, wk, nk), (values, wv, nv)):
        dense[:, :, length : length + WINDOW] = window
        dense[:, :, length + WINDOW :] = new
    return keys, values


_MODULE = SimpleNamespace(is_causal=True, num_key_value_groups=Q_HEADS // KV_HEADS, training=False)


def sdpa_dense(inputs: dict, history: tuple, mask: torch.Tensor, scale: float) -> torch.Tensor:
    return sdpa_attention_forward(_MODULE, inputs["query"], *history, mask, scaling=scale)[0]


def flash_dense(inputs: dict, history: tuple, scale: float) -> torch.Tensor:
    """Flash attention only (an error if torch cannot use it here), bottom-right causal, K/V not expanded."""
    query, (keys, values) = inputs["query"], history
    mask = causal_lower_right(query.shape[2], keys.shape[2])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out.transpose(1, 2)  # sdpa's layout, as `sdpa_dense` returns it


def fused_chunk(inputs: dict, config: OscarConfig, scale: float, tuning: ChunkTuning | None = None) -> torch.Tensor:
    """`ChunkHistory`: the exact window then the chunk (`KVStorage.exact`), the kernel over the packed history."""
    keys, values = exact_tokens(inputs)
    out = chunk_attention_triton(
        inputs["query"], inputs["quantized"], keys, values, None, scale, config, inputs["key_rotated"], tuning=tuning
    )
    return out.transpose(1, 2)  # sdpa's layout, as the sdpa entry returns it (a view: the kernel writes [B, T, H, D])


def flash_pieces(inputs: dict, config: OscarConfig, scale: float) -> torch.Tensor:
    """`ChunkHistory` for a long chunk: the same exact tokens, flash over them and the history dequantized in pieces."""
    keys, values = exact_tokens(inputs)
    out = chunk_attention_flash(
        inputs["query"], inputs["quantized"], keys, values, scale, config, inputs["key_rotated"]
    )
    return out.transpose(1, 2)


def exact_tokens(inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    (wk, wv), (nk, nv) = inputs["window"], inputs["new"]
    return torch.cat((wk, nk), dim=-2), torch.cat((wv, nv), dim=-2)


def measure(fn) -> dict:
    """Median ms (do_bench) and the peak memory one call allocates beyond what is allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - base
    del out
    return {"ms": do_bench(fn, warmup=5, rep=50), "transient_mib": transient / 2**20}


def bench_history(batch: int, history: int, chunk: int, config: OscarConfig, sweep: bool) -> list[dict]:
    """The rows of one history length: `dequant_sdpa` first, then `sdpa_dense_bf16`, then the kernel's tunings."""
    scale = 1 / math.sqrt(HEAD_DIM)
    inputs = make_inputs(batch, history, chunk, config, "cuda")
    mask = causal_mask(batch, history, chunk, "cuda")
    shape = {"batch": batch, "history": history, "chunk": chunk, "mask_mib": mask.numel() / 2**20}
    reference = dequant_sdpa(inputs, config, mask, scale)
    rows = [
        {**shape, "path": "dequant_sdpa", **measure(lambda: dequant_sdpa(inputs, config, mask, scale))},
        {**shape, "path": "sdpa_dense_bf16", **measure_sdpa_dense(inputs, config, mask, scale)},
        *flash_rows(inputs, config, scale, reference, shape),
    ]
    for tuning in SWEEP if sweep else (default_chunk_tuning(HEAD_DIM),):
        fused = functools.partial(fused_chunk, inputs, config, scale, tuning)
        tuned = {"path": "fused_chunk", "tuning": dataclasses.asdict(tuning)}
        rows.append({**shape, **tuned, "rel_err": rel_err(fused(), reference), **measure(fused)})
    flash = functools.partial(flash_pieces, inputs, config, scale)
    rows.append({**shape, "path": "flash_pieces", "rel_err": rel_err(flash(), reference), **measure(flash)})
    return rows


def rel_err(out: torch.Tensor, reference: torch.Tensor) -> float:
    """Relative RMSE of `out` against `reference`."""
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def flash_rows(inputs: dict, config: OscarConfig, scale: float, reference: torch.Tensor, shape: dict) -> list[dict]:
    """`flash_dense_bf16` and `dequant_flash`, with their error against `dequant_sdpa`."""
    flash = measure_flash_dense(inputs, config, scale, reference)
    dequant_flash = measure(lambda: flash_dense(inputs, dense_history(inputs, config), scale))
    return [
        {**shape, "path": "flash_dense_bf16", **flash},
        {**shape, "path": "dequant_flash", "rel_err": flash["rel_err"], **dequant_flash},
    ]


def measure_flash_dense(inputs: dict, config: OscarConfig, scale: float, reference: torch.Tensor) -> dict:
    """`measure` of the flash call alone, its dense K/V an input (freed on return), and its error."""
    dense = dense_history(inputs, config)
    err = rel_err(flash_dense(inputs, dense, scale), reference)
    return {"rel_err": err, **measure(lambda: flash_dense(inputs, dense, scale))}


def measure_sdpa_dense(inputs: dict, config: OscarConfig, mask: torch.Tensor, scale: float) -> dict:
    """`measure` of the sdpa call alone, its dense K/V an input (freed on return)."""
    dense = dense_history(inputs, config)
    return measure(lambda: sdpa_dense(inputs, dense, mask, scale))


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--histories", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096], help="chunk lengths T")
    parser.add_argument("--sweep", action="store_true", help="also time the kernel's launch variants")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    header = records.header("prefill chunk attention over the 2-bit history, per layer", "cuda")
    run, path = header["run"], args.out / f"chunk_attention_{records.gpu_slug(header['device'])}.json"
    config = OscarConfig(method="oscar", bits=2)
    record = records.start_run(
        path,
        header,
        shape={"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "window": WINDOW, "dtype": "bf16"},
        config=config.to_dict(),
        argv=sys.argv[1:] if argv is None else argv,
    )
    for history, chunk in itertools.product(args.histories, args.chunks):
        rows = bench_history(args.batch, history - history % config.residual_length, chunk, config, args.sweep)
        for row in rows:
            row["run"] = run
        record["rows"].extend(rows)
        records.write_record(path, record)
        base = rows[0]["ms"]
        for row in rows:
            label = row["path"] + (f" {tuple(row['tuning'].values())}" if "tuning" in row else "")
            print(
                f"B={row['batch']} H={row['history']} T={row['chunk']} {label:>36s}: {row['ms']:8.2f} ms "
                f"({base / row['ms']:5.2f}x dequant_sdpa), transient {row['transient_mib']:8.0f} MiB"
                + (f", rel_err {row['rel_err']:.2e}" if "rel_err" in row else ""),
                flush=True,
            )
    print(f"run {run} -> {path}")
    return path


if __name__ == "__main__":
    main()
