"""Which cache positions of each row hold padding (`OscarCache.set_padding`), and the padding mask an attention call
hands the fused kernel."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Padding:
    """Which cache positions of each row hold padding, as the layers read it, and, with `sink_tokens`, where each
    row's sinks are: its own first real tokens, which the layer keeps exact in its sink slots (slot j: the row's
    (j + 1)-th real token), so that a left-padded row costs `sink_tokens` slots like any other."""

    mask: torch.Tensor  # [B, P] bool, True for real tokens; positions from P on are real
    end: int  # no row has padding at or after this position: blocks starting there need no mask (host-side)
    sinks: torch.Tensor | None = None  # [B, sink_tokens] long: the positions of each row's sinks, ascending
    quantizable: torch.Tensor | None = None  # [B, W] bool: real and no row's sink; positions from W on are both
    sinks_end: int = 0  # no row has a sink at or after this position (host-side)

    @classmethod
    def of(cls, attention_mask: torch.Tensor, sink_tokens: int = 0) -> Padding | None:
        mask = attention_mask.bool()
        batch, width = mask.shape
        positions = torch.arange(width, device=mask.device)
        if not mask.numel():
            return None
        count = mask.long().cumsum(1)  # real tokens at or before each position
        nth = torch.arange(1, sink_tokens + 1, device=mask.device).expand(batch, -1)
        # the n-th real token's position; past the mask every position is real
        sinks = torch.searchsorted(count, nth.contiguous()).where(nth <= count[:, -1:], width - 1 + nth - count[:, -1:])
        last = sinks[:, -1].amax() if sink_tokens else positions.new_zeros(())
        # one host sync per call: no padding at or after `end`, no sink at or after `sinks_end`
        end, sinks_end = (int(n) for n in torch.stack((torch.where(mask, 0, positions + 1).amax(), last + 1)))
        if end == 0:
            return None
        if not sink_tokens:
            return cls(mask, end)
        columns = torch.arange(max(width, sinks_end), device=mask.device)
        real = torch.cat((mask, mask.new_ones(batch, columns.numel() - width)), dim=1)
        return cls(mask, end, sinks, real & (columns > sinks[:, -1:]), sinks_end)

    def valid(self, start: int, keys: torch.Tensor) -> torch.Tensor | None:
        """`[B, N]` bool for the N tokens of `keys` at positions `start..start + N - 1` (on their device): the tokens
        that quantization and the key statistics count (real, and no row's sink: those are kept exact), or None when
        all of them count."""
        return _columns(self.counted, max(self.end, self.sinks_end), start, keys.shape[-2], keys.shape[0], keys.device)

    @property
    def counted(self) -> torch.Tensor:
        """`[B, W]` bool: the tokens quantization counts (`valid`), positions from W on all counted."""
        return self.mask if self.quantizable is None else self.quantizable

    def columns(self, start: int, tokens: int, batch: int, device: torch.device) -> torch.Tensor | None:
        """`[B, tokens]` bool, True for real tokens, for `tokens` positions from `start` of a batch of `batch` rows,
        on `device`; None when they hold no padding."""
        return _columns(self.mask, self.end, start, tokens, batch, device)

    def apply(self, fn) -> Padding:
        """This padding after a batch-axis (or device) transform of the cache."""
        if self.sinks is None:
            return Padding(fn(self.mask), self.end)
        return Padding(fn(self.mask), self.end, fn(self.sinks), fn(self.quantizable), self.sinks_end)

    def fill_sinks(
        self, slots: tuple[torch.Tensor, torch.Tensor], new: tuple[torch.Tensor, torch.Tensor], start: int
    ) -> None:
        """Copy into the sink slots (`slots`: the exact K/V buffers, `[B, Hkv, sink_tokens + ..., D]`) each row's
        sinks among the tokens `new` (K/V `[B, Hkv, N, D]` at positions `start..start + N - 1`)."""
        tokens = new[0].shape[-2]
        if self.sinks is None or start >= self.sinks_end or not tokens:
            return
        at = self.sinks.to(new[0].device) - start
        inside = ((at >= 0) & (at < tokens))[:, None, :, None]
        index = at.clamp(0, tokens - 1)[:, None, :, None]
        for slot, states in zip(slots, new):
            sinks = slot[:, :, : at.shape[1]]
            taken = states.gather(2, index.expand(-1, states.shape[1], -1, states.shape[-1]))
            sinks.copy_(torch.where(inside, taken, sinks))

    def place_sinks(self, dense: torch.Tensor, slots: torch.Tensor, held: int) -> None:
        """Write each row's sinks among the first `held` positions (`slots` `[B, Hkv, sink_tokens, D]`) at their
        positions in `dense` (`[B, Hkv, positions, D]`, position order), over the copies stored there (quantized ones,
        which attention does not read)."""
        positions = self.sinks.to(dense.device)
        rows, slot = (positions < held).nonzero(as_tuple=True)
        dense[rows, :, positions[rows, slot]] = slots[rows, :, slot]


def _columns(
    mask: torch.Tensor, end: int, start: int, tokens: int, batch: int, device: torch.device
) -> torch.Tensor | None:
    """`mask`'s columns `start..start + tokens - 1` (True past its width), or None from `end` on (all True)."""
    if start >= end:
        return None
    if mask.shape[0] != batch:
        raise ValueError(
            f"OscarCache: the padding mask given to set_padding has {mask.shape[0]} rows but the cache "
            f"holds a batch of {batch}; pass the attention mask of this batch."
        )
    part = mask[:, start : start + tokens]
    return torch.cat([part, part.new_ones(batch, tokens - part.shape[1])], dim=1).to(device)


def row_sinks(padding: Padding | None) -> Padding | None:
    """`padding` where it says where each row's own sinks are (left padding and `sink_tokens`), else None: the sinks
    are the first positions, shared by the rows."""
    return padding if padding is not None and padding.sinks is not None else None


def valid(padding: Padding | None, start: int, tensor: torch.Tensor) -> torch.Tensor | None:
    """`padding.valid`, None without padding."""
    return None if padding is None else padding.valid(start, tensor)


def storage_order(
    padding: torch.Tensor | None,
    sinks: int,
    quantized: int,
    own_sinks: Padding | None = None,
    held: int | None = None,
) -> torch.Tensor | None:
    """A key padding mask `[B, positions]` in position order (as transformers builds it) over `sinks` sink slots,
    `quantized` quantized tokens and exact ones, reordered as the fused kernels read the tokens: the quantized ones,
    then the exact ones (the sinks, then the rest; `storage.KVStorage`). With `own_sinks` (`row_sinks` of the padding),
    slot j holds each row's own (j + 1)-th real token: it is read once its position is among the `held` positions
    the slots were filled from (default: all), and the row's sinks where the positions put them (quantized, or in
    the window or a chunk: copies) are not."""
    if not sinks:
        return padding
    end = sinks + quantized
    if own_sinks is None:
        if padding is None:
            return None
        return torch.cat((padding[:, sinks:end], padding[:, :sinks], padding[:, end:]), dim=1)
    if padding is None:
        raise ValueError(
            "OscarCache: set_padding said that rows hold padding, but an attention call brought no attention mask; "
            "pass the batch's attention_mask to the model's forward (generate does)."
        )
    held = padding.shape[1] if held is None else held
    filled = own_sinks.sinks[:, :sinks].to(padding.device) < held
    # The copies of the rows' sinks lie before `sinks_end` (the columns after it need nothing): left out where their
    # slots are read, before `held` (a chunk's own tokens are read where they are).
    copies = min(own_sinks.sinks_end, held)
    rest = padding[:, sinks:]
    if copies > sinks:
        counted = own_sinks.counted[:, sinks:copies].to(padding.device)
        rest = torch.cat((rest[:, : copies - sinks] & counted, rest[:, copies - sinks :]), dim=1)
    return torch.cat((rest[:, :quantized], filled, rest[:, quantized:]), dim=1)


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
