"""What the 2-bit pool stores, byte for byte, and the one place where it quantizes and dequantizes.

A **page** is one full-attention layer's quantized region for `residual_length` (R = 128) tokens of one request: the
fields of `oscar_hf.layout.QuantizedKV` for a batch of one and R tokens (packed codes, scales and minimums, token
norms), each at a 16-byte-aligned offset, the whole padded to 128 bytes. A **page block** is the pages of every
full-attention layer for the same R tokens (transformers' "block": the unit the allocators hand out). A **tail** is a
request's exact tokens, the sinks then the window of 1..R newest tokens, keys and values, for every full-attention
layer, in the model dtype (`TailLayout`).

`PageCodec` is the only code that turns exact keys and values into pages and back, through the backend a cache layer
would use on the same device (`oscar_hf.cache.backends`: the reference, or the Triton quantizer and dequantizer), with
its finite check. Attention reads pages in place (`history.PagedHistory`): a decode step through the block table
(kernels/decode_paged.py), a prompt chunk over its pages gathered into one quantized region (`gather_pages`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..cache.backends import PortableBackend
from ..cache.finite import FiniteCheck
from ..config import OscarConfig
from ..layout import QuantizedKV, StorageLayout

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


def stack_views(views: list[torch.Tensor]) -> torch.Tensor:
    """One `[blocks, len(views), ...]` view of `views`: `strided_view`s of one buffer with equal shapes and strides
    whose offsets step evenly (one field of consecutive layers), so that one index writes a block's item of each."""
    first = views[0]
    step = views[1].storage_offset() - first.storage_offset() if len(views) > 1 else 0
    for i, view in enumerate(views):
        if view.stride() != first.stride() or view.storage_offset() != first.storage_offset() + i * step:
            raise ValueError("stack_views: the views must be of one buffer, with equal strides and evenly spaced")
    shape = (views[-1].shape[0], len(views), *first.shape[1:])  # the blocks every view has
    return first.as_strided(shape, (first.stride(0), step, *first.stride()[1:]), first.storage_offset())


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


def gather_pages(pages: QuantizedKV, blocks: torch.Tensor) -> QuantizedKV:
    """The pages of `blocks` (in position order) of one layer's field views (`PageLayout.views`) as one quantized
    region of `len(blocks) * R` tokens in the storage contract (`oscar_hf.layout`, a batch of one): a page's groups
    and packed words never cross its boundary, so the pages' rows follow each other. One gather per field, into the
    region's layout (`[heads, pages, ...]`: the flatten is a view)."""
    return QuantizedKV(
        *(None if view is None else view.transpose(0, 1)[:, blocks].flatten(1, 2)[None] for view in pages)
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
    """Writes pages from exact K/V and reads them back as dense K/V, through `backend` (`PortableBackend` or
    `TritonBackend`). `pages[i]`: the field views of full-attention layer i (`PageLayout.views`).

    Every key is rotated (method="paper"; with `rotation=False` none is): the pool holds no per-page rotation choice.
    """

    def __init__(self, config: OscarConfig, pages: list[QuantizedKV], backend: PortableBackend):
        self.config, self.pages, self.backend = config, pages, backend
        self.finite = FiniteCheck(config)  # outside its `gathered` scope: each write checked at once
        # every layer's page of a block at once: `[blocks, layers, *field shape]`
        self.layers = QuantizedKV(*(None if v[0] is None else stack_views(v) for v in zip(*pages)))

    def write(self, layer: int, blocks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `keys`/`values` (`[n, heads, R, head_dim]`, model dtype) into layer `layer`'s pages of the `n`
        page blocks `blocks`, refusing non-finite K/V or scales (`FiniteCheck`)."""
        page = self.backend.quantize(keys, values, self.config, None, None, None, self.finite)
        for view, field in zip(self.pages[layer], page):
            if view is not None:
                view[blocks] = field

    def write_layers(self, block: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize `keys`/`values` (`[layers, heads, R, head_dim]`: every full-attention layer's tokens of one page)
        into page block `block`, in one call of the quantizer (each layer's page is quantized on its own, as `write`
        does it)."""
        page = self.backend.quantize(keys, values, self.config, None, None, None, self.finite)
        for view, field in zip(self.layers, page):
            if view is not None:
                view[block] = field

    def read(self, layer: int, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense keys and values (`[n, heads, R, head_dim]`, `dtype`) of layer `layer`'s pages of `blocks`, as a cache
        layer on the same backend dequantizes them."""
        page = QuantizedKV(*(None if view is None else view[blocks] for view in self.pages[layer]))
        return self.backend.dequantize(page, self.config, None, dtype)
