"""`OscarCache`: a transformers `Cache` whose full-attention layers store K/V in OScaR's 2-bit format.

Each `OscarLayer` holds two regions of one layer's history, oldest first:

* the quantized region: `quantized_length` tokens (a multiple of `residual_length`) in the storage contract of
  `oscar_hf.reference` (packed codes, scales/mins, token norms), in buffers that grow by doubling so that a
  flush copies one block, never the whole history;
* the residual window: the latest 1 to `residual_length` tokens, exact, in the model dtype, as the model produced
  them (post-RoPE, neither rotated nor scaled), in a fixed buffer of `residual_length` tokens.

Appending tokens fills the residual; complete blocks of R = residual_length tokens are rotated, scaled, quantized and
moved to the quantized region, the newest block once the next update begins (after a prefill of S tokens,
`(S - 1) // R * R` are quantized). Every attention call therefore sees all complete blocks of its history quantized,
the rest of the history exact, and its own tokens exact; the fused decode kernel finds a step's own tokens at the end
of the residual.

Portable path (`update` returns dense K/V): what the storage represents, dequantized, followed by the residual and
the new tokens. A chunk with no history attends to its own exact K/V; a chunk arriving with history (multi-turn,
chunked prefill, scoring) attends to the dequantized history plus its own exact tokens.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, fields

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .config import OscarConfig
from .integrations import fused_attention
from .kernels import DECODE_HEAD_DIMS, DECODE_MAX_QUERY_ROWS, DECODE_MAX_QUERY_TOKENS
from .reference import (
    QuantizedKV,
    check_finite,
    check_head_dim,
    dequantize_kv,
    empty_quantized_kv,
    key_rotation_choice,
    quantize_kv,
)

# Tokens quantized per call during a long prefill: bounds the float32 temporaries of `quantize_kv`.
_QUANTIZE_CHUNK_TOKENS = 4096


def _tokens_per_row(config: OscarConfig) -> QuantizedKV:
    """How many tokens one row (index along dim 2) of each `QuantizedKV` field covers."""
    w, g = config.codes_per_word, config.group_size
    return QuantizedKV(key_codes=w, key_scale=g, key_min=g, key_norms=1, value_codes=w, value_scale=1, value_min=1)


class OscarLayer(CacheLayerMixin):
    """One full-attention layer of an `OscarCache` (see the module docstring for the two regions)."""

    is_sliding = False
    is_croppable = True
    # Set by `OscarCache` at the first update when the Triton path applies (CUDA, sdpa model, supported shapes):
    # then blocks are quantized by the Triton kernel, and steps of up to `fused_query_tokens` tokens attend with
    # the fused kernel (its limit on query rows per KV head divided by the model's GQA group).
    use_kernels = False
    fused_query_tokens = 0

    def __init__(self, config: OscarConfig):
        super().__init__()
        self.config = config
        self._rows = _tokens_per_row(config)
        self.quantized_length = 0
        self.residual_length = 0  # tokens currently in the residual window
        self._storage: QuantizedKV | None = None  # capacity buffers; the first `quantized_length` tokens are valid
        self._reserved_tokens = 0
        self.residual_keys: torch.Tensor | None = None  # [B, Hkv, config.residual_length, Dk], model dtype
        self.residual_values: torch.Tensor | None = None
        # method="oscar": [B, Hkv] bool, which heads rotate their keys, decided at the first quantized block.
        self.key_rotated: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_head_dim(key_states.shape[-1], self.config)
        check_head_dim(value_states.shape[-1], self.config)
        self.dtype, self.device = key_states.dtype, key_states.device
        window = self.config.residual_length
        self.residual_keys = key_states.new_empty(*key_states.shape[:2], window, key_states.shape[-1])
        self.residual_values = value_states.new_empty(*value_states.shape[:2], window, value_states.shape[-1])
        self.is_initialized = True

    # ----------------------------------------------------------------------------------------------------------
    # transformers' layer API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return the dense K/V to attend to (history as stored, then the new tokens)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.get_seq_length() == 0:
            self.append(key_states, value_states)
            return key_states, value_states
        if self.residual_length == self.config.residual_length:  # a complete block: quantized before it is read
            self._store(self._quantize(self.residual_keys, self.residual_values))
            self.residual_length = 0
        new = key_states.shape[-2]
        if (
            self.use_kernels
            and new <= self.fused_query_tokens
            and self.residual_length + new <= self.config.residual_length
        ):
            # Fused decode: the kernel reads the storage itself (integrations/fused_attention.py), so only the new
            # tokens are returned, as the handle the wrapped sdpa recognises.
            self.append(key_states, value_states)
            fused_attention.expect_fused_decode(self, key_states)
            return key_states, value_states
        past_keys, past_values = self.dense_history()
        # Concatenate before appending: the history may be a view of the residual buffer that `append` rewrites.
        keys, values = torch.cat([past_keys, key_states], dim=-2), torch.cat([past_values, value_states], dim=-2)
        self.append(key_states, value_states)
        return keys, values

    def get_seq_length(self) -> int:
        return self.quantized_length + self.residual_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.quantized_length = self.residual_length = 0
        self._storage = self.residual_keys = self.residual_values = self.key_rotated = None
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (assisted decoding rolls back rejected candidates).

        Cropping into the quantized region moves the surviving tokens of the last blocks back into the residual
        window as the values they decode to, so attention sees exactly what it saw before the crop.
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as transformers does."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        if keep >= self.quantized_length:
            self.residual_length = keep - self.quantized_length
            return
        block_start = keep - keep % self.config.residual_length
        keys, values = self._dequantize(block_start, self.quantized_length)
        survivors = keep - block_start
        self.residual_keys[:, :, :survivors] = keys[:, :, :survivors]
        self.residual_values[:, :, :survivors] = values[:, :, :survivors]
        self.quantized_length, self.residual_length = block_start, survivors

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        # Reordering packed codes is lossless, so beam search reorders eagerly (no deferred dequantization).
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def offload(self) -> None:
        self._apply(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        self._apply(lambda t: t.to(self.device, non_blocking=True))

    # ----------------------------------------------------------------------------------------------------------
    # storage
    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add tokens to the residual window, quantizing whole `residual_length` blocks but the newest: the residual
        keeps the last 1..R tokens (a complete last block is quantized when the next update begins), so a fused
        decode step finds its own tokens in the residual."""
        window = self.config.residual_length
        held, new = self.residual_length, key_states.shape[-2]
        to_quantize = (held + new - 1) // window * window
        if to_quantize == 0:
            self.residual_keys[:, :, held : held + new] = key_states
            self.residual_values[:, :, held : held + new] = value_states
            self.residual_length += new
            return
        if held:
            key_states = torch.cat([self.residual_keys[:, :, :held], key_states], dim=-2)
            value_states = torch.cat([self.residual_values[:, :, :held], value_states], dim=-2)
        for start in range(0, to_quantize, _QUANTIZE_CHUNK_TOKENS):
            end = min(start + _QUANTIZE_CHUNK_TOKENS, to_quantize)
            self._store(self._quantize(key_states[:, :, start:end], value_states[:, :, start:end]))
        self.residual_length = key_states.shape[-2] - to_quantize
        self.residual_keys[:, :, : self.residual_length] = key_states[:, :, to_quantize:]
        self.residual_values[:, :, : self.residual_length] = value_states[:, :, to_quantize:]

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor) -> QuantizedKV:
        if self.key_rotated is None and self.config.rotation and self.config.method == "oscar":
            self.key_rotated = key_rotation_choice(keys, self.config)  # once, from the first block: the prompt
        if self.use_kernels:
            from .kernels import quantize_kv_triton

            block = quantize_kv_triton(keys, values, self.config)
        else:
            block = quantize_kv(keys, values, self.config, self.key_rotated)
        check_finite(block, self.config)
        return block

    def fused_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of this step's queries (the newest residual tokens) over everything stored, read in place by
        the fused Triton kernel: `[B, Hq, Tq, D]`."""
        from .kernels import decode_attention_triton

        padding = None
        if attention_mask is not None:  # [B or 1, 1, Tq, kv]: the last query row masks exactly the padding
            padding = attention_mask[:, 0, -1, : self.get_seq_length()]
            if padding.dtype != torch.bool:  # an additive float mask: 0 where attending
                padding = padding == 0
            padding = padding.expand(query.shape[0], -1)
        held = self.residual_length
        residual_keys, residual_values = self.residual_keys[:, :, :held], self.residual_values[:, :, :held]
        return decode_attention_triton(
            query, self.quantized(), residual_keys, residual_values, padding, scaling, self.config
        )

    def quantized(self) -> QuantizedKV | None:
        """Views of the quantized region (`quantized_length` tokens), or None when it is empty."""
        return self._stored(0, self.quantized_length) if self.quantized_length else None

    def dense_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, as dense K/V in the model dtype: dequantized region, then the exact residual."""
        keys = self.residual_keys[:, :, : self.residual_length]
        values = self.residual_values[:, :, : self.residual_length]
        if self.quantized_length:
            old_keys, old_values = self._dequantize(0, self.quantized_length)
            keys = torch.cat([old_keys, keys], dim=-2)
            values = torch.cat([old_values, values], dim=-2)
        return keys, values

    def _dequantize(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of quantized tokens `[start, end)` (block-aligned), in the model dtype."""
        math_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        keys, values = dequantize_kv(self._stored(start, end), self.config, math_dtype, self.key_rotated)
        return keys.to(self.dtype), values.to(self.dtype)

    def reserve(self, tokens: int) -> None:
        """Size the quantized storage for `tokens` tokens up front (generate knows its maximum length)."""
        self._reserved_tokens = tokens - tokens % self.config.residual_length
        if self.is_initialized and self._storage is not None:
            self._grow(self._reserved_tokens)

    def _stored(self, start: int, end: int) -> QuantizedKV:
        return QuantizedKV(
            *(
                None if buf is None else buf[:, :, start // rows : end // rows]
                for buf, rows in zip(self._storage, self._rows)
            )
        )

    def _store(self, block: QuantizedKV) -> None:
        start = self.quantized_length
        end = start + block.key_scale.shape[2] * self.config.group_size
        self._grow(end)
        for buf, part, rows in zip(self._storage, block, self._rows):
            if buf is not None:
                buf[:, :, start // rows : end // rows] = part
        self.quantized_length = end

    def _grow(self, tokens: int) -> None:
        """Make room for `tokens` quantized tokens: capacity doubles, so appending is amortized O(block)."""
        capacity = 0 if self._storage is None else self._storage.key_scale.shape[2] * self.config.group_size
        if tokens <= capacity:
            return
        window = self.config.residual_length
        capacity = -(-max(tokens, 2 * capacity, self._reserved_tokens) // window) * window
        new = empty_quantized_kv(self.residual_keys, self.residual_values, capacity, self.config)
        if self._storage is not None:
            for buf, old in zip(new, self._storage):
                if buf is not None:
                    buf[:, :, : old.shape[2]] = old
        self._storage = new

    def _apply(self, fn) -> None:
        """Apply a batch-axis (or device) transform to every stored tensor."""
        if not self.is_initialized:
            return
        self.residual_keys, self.residual_values = fn(self.residual_keys), fn(self.residual_values)
        if self.key_rotated is not None:
            self.key_rotated = fn(self.key_rotated)
        if self._storage is not None:
            self._storage = QuantizedKV(*(None if t is None else fn(t) for t in self._storage))

    # ----------------------------------------------------------------------------------------------------------
    # memory accounting
    def memory(self) -> KVMemory:
        if not self.is_initialized:
            return KVMemory()
        elements_per_token = self.residual_keys[:, :, 0].numel() + self.residual_values[:, :, 0].numel()
        allocated = self.residual_keys.nbytes + self.residual_values.nbytes
        if self._storage is not None:
            allocated += sum(t.nbytes for t in self._storage if t is not None)
        quantized = self.quantized()
        return KVMemory(
            quantized_bytes=0 if quantized is None else sum(t.nbytes for t in quantized if t is not None),
            quantized_bf16_bytes=2 * elements_per_token * self.quantized_length,
            exact_bytes=self.residual_keys.element_size() * elements_per_token * self.residual_length,
            exact_bf16_bytes=2 * elements_per_token * self.residual_length,
            allocated_bytes=allocated,
        )


@dataclass(frozen=True)
class KVMemory:
    """Bytes held by a cache (summed over layers), and what a bf16 DynamicCache would hold for the same tokens.

    `quantized_*` covers the 2-bit region of the OScaR layers; `exact_*` everything kept in full precision (residual
    windows, and the layers OScaR leaves alone, e.g. sliding-window layers). `allocated_bytes` includes spare
    capacity (buffers grow by doubling; `generate` reserves its maximum length up front).
    """

    quantized_bytes: int = 0
    quantized_bf16_bytes: int = 0
    exact_bytes: int = 0
    exact_bf16_bytes: int = 0
    allocated_bytes: int = 0

    def __add__(self, other: KVMemory) -> KVMemory:
        return KVMemory(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(KVMemory)))

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
    def quantized_ratio_vs_bf16(self) -> float:
        """How many times smaller than bf16 the quantized region is (about 5.3x at 2 bits, D=128, fp16 scales)."""
        return self.quantized_bf16_bytes / self.quantized_bytes if self.quantized_bytes else float("nan")


def kv_memory(cache: Cache) -> KVMemory:
    """Bytes a cache holds now (any transformers `Cache`; OScaR layers report their quantized region separately)."""
    total = KVMemory()
    for layer in cache.layers:
        if isinstance(layer, OscarLayer):
            total += layer.memory()
            continue
        tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]
        held = sum(t.nbytes for t in tensors)
        total += KVMemory(exact_bytes=held, exact_bf16_bytes=sum(2 * t.numel() for t in tensors), allocated_bytes=held)
    return total


class OscarCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers are `OscarLayer`s; other layer types (sliding window, linear
    attention, KV-sharing) keep transformers' own layers.

    Args:
        config: the model's config (`model.config`); the layer types come from it.
        oscar_config: an `OscarConfig`, or a dict of its fields (unknown keys are an error), or None for defaults.

    Example:
        >>> cache = OscarCache(model.config, OscarConfig(bits=2))
        >>> model.generate(**inputs, past_key_values=cache)
    """

    layer_class: type[OscarLayer] = OscarLayer

    def __init__(self, config: PretrainedConfig, oscar_config: OscarConfig | dict | None = None):
        if not isinstance(oscar_config, OscarConfig):
            oscar_config = OscarConfig.from_dict(oscar_config)
        self.oscar_config = oscar_config
        text_config = config.get_text_config(decoder=True)
        self._text_config = text_config
        if getattr(text_config, "is_encoder_decoder", False):
            raise ValueError("OscarCache supports decoder-only models; this model is an encoder-decoder.")
        head_dim = getattr(text_config, "head_dim", None)
        if isinstance(head_dim, int):
            check_head_dim(head_dim, oscar_config)
        super().__init__(config=config)
        self.layers = [
            self.layer_class(oscar_config) if type(layer) is DynamicLayer else layer for layer in self.layers
        ]
        if not any(isinstance(layer, OscarLayer) for layer in self.layers):
            raise ValueError(
                f"OscarCache found no standard full-attention layer in this {type(config).__name__} (layer types: "
                f"{sorted({type(layer).__name__ for layer in self.layers})}); nothing would be quantized. Use the "
                "model's default cache."
            )

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, OscarLayer) and not layer.is_initialized:
            layer.use_kernels = self._kernels_apply(key_states, value_states)
            group = getattr(self._text_config, "num_attention_heads", key_states.shape[1]) // key_states.shape[1]
            layer.fused_query_tokens = min(DECODE_MAX_QUERY_TOKENS, DECODE_MAX_QUERY_ROWS // max(group, 1))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _kernels_apply(self, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether a layer seeing these K/V uses the Triton kernels. With attention="auto" the portable path runs
        where they do not apply (same storage, same results up to rounding); attention="fused" demands them."""
        mode = self.oscar_config.attention
        if mode == "portable":
            return False
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs kernels on CPU tensors
        implementation = getattr(self._text_config, "_attn_implementation", None)
        reasons = [
            reason
            for failed, reason in (
                (self.offloading, "cache offloading is on"),
                (implementation != "sdpa", f"the model's attn_implementation is {implementation!r}, not 'sdpa'"),
                (
                    not (key_states.is_cuda or (mode == "fused" and interpreting)),
                    f"K/V are on {key_states.device} (CUDA needed; CPU only under TRITON_INTERPRET=1)",
                ),
                (
                    not key_states.shape[-1] == value_states.shape[-1] in DECODE_HEAD_DIMS,
                    f"head dims {key_states.shape[-1]}/{value_states.shape[-1]} are not one of {DECODE_HEAD_DIMS}",
                ),
                (importlib.util.find_spec("triton") is None, "triton is not installed"),
                (
                    self.oscar_config.rotation and self.oscar_config.method == "oscar",
                    "the kernels do not implement method='oscar' (per-head key rotation) yet; method='paper' or "
                    "rotation=False use them",
                ),
            )
            if failed
        ]
        if reasons and mode == "fused":
            raise ValueError(
                f"OscarConfig(attention='fused') cannot use the Triton kernels: {'; '.join(reasons)}. "
                "Use attention='auto' (kernels where they apply) or 'portable'."
            )
        if not reasons:
            fused_attention.install()
        return not reasons

    def memory_footprint(self) -> KVMemory:
        """Bytes this cache holds now, and the ratio to a bf16 cache of the same tokens."""
        return kv_memory(self)

    def reserve(self, tokens: int) -> None:
        """Pre-allocate quantized storage for `tokens` tokens in every initialized OScaR layer."""
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                layer.reserve(tokens)
