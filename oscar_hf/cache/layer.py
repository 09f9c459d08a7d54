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

`OscarLayer` is transformers' layer API over objects with one job each: the regions (`storage.KVStorage`), how blocks
are quantized and read back and how steps attend (`backends.PortableBackend` / `TritonBackend`, chosen by `OscarCache`
at the first update), the finite check (`finite.FiniteCheck`), the query rule's state (`key_rotation.KeyRotation`),
bits="auto"'s cost sums (`layer_bits.LayerBits`), the device counter of compiled decode (`compiled.CompiledDecode`)
and the padding (`padding.Padding`). The layer hands each what it needs; none of them reads the layer.

Portable path (`update` returns dense K/V): what the storage represents, dequantized, followed by the residual and
the new tokens. A chunk with no history attends to its own exact K/V; a chunk arriving with history (multi-turn,
chunked prefill, scoring) attends to the dequantized history plus its own exact tokens. On the Triton backend such a
chunk attends to the same history with the chunk kernel, which reads the quantized region in place (cache/history.py).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..config import OscarConfig
from ..layout import QuantizedKV, StorageLayout
from ..reference import check_head_dim, query_moment, token_norms
from .backends import PortableBackend
from .compiled import CompiledDecode
from .finite import FiniteCheck
from .key_rotation import KeyRotation, real_positions
from .layer_bits import CONVERT_SLICE_BYTES, LayerBits
from .memory import KVMemory
from .padding import Padding, row_sinks, valid
from .step import FusedStep, await_queries
from .storage import KVStorage


class OscarLayer(CacheLayerMixin):
    """One full-attention layer of an `OscarCache` (see the module docstring for the regions)."""

    is_sliding = False
    is_croppable = True
    max_cache_len: int | None = None  # set by `reserve`: the most tokens this layer will hold (generate's max length)

    def __init__(self, config: OscarConfig):
        super().__init__()
        self.bits = LayerBits(config) if config.auto_bits else None  # bits="auto": widths chosen from the prompt
        self.config = self.bits.stored_config(config) if self.bits else config
        self.backend = PortableBackend()  # chosen by `OscarCache` at the first update (`configure`)
        self.head_group = None  # tensor parallel: the group over which this process holds a shard of the KV heads
        self.rotation = KeyRotation(self.config)
        self.finite = FiniteCheck(self.config)
        self.storage = KVStorage(self.layout, self.config.residual_length, self._quantize, self._dequantize)
        self.fused_step: FusedStep | None = None  # its latest fused step, until attended
        self.compiled: CompiledDecode | None = None  # compiled decode only
        self.padding: Padding | None = None  # set by `OscarCache.set_padding`: which positions hold padding
        self._padding_given = False  # whether `set_padding` said so (else padding is known from the masks only)

    layout = property(lambda self: StorageLayout.of(self.config), doc="The quantized region's storage layout.")

    def configure(self, backend: PortableBackend, head_group=None) -> None:
        """Take the backend `OscarCache` chose for this layer (before its first update) and, under tensor parallelism,
        the process group over which its KV heads are sharded: the Omni-Token norm (over all heads) is all-reduced
        over it (eager code only)."""
        self.backend, self.head_group = backend, head_group

    def set_padding(self, padding: Padding | None) -> None:
        """Which positions hold padding, from `OscarCache.set_padding` (quantization leaves them out, and a prefill
        chunk arriving with history reads its history's padding from it: `get_mask_sizes`)."""
        self.padding, self._padding_given = padding, True

    # What the layer holds, and how it decodes, as tests, benchmarks and transformers read them.
    use_kernels = property(lambda self: self.backend.name == "triton", doc="Whether the Triton kernels run.")
    fused_query_tokens = property(lambda self: self.backend.query_tokens)
    residual_keys = property(lambda self: self.storage.keys, doc="[B, Hkv, residual_length, Dk], model dtype")
    residual_values = property(lambda self: self.storage.values)
    residual_length = property(lambda self: self.storage.held, doc="Tokens in the residual window.")
    quantized_length = property(lambda self: self.storage.length, doc="Tokens in the quantized region.")
    key_rotated = property(lambda self: self.rotation.flags, doc="method='oscar': [B, Hkv] bool, or None until chosen")
    bits_open = property(lambda self: self.bits is not None and self.bits.open, doc="bits='auto': widths to choose")
    kv_shape = property(lambda self: (self.storage.keys.shape[1], self.storage.keys.shape[-1]), doc="(Hkv, head_dim)")
    compiled_decode = property(  # compiled single-token steps can run: a backend that has them, maximum length reserved
        lambda self: self.backend.compiled_steps and self.max_cache_len is not None
    )

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for states in (key_states, value_states):
            check_head_dim(states.shape[-1], self.config)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.storage.allocate(key_states, value_states, self.config.sink_tokens)
        self.is_initialized = True
        if self.compiled_decode and not self.bits_open:
            self._start_compiled()

    def _start_compiled(self) -> None:
        """Storage at full size and compiled decode's device counter (`CompiledDecode`)."""
        self.compiled = CompiledDecode(self.storage, self.config, self.max_cache_len, self.key_rotated)

    # transformers' layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        """Store the new tokens and return the K/V to attend to: the history as stored, then the new tokens; or, on
        a step attended in place, the new tokens only, carrying the step (`step.FusedStep`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.storage.check_batch(key_states, value_states)
        if torch.compiler.is_compiling():
            self._refuse_compiled_step(key_states.shape[-2])
            step = self.compiled.step(key_states, value_states, self.padding, self.key_rotated)
            FusedStep.start(self, key_states, value_states, step)
            return key_states, value_states
        self.fused_step = None  # valid until this update
        with self.finite.gathered():  # one finite check for the blocks of this update
            keys, values = self._eager_update(key_states, value_states)
        if self.compiled is not None:
            self.compiled.length.fill_(self.get_seq_length())
        return keys, values

    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        storage, rotation = self.storage, self.rotation
        if self.bits_open:
            mask = valid(self.padding, self.get_seq_length(), key_states)
            self.bits.observe(key_states, value_states, mask, self.backend.fake_quantize_kv)
        if not rotation.final:
            held = self.get_seq_length()
            if rotation.must_choose(held):
                self._choose_rotation()
            rotation.settle(key_states.shape[-2], held, storage.length)
        if storage.total == 0:
            self._append(key_states, value_states, key_states)
            return key_states, value_states
        storage.flush()  # a complete block: quantized before it is read
        # What the step attends to, taken before the new tokens are stored (storing a chunk rewrites the window)
        history = self.backend.history(storage, key_states, value_states, self.config, self.key_rotated, self.padding)
        if history is None:  # the model's attention reads the dense history (new buffers: see `append`)
            keys, values = storage.history(key_states, value_states, row_sinks(self.padding))
            self._append(key_states, value_states, keys)
            return keys, values
        # The backend reads the storage in place: only the new tokens are returned, carrying the step that the sdpa
        # entry recognises (integrations/fused_attention.py).
        self._append(key_states, value_states, key_states)  # a decode step completes no block
        FusedStep.start(self, key_states, value_states, history)
        return key_states, value_states

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor, keys: torch.Tensor) -> None:
        """Append the tokens of an update whose attention call receives `keys`: while the key rotation is open, the
        blocks they complete wait, exact, for that call's queries (`KeyRotation`), which it hands over."""
        if self.rotation.final:
            self.storage.append(key_states, value_states, row_sinks(self.padding))
            return
        with self.rotation.deferring():
            self.storage.append(key_states, value_states, row_sinks(self.padding))
        self.rotation.await_queries(keys)
        await_queries(self, keys)

    def _refuse_compiled_step(self, tokens: int) -> None:
        """Raise unless a compiled forward's update of `tokens` tokens can run compiled here: a single-token step on a
        backend with compiled steps, the length reserved, the key rotation and the widths chosen (a compiled step
        cannot choose)."""
        rotation = self.rotation
        if self.compiled_decode and tokens == 1:
            if rotation.unwritten or (rotation.active and rotation.flags is None):
                raise RuntimeError(rotation.unsettled_message())
            if self.bits_open:
                raise RuntimeError(
                    "OscarCache(bits='auto'): a compiled decode step reached a layer whose widths are not chosen yet, "
                    "and a compiled step cannot choose them. Call `cache.choose_bits()` after the prefill (generate "
                    "does), or run the first decode step eagerly."
                )
            return
        raise RuntimeError(
            "OscarCache: a compiled forward can only run single-token decode steps on the fused path (CUDA, an "
            "sdpa model, supported head dims) with the maximum length reserved (`generate` reserves it; by hand: "
            f"`cache.reserve(max_length)` before the prefill). Got {tokens} tokens, the {self.backend.name} "
            f"backend, reserved length {self.max_cache_len}. Run this step eagerly."
        )

    def get_seq_length(self) -> int | torch.Tensor:
        if torch.compiler.is_compiling() and self.compiled is not None:
            return self.compiled.length  # a tensor, as transformers' StaticLayer returns: no recompilation per step
        if self.compiled is not None:
            self.compiled.read_back()
        return self.storage.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Decode steps of a cache that can run compiled get one mask shape for the whole generation.
        if self.compiled_decode and query_length == 1:
            if torch.compiler.is_compiling():
                return self.storage.reserved_width(), 0
            if self.get_seq_length():
                return max(self.storage.reserved_width(), self.get_seq_length() + 1), 0
        held = self.get_seq_length()
        storage = self.storage
        chunk = self.backend.chunk_step(storage.total, storage.held, query_length, storage.window)
        if self._padding_given and not torch.compiler.is_compiling() and chunk:
            # The chunk kernel takes the history's padding from `set_padding`: the mask transformers builds covers the
            # chunk only, [B, 1, T, T], not [B, 1, T, held + T] (`ChunkHistory.key_padding`).
            return query_length, held
        return held + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.bits is not None:  # bits="auto": choose again for the next prompt, storing the widest widths until then
            self.bits.reset()
            self._set_config(self.bits.stored_config(self.config))
            self.storage.empty_quantized(self.layout)
            self.storage.reserve(0)  # reserved again once the widths are chosen (`set_widths`)
        self.storage.clear()
        self.fused_step = self.compiled = self.padding = None
        self._padding_given = False
        self.rotation.reset()
        self.finite.reset()
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
        self._write_waiting()
        if not self.rotation.final:  # the exact copies would no longer match the blocks
            self.rotation.finalize()
        if self.compiled is not None:
            self.compiled.length.fill_(keep)
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
        if self.padding is not None:
            self.padding = self.padding.apply(fn)

    def reserve(self, tokens: int) -> None:
        """Size the quantized storage for `tokens` tokens up front (generate knows its maximum length). bits="auto"
        reserves once the widths are chosen (`set_widths`): reserved while the choice is open, the whole length would
        be 4-bit, the prefill's peak 1.6x the 2-bit cache's even when only the choice's first tokens are stored before
        it."""
        self.max_cache_len = tokens
        if not self.bits_open:
            self._reserve_storage()

    def _reserve_storage(self) -> None:
        """Allocate the reserved length (`max_cache_len`) at the stored widths, and compiled decode's counter."""
        self.storage.reserve(self.max_cache_len)
        if self.is_initialized and self.compiled_decode:
            self._start_compiled()
        elif self.is_initialized and self.storage.buffers is not None:
            self.storage.grow(self.storage.reserved)

    def memory(self) -> KVMemory:
        """Bytes this layer holds now (`memory.kv_memory` sums them over a cache)."""
        if not self.is_initialized:
            return KVMemory()
        self.get_seq_length()  # lengths read back after compiled steps
        return KVMemory.of_storage(self.storage)

    # quantizing and reading blocks
    def _set_config(self, config: OscarConfig) -> None:
        """Store in `config`'s format from now on (its widths: bits="auto" sets them once chosen)."""
        self.config = self.rotation.config = self.finite.config = config

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, start: int) -> None:
        """Write the block of the tokens at quantized position `start` (`KVStorage`'s quantize), or, while it waits
        for the key rotation's choice, leave it to the choice (`KeyRotation.hold`)."""
        if not self.rotation.final and self.rotation.hold(start, keys, values, self.storage.keys):
            return
        self._quantize_at(keys, values, start, write=True)

    def _quantize_at(self, keys: torch.Tensor, values: torch.Tensor, start: int, write: bool = False) -> QuantizedKV:
        """Quantize the tokens at quantized position `start` (the backend's `quantize`, padding left out, the token
        norms over every rank's heads under tensor parallelism); `write`: into the storage."""
        mask = valid(self.padding, self.storage.sinks + start, keys)  # the sinks precede the quantized tokens
        norms = None
        if self.head_group is not None and self.config.token_scaling:
            norms = token_norms(keys, self.head_group)  # over the heads of every rank: one all-reduce per block
        into = (self.storage, start) if write else None
        return self.backend.quantize(keys, values, self.config, self.key_rotated, norms, mask, self.finite, into)

    def _dequantize(self, start: int, end: int, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of quantized tokens `[start, end)` (block-aligned; 0 follows the sinks) in the model dtype."""
        rows = self.storage.rows(start, end)
        return self.backend.dequantize(rows, self.config, self.key_rotated, self.dtype, out)

    def quantized(self) -> QuantizedKV | None:
        """Views of the quantized region (`quantized_length` tokens), or None when it is empty."""
        self._write_waiting()
        return self.storage.quantized()

    def dense_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything stored, as dense K/V in the model dtype, in position order (sinks, quantized region, window)."""
        self._write_waiting()
        return self.storage.history(own_sinks=row_sinks(self.padding))

    # bits="auto" (its cost sums: `LayerBits`; the choice over the layers: `OscarCache.choose_bits`)
    def bit_costs(self, query_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What each key and value width costs this layer's attention (`LayerBits.costs`), its queries the query
        rule's (`query_group` query heads per KV head)."""
        return self.bits.costs(self.rotation.moment, self.rotation.positions, query_group)

    def set_widths(self, key_bits: int, value_bits: int, key_rotated: torch.Tensor | None) -> None:
        """`OscarCache.choose_bits`: store keys of `key_bits` and values of `value_bits` from now on, and the quantized
        region again at those widths, which makes the choice final: the blocks are dequantized (float32, in slices of
        `CONVERT_SLICE_BYTES`) and quantized again, with `key_rotated` the heads' key rotation at `key_bits`
        (method="oscar"); a half whose width and rotation stay keeps its codes (quantizing them again would only add
        error). A layer given a maximum length (`reserve`) reserves it now, at the new widths, with compiled decode's
        counter where compiled steps may run."""
        self._write_waiting()
        self.finite.read(wait=True)
        storage, rotation = self.storage, self.rotation
        old_config, old_layout, old_rotated = self.config, self.layout, self.key_rotated
        keep_values = value_bits == old_layout.value_bits
        keep_keys = key_bits == old_layout.key_bits and (
            key_rotated is None or old_rotated is None or torch.equal(key_rotated, old_rotated)
        )
        old_rotated = None if old_rotated is None else old_rotated.clone()
        # The query rule's exact copies of the keys quantized so far (while its choice is open: prompts up to its
        # horizon): the keys are quantized at their widths from these, not again from the 4-bit round trip, whose
        # token norms, recomputed from the dequantized keys, no longer align the two grids (docs/accuracy.md measures
        # what that cost)
        copies = rotation.blocks if not rotation.final and rotation.covers(storage.length) else []
        if key_rotated is not None and rotation.flags is not None:
            rotation.flags.copy_(key_rotated)  # in place: compiled decode holds its address
        elif key_rotated is not None:
            rotation.flags = key_rotated.clone()
        if not rotation.final:
            rotation.finalize()
        self._set_config(self.config.with_widths(key_bits, value_bits))
        self.bits.close()
        if not (keep_keys and keep_values):
            old, length = storage.buffers, storage.length
            storage.empty_quantized(self.layout)
            if self.max_cache_len is not None:
                storage.reserve(self.max_cache_len)  # allocated once, at the new widths
            storage.extend(length)
            batch, heads, _, dim = storage.exact_keys.shape
            tokens = max(1, CONVERT_SLICE_BYTES // (batch * heads * dim * 2 * 4 * storage.window)) * storage.window
            with self.finite.gathered():  # one check for the layer's blocks (on CUDA, deferred: no wait)
                for start in range(0, length, tokens):
                    rows = old_layout.rows(old, start, min(start + tokens, length))
                    keys, values = self.backend.dequantize(rows, old_config, old_rotated, torch.float32)
                    self._quantize_at(keys, values, start, write=True)
                for start, keys, _ in copies if not keep_keys else ():  # the keys stand in for values, not written
                    self.storage.write(start, self._quantize_at(keys, keys, start), halves=("key",))
            if length and (keep_keys or keep_values):  # that half's codes stay (quantizing again only adds error)
                storage.write(0, old_layout.rows(old, 0, length), halves=("key",) if keep_keys else ("value",))
        if self.max_cache_len is not None:
            self._reserve_storage()

    # method="oscar"'s query rule (its state and choice: `KeyRotation`, whose docstring says when it is final)
    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """method="oscar": the queries `[B, Hq, Tq, D]` (post-RoPE) that read the layer's latest multi-token update
        while its key rotation is open join those the choice is made from (`KeyRotation`). The sdpa entry calls it
        with the keys it received (those of another layer or cache are ignored); by hand, call it after each
        multi-token update of a cache filled without the model's attention, else the keys alone choose."""
        if not self.rotation.is_for(keys):
            return
        start = self.get_seq_length() - query.shape[-2]
        tokens = self.rotation.query_positions(start, query.shape[-2], self.storage.sinks)  # inside the horizon
        query = query[:, :, :tokens]
        mask, positions = real_positions(self.padding, start, tokens, query.shape[0], query.device)
        self.observe_query_moment(query_moment(query, self.kv_shape[0], mask), positions)

    def observe_query_moment(self, moment: torch.Tensor, positions: torch.Tensor | None = None) -> None:
        """`observe_queries` given their second moment (`reference.query_moment`, padding left out; `positions` `[B]`:
        how many query positions it sums, None: every real token held), as the lm-eval wrapper hands its exact
        prefill's over; the choice is made at once, so that a flush inside a compiled decode step finds the flags."""
        if not self.rotation.wants_queries:
            return
        if positions is None:
            held = self.get_seq_length()
            _, positions = real_positions(self.padding, 0, held, moment.shape[0], moment.device)
        self.rotation.add(moment, positions)
        self._choose_rotation()

    def _choose_rotation(self) -> None:
        """Choose the key rotation now (`KeyRotation.choose`) and write the blocks the choice changes."""
        redo = self.rotation.choose(self.storage, self.padding, self.backend.fake_quantize_keys, self.head_group)
        with self.finite.gathered():
            for start, keys, values in redo:
                if values is None:  # written before: a flip rewrites its key fields (the keys stand in for values)
                    self.storage.write(start, self._quantize_at(keys, keys, start), halves=("key",))
                else:
                    self._quantize_at(keys, values, start, write=True)

    def _write_waiting(self) -> None:
        """Before the quantized region is read outside an update: choose now if blocks wait for queries that never
        came (a cache filled by hand)."""
        if self.rotation.unwritten:
            self._choose_rotation()
