"""`OscarLayer`: one full-attention layer's storage in OScaR's 2-bit format.

A layer holds two regions of its history, oldest first:

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

The layer's other jobs have their own owners: how its steps attend (`decode_path.DecodePath`, handed over by
`OscarCache` at the first update), the query rule's state (`key_rotation.KeyRotation`), the device counter of
compiled decode (`compiled.CompiledDecode`), the deferred finite check (`finite.FiniteCheck`) and the padding
(`padding.Padding`).

Portable path (`update` returns dense K/V): what the storage represents, dequantized, followed by the residual and
the new tokens. A chunk with no history attends to its own exact K/V; a chunk arriving with history (multi-turn,
chunked prefill, scoring) attends to the dequantized history plus its own exact tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import OscarConfig
from ..decode_path import DecodePath
from ..integrations import fused_attention
from ..kernels import ops as kernel_ops
from ..layout import QuantizedKV, StorageLayout
from ..reference import (
    check_head_dim,
    dequantize_kv,
    finite_flags,
    quantize_kv,
    query_moment,
    raise_unless_finite,
    token_norms,
)
from .compiled import CompiledDecode, refuse_step
from .finite import FiniteCheck
from .key_rotation import KeyRotation
from .memory import KVMemory
from .padding import Padding, key_padding
from .storage import QuantizedRegion

# Tokens quantized per call during a long prefill: bounds the float32 temporaries of `quantize_kv`.
_QUANTIZE_CHUNK_TOKENS = 4096


class OscarLayer(CacheLayerMixin):
    """One full-attention layer of an `OscarCache` (see the module docstring for the two regions)."""

    is_sliding = False
    is_croppable = True
    max_cache_len: int | None = None  # set by `reserve`: the most tokens this layer will hold (generate's max length)

    def __init__(self, config: OscarConfig):
        super().__init__()
        self.config = config
        self.layout = StorageLayout.of(config)
        self._op_config = kernel_ops.config_key(config)  # the config as the custom ops take it
        self.path = DecodePath()  # decided by `OscarCache` at the first update (`configure`)
        self.region = QuantizedRegion(self.layout, config.residual_length)
        self.residual_length = 0  # tokens currently in the residual window
        self.residual_keys: torch.Tensor | None = None  # [B, Hkv, config.residual_length, Dk], model dtype
        self.residual_values: torch.Tensor | None = None
        self.fused_step: fused_attention.FusedStep | None = None  # this layer's latest fused decode step
        self._compiled: CompiledDecode | None = None  # compiled decode only
        self.rotation = KeyRotation(config)
        self._padding: Padding | None = None  # set by `OscarCache.set_padding`: which positions hold padding
        self._finite = FiniteCheck(config)

    def configure(self, path: DecodePath) -> None:
        """Take the decode path `OscarCache` decided for this layer (before its first update)."""
        self.path = path

    def set_padding(self, padding: Padding | None) -> None:
        """Which positions hold padding, from `OscarCache.set_padding` (quantization leaves them out)."""
        self._padding = padding

    @property
    def use_kernels(self) -> bool:
        """Whether blocks are quantized by the Triton kernel and decode steps may attend with the fused kernel."""
        return self.path.fused

    @property
    def fused_query_tokens(self) -> int:
        return self.path.query_tokens

    @property
    def head_group(self):
        return self.path.head_group

    @property
    def quantized_length(self) -> int:
        """Tokens in the quantized region (a multiple of `residual_length`)."""
        return self.region.length

    @quantized_length.setter
    def quantized_length(self, tokens: int) -> None:
        self.region.length = tokens

    @property
    def _storage(self) -> QuantizedKV | None:
        """The quantized region's capacity buffers."""
        return self.region.buffers

    @property
    def key_rotated(self) -> torch.Tensor | None:
        """method="oscar": `[B, Hkv]` bool, which heads rotate their keys (None until the prefill's queries came)."""
        return self.rotation.flags

    @property
    def compiled_decode(self) -> bool:
        """Whether compiled single-token steps can run: the fused path applies and the maximum length is reserved."""
        return self.use_kernels and self.max_cache_len is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_head_dim(key_states.shape[-1], self.config)
        check_head_dim(value_states.shape[-1], self.config)
        self.dtype, self.device = key_states.dtype, key_states.device
        window = self.config.residual_length
        # Zeros: compiled steps read (masked) unused slots, which must never hold NaN garbage.
        self.residual_keys = key_states.new_zeros(*key_states.shape[:2], window, key_states.shape[-1])
        self.residual_values = value_states.new_zeros(*value_states.shape[:2], window, value_states.shape[-1])
        self.is_initialized = True
        if self.compiled_decode:
            self._prepare_compiled_decode()

    def _prepare_compiled_decode(self) -> None:
        """Allocate the reserved storage once (zeros beyond the stored tokens) and start the device counter."""
        self.region.grow(self.region.reserved, self.residual_keys, self.residual_values)
        self.region.clear_unused()
        self._compiled = CompiledDecode(self)

    # ----------------------------------------------------------------------------------------------------------
    # transformers' layer API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return the K/V to attend to: the history as stored, then the new tokens; or, on
        a fused step, the new tokens only, carrying the step (`integrations/fused_attention.py`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_shape(key_states, value_states)
        if torch.compiler.is_compiling():
            refuse_step(self, key_states.shape[-2])
            if self.wants_queries:
                raise RuntimeError(self.rotation.no_queries_message())
            self._compiled.step(self, key_states, value_states)
            return self._fused_step(key_states, value_states)
        self._finite.read(wait=False)
        self.fused_step = None  # valid until this update
        keys, values = self._eager_update(key_states, value_states)
        if self._compiled is not None:
            self._compiled.length.fill_(self.get_seq_length())
        return keys, values

    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.get_seq_length() == 0:
            if self.wants_queries:
                self.rotation.start_prefill(key_states)
                fused_attention.await_queries(self, key_states)
            self.append(key_states, value_states)
            return key_states, value_states
        if self.wants_queries:  # the prefill's attention never handed its queries over
            raise RuntimeError(self.rotation.no_queries_message())
        if self.residual_length == self.config.residual_length:  # a complete block: quantized before it is read
            self._store(self._quantize(self.residual_keys, self.residual_values, decoding=True))
            self.residual_length = 0
        if self.path.fused_step(self.residual_length, key_states.shape[-2], self.config.residual_length):
            # Fused decode: the kernel reads the storage itself, so only the new tokens are returned, carrying the
            # step that the sdpa entry recognises (integrations/fused_attention.py).
            self.append(key_states, value_states)
            return self._fused_step(key_states, value_states)
        past_keys, past_values = self.dense_history()
        # Concatenate before appending: the history may be a view of the residual buffer that `append` rewrites.
        keys, values = torch.cat([past_keys, key_states], dim=-2), torch.cat([past_values, value_states], dim=-2)
        self.append(key_states, value_states)
        return keys, values

    def _fused_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.fused_step = fused_attention.FusedStep.of(self, key_states, value_states)
        return key_states, value_states

    def _check_shape(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Refuse K/V whose batch, heads or head_dim differ from what this layer holds (a cache reused for another
        batch), naming the fix, rather than failing inside a kernel or concatenating mismatched histories."""
        held = (self.residual_keys.shape[:2], self.residual_keys.shape[-1], self.residual_values.shape[-1])
        if (key_states.shape[:2], key_states.shape[-1], value_states.shape[-1]) == held:
            return
        (batch, heads), _, _ = held
        raise ValueError(
            f"OscarCache holds K/V of batch size {batch} with {heads} KV heads (head dims {held[1]}/{held[2]}), but "
            f"an update brought keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}: a cache "
            "serves one batch of sequences. Call `cache.reset()` before reusing it for another batch, or create a "
            "new OscarCache."
        )

    def _read_length(self) -> None:
        """Bring the host-side lengths up to date after compiled steps (one host synchronisation)."""
        total = None if self._compiled is None else self._compiled.held()
        if total is not None:
            self.quantized_length = (total - 1) // self.config.residual_length * self.config.residual_length
            self.residual_length = total - self.quantized_length

    def get_seq_length(self) -> int | torch.Tensor:
        if torch.compiler.is_compiling() and self._compiled is not None:
            return self._compiled.length  # a tensor, as transformers' StaticLayer returns: no recompilation per step
        self._read_length()
        return self.quantized_length + self.residual_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Decode steps of a cache that can run compiled get a mask over the reserved storage and the window: one shape
        # for the whole generation (generate builds the mask outside the compiled forward), as wide as the kernel's
        # reads can reach (`CompiledDecode.attention`).
        if self.compiled_decode and query_length == 1:
            capacity = self.region.reserved if self._storage is None else self.region.capacity
            width = capacity + self.config.residual_length
            if torch.compiler.is_compiling():
                return width, 0
            if self.get_seq_length():
                return max(width, self.get_seq_length() + 1), 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.region = QuantizedRegion(self.layout, self.config.residual_length)
        self.residual_length = 0
        self.residual_keys = self.residual_values = self.fused_step = self._compiled = None
        self._padding = None
        self.rotation.reset()
        self._finite.reset()
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
        if self._compiled is not None:
            self._compiled.length.fill_(keep)
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

    def _valid(self, start: int, tensor: torch.Tensor) -> torch.Tensor | None:
        """The padding mask of `tensor`'s tokens at positions from `start` (None: no padding)."""
        return None if self._padding is None else self._padding.valid(start, tensor)

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, decoding: bool = False) -> QuantizedKV:
        """Quantize the tokens that follow the quantized region (`quantized_length` onward), refusing non-finite
        blocks: at once (one host synchronisation), or, for a block that a decode step flushes on CUDA
        (`decoding`), from a later update without waiting (`FiniteCheck`)."""
        valid = self._valid(self.quantized_length, keys)
        key_rotated = self.rotation.flags_for(keys, values)
        norms = None
        if self.head_group is not None and self.config.token_scaling:
            norms = token_norms(keys, self.head_group)  # over the heads of every rank: one all-reduce per block
        if self.use_kernels:
            from ..kernels import quantize_kv_triton

            block = quantize_kv_triton(keys, values, self.config, key_rotated, norms=norms, valid=valid)
        else:
            block = quantize_kv(keys, values, self.config, key_rotated, norms=norms, valid=valid)
        flags = finite_flags(block, keys, values, valid)
        if decoding and flags.is_cuda:
            self._finite.defer(flags)
        else:
            raise_unless_finite(flags, self.config)
        return block

    # ----------------------------------------------------------------------------------------------------------
    # method="oscar"'s query rule (the state and the choice: `KeyRotation`)
    @property
    def wants_queries(self) -> bool:
        """method="oscar": whether this layer still waits for the prefill's queries (to choose its key rotation)."""
        return self.rotation.wants_queries

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """method="oscar": the queries `[B, Hq, Tq, D]` (post-RoPE) of the attention call that read the prefill (this
        layer's first update), the newest Tq positions. The sdpa entry (integrations/fused_attention.py) calls it
        with the keys it received, which must be the ones that update returned (a call for another layer or cache
        is ignored); by hand, call it after the first update of a cache filled without the model's attention."""
        if not self.rotation.is_for(keys):
            return
        valid = self._valid(self.get_seq_length() - query.shape[-2], query)
        self.observe_query_moment(query_moment(query, self.residual_keys.shape[1], valid))

    def observe_query_moment(self, moment: torch.Tensor) -> None:
        """`observe_queries` given their second moment (`reference.query_moment`, padding left out): what a cache
        filled from another cache's prefill receives (the lm-eval wrapper records the moments of its exact prefill).
        Made at the end of the prefill even when no block is full yet, so that a flush inside a compiled decode step
        finds the flags fixed."""
        if not self.wants_queries:
            return
        residual = self.residual_keys[:, :, : self.residual_length]
        blocks = self.rotation.choose(moment, residual, lambda keys: self._valid(0, keys))
        if self._compiled is not None:  # compiled decode reads the flags: a fixed address, as its other buffers
            torch._dynamo.mark_static_address(self.key_rotated)
        if blocks:  # the prefill's blocks, quantized before the choice: again, with it
            end, self.quantized_length = self.quantized_length, 0
            for keys, values in blocks:
                self._store(self._quantize(keys, values))
            assert self.quantized_length == end

    # ----------------------------------------------------------------------------------------------------------
    # reading
    def fused_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of this step's queries (the newest residual tokens) over everything stored, read in place by
        the fused Triton kernel: `[B, Hq, Tq, D]`."""
        if torch.compiler.is_compiling():
            return self._compiled.attention(self, query, attention_mask, scaling)
        from ..kernels import decode_attention_triton

        padding = key_padding(attention_mask, query.shape[0], self.get_seq_length())
        held = self.residual_length
        residual_keys, residual_values = self.residual_keys[:, :, :held], self.residual_values[:, :, :held]
        return decode_attention_triton(
            query, self.quantized(), residual_keys, residual_values, padding, scaling, self.config, self.key_rotated
        )

    def quantized(self) -> QuantizedKV | None:
        """Views of the quantized region (`quantized_length` tokens), or None when it is empty."""
        return self.region.view()

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
        keys, values = dequantize_kv(self.region.rows(start, end), self.config, math_dtype, self.key_rotated)
        return keys.to(self.dtype), values.to(self.dtype)

    # ----------------------------------------------------------------------------------------------------------
    # capacity
    def reserve(self, tokens: int) -> None:
        """Size the quantized storage for `tokens` tokens up front (generate knows its maximum length)."""
        self.max_cache_len = tokens
        self.region.reserved = tokens - tokens % self.config.residual_length
        if self.is_initialized and self.compiled_decode:
            self._prepare_compiled_decode()
        elif self.is_initialized and self._storage is not None:
            self.region.grow(self.region.reserved, self.residual_keys, self.residual_values)

    def _store(self, block: QuantizedKV) -> None:
        self.region.store(block, self.residual_keys, self.residual_values)

    def _apply(self, fn) -> None:
        """Apply a batch-axis (or device) transform to every stored tensor."""
        if not self.is_initialized:
            return
        self.residual_keys, self.residual_values = fn(self.residual_keys), fn(self.residual_values)
        self.rotation.apply(fn)
        if self._padding is not None:
            self._padding = self._padding.apply(fn)
        self.region.apply(fn)

    def memory(self) -> KVMemory:
        """Bytes this layer holds now (`memory.kv_memory` sums them over a cache)."""
        if not self.is_initialized:
            return KVMemory()
        self._read_length()
        elements_per_token = self.residual_keys[:, :, 0].numel() + self.residual_values[:, :, 0].numel()
        allocated = self.residual_keys.nbytes + self.residual_values.nbytes + self.region.nbytes(self._storage)
        element_size = self.residual_keys.element_size()
        return KVMemory(
            quantized_bytes=self.region.nbytes(self.quantized()),
            quantized_bf16_bytes=2 * elements_per_token * self.quantized_length,
            exact_bytes=element_size * elements_per_token * self.residual_length,
            exact_bf16_bytes=2 * elements_per_token * self.residual_length,
            allocated_bytes=allocated,
            model_dtype_bytes=element_size * elements_per_token * self.get_seq_length(),
        )
