"""Compiled decode (`torch.compile`, CUDA graphs) of an `OscarLayer`.

Where the fused path applies and the maximum length is reserved (`generate` does it; `OscarCache.reserve` by hand),
storage is allocated once at full size and the layer keeps its length in a device counter. A compiled single-token
step writes the token at the residual slot and flushes a complete block from that counter alone (the flush kernel
is launched every step and returns at once until the block is complete), and the fused kernel, handed the whole
reserved storage and the counter, attends over the tokens held: shapes and addresses never change, there is no host
synchronisation and no Python branch on a tensor value. Eager code then reads the lengths back from the counter.

A hybrid model's sliding-window layers (Gemma 3, chunked attention) become `CompiledSlidingWindowLayer`s when the
length is reserved: transformers' static sliding-window layer (what `StaticCache` builds for them: a fixed buffer of
the window's last tokens, oldest first), whose compiled single-token steps also run from a device counter, so that one
graph serves every decode step, before and after the window fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from ..config import OscarConfig
from ..kernels import ops as kernel_ops
from .padding import Padding, key_padding, row_sinks
from .storage import KVStorage


class CompiledDecode:
    """The device counter of a layer whose steps may run compiled: `length` tokens held in `storage` (reserved at
    `max_length` tokens, in `config`'s format), and whether compiled steps advanced it past the storage's host-side
    lengths."""

    def __init__(self, storage: KVStorage, config: OscarConfig, max_length: int, key_rotated: torch.Tensor | None):
        """Allocate the reserved storage once and start the counter; mark the buffers static for CUDA graphs."""
        storage.allocate_reserved()
        self.storage, self.max_length = storage, max_length
        self.op_config = kernel_ops.config_key(config)  # the config as the custom ops take it
        self.length = torch.full((), storage.total, dtype=torch.long, device=storage.keys.device)  # no host copy
        self.is_newer = False
        for tensor in (storage.exact_keys, storage.exact_values, self.length, key_rotated, *storage.buffers):
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)

    def read_back(self) -> None:
        """Bring the storage's host-side lengths up to date after compiled steps (one host synchronisation)."""
        if self.is_newer:
            self.storage.set_total(int(self.length))
            self.is_newer = False

    def step(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        padding: Padding | None,
        key_rotated: torch.Tensor | None,
    ) -> CompiledStep:
        """Store one token per row from the counter alone: a full residual (held a positive multiple of R past the
        sinks) goes to tokens [held - R, held) of the quantized region first; the kernel reads the counter and returns
        at once on the other R - 1 steps. The first tokens fill the sink slots, which precede the window's. Returns
        what the step attends to."""
        storage = self.storage
        window, sinks = storage.window, storage.sinks
        held = self.length  # tokens before this step: the residual holds 1..R of them, the rest are quantized
        torch._assert_async(held < self.max_length, "OscarCache: a compiled step beyond the reserved length")
        if storage.capacity:
            counted = None if padding is None else padding.counted  # rows' own sinks are not counted
            after_sinks = held
            if sinks:  # the quantized region starts after the sinks, its padding columns too
                after_sinks = (held - sinks).clamp(min=0)
                counted = None if counted is None else counted[:, sinks:]
            kernel_ops.flush_residual(
                storage.keys, storage.values, storage.buffers, after_sinks, self.op_config, counted, key_rotated
            )
        slot = held % window
        if sinks:
            slot = torch.where(held < sinks, held, sinks + (held - sinks) % window)
        own_sinks = row_sinks(padding)
        if own_sinks is None:
            storage.exact_keys.index_copy_(2, slot.view(1), key_states)
            storage.exact_values.index_copy_(2, slot.view(1), value_states)
        else:  # a row's own sink goes to its slot (its copy in the window is never read), padding to an empty slot
            positions = own_sinks.sinks
            before = (positions < held).sum(1, keepdim=True)  # [B, 1]: the row's sinks before this token
            own = positions.gather(1, before.clamp(max=sinks - 1)) == held
            slot = torch.where((before < sinks) & (own | (held < sinks)), before, slot).view(-1, 1, 1, 1)
            storage.exact_keys.scatter_(2, slot.expand_as(key_states), key_states)
            storage.exact_values.scatter_(2, slot.expand_as(value_states), value_states)
        self.length.add_(1)
        self.is_newer = True
        return CompiledStep(self, padding, key_rotated)

    def attention(
        self,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float,
        padding: Padding | None,
        key_rotated: torch.Tensor | None,
    ) -> torch.Tensor:
        """The fused kernel handed the whole reserved storage and residual window and the counter: it reads the
        tokens held (this step's included) and nothing beyond them. `[B, Hq, Tq, D]`."""
        storage = self.storage
        stored = storage.buffers if storage.capacity else None
        mask = key_padding(attention_mask, query.shape[0])  # over every position the kernel can read
        if storage.sinks and mask is not None:
            mask = _storage_order(mask, self.length, storage.sinks, storage.window, row_sinks(padding))
        return kernel_ops.decode_attention(
            query, stored, storage.exact_keys, storage.exact_values, mask, scaling, self.op_config, key_rotated,
            self.length, storage.sinks,
        )  # fmt: skip


@dataclass(eq=False)
class CompiledStep:
    """What a compiled decode step attends to (`step.FusedStep.history`): everything `compiled`'s storage holds, read
    by the fused kernel from the device counter. A compiled step attends with plain causal attention only (the sdpa
    entry refuses the rest before it needs a dense history)."""

    compiled: CompiledDecode
    padding: Padding | None
    key_rotated: torch.Tensor | None
    decode = True

    def attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        return self.compiled.attention(query, attention_mask, scaling, self.padding, self.key_rotated)


def _storage_order(padding: torch.Tensor, held: torch.Tensor, sinks: int, window: int, own_sinks) -> torch.Tensor:
    """`padding.storage_order` with the quantized length on the device: the kernel reads column q for quantized token
    q (q < L, position sinks + q) and column L + j for residual slot j (a sink, position j, for j < sinks; else the
    window's token at position L + j). With rows' own sinks (`own_sinks`: `padding.row_sinks`), sink slot j is read
    once its token is held, and no row's sink where its position puts it."""
    columns = torch.arange(padding.shape[1], device=padding.device)
    quantized = (held - sinks - 1).clamp(min=0) // window * window
    slot = (columns >= quantized) & (columns < quantized + sinks)
    index = torch.where(columns < quantized, columns + sinks, torch.where(slot, columns - quantized, columns))
    ordered = padding[:, index]
    if own_sinks is None:
        return ordered
    positions = own_sinks.sinks
    filled = positions.gather(1, (columns - quantized).clamp(0, sinks - 1).expand(positions.shape[0], -1)) < held
    return torch.where(slot, filled, ordered & (index > positions[:, -1:]))


class CompiledSlidingWindowLayer(StaticSlidingWindowLayer):
    """transformers' `StaticSlidingWindowLayer` (eager updates, masks, crop and reset are its own), except for
    single-token steps inside a compiled forward. Its host-side length `cumulative_length_int` branches in Python
    (full or not), which dynamo would specialize on, then make symbolic: two or three graphs per generation. Here a
    compiled step reads only the device counter `cumulative_length` (every token seen, kept exact in eager updates
    too): it rolls the buffer by one where the window is full and writes the token at the last filled slot, branch-free;
    eager code reads the host length back from the counter (one host synchronisation after compiled steps)."""

    def __init__(self, max_cache_len: int, sliding_window: int):
        self._device_is_newer = False  # compiled steps advanced `cumulative_length` past the host length
        super().__init__(max_cache_len=max_cache_len, sliding_window=sliding_window)
        self.sliding_window = sliding_window

    @property
    def cumulative_length_int(self) -> int:
        if self._device_is_newer:
            self._host_length = int(self.cumulative_length)
            self._device_is_newer = False
        return self._host_length

    @cumulative_length_int.setter
    def cumulative_length_int(self, tokens: int) -> None:
        self._host_length, self._device_is_newer = tokens, False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        if not torch.compiler.is_compiling():
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            # transformers stops counting on the device once the window is full: the counter keeps every token
            self.cumulative_length.fill_(self._host_length)
            return keys, values
        if key_states.shape[-2] != 1 or not self.is_initialized:
            raise RuntimeError(
                "OscarCache: a compiled forward runs single-token decode steps after an eager prefill; got "
                f"{key_states.shape[-2]} tokens on a sliding-window layer"
                f"{'' if self.is_initialized else ' that holds nothing yet'}. Run this step eagerly."
            )
        held = self.cumulative_length
        slot = held.clamp(max=self.max_cache_len - 1).view(1)
        full = held >= self.max_cache_len
        for buffer, new in ((self.keys, key_states), (self.values, value_states)):
            shifted = torch.where(full, buffer.roll(-1, dims=-2), buffer)  # a full window drops its oldest token
            buffer.copy_(shifted.index_copy_(2, slot, new))
        held.add_(1)
        self._device_is_newer = True
        return self.keys, self.values
