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

`OscarLayer` is transformers' layer API over objects with one job each: the two regions (`storage.KVStorage`), how
its steps attend (`decode_path.DecodePath`, handed over by `OscarCache` at the first update), the query rule's state
(`key_rotation.KeyRotation`), the device counter of compiled decode (`compiled.CompiledDecode`), the deferred finite
check (`finite.FiniteCheck`) and the padding (`padding.Padding`). It owns how a block is quantized and read back.

Portable path (`update` returns dense K/V): what the storage represents, dequantized, followed by the residual and
the new tokens. A chunk with no history attends to its own exact K/V; a chunk arriving with history (multi-turn,
chunked prefill, scoring) attends to the dequantized history plus its own exact tokens. On the fused path such a chunk
attends to the same history with the chunk kernel, which reads the quantized region in place (cache/chunk.py).
"""

from __future__ import annotations

import functools

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
from .chunk import ChunkHistory
from .compiled import CompiledDecode, mask_width, refuse_step
from .finite import FiniteCheck
from .key_rotation import KeyRotation
from .memory import KVMemory
from .padding import Padding, key_padding, valid
from .storage import KVStorage

_NO_VIEWS = (None, 0, None)


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
        self.storage = KVStorage(self.layout, config.residual_length, self._quantize, self._dequantize)
        self.fused_step: fused_attention.FusedStep | None = None  # this layer's latest fused decode step
        self._compiled: CompiledDecode | None = None  # compiled decode only
        self.rotation = KeyRotation(config)
        self._padding: Padding | None = None  # set by `OscarCache.set_padding`: which positions hold padding
        self._finite = FiniteCheck(config)
        self._stored_views: tuple = _NO_VIEWS  # (buffers, length, views of them): what eager fused steps read

    def configure(self, path: DecodePath) -> None:
        """Take the decode path `OscarCache` decided for this layer (before its first update)."""
        self.path = path

    def set_padding(self, padding: Padding | None) -> None:
        """Which positions hold padding, from `OscarCache.set_padding` (quantization leaves them out)."""
        self._padding = padding

    # What the layer holds, and how it decodes, as tests, benchmarks and transformers read them.
    use_kernels = property(lambda self: self.path.fused, doc="Whether the Triton kernels quantize and attend.")
    fused_query_tokens = property(lambda self: self.path.query_tokens)
    head_group = property(lambda self: self.path.head_group)
    residual_keys = property(lambda self: self.storage.keys, doc="[B, Hkv, residual_length, Dk], model dtype")
    residual_values = property(lambda self: self.storage.values)
    residual_length = property(lambda self: self.storage.held, doc="Tokens in the residual window.")
    quantized_length = property(lambda self: self.storage.length, doc="Tokens in the quantized region.")
    _storage = property(lambda self: self.storage.buffers, doc="The quantized region's capacity buffers.")
    key_rotated = property(lambda self: self.rotation.flags, doc="method='oscar': [B, Hkv] bool, or None until chosen")
    compiled_decode = property(  # compiled single-token steps can run: fused path, maximum length reserved
        lambda self: self.use_kernels and self.max_cache_len is not None
    )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for states in (key_states, value_states):
            check_head_dim(states.shape[-1], self.config)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.storage.allocate(key_states, value_states)
        self.is_initialized = True
        if self.compiled_decode:
            self._compiled = CompiledDecode(self)

    # ----------------------------------------------------------------------------------------------------------
    # transformers' layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """Store the new tokens and return the K/V to attend to: the history as stored, then the new tokens; or, on
        a fused step, the new tokens only, carrying the step (`integrations/fused_attention.py`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.storage.check_batch(key_states, value_states)
        if torch.compiler.is_compiling():
            refuse_step(self, key_states.shape[-2])
            if self.rotation.unwritten or (self.rotation.active and self.key_rotated is None):
                raise RuntimeError(self.rotation.unsettled_message())
            self._compiled.step(self, key_states, value_states)
            fused_attention.FusedStep.start(self, key_states, value_states)
            return key_states, value_states
        self._finite.read(wait=False)
        self.fused_step = None  # valid until this update
        keys, values = self._eager_update(key_states, value_states)
        if self._compiled is not None:
            self._compiled.length.fill_(self.get_seq_length())
        return keys, values

    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        storage = self.storage
        if not self.rotation.final:
            self._prepare_rotation(key_states.shape[-2])
        if storage.total == 0:
            self._append_awaiting_queries(key_states, value_states, key_states)
            return key_states, value_states
        storage.flush()  # a complete block: quantized before it is read
        if self.path.fused_step(storage.held, key_states.shape[-2], storage.window):
            # Fused decode: the kernel reads the storage itself, so only the new tokens are returned, carrying the
            # step that the sdpa entry recognises (integrations/fused_attention.py).
            storage.append(key_states, value_states)
            fused_attention.FusedStep.start(self, key_states, value_states)
            if not self.rotation.final:
                self._await_queries(key_states)
            return key_states, value_states
        if self.path.fused:
            return self._chunk_step(key_states, value_states)
        keys, values = storage.history(key_states, value_states)  # a new buffer: `append` may rewrite the window
        self._append_awaiting_queries(key_states, value_states, keys)
        return keys, values

    def _chunk_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk arriving with history on the fused path: stored, and returned alone carrying the step whose
        `ChunkHistory` the chunk kernel attends to (cache/chunk.py)."""
        history = ChunkHistory(self, self.storage.length, *self.storage.exact(key_states, value_states))
        self._append_awaiting_queries(key_states, value_states, key_states)
        fused_attention.FusedStep.start(self, key_states, value_states, chunk=history)
        return key_states, value_states

    def _append_awaiting_queries(self, key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor):
        """Append the tokens of an update that returns `keys` (dense K/V) to its attention call: while the key rotation
        is open, the blocks they complete wait, exact, for that call's queries (`KeyRotation`)."""
        rotation = self.rotation
        if rotation.final:
            self.storage.append(key_states, value_states)
            return
        rotation.deferring = True
        try:
            self.storage.append(key_states, value_states)
        finally:
            rotation.deferring = False
        self._await_queries(keys)

    def _await_queries(self, keys: torch.Tensor) -> None:
        """The attention call that receives `keys` brings the queries the open key-rotation choice takes."""
        self.rotation.await_queries(keys)
        fused_attention.await_queries(self, keys)

    def _prepare_rotation(self, tokens: int) -> None:
        """Before an update of `tokens` tokens while the key rotation is open: choose if the queries of the updates
        so far never came (blocks wait, or nothing was chosen), then make the choice final at a decode step (one
        token after a prompt) or when blocks were quantized without exact copies (compiled steps)."""
        rotation, held = self.rotation, self.get_seq_length()
        if rotation.unwritten or (rotation.flags is None and held):
            self._choose()
        if not rotation.final and ((tokens == 1 and held) or not rotation.covers(self.storage.length)):
            rotation.finalize()

    def get_seq_length(self) -> int | torch.Tensor:
        if torch.compiler.is_compiling() and self._compiled is not None:
            return self._compiled.length  # a tensor, as transformers' StaticLayer returns: no recompilation per step
        if self._compiled is not None:
            self._compiled.read_back(self.storage)
        return self.storage.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Decode steps of a cache that can run compiled get one mask shape for the whole generation (`mask_width`).
        if self.compiled_decode and query_length == 1:
            if torch.compiler.is_compiling():
                return mask_width(self), 0
            if self.get_seq_length():
                return max(mask_width(self), self.get_seq_length() + 1), 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.storage.clear()
        self.fused_step = self._compiled = self._padding = None
        self._stored_views = _NO_VIEWS
        self.rotation.reset()
        self._finite.reset()
        self.is_initialized = False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens (assisted decoding rolls back rejected candidates); tokens of
        the quantized region that survive return to the window as the values they decode to (`KVStorage.crop`)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as transformers does."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        self._write_waiting_blocks()
        if not self.rotation.final:  # the exact copies would no longer match the blocks
            self.rotation.finalize()
        if self._compiled is not None:
            self._compiled.length.fill_(keep)
        self.storage.crop(keep)

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

    def _apply(self, fn) -> None:
        """Apply a batch-axis (or device) transform to every stored tensor."""
        if not self.is_initialized:
            return
        self._stored_views = _NO_VIEWS  # views of the buffers `fn` replaces
        self.storage.apply(fn)
        self.rotation.apply(fn)
        if self._padding is not None:
            self._padding = self._padding.apply(fn)

    def reserve(self, tokens: int) -> None:
        """Size the quantized storage for `tokens` tokens up front (generate knows its maximum length)."""
        self.max_cache_len = tokens
        self._stored_views = _NO_VIEWS  # views of buffers the reservation may replace
        self.storage.reserved = tokens - tokens % self.config.residual_length
        if self.is_initialized and self.compiled_decode:
            self._compiled = CompiledDecode(self)
        elif self.is_initialized and self.storage.buffers is not None:
            self.storage.grow(self.storage.reserved)

    def memory(self) -> KVMemory:
        """Bytes this layer holds now (`memory.kv_memory` sums them over a cache)."""
        if not self.is_initialized:
            return KVMemory()
        self.get_seq_length()  # lengths read back after compiled steps
        return self.storage.memory()

    # ----------------------------------------------------------------------------------------------------------
    # quantizing and reading blocks
    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, decoding: bool = False) -> QuantizedKV | None:
        """The block of the tokens that follow the quantized region (`KVStorage`'s quantize); None while it waits for
        the key rotation's choice (`KeyRotation.hold`: the layer writes it then)."""
        start = self.quantized_length
        if not self.rotation.final:
            if keys.data_ptr() == self.storage.keys.data_ptr():  # the window buffer: later updates rewrite it
                keys, values = keys.clone(), values.clone()
            if self.rotation.hold(start, keys, values):
                return None
        return self._quantize_at(keys, values, start, decoding)

    def _quantize_at(self, keys: torch.Tensor, values: torch.Tensor, start: int, decoding: bool = False) -> QuantizedKV:
        """Quantize the tokens at quantized position `start`, refusing non-finite blocks: at once (one host
        synchronisation), or, for a block that a decode step flushes on CUDA (`decoding`), from a later update
        without waiting (`FiniteCheck`)."""
        mask = valid(self._padding, start, keys)
        key_rotated = self.rotation.flags
        norms = None
        if self.head_group is not None and self.config.token_scaling:
            norms = token_norms(keys, self.head_group)  # over the heads of every rank: one all-reduce per block
        if self.use_kernels:
            from ..kernels import quantize_kv_triton

            block = quantize_kv_triton(keys, values, self.config, key_rotated, norms=norms, valid=mask)
        else:
            block = quantize_kv(keys, values, self.config, key_rotated, norms=norms, valid=mask)
        flags = finite_flags(block, keys, values, mask)
        if decoding and flags.is_cuda:
            self._finite.defer(flags)
        else:
            raise_unless_finite(flags, self.config)
        return block

    def _dequantize(
        self, start: int, end: int, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of quantized tokens `[start, end)` (block-aligned), in the model dtype, written into `out` when
        given: on the fused path by the Triton kernel (`dequantize_kv_triton`: straight from the packed codes to the
        model dtype), elsewhere by the reference in float32 (float64 for a float64 model)."""
        rows = self.storage.rows(start, end)
        if self.use_kernels:
            from ..kernels import dequantize_kv_triton

            return dequantize_kv_triton(rows, self.config, self.key_rotated, out, self.dtype)
        math_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        keys, values = dequantize_kv(rows, self.config, math_dtype, self.key_rotated)
        if out is None:
            return keys.to(self.dtype), values.to(self.dtype)
        out[0].copy_(keys)
        out[1].copy_(values)
        return out

    def quantized(self) -> QuantizedKV | None:
        """Views of the quantized region (`quantized_length` tokens), or None when it is empty."""
        self._write_waiting_blocks()
        return self.storage.quantized()

    def dense_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, as dense K/V in the model dtype: dequantized region, then the exact residual."""
        self._write_waiting_blocks()
        return self.storage.history()

    def fused_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of this step's queries (the newest residual tokens) over everything stored, read in place by
        the fused Triton kernel: `[B, Hq, Tq, D]`."""
        if torch.compiler.is_compiling():
            return self._compiled.attention(self, query, attention_mask, scaling)
        from ..kernels import decode_attention_triton

        padding = key_padding(attention_mask, query.shape[0], self.get_seq_length())
        keys, values = self.storage.window_keys(), self.storage.window_values()
        return decode_attention_triton(
            query, self._quantized_views(), keys, values, padding, scaling, self.config, self.key_rotated
        )

    def _quantized_views(self) -> QuantizedKV | None:
        """`quantized()`, made again only when the quantized region grew or its buffers changed: the decode steps
        between two flushes read the same views (seven slicing ops less per layer and step)."""
        storage = self.storage
        buffers, length, views = self._stored_views
        if buffers is not storage.buffers or length != storage.length:
            views = storage.quantized()
            self._stored_views = (storage.buffers, storage.length, views)
        return views

    # ----------------------------------------------------------------------------------------------------------
    # method="oscar"'s query rule (its state and choice: `KeyRotation`, whose docstring says when it is final)
    wants_queries = property(
        lambda self: self.rotation.wants_queries, doc="Whether the latest update's queries are awaited."
    )

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """method="oscar": the queries `[B, Hq, Tq, D]` (post-RoPE) of the attention call that read the layer's latest
        multi-token update while its key rotation is open (the newest Tq positions): they join the queries the
        choice is made from, and the choice is made again. The sdpa entry (integrations/fused_attention.py) calls it
        with the keys it received, which must be the ones that update returned (a call for another layer or cache
        is ignored); by hand, call it after each multi-token update of a cache filled without the model's attention
        (without it, the next update chooses from the keys alone)."""
        if not self.rotation.is_for(keys):
            return
        mask = valid(self._padding, self.get_seq_length() - query.shape[-2], query)
        self.observe_query_moment(query_moment(query, self.residual_keys.shape[1], mask))

    def observe_query_moment(self, moment: torch.Tensor) -> None:
        """`observe_queries` given their second moment (`reference.query_moment`, padding left out): what a cache
        filled from another cache's prefill receives (the lm-eval wrapper records the moments of its exact prefill).
        The choice is made at once, even when no block is full yet, so that a flush inside a compiled decode step
        finds the flags."""
        if not self.wants_queries:
            return
        self.rotation.add(moment)
        self._choose()

    def _choose(self) -> None:
        """Make the key rotation's choice (`KeyRotation.choose`), writing the blocks that wait for it."""
        valid_of = functools.partial(valid, self._padding, 0)  # the padding of the keys held, from the first
        new = self.rotation.choose(self.storage, valid_of, self._quantize_at, self.head_group)
        if new and self._compiled is not None:  # compiled decode reads the flags: a fixed address, as its buffers
            torch._dynamo.mark_static_address(self.key_rotated)

    def _write_waiting_blocks(self) -> None:
        """Before the quantized region is read outside an update: choose now if blocks wait for queries that never
        came (a cache filled by hand)."""
        if self.rotation.unwritten:
            self._choose()
