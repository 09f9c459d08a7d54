"""Float64 stand-ins for the Gluon kernel's launches (kernels/decode_gluon.py: Gluon has no CPU interpreter): what
its programs write into the partial slots, so that the launches around it are tested on any device. Program (bh, s)
reads its blocks of 128 tokens, its warp w tokens 64 w .. 64 w + 63 of each (word rows 4 w .. 4 w + 3), and warp w
fills partial slot 2 s + w with (o, m, l): o in the values' stored domain, m and the scores in base 2 from the query
operand [D, 8] and score scale that the Triton kernel wrote."""

from __future__ import annotations

import torch

from oscar_hf.layout import QuantizedKV, StorageLayout
from oscar_hf.reference import dequantize_groups

BLOCK, WARPS = 128, 2


def dequantized(quantized: QuantizedKV, key_norms, key_bits: int, value_bits: int) -> tuple[torch.Tensor, ...]:
    """Keys (times `key_norms`, if given) and values of `quantized` in float64, in their stored (rotated) domain:
    `[..., tokens, D]` each (groups of 32)."""
    unpack, f64 = StorageLayout.unpack_codes, torch.float64
    keys = dequantize_groups(unpack(quantized.key_codes, key_bits), quantized.key_scale, quantized.key_min, 32, -2, f64)
    if key_norms is not None:
        keys = keys * key_norms.to(f64).unsqueeze(-1)
    values = dequantize_groups(
        unpack(quantized.value_codes, value_bits), quantized.value_scale, quantized.value_min, 32, -1, f64
    )
    return keys, values


def warp_tokens(first: int, end: int, warp: int, device) -> torch.Tensor:
    """The tokens of blocks [first, end) (token indices, blocks of `BLOCK`) that warp `warp` reads."""
    tokens = torch.arange(first * BLOCK, end * BLOCK, device=device)
    return tokens[tokens % BLOCK // (BLOCK // WARPS) == warp]


def write_partial(part_o, part_ml, bh: int, slot: int, q, q_scale: float, keys, values, allowed=None) -> None:
    """Partial slot `slot` of KV head row `bh`: the softmax sums of query operand rows `q` [rows, D] over `keys` /
    `values` [tokens, D], scores in base 2 times `q_scale`; `allowed`: the padding mask over those tokens."""
    scores = q @ keys.T * q_scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    empty = torch.full((q.shape[0],), float("-inf"), dtype=scores.dtype, device=q.device)
    m = scores.amax(-1) if len(keys) else empty
    p = torch.exp2(scores - torch.where(m == float("-inf"), 0.0, m)[:, None])
    part_o[bh, slot] = (p @ values).to(part_o.dtype)
    part_ml[bh, slot, :, 0], part_ml[bh, slot, :, 1] = m, p.sum(-1)


def contiguous_launch(
    bound, stream, q_op, q_scale, quantized, key_norms, mask, length, part_o, part_ml, num_residual
) -> None:  # fmt: skip
    """`decode_gluon.launch` (the cache's storage; the other sizes as `decode_gluon.bind` bound them): program
    (bh, s) over full blocks [s * blocks_per_split, ...) of row b's storage."""
    sizes, (bh_count, splits) = bound.constants, bound.grid
    num_quantized, per_split, rows = sizes["num_quantized"], sizes["blocks_per_split"], sizes["ROWS_USED"]
    if length is not None:
        num_quantized = (int(length) - 1) // num_residual * num_residual
    norms = key_norms if sizes["TOKEN_SCALING"] else None
    keys, values = dequantized(quantized, norms, sizes["KEY_BITS"], sizes["VALUE_BITS"])
    kv_heads = quantized.key_codes.shape[1]
    for bh in range(bh_count):
        b, h = divmod(bh, kv_heads)
        for split in range(splits):
            first = split * per_split
            end = max(first, min(first + per_split, num_quantized // BLOCK))
            for warp in range(WARPS):
                tokens = warp_tokens(first, end, warp, q_op.device)
                allowed = mask[b, tokens] != 0 if sizes["HAS_MASK"] else None
                write_partial(
                    part_o, part_ml, bh, split * WARPS + warp, q_op[bh, :, :rows].double().T, float(q_scale[bh]),
                    keys[b, h, tokens], values[b, h, tokens], allowed,
                )  # fmt: skip


def paged_launch(grid, q_op, q_scale, pages, block_table, page_counts, part_o, part_ml, config, pdl) -> None:
    """`decode_gluon.launch_paged` (the serving pool's pages, a page one block): program (bh, s) over pages
    [s * P, (s + 1) * P) of request b's row of the table, P = ceil(its pages / splits). `pdl` (a GPU's launch order)
    changes nothing here: the merge, launched as a programmatic dependent, waits for these torch kernels' end."""
    bh_count, splits = grid
    norms = pages.key_norms if config.token_scaling else None
    keys, values = dequantized(pages, norms, config.key_bits, config.value_bits)  # [blocks, Hkv, 128, D]
    kv_heads, rows = pages.key_codes.shape[1], part_o.shape[2]
    for bh in range(bh_count):
        b, h = divmod(bh, kv_heads)
        count = int(page_counts[b])
        per_split = -(-count // splits)
        request_keys, request_values = (x[block_table[b, :count].long(), h].flatten(0, 1) for x in (keys, values))
        for split in range(splits):
            first = split * per_split
            end = max(first, min(first + per_split, count))
            for warp in range(WARPS):
                tokens = warp_tokens(first, end, warp, q_op.device)
                write_partial(
                    part_o, part_ml, bh, split * WARPS + warp, q_op[bh, :, :rows].double().T, float(q_scale[bh]),
                    request_keys[tokens], request_values[tokens],
                )  # fmt: skip
