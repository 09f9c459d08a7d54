"""`OscarLayer`: one full-attention layer's storage in OScaR's 2-bit format.

A layer holds up to three regions of its history, oldest first:

* the sinks (`sink_tokens`, 0 by default): the first tokens, exact, in the model dtype, never quantized; with left
  padding (`set_padding`), each row's own first real tokens, in the same slots (`padding.Padding` says where);
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
its steps attend (`decode_path.DecodePath`, handed over by `OscarCache` at the first update), how a block is quantized
and read back (`blocks.BlockCodec`, with the finite check), the query rule's state (`key_rotation.KeyRotation`), the
device counter of compiled decode (`compiled.CompiledDecode`) and the padding (`padding.Padding`).

Portable path (`update` returns dense K/V): what the storage represents, dequantized, followed by the residual and
the new tokens. A chunk with no history attends to its own exact K/V; a chunk arriving with history (multi-turn,
chunked prefill, scoring) attends to the dequantized history plus its own exact tokens. On the fused path such a chunk
attends to the same history with the chunk kernel, which reads the quantized region in place (cache/history.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import OscarConfig
from ..decode_path import DecodePath
from ..integrations import fused_attention
from ..kernels import ops as kernel_ops
from ..layout import QuantizedKV, StorageLayout
from ..reference import check_head_dim
from .blocks import BlockCodec
from .compiled import CompiledDecode, mask_width, refuse_step
from .history import DecodeHistory, step_history
from .key_rotation import KeyRotation
from .layer_bits import LayerBits
from .memory import KVMemory
from .padding import Padding, row_sinks, valid
from .storage import KVStorage


class OscarLayer(CacheLayerMixin):
    """One full-attention layer of an `OscarCache` (see the module docstring for the two regions)."""

    is_sliding = False
    is_croppable = True
    max_cache_len: int | None = None  # set by `reserve`: the most tokens this layer will hold (generate's max length)

    def __init__(self, config: OscarConfig):
        super().__init__()
        self.bits = LayerBits(config) if config.auto_bits else None  # bits="auto": widths chosen from the prompt
        config = self.bits.stored_config(config) if self.bits else config
        self.path = DecodePath()  # decided by `OscarCache` at the first update (`configure`)
        self.rotation = KeyRotation(config)
        self._set_config(config)
        self.storage = KVStorage(self.layout, config.residual_length, self._quantize, self._dequantize)
        self.fused_step: fused_attention.FusedStep | None = None  # its latest fused step, until attended
        self._compiled: CompiledDecode | None = None  # compiled decode only
        self._padding: Padding | None = None  # set by `OscarCache.set_padding`: which positions hold padding
        self._padding_given = False  # whether `set_padding` said so (else padding is known from the masks only)

    def _set_config(self, config: OscarConfig) -> None:
        """Store in `config`'s format from now on (its widths: bits="auto" sets them once chosen)."""
        self.config = config
        self.layout = StorageLayout.of(config)
        self._op_config = kernel_ops.config_key(config)  # the config as the custom ops take it
        self.codec = BlockCodec(config)
        self.rotation.config = config

    def configure(self, path: DecodePath) -> None:
        """Take the decode path `OscarCache` decided for this layer (before its first update)."""
        self.path = path

    def set_padding(self, padding: Padding | None) -> None:
        """Which positions hold padding, from `OscarCache.set_padding` (quantization leaves them out, and a prefill
        chunk arriving with history reads its history's padding from it: `get_mask_sizes`)."""
        self._padding, self._padding_given = padding, True

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
    bits_open = property(lambda self: self.bits is not None and self.bits.open, doc="bits='auto': widths to choose")
    compiled_decode = property(  # compiled single-token steps can run: fused path, maximum length reserved
        lambda self: self.use_kernels and self.max_cache_len is not None
    )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for states in (key_states, value_states):
            check_head_dim(states.shape[-1], self.config)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.storage.allocate(key_states, value_states, self.config.sink_tokens)
        self.is_initialized = True
        if self.compiled_decode and not self.bits_open:
            self._compiled = CompiledDecode(self)

    # transformers' layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """Store the new tokens and return the K/V to attend to: the history as stored, then the new tokens; or, on
        a fused step, the new tokens only, carrying the step (`integrations/fused_attention.py`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.storage.check_batch(key_states, value_states)
        if torch.compiler.is_compiling():
            refuse_step(self, key_states.shape[-2])
            self._compiled.step(self, key_states, value_states)
            fused_attention.FusedStep.start(self, key_states, value_states, DecodeHistory(self))
            return key_states, value_states
        self.fused_step = None  # valid until this update
        with self.codec.finite.gathered():  # one finite check for the blocks of this update
            keys, values = self._eager_update(key_states, value_states)
        if self._compiled is not None:
            self._compiled.length.fill_(self.get_seq_length())
        return keys, values

    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        storage, rotation = self.storage, self.rotation
        if self.bits_open:
            self.bits.observe(self, key_states, value_states)
        if not rotation.final:
            rotation.prepare(self, key_states.shape[-2])
        if storage.total == 0:
            self._append_dense(key_states, value_states, key_states)
            return key_states, value_states
        storage.flush()  # a complete block: quantized before it is read
        if self.path.fused:
            # The kernels read the storage in place, so only the new tokens are returned, carrying the step that the
            # sdpa entry recognises (integrations/fused_attention.py): a decode step for the decode kernel, or a chunk
            # with history for the chunk kernel, which reads it as the update found it (cache/history.py).
            history = step_history(self, key_states, value_states)
            self._append_dense(key_states, value_states, key_states)  # a decode step completes no block
            fused_attention.FusedStep.start(self, key_states, value_states, history)
            return key_states, value_states
        keys, values = storage.history(key_states, value_states, row_sinks(self._padding))  # new buffers: see append
        self._append_dense(key_states, value_states, keys)
        return keys, values

    def _append_dense(self, key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor) -> None:
        """Append the tokens of an update whose attention call receives `keys`: while the key rotation is open, the
        blocks they complete wait, exact, for that call's queries (`KeyRotation`), which it hands over."""
        if self.rotation.final:
            self.storage.append(key_states, value_states, row_sinks(self._padding))
            return
        with self.rotation.deferring():
            self.storage.append(key_states, value_states, row_sinks(self._padding))
        self.rotation.await_queries(keys)
        fused_attention.await_queries(self, keys)

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
        held = self.get_seq_length()
        storage = self.storage
        chunk = self.path.chunk_step(storage.total, storage.held, query_length, storage.window)
        if self._padding_given and not torch.compiler.is_compiling() and chunk:
            # The chunk kernel takes the history's padding from `set_padding`: the mask transformers builds covers the
            # chunk only, [B, 1, T, T], not [B, 1, T, held + T] (`ChunkHistory.key_padding`).
            return query_length, held
        return held + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.bits is not None:
            self.bits.restart(self)
        self.storage.clear()
        self.fused_step = self._compiled = self._padding = None
        self._padding_given = False
        self.rotation.reset()
        self.codec.finite.reset()
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
        self.rotation.write_waiting(self)
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
        self.storage.apply(fn)
        self.rotation.apply(fn)
        if self.bits is not None:
            self.bits.apply(fn)
        if self._padding is not None:
            self._padding = self._padding.apply(fn)

    def reserve(self, tokens: int) -> None:
        """Size the quantized storage for `tokens` tokens up front (generate knows its maximum length). bits="auto"
        reserves once the widths are chosen (`LayerBits.convert`): reserved while the choice is open, the whole
        length would be 4-bit, the prefill's peak 1.6x the 2-bit cache's even when only the choice's first tokens
        are stored before it."""
        self.max_cache_len = tokens
        if not self.bits_open:
            self.reserve_storage()

    def reserve_storage(self) -> None:
        """Allocate the reserved length (`max_cache_len`) at the stored widths, and compiled decode's counter."""
        self.storage.reserve(self.max_cache_len)
        if self.is_initialized and self.compiled_decode:
            self._compiled = CompiledDecode(self)
        elif self.is_initialized and self.storage.buffers is not None:
            self.storage.grow(self.storage.reserved)

    def memory(self) -> KVMemory:
        """Bytes this layer holds now (`memory.kv_memory` sums them over a cache)."""
        if not self.is_initialized:
            return KVMemory()
        self.get_seq_length()  # lengths read back after compiled steps
        return KVMemory.of_storage(self.storage)

    # quantizing and reading blocks
    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write the block of the tokens at quantized position `start` (`KVStorage`'s quantize), or, while it waits
        for the key rotation's choice, leave it to the choice (`KeyRotation.hold`)."""
        if not self.rotation.final and self.rotation.hold(start, keys, values, self.storage.keys):
            return
        self._quantize_at(keys, values, start, write=True)

    def _quantize_at(self, keys: torch.Tensor, values: torch.Tensor, start: int, write: bool = False) -> QuantizedKV:
        """Quantize the tokens at quantized position `start` (`BlockCodec.quantize`); `write`: into the storage."""
        mask = valid(self._padding, self.storage.sinks + start, keys)  # the sinks precede the quantized tokens
        into = (self.storage, start) if write else None
        return self.codec.quantize(keys, values, self.key_rotated, mask, self.path, into)

    def _dequantize(self, start: int, end: int, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of quantized tokens `[start, end)` (block-aligned; 0 follows the sinks) in the model dtype."""
        return self.codec.dequantize(self.storage.rows(start, end), self.key_rotated, self.path, self.dtype, out)

    def quantized(self) -> QuantizedKV | None:
        """Views of the quantized region (`quantized_length` tokens), or None when it is empty."""
        self.rotation.write_waiting(self)
        return self.storage.quantized()

    def dense_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, as dense K/V in the model dtype, in position order (sinks, quantized region, window)."""
        self.rotation.write_waiting(self)
        return self.storage.history(own_sinks=row_sinks(self._padding))

    # method="oscar"'s query rule (its state and choice: `KeyRotation`, whose docstring says when it is final)
    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """method="oscar": the queries `[B, Hq, Tq, D]` (post-RoPE) that read the layer's latest multi-token update
        while its key rotation is open join those the choice is made from (`KeyRotation`). The sdpa entry calls it
        with the keys it received (those of another layer or cache are ignored); by hand, call it after each
        multi-token update of a cache filled without the model's attention, else the keys alone choose."""
        self.rotation.observe_queries(self, query, keys)

    def observe_query_moment(self, moment: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """`observe_queries` given their second moment (`reference.query_moment`, padding left out; `positions` `[B]`:
        how many query positions it sums, None: every real token held), as the lm-eval wrapper hands its exact
        prefill's over; the choice is made at once, so that a flush inside a compiled decode step finds the flags."""
        self.rotation.observe(self, moment, positions)
