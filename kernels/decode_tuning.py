"""Launch choices of fused decode attention: `DecodeTuning` (tile sizes, warps, programs per SM), `default_tuning`
(the measured choice per head dim, query rows and scale dtype; the measurements: docs/kernels.md) and the split
count that follows from them and the GPU's SM count."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import DECODE_HEAD_DIMS

# Up to this many quantized tokens with few KV heads (`few_heads`), D=128 keeps 4-warp programs of 128-token steps
# (faster than the 2-warp programs at short contexts, as fast at long ones).
SHORT_CONTEXT = 8192


@dataclass(frozen=True)
class DecodeTuning:
    """Launch choices of the split kernels; `default_tuning` picks them, `bench_decode_attention.py --sweep` sweeps
    them (`decode_attention_triton(..., tuning=...)`)."""

    block_n: int  # quantized tokens per inner step (a multiple of 16)
    num_warps: int
    block_m: int  # query rows of a program's tiles, at least (the rows a KV head reads, rounded up to a power of 2)
    programs_per_sm: int  # splits are sized to launch about this many programs per SM ...
    programs_per_sm_few_heads: int  # ... this many when B * Hkv < SMs / 4 (one wave: shorter merge, fewer partials)
    min_blocks_per_split: int = 4  # ... but no split gets fewer blocks than this ...
    min_blocks_per_split_few_heads: int = 1  # ... or than this with few heads (short contexts: one block per program)
    num_stages: int = 3
    max_registers: int | None = None  # ptxas register cap per thread (None: the compiler's choice)
    residual_block: int = 32  # residual tokens per step of the program that reads the residual window
    # The merge kernel reads partial outputs ([partials, D], fp32) in tiles of up to `merge_tile` elements, over one
    # warp per `merge_tile_per_warp`: its latency after the last partial is the decode's tail, so few warps and one
    # tile where the partials fit.
    merge_tile: int = 16384
    merge_tile_per_warp: int = 4096
    gluon_programs_per_sm: int = (
        0  # where the Gluon kernel runs (`decode_gluon.supports`): its programs per SM (0: never)
    )
    gluon_max_registers: int | None = None  # ptxas register cap of the Gluon kernel (None: the compiler's choice)
    # ptxas options of the Gluon kernel: the most aggressive register-usage level schedules its loop in fewer
    # instructions with as many registers as the default level
    gluon_ptxas_options: str | None = "--register-usage-level 10"
    # Hopper and newer: the Gluon and merge kernels are launched as programmatic dependents (they start while the
    # kernel before them runs, and wait for it where they read its output)
    gluon_pdl: bool = True


def default_tuning(head_dim: int, rows: int, scale_dtype: torch.dtype, short_few_heads: bool = False) -> DecodeTuning:
    """Launch choices by head dim, query rows per KV head and scale dtype (`short_few_heads`: at most `SHORT_CONTEXT`
    quantized tokens over few KV heads), measured with `bench_decode_attention.py --sweep` (docs/kernels.md).

    Up to 16 query rows with fp16 scales (the usual decode step): 64-token steps over one warp per 64 channels, 8-row
    query tiles, splits sized for 32 / 12 / 8 programs per SM at D = 64 / 128 / 256. The kernel is latency-bound (its
    registers allow two or three warps per scheduler) and the warps of a program wait for each other at every
    cross-warp reduction, so programs of fewer warps, independent of each other, keep the SMs busier. At D=128 the
    Gluon kernel reads the full 128-token blocks, one wave of 4 two-warp programs per SM.
    More query rows (speculative steps, wide GQA) or fp32 scales (tf32 operands): 64-token steps (32 at D=256, and
    with fp32 scales) over 4 warps (8 at D=256 or above 32 rows); the residual program's 32-token tile keeps the
    4-warp programs' registers under the cap."""
    if rows <= 16 and scale_dtype != torch.float32 and head_dim in DECODE_HEAD_DIMS:
        if short_few_heads and head_dim == 128:
            return DecodeTuning(block_n=128, num_warps=4, block_m=8, programs_per_sm=8, programs_per_sm_few_heads=2)
        warps = head_dim // 64
        return DecodeTuning(
            block_n=64,
            num_warps=warps,
            block_m=8,
            programs_per_sm={64: 32, 128: 12, 256: 8}[head_dim],
            programs_per_sm_few_heads=8 // warps,
            min_blocks_per_split=8 if head_dim == 128 else 4,
            gluon_programs_per_sm=4,
        )
    return DecodeTuning(
        block_n=32 if scale_dtype == torch.float32 or head_dim > 128 else 64,
        num_warps=8 if head_dim > 128 or rows > 32 else 4,
        block_m=16,
        programs_per_sm=8,
        programs_per_sm_few_heads=2,
    )


def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def few_heads(batch_heads: int, device: torch.device) -> bool:
    """Whether B * Hkv is under a quarter of the SMs (then one wave of programs: `DecodeTuning`'s few-heads choices)."""
    return device.type == "cuda" and 4 * batch_heads < num_sms(device)


def num_splits(batch_heads: int, num_blocks: int, device: torch.device, tuning: DecodeTuning, few: bool) -> int:
    """Splits of the quantized blocks of each KV head (0 without quantized blocks); `few`: `few_heads`.

    Under the interpreter: as if there were 4 SMs, one block per split (tests then cross split boundaries).
    """
    if num_blocks == 0:
        return 0
    if device.type != "cuda":  # the interpreter: 4 SMs, one block per split
        return max(1, min(math.ceil(tuning.programs_per_sm * 4 / batch_heads), num_blocks))
    if few:
        per_sm, min_blocks = tuning.programs_per_sm_few_heads, tuning.min_blocks_per_split_few_heads
    else:
        per_sm, min_blocks = tuning.programs_per_sm, tuning.min_blocks_per_split
    return max(1, min(math.ceil(per_sm * num_sms(device) / batch_heads), num_blocks // min_blocks))


def gluon_programs_per_head(batch_heads: int, full_blocks: int, tuning: DecodeTuning, device: torch.device) -> int:
    """Programs of the Gluon kernel per KV head: all in one wave of `tuning.gluon_programs_per_sm` two-warp programs
    per SM (its ~212 registers allow 4), at least two blocks each (a second, partly filled wave would add its whole
    time)."""
    wave = tuning.gluon_programs_per_sm * num_sms(device)
    return max(1, min(wave // batch_heads, full_blocks // 2))
