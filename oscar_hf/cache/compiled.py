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

import torch
from transformers.cache_utils import StaticSlidingWindowLayer

from ..kernels import ops as kernel_ops
from .padding import key_padding, row_sinks


class CompiledDecode:
    """The device counter of a layer whose steps may run compiled: `length` tokens held, and whether compiled steps
    advanced it past the layer's host-side lengths."""

    def __init__(self, layer):
        """Allocate `layer`'s reserved storage once and start the counter; mark the buffers static for CUDA graphs."""
        storage = layer.storage
        storage.allocate_reserved()
        self.length = torch.full((), storage.total, dtype=torch.long, device=storage.keys.device)  # no host copy
        self.is_newer = False
        for tensor in (storage.exact_keys, storage.exact_values, self.length, layer.key_rotated, *storage.buffers):
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)

    def read_back(self, storage) -> None:
        """Bring `storage`'s host-side lengths up to date after compiled steps (one host synchronisation)."""
        if self.is_newer:
            storage.set_total(int(self.length))
            self.is_newer = False

    def step(self, layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store one token per row from the counter alone: a full residual (held a positive multiple of R past the
        sinks) goes to tokens [held - R, held) of the quantized region first; the kernel reads the counter and returns
        at once on the other R - 1 steps. The first tokens fill the sink slots, which precede the window's."""
        storage, window, sinks = layer.storage, layer.config.residual_length, layer.storage.sinks
        held = self.length  # tokens before this step: the residual holds 1..R of them, the rest are quantized
        torch._assert_async(held < layer.max_cache_len, "OscarCache: a compiled step beyond the reserved length")
        if storage.capacity:
            padding = None if layer._padding is None else layer._padding.counted  # rows' own sinks are not counted
            after_sinks = held
            if sinks:  # the quantized region starts after the sinks, its padding columns too
                after_sinks = (held - sinks).clamp(min=0)
                padding = None if padding is None else padding[:, sinks:]
            kernel_ops.flush_residual(
                storage.keys, storage.values, storage.buffers, after_sinks, layer._op_config, padding,
                layer.key_rotated,
            )  # fmt: skip
        slot = held % window
        if sinks:
            slot = torch.where(held < sinks, held, sinks + (held - sinks) % window)
        own_sinks = row_sinks(layer._padding)
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

    def attention(self, layer, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float):
        """The fused kernel handed the whole reserved storage and residual window and the counter: it reads the
        tokens held (this step's included) and nothing beyond them. `[B, Hq, Tq, D]`."""
        storage = layer.storage
        stored = storage.buffers if storage.capacity else None
        padding = key_padding(attention_mask, query.shape[0])  # over every position the kernel can read
        if storage.sinks and padding is not None:
            padding = _storage_order(padding, self.length, storage.sinks, storage.window, row_sinks(layer._padding))
        return kernel_ops.decode_attention(
            query, stored, storage.exact_keys, storage.exact_values, padding, scaling, layer._op_config,
            layer.key_rotated, self.length, storage.sinks,
        )  # fmt: skip


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


def mask_width(layer) -> int:
    """The width of a compiled decode step's attention mask: the reserved storage, the sinks and the window, one shape
    for the whole generation (generate builds the mask outside the compiled forward), as wide as the kernel's reads
    reach."""
    storage = layer.storage
    return (storage.reserved if storage.buffers is None else storage.capacity) + storage.sinks + storage.window


def refuse_step(layer, tokens: int) -> None:
    """Raise unless a compiled forward's update of `tokens` tokens can run compiled on `layer`: a single-token step
    on the fused path with the length reserved, whose key rotation is chosen (a compiled step cannot choose)."""
    rotation = layer.rotation
    if layer.compiled_decode and tokens == 1:
        if rotation.unwritten or (rotation.active and rotation.flags is None):
            raise RuntimeError(rotation.unsettled_message())
        if layer.bits_open:
            raise RuntimeError(
                "OscarCache(bits='auto'): a compiled decode step reached a layer whose widths are not chosen yet, "
                "and a compiled step cannot choose them. Call `cache.choose_bits()` after the prefill (generate does), "
                "or run the first decode step eagerly."
            )
        return
    raise RuntimeError(
        "OscarCache: a compiled forward can only run single-token decode steps on the fused path (CUDA, an "
        "sdpa model, supported head dims) with the maximum length reserved (`generate` reserves it; by hand: "
        f"`cache.reserve(max_length)` before the prefill). Got {tokens} tokens, fused path "
        f"{'on' if layer.use_kernels else 'off'}, reserved length {layer.max_cache_len}. Run this step eagerly."
    )


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
