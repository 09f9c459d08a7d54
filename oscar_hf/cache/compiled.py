"""Compiled decode (`torch.compile`, CUDA graphs) of an `OscarLayer`.

Where the fused path applies and the maximum length is reserved (`generate` does it; `OscarCache.reserve` by hand),
storage is allocated once at full size and the layer keeps its length in a device counter. A compiled single-token
step writes the token at the residual slot and flushes a complete block from that counter alone (the flush kernel
is launched every step and returns at once until the block is complete), and the fused kernel, handed the whole
reserved storage and the counter, attends over the tokens held: shapes and addresses never change, there is no host
synchronisation and no Python branch on a tensor value. Eager code then reads the lengths back from the counter.
"""

from __future__ import annotations

import torch

from ..kernels import ops as kernel_ops
from .padding import key_padding


class CompiledDecode:
    """The device counter of a layer whose steps may run compiled: `length` tokens held, and whether compiled steps
    advanced it past the layer's host-side lengths."""

    def __init__(self, layer):
        self.length = torch.tensor(layer.get_seq_length(), dtype=torch.long, device=layer.device)
        self.is_newer = False
        for tensor in (layer.residual_keys, layer.residual_values, self.length, layer.key_rotated, *layer._storage):
            if tensor is not None:  # static addresses for CUDA graphs
                torch._dynamo.mark_static_address(tensor)

    def held(self) -> int | None:
        """The tokens held, read back from the device (one host synchronisation) when compiled steps advanced them;
        None when the host-side lengths are current."""
        if not self.is_newer:
            return None
        self.is_newer = False
        return int(self.length)

    def step(self, layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store one token per row from the counter alone: a full residual (held a positive multiple of R) goes to
        tokens [held - R, held) first; the kernel reads the counter and returns at once on the other R - 1 steps."""
        window = layer.config.residual_length
        held = self.length  # tokens before this step: the residual holds 1..R of them, the rest are quantized
        torch._assert_async(held < layer.max_cache_len, "OscarCache: a compiled step beyond the reserved length")
        if layer.layout.num_tokens(layer._storage):
            padding = None if layer._padding is None else layer._padding.mask
            kernel_ops.flush_residual(
                layer.residual_keys, layer.residual_values, layer._storage, held, layer._op_config, padding,
                layer.key_rotated,
            )  # fmt: skip
        slot = (held % window).view(1)
        layer.residual_keys.index_copy_(2, slot, key_states)
        layer.residual_values.index_copy_(2, slot, value_states)
        self.length.add_(1)
        self.is_newer = True

    def attention(self, layer, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float):
        """The fused kernel handed the whole reserved storage and residual window and the counter: it reads the
        tokens held (this step's included) and nothing beyond them. `[B, Hq, Tq, D]`."""
        stored = layer._storage if layer.layout.num_tokens(layer._storage) else None
        padding = key_padding(attention_mask, query.shape[0])  # over every position the kernel can read
        return kernel_ops.decode_attention(
            query, stored, layer.residual_keys, layer.residual_values, padding, scaling, layer._op_config,
            layer.key_rotated, self.length,
        )  # fmt: skip


def refuse_step(layer, tokens: int) -> None:
    """Raise unless a compiled forward's update of `tokens` tokens can run compiled on `layer`."""
    if layer.compiled_decode and tokens == 1:
        return
    raise RuntimeError(
        "OscarCache: a compiled forward can only run single-token decode steps on the fused path (CUDA, an "
        "sdpa model, supported head dims) with the maximum length reserved (`generate` reserves it; by hand: "
        f"`cache.reserve(max_length)` before the prefill). Got {tokens} tokens, fused path "
        f"{'on' if layer.use_kernels else 'off'}, reserved length {layer.max_cache_len}. Run this step eagerly."
    )
