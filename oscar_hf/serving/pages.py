"""What the 2-bit pool stores, byte for byte, and the one place where it quantizes and dequantizes.

A **page** is one full-attention layer's quantized region for `residual_length` (R = 128) tokens of one request: the
fields of `oscar_hf.layout.QuantizedKV` for a batch of one and R tokens (packed codes, scales and minimums, token
norms), each at a 16-byte-aligned offset, the whole padded to 128 bytes. A **page block** is the pages of every
full-attention layer for the same R tokens (transformers' "block": the unit the allocators hand out). A **tail** is a
request's exact tokens, the sinks then the window of 1..R newest tokens, keys and values, for every full-attention
layer, in the model dtype (`TailLayout`).

`PageCodec` is the pool's backend: the only code that turns exact keys and values into pages and back (the reference
`quantize_kv` / `dequantize_kv`, with their finite check). A faster backend (Triton kernels reading pages in place) is
a `PageCodec` with the same two methods.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import OscarConfig
from ..layout import QuantizedKV, StorageLayout
from ..reference import dequantize_kv, finite_flags, quantize_kv, raise_unless_finite

FIELD_ALIGN = 16  # bytes: every field starts at a multiple (int32, float16 and float32 views need 4)
PAGE_ALIGN = 128  # bytes: the page size is a multiple (transformers aligns its sectors to 128 bytes too)


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def strided_view(buffer: torch.Tensor, dtype: torch.dtype, offset: int, block_bytes: int, shape: tuple[int, ...]):
    """`[buffer bytes // block_bytes, *shape]` view of a flat uint8 `buffer`: item i is the `shape` tensor (C order) of
    `dtype` at byte `i * block_bytes + offset`. Writing through it (index_put_) writes the buffer."""
    size = dtype.itemsize
    if block_bytes % size or offset % size:
        raise ValueError(f"offset {offset} and block size {block_bytes} must be multiples of {dtype}'s {size} bytes")
    typed = buffer.view(dtype)
    blocks = (buffer.numel() - offset - math.prod(shape) * size) // block_bytes + 1  # the last one ending in the buffer
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    return typed.as_strided((blocks, *shape), (block_bytes // size, *strides), offset // size)


@dataclass(frozen=True)
class PageLayout:
    """Byte layout of one layer's page (see the module docstring) for K/V of `heads` KV heads of `head_dim`."""

    storage: StorageLayout
    heads: int
    head_dim: int
    tokens: int  # R: the page's tokens

    @classmethod
    def of(cls, config: OscarConfig, heads: int, head_dim: int) -> PageLayout:
        return cls(StorageLayout.of(config), heads, head_dim, config.residual_length)

    @property
    def field_shapes(self) -> QuantizedKV:
        """Each field's shape for one page (the batch axis of `StorageLayout.shapes` dropped; None: absent)."""
        shapes = self.storage.shapes(1, self.heads, self.head_dim, self.heads, self.head_dim, self.tokens)
        return QuantizedKV(*(None if s is None else s[1:] for s in shapes))

    @property
    def field_offsets(self) -> QuantizedKV:
        offsets, at = [], 0
        for shape, dtype in zip(self.field_shapes, self.storage.dtypes):
            if shape is None:
                offsets.append(None)
                continue
            offsets.append(at)
            at = round_up(at + math.prod(shape) * dtype.itemsize, FIELD_ALIGN)
        return QuantizedKV(*offsets)

    @property
    def bytes(self) -> int:
        """Bytes of one page, padded to `PAGE_ALIGN`."""
        end = max(o + math.prod(s) * d.itemsize for o, s, d in self._present())
        return round_up(end, PAGE_ALIGN)

    def _present(self):
        fields = zip(self.field_offsets, self.field_shapes, self.storage.dtypes)
        return [(o, s, d) for o, s, d in fields if s is not None]

    def views(self, buffer: torch.Tensor, block_bytes: int, page_index: int) -> QuantizedKV:
        """The fields of page `page_index` of every block of `buffer` (blocks of `block_bytes`): `QuantizedKV` whose
        tensors are `[blocks, *field shape]` views, indexed by block id."""
        base = page_index * self.bytes
        return QuantizedKV(
            *(
                None if shape is None else strided_view(buffer, dtype, base + offset, block_bytes, shape)
                for offset, shape, dtype in zip(self.field_offsets, self.field_shapes, self.storage.dtypes)
            )
        )


@dataclass(frozen=True)
class TailLayout:
    """Byte layout of a request's tail: per full-attention layer, the keys then the values of `sinks + window` exact
    tokens (`[slots, heads, head_dim]` each, model dtype); slot i < sinks holds position i, slot sinks + j the window
    token at offset j of its page."""

    layers: int
    sinks: int
    window: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def slots(self) -> int:
        return self.sinks + self.window

    @property
    def bytes(self) -> int:
        return self.layers * 2 * self.slots * self.heads * self.head_dim * self.dtype.itemsize

    def views(self, buffer: torch.Tensor, block_bytes: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of layer `layer` (its position among the full-attention layers) of every tail block of
        `buffer`: two `[blocks, slots, heads, head_dim]` views, indexed by block id then slot."""
        shape = (self.slots, self.heads, self.head_dim)
        half = math.prod(shape) * self.dtype.itemsize
        keys = strided_view(buffer, self.dtype, 2 * layer * half, block_bytes, shape)
        return keys, strided_view(buffer, self.dtype, (2 * layer + 1) * half, block_bytes, shape)


class PageCodec:
    """The pool's quantize/dequantize backend (portable: the reference, in PyTorch): writes pages from exact K/V and
    reads them back as dense K/V. `pages[i]`: the field views of full-attention layer i (`PageLayout.views`).

    Every key is rotated (method="paper"; with `rotation=False` none is): the pool holds no per-page rotation choice.
    """

    def __init__(self, config: OscarConfig, pages: list[QuantizedKV]):
        self.config = config
        self.pages = pages

    def write(self, layer: int, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `keys`/`values` (`[n, heads, R, head_dim]`, model dtype) into layer `layer`'s pages of the `n`
        page blocks `blocks`, refusing non-finite K/V or scales (`reference.raise_unless_finite`)."""
        page = quantize_kv(keys, values, self.config)
        raise_unless_finite(finite_flags(page, keys, values), self.config)
        for view, field in zip(self.pages[layer], page):
            if view is not None:
                view[blocks] = field

    def read(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values (`[n, heads, R, head_dim]`, `dtype`) of layer `layer`'s pages of `blocks`, computed in
        float32 (float64 for a float64 model) as the cache's portable path computes them."""
        page = QuantizedKV(*(None if view is None else view[blocks] for view in self.pages[layer]))
        math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        keys, values = dequantize_kv(page, self.config, math_dtype)
        return keys.to(dtype), values.to(dtype)
