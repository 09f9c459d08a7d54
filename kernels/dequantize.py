"""Dequantize the packed storage straight into dense K/V in the model dtype: `reference.dequantize_kv` in one kernel.

Where a call attends over the dense history through the model's sdpa (a crop, an attention feature the fused kernels
lack: dropout, softcap, sliding window, sinks; `kernels/chunk_attention.py` reads a chunk's history in place
otherwise), the cache hands it dense K/V. This kernel builds the quantized region of that dense history in place, in
the output buffer the cache preallocates for the history, its exact window and the chunk, so that the only transient
is the layer's dense K/V itself:

    codes -> code * scale + min (fp32) -> times the token norm (keys, token scaling) -> un-rotate (x H, fp32
    butterflies in registers: keys of the heads that rotate, every value) -> model dtype

One program per (tile of BLOCK_T tokens inside one key group, batch row x KV head) writes that tile's keys and
values, reading each packed word, key scale/min row and value scale/min once (`oscar_hf.layout` defines them).
The math is the reference's in float32 (the order of the butterflies included); the results differ from it by
float32 rounding (fused multiply-adds) only.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout
from oscar_hf.reference import check_head_dim, per_head_rotation

from . import DECODE_HEAD_DIMS
from .common import MODEL_DTYPES, code_row, fwht_rows, word_planes, word_tokens
from .quantize_pack import check_key_rotated, quantize_kv_triton


@triton.jit
def _unpack(words_ptr, start, d, row_stride, d_stride, BLOCK_T: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """fp32 codes `[BLOCK_T, D]` of tokens `start ...` (a multiple of BLOCK_T), in the layout's bits: W =
    `word_tokens(BITS)` tokens a word, token r * W + j at bits [j * b, (j + 1) * b) of each of its `word_planes` rows
    (b = BITS in one row, or b = 1 in 3 bit planes, plane p holding bit p). Each word is loaded once and shifted once
    per token it holds in this tile: a tile of fewer than W tokens (16 at D = 256, 3-bit planes of 32) reads its part
    of the word, from its offset."""
    W: tl.constexpr = word_tokens(BITS)
    PLANES: tl.constexpr = word_planes(BITS)
    B: tl.constexpr = BITS // PLANES  # bits of a token in each word
    T: tl.constexpr = W if BLOCK_T >= W else BLOCK_T  # tokens of each word in this tile
    rows = code_row(start // W * W, BITS) + tl.arange(0, BLOCK_T // T) * PLANES
    shifts = (start % W + tl.arange(0, T)) * B  # start % W: 0 unless the tile is part of a word
    codes = tl.zeros((BLOCK_T // T, T, D), tl.int32)
    for p in tl.static_range(PLANES):
        words = tl.load(words_ptr + (rows + p)[:, None] * row_stride + d[None, :] * d_stride)
        codes += ((words[:, None, :] >> shifts[None, :, None]) & ((1 << B) - 1)) << p  # the mask drops sign bits
    return tl.reshape(codes, (BLOCK_T, D)).to(tl.float32)


@triton.jit
def _per_channel(params, BLOCK_T: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """`[BLOCK_T, D // G]` parameters of groups of G channels -> fp32 `[BLOCK_T, D]`, each repeated over its group."""
    return tl.reshape(tl.broadcast_to(params[:, :, None], (BLOCK_T, D // G, G)), (BLOCK_T, D)).to(tl.float32)


@triton.jit
def _dequantize_kernel(
    key_codes_ptr,
    key_scale_ptr,
    key_min_ptr,
    key_norms_ptr,
    value_codes_ptr,
    value_scale_ptr,
    value_min_ptr,
    key_rotated_ptr,
    out_keys_ptr,
    out_values_ptr,
    num_heads,
    # strides: [b, h, row, d] of the codes, key scale/min and value scale/min (each pair shares its strides), the
    # norms' [b, t], the flags' [b, h] and the outputs' [b, h, t, d]
    kc_b, kc_h, kc_r, kc_d,
    ks_b, ks_h, ks_r, ks_d,
    vc_b, vc_h, vc_r, vc_d,
    vs_b, vs_h, vs_r, vs_d,
    n_b, n_t,
    f_b, f_h,
    ok_b, ok_h, ok_t, ok_d,
    ov_b, ov_h, ov_t, ov_d,
    D: tl.constexpr,
    LOG2_D: tl.constexpr,
    G: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    ROTATION: tl.constexpr,
    PER_HEAD_FLAGS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(1) // num_heads
    h = tl.program_id(1) % num_heads
    start = tl.program_id(0) * BLOCK_T  # BLOCK_T divides G, which divides the number of tokens: no partial tile
    tokens = start + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)

    # keys: per channel, per group of G tokens (one group per tile)
    codes = _unpack(key_codes_ptr + b * kc_b + h * kc_h, start, d, kc_r, kc_d, BLOCK_T, D, KEY_BITS)
    params = b * ks_b + h * ks_h + (start // G) * ks_r + d * ks_d
    k = codes * tl.load(key_scale_ptr + params).to(tl.float32)[None, :]
    k = k + tl.load(key_min_ptr + params).to(tl.float32)[None, :]
    if TOKEN_SCALING:
        k = k * tl.load(key_norms_ptr + b * n_b + tokens * n_t)[:, None]
    if ROTATION:
        if PER_HEAD_FLAGS:
            k = tl.where(tl.load(key_rotated_ptr + b * f_b + h * f_h) != 0, fwht_rows(k, BLOCK_T, D, LOG2_D), k)
        else:
            k = fwht_rows(k, BLOCK_T, D, LOG2_D)
    out = out_keys_ptr + b * ok_b + h * ok_h + tokens[:, None] * ok_t + d[None, :] * ok_d
    tl.store(out, k.to(out_keys_ptr.dtype.element_ty))

    # values: per token, per group of G channels (each parameter loaded once, broadcast over its group)
    codes = _unpack(value_codes_ptr + b * vc_b + h * vc_h, start, d, vc_r, vc_d, BLOCK_T, D, VALUE_BITS)
    groups = tl.arange(0, D // G)
    params = b * vs_b + h * vs_h + tokens[:, None] * vs_r + groups[None, :] * vs_d
    v = codes * _per_channel(tl.load(value_scale_ptr + params), BLOCK_T, D, G)
    v = v + _per_channel(tl.load(value_min_ptr + params), BLOCK_T, D, G)
    if ROTATION:
        v = fwht_rows(v, BLOCK_T, D, LOG2_D)
    out = out_values_ptr + b * ov_b + h * ov_h + tokens[:, None] * ov_t + d[None, :] * ov_d
    tl.store(out, v.to(out_values_ptr.dtype.element_ty))


def dequantize_kv_triton(
    quantized: QuantizedKV,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.dequantize_kv(quantized, config, dtype, key_rotated)` computed in float32 and written in `dtype`
    (bf16 / fp16 / fp32): keys and values `[B, Hkv, L, D]`. `out`: the two tensors to write instead (any strides,
    e.g. the first L tokens of a dense buffer that the window and new tokens follow), in a model dtype; returned.
    `quantized` may be views of larger capacity buffers (`StorageLayout.rows`). `key_rotated` as for
    `quantize_kv_triton` (method="oscar": the `[B, Hkv]` flags; None otherwise)."""
    batch, heads, _, head_dim = quantized.key_codes.shape
    device = quantized.key_codes.device
    check_head_dim(head_dim, config)
    if head_dim not in DECODE_HEAD_DIMS:
        raise ValueError(f"dequantize_kv_triton: head_dim {head_dim} is not one of {DECODE_HEAD_DIMS}.")
    tokens = StorageLayout.of(config).check(quantized, batch, heads, head_dim, device, "dequantize_kv_triton")
    check_key_rotated(key_rotated, batch, heads, device, config, "dequantize_kv_triton")
    if quantized.key_min.stride() != quantized.key_scale.stride() or (
        quantized.value_min.stride() != quantized.value_scale.stride()
    ):
        raise ValueError("dequantize_kv_triton: each min must have its scale's strides (as StorageLayout.empty).")
    if out is None:
        out = tuple(torch.empty(batch, heads, tokens, head_dim, dtype=dtype, device=device) for _ in range(2))
    for tensor in out:
        if tuple(tensor.shape) != (batch, heads, tokens, head_dim) or tensor.dtype not in MODEL_DTYPES:
            raise ValueError(
                f"dequantize_kv_triton: out must be two {(batch, heads, tokens, head_dim)} tensors in one of "
                f"{MODEL_DTYPES}, got {tensor.dtype} {tuple(tensor.shape)}."
            )
        if tensor.device != device:
            raise ValueError(f"dequantize_kv_triton: out is on {tensor.device}, the storage on {device}.")
    if tokens == 0:
        return out
    keys, values = out
    norms = quantized.key_norms
    flags = key_rotated.view(torch.uint8) if key_rotated is not None else None
    # [BLOCK_T, D] fp32 tiles of at most 16 KiB (the butterflies stay in registers), inside one key group
    block = min(4096 // head_dim, config.group_size)
    _dequantize_kernel[(tokens // block, batch * heads)](
        quantized.key_codes, quantized.key_scale, quantized.key_min, norms,
        quantized.value_codes, quantized.value_scale, quantized.value_min, flags, keys, values,
        heads,
        *quantized.key_codes.stride(), *quantized.key_scale.stride(),
        *quantized.value_codes.stride(), *quantized.value_scale.stride(),
        *((norms.stride(0), norms.stride(2)) if norms is not None else (0, 0)),
        *(flags.stride() if flags is not None else (0, 0)),
        *keys.stride(), *values.stride(),
        D=head_dim, LOG2_D=head_dim.bit_length() - 1, G=config.group_size,
        KEY_BITS=config.key_bits, VALUE_BITS=config.value_bits, BLOCK_T=block,
        TOKEN_SCALING=norms is not None, ROTATION=config.rotation, PER_HEAD_FLAGS=flags is not None,
    )  # fmt: skip
    return out


def fake_quantize_kv_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_rotated: torch.Tensor,
    config: OscarConfig,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.fake_quantize_kv` (bits="auto"'s round trip at each width) and, of the keys,
    `reference.fake_quantize_keys` (`fake_quantize_keys_triton`: the query rule's), through the quantizer and this
    kernel: two launches where the reference runs a hundred-odd small operations over the prompt's K/V, the same codes
    up to rounding ties (`quantize_kv_triton`) and results up to float32 rounding. `keys`, `values`: whole key groups
    `[B, Hkv, N, D]` in a model dtype; `key_rotated`, `valid` as for the reference."""
    config, key_rotated = per_head_rotation(config, key_rotated)
    stored = quantize_kv_triton(keys, values, config, key_rotated, valid=valid)
    return dequantize_kv_triton(stored, config, key_rotated, dtype=keys.dtype)


def fake_quantize_keys_triton(
    keys: torch.Tensor, rotated: bool, config: OscarConfig, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """`reference.fake_quantize_keys`: `fake_quantize_kv_triton` of the keys, every head rotated or none as `rotated`
    says (the config's rotation aside, as in the reference), handling a copy of them as values, which nothing reads."""
    key_rotated = torch.full(keys.shape[:2], rotated, dtype=torch.bool, device=keys.device)
    return fake_quantize_kv_triton(keys, keys, key_rotated, dataclasses.replace(config, rotation=True), valid)[0]
