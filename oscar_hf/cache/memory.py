"""Bytes a KV cache holds, and its ratios to a bf16 cache and to one in the model's dtype; the stored bits per K/V
element of a config (its quantized region), and the effective bits (everything it holds, exact tokens included, at a
context length)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers.cache_utils import BaseQuantizedLayer, Cache

from ..config import OscarConfig
from ..layout import QuantizedKV, StorageLayout


@dataclass(frozen=True)
class KVMemory:
    """Bytes held by a cache (summed over layers), and what a DynamicCache would hold for the same tokens, in the
    model's dtype and in bf16. `print(memory)` shows the whole cache's ratios to both.

    `quantized_*` covers the 2-bit region of the OScaR layers; `exact_*` everything kept in full precision (residual
    windows, sinks, and the layers OScaR leaves alone, e.g. sliding-window layers). `allocated_bytes` includes spare
    capacity (buffers grow by doubling; `generate` reserves its maximum length up front).
    """

    quantized_bytes: int = 0
    quantized_bf16_bytes: int = 0
    exact_bytes: int = 0
    exact_bf16_bytes: int = 0
    allocated_bytes: int = 0
    model_dtype_bytes: int = 0  # the same tokens in the model's dtype (a DynamicCache)

    def __add__(self, other: KVMemory) -> KVMemory:
        return KVMemory(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(KVMemory)))

    @classmethod
    def of_storage(cls, storage) -> KVMemory:
        """What one layer's `KVStorage` holds now, and what a cache of the same tokens in the model's dtype and in
        bf16 would hold."""
        per_token = storage.keys[:, :, 0].numel() + storage.values[:, :, 0].numel()
        element_size, exact = storage.keys.element_size(), storage.sinks_held + storage.held
        return cls(
            quantized_bytes=_nbytes(storage.quantized()),
            quantized_bf16_bytes=2 * per_token * storage.length,
            exact_bytes=element_size * per_token * exact,
            exact_bf16_bytes=2 * per_token * exact,
            allocated_bytes=storage.exact_keys.nbytes + storage.exact_values.nbytes + _nbytes(storage.buffers),
            model_dtype_bytes=element_size * per_token * storage.total,
        )

    @property
    def total_bytes(self) -> int:
        return self.quantized_bytes + self.exact_bytes

    @property
    def bf16_bytes(self) -> int:
        return self.quantized_bf16_bytes + self.exact_bf16_bytes

    @property
    def ratio_vs_bf16(self) -> float:
        """How many times smaller than bf16 the whole cache is (residual windows and other layers included)."""
        return self.bf16_bytes / self.total_bytes if self.total_bytes else float("nan")

    @property
    def ratio_vs_model_dtype(self) -> float:
        """How many times smaller the whole cache is than a DynamicCache of the same tokens in the model's dtype."""
        return self.model_dtype_bytes / self.total_bytes if self.total_bytes else float("nan")

    @property
    def quantized_ratio_vs_bf16(self) -> float:
        """How many times smaller than bf16 the quantized region is (about 5.3x at 2 bits, D=128, fp16 scales; the
        stored bits per element of a config: `average_bits`)."""
        return self.quantized_bf16_bytes / self.quantized_bytes if self.quantized_bytes else float("nan")

    def __str__(self) -> str:
        def mib(n: int) -> str:
            return f"{n / 2**20:.2f} MiB"

        text = f"KV cache {mib(self.total_bytes)}"
        if self.quantized_bytes:
            text += f" ({mib(self.quantized_bytes)} quantized + {mib(self.exact_bytes)} exact)"
        text += (
            f"; compression {self.ratio_vs_model_dtype:.2f}x vs the model's dtype ({mib(self.model_dtype_bytes)}), "
            f"{self.ratio_vs_bf16:.2f}x vs bf16 ({mib(self.bf16_bytes)})"
        )
        if self.quantized_bytes:
            text += f"; the quantized region alone: {self.quantized_ratio_vs_bf16:.2f}x vs bf16"
        return text


def kv_memory(cache: Cache) -> KVMemory:
    """Bytes a cache holds now (any transformers `Cache`; OScaR layers and transformers' quantized layers report their
    quantized region separately)."""
    total = KVMemory()
    for layer in cache.layers:
        if callable(getattr(layer, "memory", None)):  # an OscarLayer (transformers' layers have no `memory`)
            total += layer.memory()
            continue
        tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]
        held = sum(t.nbytes for t in tensors)
        bf16 = sum(2 * t.numel() for t in tensors)
        total += KVMemory(exact_bytes=held, exact_bf16_bytes=bf16, allocated_bytes=held, model_dtype_bytes=held)
        if isinstance(layer, BaseQuantizedLayer) and layer._quantized_keys is not None:
            total += _quantized_layer_memory(layer)
    return total


def _quantized_layer_memory(layer: BaseQuantizedLayer) -> KVMemory:
    """The quantized states of a transformers `QuantizedCache` layer (quanto, HQQ or FP8 backend): their stored bytes,
    and the bytes of the tokens they stand for in the model's dtype and in bf16 (the exact window is counted apart)."""
    stored = _stored_bytes(layer._quantized_keys) + _stored_bytes(layer._quantized_values)
    elements = _logical_elements(layer._quantized_keys) + _logical_elements(layer._quantized_values)
    return KVMemory(
        quantized_bytes=stored,
        quantized_bf16_bytes=2 * elements,
        allocated_bytes=stored,
        model_dtype_bytes=layer.keys.element_size() * elements,
    )


def _stored_bytes(states) -> int:
    """Bytes of every tensor in a backend's quantized states: a tensor (a wrapper subclass, as optimum-quanto's, by
    its inner tensors: codes, scales, shifts), or a tuple, list or dict of them (HQQ's codes and metadata, FP8's codes
    and scale)."""
    if torch.is_tensor(states):
        if is_traceable_wrapper_subclass(states):
            names, _ = states.__tensor_flatten__()
            return sum(_stored_bytes(getattr(states, name)) for name in names)
        return states.nbytes
    if isinstance(states, (tuple, list)):
        return sum(_stored_bytes(item) for item in states)
    if isinstance(states, dict):
        return sum(_stored_bytes(item) for item in states.values())
    return 0


def _logical_elements(states) -> int:
    """The K or V elements a backend's quantized states stand for: HQQ's (codes, meta) by its meta's shape, FP8's
    (codes, scale) by its codes, a quanto tensor by its own (logical) shape."""
    if isinstance(states, tuple):
        codes, meta = states
        return math.prod(meta["shape"]) if isinstance(meta, dict) else codes.numel()
    return states.numel()


def average_bits(config: OscarConfig, head_dim: int, kv_heads: int = 1) -> float:
    """Every bit the quantized region stores per K/V element under `config`: codes (keys at `key_bits`, values at
    `value_bits`), scales and minimums in the scale dtype, and the float32 token norms, over 2 * head_dim elements per
    token and KV head (the `StorageLayout`'s own shapes and dtypes). A layer's `kv_heads` share one norm per token;
    the default 1 charges each head a whole norm (the count that does not depend on the model). With fp16 scales at
    head_dim 128: 2 bits 3.125 (100 bytes per token and KV head), 4 bits 5.125, 4-bit keys and 2-bit values 4.125
    (bf16 is 16). The exact residual window and sinks are not counted (`KVMemory` counts what a cache holds)."""
    if config.auto_bits:
        raise ValueError(
            "average_bits: bits='auto' (the default) chooses each layer's widths from the prompt; ask the cache "
            "(`cache.average_bits()`, after the prompt) or pass a config of fixed widths (config.with_widths(4, 2))."
        )
    layout = StorageLayout.of(config)
    tokens = config.group_size  # whole key groups, and whole words of codes (a word holds at most 16 tokens)
    shapes = layout.shapes(1, kv_heads, head_dim, kv_heads, head_dim, tokens)
    stored = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(shapes, layout.dtypes) if shape)
    return 8 * stored / (2 * kv_heads * tokens * head_dim)


def exact_tokens(config: OscarConfig) -> float:
    """The exact tokens an OScaR layer holds per sequence once its context passes the sinks and one window, averaged
    over a decode's cycle through the window: the sinks, and the window's mean fill (R + 1) / 2 (it holds 1 to R
    tokens: a complete block is quantized when the next update begins)."""
    return config.sink_tokens + (config.residual_length + 1) / 2


def mixed_bits(stored_bits: float, exact: float, context: int, exact_bits: int = 16) -> float:
    """Bits per K/V element of `context` tokens of which `exact` (at most all of them) are held at `exact_bits` and the
    rest at `stored_bits`: what `effective_bits` sums, for any cache whose exact tokens are a count per sequence."""
    if context <= 0:
        raise ValueError(f"mixed_bits: context={context} must be a positive number of tokens.")
    exact = min(exact, context)
    return (stored_bits * (context - exact) + exact_bits * exact) / context


def effective_bits(
    config: OscarConfig,
    head_dim: int,
    kv_heads: int = 1,
    context: int = 4096,
    stored_bits: float | None = None,
    exact_bits: int = 16,
) -> float:
    """Every bit an OScaR layer holds per K/V element of a sequence of `context` tokens: the quantized region at
    `average_bits` (codes, scales, minimums, token norms), the sinks and the residual window at its mean fill
    (`exact_tokens`) at `exact_bits` (16: a bf16 or fp16 model, as `average_bits` counts its scales). What a user pays
    at that context, to compare configs and peers whose exact windows differ (`integrations.lm_eval.effective_avg_bits`
    counts the peers alike). `stored_bits`: the quantized region's bits where the config does not fix them (bits="auto":
    a cache's `average_bits()` after its choice; by default the budget, which the choice stays within). At 4096 tokens,
    head_dim 128, one KV head: 2 bits and no sinks 3.125 -> 3.33; with 4 sinks 3.34. Layers OScaR leaves alone
    (sliding windows) are not counted."""
    if stored_bits is None:
        stored_bits = (
            config.budget(average_bits(config.with_widths(2, 2), head_dim, kv_heads))
            if config.auto_bits
            else average_bits(config, head_dim, kv_heads)
        )
    return mixed_bits(stored_bits, exact_tokens(config), context, exact_bits)


def _nbytes(tensors: QuantizedKV | None) -> int:
    return 0 if tensors is None else sum(t.nbytes for t in tensors if t is not None)
