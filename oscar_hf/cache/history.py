"""What a fused step attends to (`step.FusedStep.history`): a decode step everything its layer
stores (`DecodeHistory`), a prefill chunk arriving with history (chunked prefill, a new turn, scoring in windows) what
its update found (`ChunkHistory`). Each answers the step's attention with the fused kernels, and gives the same history
as dense K/V (`dense`, with its mask: `dense_mask`) for attention features the kernels lack.

A chunk attends to every complete block quantized, the rest of the history exact, its own tokens exact.
`OscarLayer.update` stores the chunk and returns it alone, carrying a `FusedStep` whose history is a `ChunkHistory`: the
length of the quantized region before the chunk (its blocks read in place by the fused kernel of
`kernels/chunk_attention.py`, or dequantized piece by piece for torch's attention: `chunk_attention`) and the exact
tokens (the sinks and the window) followed by the chunk (a new buffer: storing the chunk rewrites the window). Either
path's transients are the size of the chunk, never of the history: the dense history of the portable path
(`KVStorage.history`) is built only for attention features the kernel lacks (`dense`). So is the mask: where the cache
was told the padding (`OscarCache.set_padding`, as generate does), the layer asks transformers for the mask of the
chunk's own tokens only (`OscarLayer.get_mask_sizes`), and the history's padding comes from the cache (`key_padding`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import OscarConfig
from .padding import Padding, key_padding, row_sinks, storage_order

if TYPE_CHECKING:
    from .backends import TritonBackend
    from .storage import KVStorage


@dataclass(eq=False)
class DecodeHistory:
    """What a fused decode step attends to: everything `storage` holds, the step's own tokens the newest of its window
    (`TritonBackend.decode_step`), quantized in `config`'s format with `key_rotated`, padded as `padding` says
    (`OscarCache.set_padding`). A compiled step attends through `compiled.CompiledStep` instead."""

    backend: TritonBackend
    storage: KVStorage
    config: OscarConfig
    key_rotated: torch.Tensor | None
    padding: Padding | None
    decode = True

    def attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The step's attention, `[B, Hq, Tq, D]`, by the decode kernel over the storage read in place."""
        storage = self.storage
        padding = key_padding(attention_mask, query.shape[0], storage.total)
        padding = storage_order(padding, storage.sinks_held, storage.length, row_sinks(self.padding))
        keys, values = storage.exact_tokens()
        return self.backend.decode_attention(
            query, storage.quantized(), keys, values, padding, scaling, self.config, self.key_rotated
        )

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored as dense K/V in the model dtype, in position order (a decode step completes no block, so
        none waits for the key rotation's choice)."""
        return self.storage.history(own_sinks=row_sinks(self.padding))

    def dense_mask(self, attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """A decode step's mask spans the history already."""
        return attention_mask


@dataclass(eq=False)
class ChunkHistory:
    """What a chunk of T tokens attends to: quantized tokens `[0, quantized_length)` of `storage`, then
    `keys`/`values` `[B, Hkv, E, D]`, the exact tokens (`sinks` sinks, then the window) then the chunk (the queries
    are their last T tokens). In position order the sinks come first. The other fields as `DecodeHistory`'s."""

    backend: TritonBackend
    storage: KVStorage
    config: OscarConfig
    key_rotated: torch.Tensor | None
    padding: Padding | None
    sinks: int
    quantized_length: int
    keys: torch.Tensor
    values: torch.Tensor
    tokens: int  # the chunk's own, T
    decode = False

    def attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The chunk's attention `[B, Hq, T, D]` by the backend's chunk kernels over the packed history in place."""
        length = self.quantized_length
        quantized = self.storage.rows(0, length) if length else None
        padding = self.key_padding(attention_mask, query.shape[-2])
        padding = storage_order(padding, self.sinks, length, row_sinks(self.padding), self.history_positions)
        return self.backend.chunk_attention(
            query, quantized, self.keys, self.values, padding, scaling, self.config, self.key_rotated
        )

    @property
    def positions(self) -> int:
        """The tokens this chunk attends to: the history, then its own."""
        return self.quantized_length + self.keys.shape[-2]

    @property
    def history_positions(self) -> int:
        """The positions before the chunk: what the sink slots were filled from."""
        return self.positions - self.tokens

    def covers_history(self, attention_mask: torch.Tensor | None) -> bool:
        """Whether the attention call's mask spans the history too; else (`OscarLayer.get_mask_sizes` asked for the
        chunk's own tokens only) it is `[B, 1, T, T]`, or None where transformers needed none."""
        return attention_mask is not None and attention_mask.shape[-1] >= self.positions

    def key_padding(self, attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """`[B, positions]` bool in position order (None: no padding): read from the mask where it spans the
        history, else the history's from the layer's padding (`set_padding`) and the chunk's `tokens` from the mask."""
        batch = self.keys.shape[0]
        if self.covers_history(attention_mask):
            return key_padding(attention_mask, batch, self.positions)
        history = self._history_padding(tokens)
        own = None if attention_mask is None else key_padding(attention_mask, batch)
        if history is None and own is None:
            return None
        ones = self.keys.new_ones((), dtype=torch.bool)
        history = ones.expand(batch, self.positions - tokens) if history is None else history
        return torch.cat((history, ones.expand(batch, tokens) if own is None else own), dim=1)

    def _history_padding(self, tokens: int) -> torch.Tensor | None:
        """`[B, positions - tokens]` bool: the history's padding from the layer's (`set_padding`); None: none."""
        if self.padding is None:
            return None
        return self.padding.columns(0, self.positions - tokens, self.keys.shape[0], self.keys.device)

    def dense_mask(self, attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor | None:
        """The mask for the model's sdpa over `dense()`: the call's own where it spans the history, else
        `[B, 1, T, positions]` bool: every real token of the history, then the chunk's mask (causal where None)."""
        if self.covers_history(attention_mask):
            return attention_mask
        batch, history = self.keys.shape[0], self.positions - tokens
        own = attention_mask
        if own is None:
            own = torch.ones(tokens, tokens, dtype=torch.bool, device=self.keys.device).tril()
        elif own.dtype != torch.bool:  # an additive float mask: 0 where attending
            own = own == 0
        real = self._history_padding(tokens)
        seen = own.new_ones(()) if real is None else real[:, None, None, :]
        return torch.cat((seen.expand(batch, 1, tokens, history), own.expand(batch, 1, tokens, tokens)), dim=-1)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same history as dense K/V in the model dtype, as the portable path hands it to the model's sdpa."""
        if not self.quantized_length:
            return self.keys, self.values
        sinks, own_sinks = self.sinks, row_sinks(self.padding)
        keys, values = self.storage.dequantize(0, self.quantized_length)
        dense = tuple(
            torch.cat((exact[:, :, :sinks], quantized, exact[:, :, sinks:]), dim=-2)
            for exact, quantized in ((self.keys, keys), (self.values, values))
        )
        if own_sinks is not None:  # over the quantized copies of rows' sinks
            for history, exact in zip(dense, (self.keys, self.values)):
                own_sinks.place_sinks(history, exact[:, :, :sinks], self.history_positions)
        return dense
