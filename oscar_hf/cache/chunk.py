"""A prefill chunk arriving with history on the fused path (chunked prefill, a new turn, scoring in windows).

The chunk attends to what its update found: every complete block quantized, the rest of the history exact, its own
tokens exact. `OscarLayer.update` stores the chunk and returns it alone, carrying a `FusedStep` whose `chunk` is a
`ChunkHistory`: the length of the quantized region before the chunk (its blocks read in place by
`kernels/chunk_attention.py`) and the exact tokens (the sinks and the window) followed by the chunk (a new buffer:
storing the chunk rewrites the window). The sdpa entry (integrations/fused_attention.py) runs the kernel, whose
transients are the size of the chunk, never of the history: the dense history of the portable path (`KVStorage.history`)
is built only for attention features the kernel lacks (`dense`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .padding import key_padding, storage_order


@dataclass(eq=False)
class ChunkHistory:
    """What a chunk of T tokens attends to: quantized tokens `[0, quantized_length)` of `layer`'s storage, then
    `keys`/`values` `[B, Hkv, E, D]`, the exact tokens (`sinks` sinks, then the window) then the chunk (the queries
    are their last T tokens). In position order the sinks come first."""

    layer: object  # the OscarLayer whose storage holds the quantized tokens
    sinks: int
    quantized_length: int
    keys: torch.Tensor
    values: torch.Tensor

    def attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The chunk's attention `[B, Hq, T, D]` by the fused kernel, the packed history read in place."""
        from ..kernels.chunk_attention import chunk_attention_triton

        layer, length = self.layer, self.quantized_length
        quantized = layer.storage.rows(0, length) if length else None
        padding = key_padding(attention_mask, query.shape[0], length + self.keys.shape[-2])
        padding = storage_order(padding, self.sinks, length)
        return chunk_attention_triton(
            query, quantized, self.keys, self.values, padding, scaling, layer.config, layer.key_rotated
        )

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same history as dense K/V in the model dtype, as the portable path hands it to the model's sdpa."""
        if not self.quantized_length:
            return self.keys, self.values
        sinks = self.sinks
        keys, values = self.layer.storage.dequantize(0, self.quantized_length)
        return tuple(
            torch.cat((exact[:, :, :sinks], quantized, exact[:, :, sinks:]), dim=-2)
            for exact, quantized in ((self.keys, keys), (self.values, values))
        )
