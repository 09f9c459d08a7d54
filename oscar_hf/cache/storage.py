"""The quantized region of an `OscarLayer`: packed blocks in the storage contract of `oscar_hf.layout`, in buffers
that grow by doubling (or are reserved once at full size), so that a flush copies one block, never the history."""

from __future__ import annotations

import torch

from ..layout import QuantizedKV, StorageLayout


class QuantizedRegion:
    """`length` quantized tokens (a multiple of the block size) at the start of capacity `buffers`."""

    def __init__(self, layout: StorageLayout, block: int):
        self.layout = layout
        self.block = block  # residual_length: capacities are whole blocks
        self.buffers: QuantizedKV | None = None  # capacity; the first `length` tokens are valid
        self.length = 0
        self.reserved = 0  # tokens reserved up front (`OscarLayer.reserve`), whole blocks

    @property
    def capacity(self) -> int:
        return 0 if self.buffers is None else self.layout.num_tokens(self.buffers)

    def rows(self, start: int, end: int) -> QuantizedKV:
        """Views of quantized tokens `[start, end)` (block-aligned)."""
        return self.layout.rows(self.buffers, start, end)

    def view(self) -> QuantizedKV | None:
        """Views of the quantized tokens, or None when there are none."""
        return self.rows(0, self.length) if self.length else None

    def store(self, block: QuantizedKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append a quantized block; `keys`/`values` (any tokens of the layer) give the buffers' shapes."""
        start = self.length
        end = start + self.layout.num_tokens(block)
        self.grow(end, keys, values)
        for buf, part in zip(self.rows(start, end), block):
            if buf is not None:
                buf.copy_(part)
        self.length = end

    def grow(self, tokens: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Make room for `tokens` quantized tokens: capacity doubles, so appending is amortized O(block)."""
        capacity = self.capacity
        if tokens <= capacity and self.buffers is not None:
            return
        capacity = -(-max(tokens, 2 * capacity, self.reserved) // self.block) * self.block
        (batch, key_heads, _, key_dim), (_, value_heads, _, value_dim) = keys.shape, values.shape
        new = self.layout.empty(batch, key_heads, key_dim, value_heads, value_dim, capacity, keys.device)
        if self.buffers is not None:
            for buf, old in zip(self.layout.rows(new, 0, self.capacity), self.buffers):
                if buf is not None:
                    buf.copy_(old)
        self.buffers = new

    def clear_unused(self) -> None:
        """Zero the capacity beyond the stored tokens (compiled steps read it, masked: never NaN garbage)."""
        for buf, rows in zip(self.buffers, self.layout.tokens_per_row):
            if buf is not None:
                buf[:, :, self.length // rows :] = 0

    def apply(self, fn) -> None:
        """Follow a batch-axis (or device) transform of the cache."""
        if self.buffers is not None:
            self.buffers = QuantizedKV(*(None if t is None else fn(t) for t in self.buffers))

    def nbytes(self, region: QuantizedKV | None) -> int:
        return 0 if region is None else sum(t.nbytes for t in region if t is not None)
