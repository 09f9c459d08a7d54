"""Which cache positions of each row hold padding (`OscarCache.set_padding`), and the padding mask an attention call
hands the fused kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Padding:
    """Which cache positions of each row hold padding, as the layers read it."""

    mask: torch.Tensor  # [B, P] bool, True for real tokens; positions from P on are real
    end: int  # no row has padding at or after this position: blocks starting there need no mask (host-side)
    left: int  # the most left padding of any row (positions before its first real token; host-side)

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> Padding | None:
        mask = attention_mask.bool()
        positions = torch.arange(mask.shape[1], device=mask.device)
        if not mask.numel():
            return None
        # one host sync per call: no padding at or after `end`; `left` padding positions before a row's first token
        end, left = torch.stack((torch.where(mask, 0, positions + 1).amax(), mask.int().cumsum(1).eq(0).sum(1).amax()))
        if end == 0:
            return None
        return cls(mask, int(end), int(left))

    def valid(self, start: int, keys: torch.Tensor) -> torch.Tensor | None:
        """`[B, N]` bool for the N tokens of `keys` at positions `start..start + N - 1` (on their device), or None
        when they hold no padding."""
        return self.columns(start, keys.shape[-2], keys.shape[0], keys.device)

    def columns(self, start: int, tokens: int, batch: int, device: torch.device) -> torch.Tensor | None:
        """`valid` for `tokens` positions from `start` of a batch of `batch` rows, on `device`."""
        if start >= self.end:
            return None
        if self.mask.shape[0] != batch:
            raise ValueError(
                f"OscarCache: the padding mask given to set_padding has {self.mask.shape[0]} rows but the cache "
                f"holds a batch of {batch}; pass the attention mask of this batch."
            )
        part = self.mask[:, start : start + tokens]
        return torch.cat([part, part.new_ones(batch, tokens - part.shape[1])], dim=1).to(device)

    def apply(self, fn) -> Padding:
        """This padding after a batch-axis (or device) transform of the cache."""
        return Padding(fn(self.mask), self.end, self.left)


def valid(padding: Padding | None, start: int, tensor: torch.Tensor) -> torch.Tensor | None:
    """`padding.valid`, None without padding."""
    return None if padding is None else padding.valid(start, tensor)


def storage_order(padding: torch.Tensor | None, sinks: int, quantized: int) -> torch.Tensor | None:
    """A key padding mask `[B, positions]` in position order (as transformers builds it) over `sinks` sink tokens,
    `quantized` quantized tokens and exact ones, reordered as the fused kernels read the tokens: the quantized ones,
    then the exact ones (the sinks, then the rest; `storage.KVStorage`)."""
    if padding is None or not sinks:
        return padding
    end = sinks + quantized
    return torch.cat((padding[:, sinks:end], padding[:, :sinks], padding[:, end:]), dim=1)


def key_padding(attention_mask: torch.Tensor | None, batch: int, width: int | None = None) -> torch.Tensor | None:
    """The fused kernel's key padding mask `[batch, width]` (True where attending) from an attention call's mask
    `[B or 1, 1, Tq, positions]`: its last query row masks exactly the padding (a causal mask hides nothing older from
    it). `width`: the first positions only (eager steps read the tokens held; compiled steps every position)."""
    if attention_mask is None:
        return None
    padding = attention_mask.select(1, 0).select(1, -1)  # (per layer and eager step: methods index faster than [])
    if width is not None:
        padding = padding[:, :width]
    if padding.dtype != torch.bool:  # an additive float mask: 0 where attending
        padding = padding == 0
    return padding if padding.shape[0] == batch else padding.expand(batch, -1)


def sink_slots(sink_tokens: int, padding: Padding | None) -> int:
    """The sink slots a layer keeps: `sink_tokens`, and with left padding as many more as the most left padding of any
    row, so that every row's sinks are its first real tokens (its padding stays masked)."""
    return sink_tokens + padding.left if sink_tokens and padding is not None else sink_tokens
