"""The storage layout of the quantized region: one home for what each stored tensor holds, its shape and dtype,
the axis its codes are packed along, and how many tokens one of its rows covers.

The reference (`oscar_hf.reference`), the cache, both Triton kernels and the tests read this module; none of them
spells a shape, a pack axis or a row size of its own. A layout change is an edit of `StorageLayout` plus its
`pack_codes` / `unpack_codes` (and the kernels' unpacking of the same bits).

For `L` quantized tokens (a multiple of the group size G), keys of b_k bits and values of b_v bits (`key_bits`,
`value_bits`: each one of `SUPPORTED_WIDTHS`), `W_k = 32 // b_k` and `W_v = 32 // b_v` codes per int32 word
(`WORD_BITS`) and a head dim D, one layer's quantized region is a `QuantizedKV`; dim 2 of every tensor is the
token-row axis:

    key_codes    int32        [B, Hkv, L // W_k, D]   codes of u = (k H) / n_t, packed along the token axis
    key_scale    scale_dtype  [B, Hkv, L // G, D]     per channel, per group of G consecutive tokens
    key_min      scale_dtype  [B, Hkv, L // G, D]
    key_norms    float32      [B, 1, L]               n_t, one per token shared by all KV heads (None if no scaling)
    value_codes  int32        [B, Hkv, L // W_v, D]   codes of v H, packed along the token axis
    value_scale  scale_dtype  [B, Hkv, L, D // G]     per token, per group of G consecutive channels
    value_min    scale_dtype  [B, Hkv, L, D // G]

Packing (`pack_codes`, b bits, W = 32 // b): word `[b, h, r, d]` holds the codes of tokens `r * W + j`, j = 0..W-1,
at bits `[j * b, (j + 1) * b)` (token r*W in the least significant bits). Both K and V are packed along tokens, so one
row of D words (512 bytes at D=128) is a single coalesced load covering W tokens of a head. The cache may allocate
more rows than it uses (it grows by doubling); kernels take strides and the length. Dequantization:
`x = code * scale + min`; a zero range stores scale 0, so every code decodes to the minimum.

3-bit codes, whose width does not divide the word, are bit planes: 32 tokens take 3 words, word `[b, h, 3 g + p, d]`
holding bit p of tokens `32 g + j` at bit j, so a row covers 32 / 3 tokens (`tokens_per_code_row`) and a group of 32
tokens is whole rows. Ten 3-bit codes a word would spread 32 tokens over 4 words (4 bits a code); planes keep 3, and
each plane unpacks as 1-bit codes, 32 a word, one shift and mask per code as at 2 and 4 bits. At every width the
first row of the tokens from t (a multiple of 32) is `t * bits // WORD_BITS` (the kernels' `common.code_row`).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch

from .config import SUPPORTED_WIDTHS, OscarConfig

__all__ = ["SUPPORTED_WIDTHS", "WORD_BITS", "QuantizedKV", "StorageLayout"]

# Bits of the integer words codes are packed into (int32): the kernels unpack `WORD_BITS // bits` codes per word.
WORD_BITS = 32


class QuantizedKV(NamedTuple):
    """Quantized keys and values of one layer (`StorageLayout` says what each field holds)."""

    key_codes: torch.Tensor
    key_scale: torch.Tensor
    key_min: torch.Tensor
    key_norms: torch.Tensor | None
    value_codes: torch.Tensor
    value_scale: torch.Tensor
    value_min: torch.Tensor


@dataclass(frozen=True)
class StorageLayout:
    """Shapes, dtypes and row sizes of a `QuantizedKV` for one `OscarConfig` (see the module docstring)."""

    key_bits: int
    value_bits: int
    group_size: int
    token_scaling: bool
    scale_dtype: torch.dtype

    @classmethod
    def of(cls, config: OscarConfig) -> StorageLayout:
        config.require_widths("StorageLayout.of")
        c = config
        return cls(c.key_bits, c.value_bits, c.group_size, c.token_scaling, c.scale_torch_dtype)

    @staticmethod
    def codes_per_word(bits: int) -> int:
        return WORD_BITS // bits

    @staticmethod
    def tokens_per_code_row(bits: int) -> int | Fraction:
        """`WORD_BITS // bits` where `bits` divides the word; bit planes (3 bits) hold `WORD_BITS` tokens in `bits`
        rows. An int where it can be: the cache slices rows on its steps, and Fraction arithmetic costs microseconds."""
        return WORD_BITS // bits if WORD_BITS % bits == 0 else Fraction(WORD_BITS, bits)

    @property
    def tokens_per_row(self) -> QuantizedKV:
        """How many tokens one row (index along dim 2) of each field covers (None for an absent field)."""
        wk, wv, g = self.tokens_per_code_row(self.key_bits), self.tokens_per_code_row(self.value_bits), self.group_size
        return QuantizedKV(wk, g, g, 1 if self.token_scaling else None, wv, 1, 1)

    @property
    def dtypes(self) -> QuantizedKV:
        sd = self.scale_dtype
        return QuantizedKV(torch.int32, sd, sd, torch.float32 if self.token_scaling else None, torch.int32, sd, sd)

    def shapes(self, batch: int, key_heads: int, key_dim: int, value_heads: int, value_dim: int, tokens: int):
        """The shape of each field for `tokens` quantized tokens (None for an absent field)."""
        rows = [None if r is None else tokens // r for r in self.tokens_per_row]
        g = self.group_size
        return QuantizedKV(
            (batch, key_heads, rows[0], key_dim),
            (batch, key_heads, rows[1], key_dim),
            (batch, key_heads, rows[2], key_dim),
            (batch, 1, rows[3]) if self.token_scaling else None,
            (batch, value_heads, rows[4], value_dim),
            (batch, value_heads, rows[5], value_dim // g),
            (batch, value_heads, rows[6], value_dim // g),
        )

    def empty(
        self, batch: int, key_heads: int, key_dim: int, value_heads: int, value_dim: int, tokens: int, device
    ) -> QuantizedKV:
        """Uninitialised storage for `tokens` tokens."""
        shapes = self.shapes(batch, key_heads, key_dim, value_heads, value_dim, tokens)
        return QuantizedKV(
            *(None if s is None else torch.empty(s, dtype=d, device=device) for s, d in zip(shapes, self.dtypes))
        )

    def num_tokens(self, qkv: QuantizedKV) -> int:
        """Quantized tokens a `QuantizedKV` holds (read off the per-token value parameters)."""
        return qkv.value_scale.shape[2] * self.tokens_per_row.value_scale

    def rows(self, qkv: QuantizedKV, start: int, end: int) -> QuantizedKV:
        """Views of tokens `[start, end)` (multiples of the group size) of every field."""
        return QuantizedKV(
            *(None if t is None else t[:, :, start // r : end // r] for t, r in zip(qkv, self.tokens_per_row))
        )

    def check(self, qkv: QuantizedKV, batch: int, heads: int, head_dim: int, device: torch.device, who: str) -> int:
        """Raise a ValueError naming the first field whose shape, dtype or device breaks this layout for K/V of
        `[batch, heads, *, head_dim]`; return the number of quantized tokens."""
        tokens = self.num_tokens(qkv)
        if tokens % self.group_size:
            raise ValueError(f"{who}: {tokens} quantized tokens is not a multiple of group_size={self.group_size}.")
        expected = self.shapes(batch, heads, head_dim, heads, head_dim, tokens)
        for name, tensor, shape, dtype in zip(QuantizedKV._fields, qkv, expected, self.dtypes):
            got = None if tensor is None else tuple(tensor.shape)
            if got != shape:
                raise ValueError(f"{who}: quantized.{name} has shape {got}, expected {shape} for this config.")
            if tensor is None:
                continue
            if tensor.dtype != dtype:
                raise ValueError(f"{who}: quantized.{name} is {tensor.dtype}, expected {dtype} for this config.")
            if tensor.device != device:
                raise ValueError(f"{who}: quantized.{name} is on {tensor.device}, not {device}.")
        return tokens

    @staticmethod
    def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
        """`[..., N, D]` integer codes of `bits` bits -> `[..., N // W, D]` int32 words, packed along the token axis."""
        if WORD_BITS % bits:
            return _pack_planes(codes, bits)
        per_word = WORD_BITS // bits
        grouped = codes.to(torch.int32).unflatten(-2, (codes.shape[-2] // per_word, per_word))
        words = torch.zeros_like(grouped[..., 0, :])
        for j in range(per_word):
            words |= grouped[..., j, :] << (j * bits)  # j * bits reaches the sign bit: int32 wraps, bits exact
        return words

    @staticmethod
    def unpack_codes(words: torch.Tensor, bits: int) -> torch.Tensor:
        """`[..., N // W, D]` int32 words -> `[..., N, D]` uint8 codes of `bits` bits."""
        if WORD_BITS % bits:
            return _unpack_planes(words, bits)
        per_word = WORD_BITS // bits
        shifts = torch.arange(per_word, device=words.device, dtype=torch.int32).mul_(bits).view(per_word, 1)
        codes = (words.unsqueeze(-2) >> shifts) & (2**bits - 1)  # arithmetic shift; the mask drops sign bits
        return codes.flatten(-3, -2).to(torch.uint8)


def _pack_planes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bit planes: `[..., N, D]` codes -> `[..., N * bits // WORD_BITS, D]` words; word `g * bits + p` holds bit p of
    tokens `g * WORD_BITS + j` at bit j."""
    grouped = codes.to(torch.int32).unflatten(-2, (codes.shape[-2] // WORD_BITS, WORD_BITS))
    planes = []
    for p in range(bits):
        words = torch.zeros_like(grouped[..., 0, :])
        for j in range(WORD_BITS):
            words |= ((grouped[..., j, :] >> p) & 1) << j
        planes.append(words)
    return torch.stack(planes, -2).flatten(-3, -2)


def _unpack_planes(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_planes`."""
    planes = words.unflatten(-2, (words.shape[-2] // bits, bits))  # [..., G, bits, D]
    shifts = torch.arange(WORD_BITS, device=words.device, dtype=torch.int32).view(WORD_BITS, 1)
    bit = (planes.unsqueeze(-2) >> shifts) & 1  # [..., G, bits, WORD_BITS, D]
    codes = sum(bit[..., p, :, :] << p for p in range(bits))
    return codes.flatten(-3, -2).to(torch.uint8)
