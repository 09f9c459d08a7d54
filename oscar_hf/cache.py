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

Compiled decode (`torch.compile`, CUDA graphs): where the fused path applies and the maximum length is reserved
(`generate` does it; `OscarCache.reserve` by hand), storage is allocated once at full size and a layer keeps its
length in a device counter. A compiled single-token step writes the token at the residual slot and flushes a
complete block from that counter alone (the flush kernel is launched every step and returns at once until the
block is complete), and the fused kernel, handed the whole reserved storage and the counter, attends over the tokens
held: shapes and addresses never change, there is no host synchronisation and no Python branch on a tensor value.
Eager code then reads the lengths back from the counter. method="oscar" fixes each (row, KV head)'s key rotation at
the end of the prefill, when its queries arrive, however short the prompt: a flush in a compiled step reads those
flags.

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
from .kernels import ops as kernel_ops
from .layout import QuantizedKV, StorageLayout
from .reference import (
    check_head_dim,
    dequantize_kv,
    finite_flags,
    quantize_kv,
    query_moment,
    query_rotation_choice,
    raise_unless_finite,
    token_norms,
)

_HAS_TRITON = importlib.util.find_spec("triton") is not None
# Tokens quantized per call during a long prefill: bounds the float32 temporaries of `quantize_kv`.
_QUANTIZE_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class _Padding:
    """Which cache positions of each row hold padding (`OscarCache.set_padding`), as the layers read it."""

    mask: torch.Tensor  # [B, P] bool, True for real tokens; positions from P on are real
    end: int  # no row has padding at or after this position: blocks starting there need no mask (host-side)

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> _Padding | None:
        mask = attention_mask.bool()
        positions = torch.arange(mask.shape[1], device=mask.device)
        end = int(torch.where(mask, 0, positions + 1).amax()) if mask.numel() else 0  # one host sync per call
        if end == 0:
            return None
        return cls(mask, end)

    def valid(self, start: int, keys: torch.Tensor) -> torch.Tensor | None:
        """`[B, N]` bool for the N tokens of `keys` at positions `start..start + N - 1` (on their device), or None
        when they hold no padding."""
        if start >= self.end:
            return None
        batch, tokens = keys.shape[0], keys.shape[-2]
        if self.mask.shape[0] != batch:
            raise ValueError(
                f"OscarCache: the padding mask given to set_padding has {self.mask.shape[0]} rows but the cache "
                f"holds a batch of {batch}; pass the attention mask of this batch."
            )
        part = self.mask[:, start : start + tokens]
        return torch.cat([part, part.new_ones(batch, tokens - part.shape[1])], dim=1).to(keys.device)

    def apply(self, fn) -> _Padding:
        """This padding after a batch-axis (or device) transform of the cache."""
        return _Padding(fn(self.mask), self.end)


class OscarLayer(CacheLayerMixin):
    """One full-attention layer of an `OscarCache` (see the module docstring for the two regions)."""

    is_sliding = False
    is_croppable = True
    # Set by `OscarCache` at the first update when the Triton path applies (CUDA, sdpa model, supported shapes):
    # then blocks are quantized by the Triton kernel, and steps of up to `fused_query_tokens` tokens attend with
    # the fused kernel (its limit on query rows per KV head divided by the model's GQA group).
    use_kernels = False
    fused_query_tokens = 0
    # Set by `OscarCache` at the first update when this process holds a shard of the layer's KV heads (tensor
    # parallel): the torch.distributed group over which the Omni-Token norm (over all heads) is all-reduced.
    head_group = None
    max_cache_len: int | None = None  # set by `reserve`: the most tokens this layer will hold (generate's max length)

    def __init__(self, config: OscarConfig):
        super().__init__()
        self.config = config
        self.layout = StorageLayout.of(config)
        self._op_config = kernel_ops.config_key(config)  # the config as the custom ops take it
        self.quantized_length = 0
        self.residual_length = 0  # tokens currently in the residual window
        self._storage: QuantizedKV | None = None  # capacity buffers; the first `quantized_length` tokens are valid
        self._reserved_tokens = 0
        self.residual_keys: torch.Tensor | None = None  # [B, Hkv, config.residual_length, Dk], model dtype
        self.residual_values: torch.Tensor | None = None
        self.fused_step: fused_attention.FusedStep | None = None  # this layer's latest fused decode step
        self._length: torch.Tensor | None = None  # tokens held, on the device (compiled decode only)
        self._length_is_newer = False  # compiled steps advanced `_length` past the host-side lengths
        # method="oscar": [B, Hkv] bool, which heads rotate their keys, decided when the prefill's queries arrive
        # (`_choose_key_rotation`) and fixed from then on: the flags every quantization, eager or compiled, reads.
        self.key_rotated: torch.Tensor | None = None
        # method="oscar", during the prefill (the first update): the blocks it quantized before its queries came (its
        # attention runs after `update`), exact, to quantize again with the choice; and the keys it returned, which
        # identify the attention call that brings those queries.
        self._provisional: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._awaiting_keys: torch.Tensor | None = None
        self._padding: _Padding | None = None  # set by `OscarCache.set_padding`: which positions hold padding
        # Eager decode on CUDA: the latest flushed block's `finite_flags`, on their way to pinned host memory, and the
        # event after which they are there (`_defer_finite_check`).
        self._finite_check: tuple[torch.Tensor, torch.cuda.Event] | None = None

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
        """Allocate the reserved storage once (zeros beyond the stored tokens), start the device counter, and mark
        the buffers as static addresses for CUDA graphs."""
        if self._storage is None:
            keys, values = self.residual_keys, self.residual_values
            (batch, key_heads, _, key_dim), (_, value_heads, _, value_dim) = keys.shape, values.shape
            self._storage = self.layout.empty(batch, key_heads, key_dim, value_heads, value_dim, 0, keys.device)
        self._grow(self._reserved_tokens)
        for buf, rows in zip(self._storage, self.layout.tokens_per_row):
            if buf is not None:
                buf[:, :, self.quantized_length // rows :] = 0
        self._length = torch.tensor(self.get_seq_length(), dtype=torch.long, device=self.device)
        for tensor in (self.residual_keys, self.residual_values, self._length, self.key_rotated, *self._storage):
            if tensor is not None:
                torch._dynamo.mark_static_address(tensor)

    @property
    def compiled_decode(self) -> bool:
        """Whether compiled single-token steps can run: the fused path applies and the maximum length is reserved."""
        return self.use_kernels and self.max_cache_len is not None

    # ----------------------------------------------------------------------------------------------------------
    # transformers' layer API
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens and return the dense K/V to attend to (history as stored, then the new tokens)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_shape(key_states, value_states)
        if torch.compiler.is_compiling():
            return self._compiled_step(key_states, value_states)
        self._read_finite_check(wait=False)
        keys, values = self._eager_update(key_states, value_states)
        if self._length is not None:
            self._length.fill_(self.get_seq_length())
        return keys, values

    def _eager_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.get_seq_length() == 0:
            if self.wants_queries:
                self._provisional = []
                self._awaiting_keys = key_states
            self.append(key_states, value_states)
            return key_states, value_states
        if self.wants_queries:  # the prefill's attention never handed its queries over
            raise RuntimeError(self._no_queries_message())
        if self.residual_length == self.config.residual_length:  # a complete block: quantized before it is read
            self._store(self._quantize(self.residual_keys, self.residual_values, decoding=True))
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
            fused_attention.expect_fused_decode(self, key_states, value_states)
            return key_states, value_states
        past_keys, past_values = self.dense_history()
        # Concatenate before appending: the history may be a view of the residual buffer that `append` rewrites.
        keys, values = torch.cat([past_keys, key_states], dim=-2), torch.cat([past_values, value_states], dim=-2)
        self.append(key_states, value_states)
        return keys, values

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

    def _compiled_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row, stored from the device counter alone (module docstring); a fused step."""
        if not self.compiled_decode or key_states.shape[-2] != 1:
            raise RuntimeError(
                "OscarCache: a compiled forward can only run single-token decode steps on the fused path (CUDA, an "
                "sdpa model, supported head dims) with the maximum length reserved (`generate` reserves it; by hand: "
                f"`cache.reserve(max_length)` before the prefill). Got {key_states.shape[-2]} tokens, fused path "
                f"{'on' if self.use_kernels else 'off'}, reserved length {self.max_cache_len}. Run this step eagerly."
            )
        if self.wants_queries:
            raise RuntimeError(self._no_queries_message())
        window = self.config.residual_length
        held = self._length  # tokens before this step: the residual holds 1..R of them, the rest are quantized
        torch._assert_async(held < self.max_cache_len, "OscarCache: a compiled step beyond the reserved length")
        if self.layout.num_tokens(self._storage):
            # A full residual (held a positive multiple of R) goes to tokens [held - R, held): the kernel reads the
            # counter and returns at once on the other R - 1 steps of a block.
            padding = None if self._padding is None else self._padding.mask
            storage, flags = self._storage, self.key_rotated
            kernel_ops.flush_residual(
                self.residual_keys, self.residual_values, storage, held, self._op_config, padding, flags
            )
        slot = (held % window).view(1)
        self.residual_keys.index_copy_(2, slot, key_states)
        self.residual_values.index_copy_(2, slot, value_states)
        self._length.add_(1)
        self._length_is_newer = True
        fused_attention.expect_fused_decode(self, key_states, value_states)
        return key_states, value_states

    def _read_length(self) -> None:
        """Bring the host-side lengths up to date after compiled steps (one host synchronisation)."""
        if self._length_is_newer:
            total = int(self._length)
            self.quantized_length = (total - 1) // self.config.residual_length * self.config.residual_length
            self.residual_length = total - self.quantized_length
            self._length_is_newer = False

    def get_seq_length(self) -> int | torch.Tensor:
        if torch.compiler.is_compiling() and self._length is not None:
            return self._length  # a tensor, as transformers' StaticLayer returns: no recompilation per step
        self._read_length()
        return self.quantized_length + self.residual_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # Decode steps of a cache that can run compiled get a mask over the reserved storage and the window: one shape
        # for the whole generation (generate builds the mask outside the compiled forward), as wide as the kernel's
        # reads can reach (`_compiled_attention`).
        if self.compiled_decode and query_length == 1:
            capacity = self._reserved_tokens if self._storage is None else self.layout.num_tokens(self._storage)
            width = capacity + self.config.residual_length
            if torch.compiler.is_compiling():
                return width, 0
            if self.get_seq_length():
                return max(width, self.get_seq_length() + 1), 0
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.quantized_length = self.residual_length = 0
        self._storage = self.residual_keys = self.residual_values = self.fused_step = self._length = None
        self.key_rotated = self._padding = self._provisional = self._awaiting_keys = self._finite_check = None
        self._length_is_newer = False
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
        if self._length is not None:
            self._length.fill_(keep)
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

    def _quantize(self, keys: torch.Tensor, values: torch.Tensor, decoding: bool = False) -> QuantizedKV:
        """Quantize the tokens that follow the quantized region (`quantized_length` onward), refusing non-finite
        blocks: at once (one host synchronisation), or, for a block that a decode step flushes on CUDA
        (`decoding`), from a later update without waiting (`_defer_finite_check`)."""
        start = self.quantized_length
        valid = None if self._padding is None else self._padding.valid(start, keys)
        key_rotated = self.key_rotated
        if self.wants_queries:  # a prefill block before its queries came: unrotated for now, again at the choice
            self._provisional.append((keys, values))
            key_rotated = torch.zeros(keys.shape[:2], dtype=torch.bool, device=keys.device)
        norms = None
        if self.head_group is not None and self.config.token_scaling:
            norms = token_norms(keys, self.head_group)  # over the heads of every rank: one all-reduce per block
        if self.use_kernels:
            from .kernels import quantize_kv_triton

            block = quantize_kv_triton(keys, values, self.config, key_rotated, norms=norms, valid=valid)
        else:
            block = quantize_kv(keys, values, self.config, key_rotated, norms=norms, valid=valid)
        flags = finite_flags(block, keys, values, valid)
        if decoding and flags.is_cuda:
            self._defer_finite_check(flags)
        else:
            raise_unless_finite(flags, self.config)
        return block

    def _defer_finite_check(self, flags: torch.Tensor) -> None:
        """Send a decode flush's `finite_flags` to the host behind the block's kernels, to be read by the first update
        that finds them arrived (in `generate`, the next step's: it synchronises after every token), so that eager
        decode never waits for the GPU. The next flush waits for them if they have not arrived by then."""
        self._read_finite_check(wait=True)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self._finite_check = (host, arrived)

    def _read_finite_check(self, wait: bool) -> None:
        """Raise if the pending decode flush's block was not finite; without `wait`, only once its flags arrived."""
        if self._finite_check is None:
            return
        host, arrived = self._finite_check
        if not wait and not arrived.query():
            return
        arrived.synchronize()
        self._finite_check = None
        raise_unless_finite(host, self.config)

    @property
    def wants_queries(self) -> bool:
        """method="oscar": whether this layer still waits for the prefill's queries (to choose its key rotation)."""
        return self.config.rotation and self.config.method == "oscar" and self.key_rotated is None

    def observe_queries(self, query: torch.Tensor, keys: torch.Tensor | None = None) -> None:
        """method="oscar": the queries `[B, Hq, Tq, D]` (post-RoPE) of the attention call that read the prefill (this
        layer's first update), the newest Tq positions. The wrapped sdpa entry (integrations/fused_attention.py) calls
        it with the keys it received, which must be the ones that update returned (a call for another layer or cache
        is ignored); by hand, call it after the first update of a cache filled without the model's attention."""
        if keys is not None and keys is not self._awaiting_keys:
            return
        start = self.get_seq_length() - query.shape[-2]
        valid = None if self._padding is None else self._padding.valid(start, query)
        self.observe_query_moment(query_moment(query, self.residual_keys.shape[1], valid))

    def observe_query_moment(self, moment: torch.Tensor) -> None:
        """`observe_queries` given their second moment (`reference.query_moment`, padding left out): what a cache
        filled from another cache's prefill receives (the lm-eval wrapper records the moments of its exact prefill)."""
        if not self.wants_queries:
            return
        self._choose_key_rotation(moment)
        blocks, self._provisional, self._awaiting_keys = self._provisional, None, None
        if blocks:  # the prefill's blocks, quantized before the choice: again, with it
            end, self.quantized_length = self.quantized_length, 0
            for keys, values in blocks:
                self._store(self._quantize(keys, values))
            assert self.quantized_length == end

    def _choose_key_rotation(self, moment: torch.Tensor) -> None:
        """Each (row, KV head) decides its key rotation from the prompt's keys the layer holds (its first
        `_QUANTIZE_CHUNK_TOKENS`: the provisional blocks, then the residual window, whole key groups or not) and the
        second moment of the prompt's queries (`query_rotation_choice`). Made at the end of the prefill even when no
        block is full yet, so that a flush inside a compiled decode step finds the flags fixed. A row whose prompt is
        all padding has nothing to decide from: it keeps its keys unrotated (its later tokens quantize as KIVI's)."""
        held = [keys for keys, _ in self._provisional or ()]
        held.append(self.residual_keys[:, :, : self.residual_length])
        keys = torch.cat(held, dim=-2)[:, :, :_QUANTIZE_CHUNK_TOKENS]
        valid = None if self._padding is None else self._padding.valid(0, keys)
        self.key_rotated = query_rotation_choice(keys, moment.to(keys.device), self.config, valid)
        if self._length is not None:  # compiled decode reads the flags: a fixed address, as its other buffers
            torch._dynamo.mark_static_address(self.key_rotated)

    @staticmethod
    def _no_queries_message() -> str:
        return (
            "OscarCache(method='oscar') chooses each KV head's key rotation from the queries that read the prompt, "
            "but none reached this layer: its attention must run through transformers' 'sdpa' attention "
            "(attn_implementation='sdpa') on the keys the cache returned, and the prefill must run eagerly. A cache "
            "filled by hand (update without the model's attention) needs `layer.observe_queries(query)` after its "
            "first update. Or use method='paper' (or the default method='auto', which picks it for such models)."
        )

    def fused_attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of this step's queries (the newest residual tokens) over everything stored, read in place by
        the fused Triton kernel: `[B, Hq, Tq, D]`."""
        if torch.compiler.is_compiling():
            return self._compiled_attention(query, attention_mask, scaling)
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
            query, self.quantized(), residual_keys, residual_values, padding, scaling, self.config, self.key_rotated
        )

    def _compiled_attention(
        self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float
    ) -> torch.Tensor:
        """The fused kernel handed the whole reserved storage and residual window and the device counter: it reads
        the tokens held (this step's included) and nothing beyond them."""
        padding = None
        if attention_mask is not None:  # [B or 1, 1, 1, positions]: its last row, over positions as the kernel reads
            padding = attention_mask[:, 0, -1]
            if padding.dtype != torch.bool:  # an additive float mask: 0 where attending
                padding = padding == 0
            padding = padding.expand(query.shape[0], -1)
        stored = self._storage if self.layout.num_tokens(self._storage) else None
        return kernel_ops.decode_attention(
            query,
            stored,
            self.residual_keys,
            self.residual_values,
            padding,
            scaling,
            self._op_config,
            self.key_rotated,
            self._length,
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
        self.max_cache_len = tokens
        self._reserved_tokens = tokens - tokens % self.config.residual_length
        if self.is_initialized and self.compiled_decode:
            self._prepare_compiled_decode()
        elif self.is_initialized and self._storage is not None:
            self._grow(self._reserved_tokens)

    def _stored(self, start: int, end: int) -> QuantizedKV:
        return self.layout.rows(self._storage, start, end)

    def _store(self, block: QuantizedKV) -> None:
        start = self.quantized_length
        end = start + self.layout.num_tokens(block)
        self._grow(end)
        for buf, part in zip(self.layout.rows(self._storage, start, end), block):
            if buf is not None:
                buf.copy_(part)
        self.quantized_length = end

    def _grow(self, tokens: int) -> None:
        """Make room for `tokens` quantized tokens: capacity doubles, so appending is amortized O(block)."""
        capacity = 0 if self._storage is None else self.layout.num_tokens(self._storage)
        if tokens <= capacity:
            return
        window = self.config.residual_length
        capacity = -(-max(tokens, 2 * capacity, self._reserved_tokens) // window) * window
        keys, values = self.residual_keys, self.residual_values
        (batch, key_heads, _, key_dim), (_, value_heads, _, value_dim) = keys.shape, values.shape
        new = self.layout.empty(batch, key_heads, key_dim, value_heads, value_dim, capacity, keys.device)
        if self._storage is not None:
            old_tokens = self.layout.num_tokens(self._storage)
            for buf, old in zip(self.layout.rows(new, 0, old_tokens), self._storage):
                if buf is not None:
                    buf.copy_(old)
        self._storage = new

    def _apply(self, fn) -> None:
        """Apply a batch-axis (or device) transform to every stored tensor."""
        if not self.is_initialized:
            return
        self.residual_keys, self.residual_values = fn(self.residual_keys), fn(self.residual_values)
        if self.key_rotated is not None:
            self.key_rotated = fn(self.key_rotated)
        if self._padding is not None:
            self._padding = self._padding.apply(fn)
        if self._storage is not None:
            self._storage = QuantizedKV(*(None if t is None else fn(t) for t in self._storage))

    # ----------------------------------------------------------------------------------------------------------
    # memory accounting
    def memory(self) -> KVMemory:
        if not self.is_initialized:
            return KVMemory()
        self._read_length()
        elements_per_token = self.residual_keys[:, :, 0].numel() + self.residual_values[:, :, 0].numel()
        allocated = self.residual_keys.nbytes + self.residual_values.nbytes
        if self._storage is not None:
            allocated += sum(t.nbytes for t in self._storage if t is not None)
        quantized = self.quantized()
        element_size = self.residual_keys.element_size()
        return KVMemory(
            quantized_bytes=0 if quantized is None else sum(t.nbytes for t in quantized if t is not None),
            quantized_bf16_bytes=2 * elements_per_token * self.quantized_length,
            exact_bytes=element_size * elements_per_token * self.residual_length,
            exact_bf16_bytes=2 * elements_per_token * self.residual_length,
            allocated_bytes=allocated,
            model_dtype_bytes=element_size * elements_per_token * self.get_seq_length(),
        )


@dataclass(frozen=True)
class KVMemory:
    """Bytes held by a cache (summed over layers), and what a DynamicCache would hold for the same tokens, in the
    model's dtype and in bf16. `print(memory)` shows the whole cache's ratios to both.

    `quantized_*` covers the 2-bit region of the OScaR layers; `exact_*` everything kept in full precision (residual
    windows, and the layers OScaR leaves alone, e.g. sliding-window layers). `allocated_bytes` includes spare
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
        """How many times smaller than bf16 the quantized region is (about 5.3x at 2 bits, D=128, fp16 scales)."""
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
    """Bytes a cache holds now (any transformers `Cache`; OScaR layers report their quantized region separately)."""
    total = KVMemory()
    for layer in cache.layers:
        if isinstance(layer, OscarLayer):
            total += layer.memory()
            continue
        tensors = [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if torch.is_tensor(t)]
        held = sum(t.nbytes for t in tensors)
        bf16 = sum(2 * t.numel() for t in tensors)
        total += KVMemory(exact_bytes=held, exact_bf16_bytes=bf16, allocated_bytes=held, model_dtype_bytes=held)
    return total


def _refuse_latent_attention(text_config: PretrainedConfig) -> None:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi, MiniCPM3, LongCat, Mistral Large 3...) caches a compressed
    latent shared by all heads (and a rotary part) in place of per-head keys and values; quantizing it per channel and
    per token as K/V would be silently wrong. Such configs name the latent's rank (`kv_lora_rank`) or the rotary part's
    width (`qk_rope_head_dim`)."""
    markers = {name: getattr(text_config, name, None) for name in ("kv_lora_rank", "qk_rope_head_dim")}
    markers = {name: value for name, value in markers.items() if value is not None}
    if markers:
        details = ", ".join(f"{name}={value}" for name, value in markers.items())
        raise ValueError(
            f"OscarCache does not support multi-head latent attention: this {type(text_config).__name__} ({details}) "
            "caches a compressed latent, not per-head keys and values, so OScaR's K/V quantization does not apply. "
            "Use the model's default cache (drop cache_implementation='oscar')."
        )


def _refuse_cross_attention(text_config: PretrainedConfig) -> None:
    """Mllama's text model reads `past_key_values.layers[i].keys` of every layer to find its cross-attention layers'
    image K/V; an `OscarLayer` keeps no dense `keys` tensor to show it."""
    layers = getattr(text_config, "cross_attention_layers", None)
    if layers:
        raise ValueError(
            f"OscarCache does not support models with cross-attention layers: this {type(text_config).__name__} "
            f"(cross_attention_layers={list(layers)}) reads every cache layer's dense `keys` tensor, which 2-bit "
            "layers do not hold. Use the model's default cache (drop cache_implementation='oscar')."
        )


class OscarCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers are `OscarLayer`s; other layer types (sliding window, linear
    attention, KV-sharing) keep transformers' own layers.

    Args:
        config: the model's config (`model.config`); the layer types come from it, and its attention implementation
            resolves method="auto" (`OscarConfig.resolve`).
        oscar_config: an `OscarConfig`, or a dict of its fields (unknown keys are an error), or None for defaults;
            `self.oscar_config` is it resolved (method "oscar" or "paper").
        tp_group: under tensor parallelism, the torch.distributed group over which the KV heads are sharded (default:
            the whole world, as with `torchrun` and `tp_plan="auto"`; `generate` passes the model's own). A layer that
            sees fewer KV heads than the config names while torch.distributed is initialized all-reduces its token
            norms over this group, so they cover every head of the layer, as on one GPU.

    Example:
        >>> cache = OscarCache(model.config, OscarConfig(bits=2))
        >>> model.generate(**inputs, past_key_values=cache)
    """

    layer_class: type[OscarLayer] = OscarLayer

    def __init__(self, config: PretrainedConfig, oscar_config: OscarConfig | dict | None = None, tp_group=None):
        if not isinstance(oscar_config, OscarConfig):
            oscar_config = OscarConfig.from_dict(oscar_config)
        text_config = config.get_text_config(decoder=True)
        # method="auto": the query rule where the model's attention hands the queries over, else the paper's (warned)
        oscar_config = oscar_config.resolve(getattr(text_config, "_attn_implementation", None))
        self.oscar_config = oscar_config
        self.tp_group = tp_group
        self._text_config = text_config
        if getattr(text_config, "is_encoder_decoder", False):
            raise ValueError("OscarCache supports decoder-only models; this model is an encoder-decoder.")
        _refuse_latent_attention(text_config)
        _refuse_cross_attention(text_config)
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
            layer.head_group = self._head_shard_group(key_states)
            kv_heads = getattr(self._text_config, "num_key_value_heads", None) or key_states.shape[1]
            group = getattr(self._text_config, "num_attention_heads", kv_heads) // kv_heads  # the same on every shard
            layer.fused_query_tokens = min(DECODE_MAX_QUERY_TOKENS, DECODE_MAX_QUERY_ROWS // max(group, 1))
        if isinstance(layer, OscarLayer) and not layer.is_initialized and layer.wants_queries:
            fused_attention.install()  # its sdpa wrapper hands this layer the queries that read it
        if getattr(layer, "use_kernels", False) or getattr(layer, "wants_queries", False):
            fused_attention.register_cache(self)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Tell the cache which positions hold padding, so that quantization leaves them out: `attention_mask` is the
        2D mask `[B, positions]` a model takes (1 for real tokens, 0 for padding), its first column the cache's first
        position; positions past its end count as real. Padding keys then enter no key group's min/max nor
        method="oscar"'s rotation choice (`reference.quantize_kv`, `valid`); a group of padding only decodes to zeros.

        `generate(cache_implementation="oscar")` calls it with the prompt's mask. By hand, call it before the forward
        that brings padded tokens (e.g. a left-padded prompt batch): `cache.set_padding(inputs["attention_mask"])`.
        None (or a mask without zeros) means no padding. Tokens already quantized keep their codes.
        """
        if attention_mask is not None and attention_mask.ndim != 2:
            raise ValueError(
                f"OscarCache.set_padding takes the 2D attention mask [batch, positions] (1 = token, 0 = padding), "
                f"got shape {tuple(attention_mask.shape)}."
            )
        padding = None if attention_mask is None else _Padding.of(attention_mask)
        for layer in self.layers:
            if isinstance(layer, OscarLayer):
                layer._padding = padding

    def _head_shard_group(self, key_states: torch.Tensor):
        """The process group over which a layer seeing these keys has its KV heads sharded, or None when this
        process holds all of them (one device, `device_map`, or no torch.distributed)."""
        total, held = getattr(self._text_config, "num_key_value_heads", None), key_states.shape[1]
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if not isinstance(total, int) or held >= total or not distributed:
            return None
        group = self.tp_group if self.tp_group is not None else torch.distributed.group.WORLD
        ranks = torch.distributed.get_world_size(group)
        if held * ranks != total:
            raise ValueError(
                f"OscarCache: a layer holds {held} of the model's {total} KV heads, but the tensor-parallel group has "
                f"{ranks} ranks ({held} x {ranks} != {total}), so the Omni-Token norm over all heads cannot be "
                "assembled. Pass the group that shards the heads: OscarCache(config, tp_group=...)."
            )
        return group

    @property
    def is_compileable(self) -> bool:
        """Whether decode steps may run compiled (`generate`'s automatic compile checks this, with the device): see
        `compile_blockers`."""
        return not self.compile_blockers()

    def compile_blockers(self) -> list[str]:
        """Why compiled decode cannot run with this model and configuration (empty when it can): it needs the fused
        path by the model's config (sdpa, head dims the kernel supports, only full-attention layers: no sliding
        window, KV sharing or linear attention) and the maximum length reserved (`generate` reserves it; by hand,
        `reserve(max_length)`). The device (CUDA) is checked by `generate` before the prefill, and by each layer at its
        first update (after which this reports it)."""
        text = self._text_config
        heads = getattr(text, "num_attention_heads", None) or 1
        head_dim = getattr(text, "head_dim", None) or getattr(text, "hidden_size", 0) // heads
        group = heads // (getattr(text, "num_key_value_heads", None) or heads)
        implementation = getattr(text, "_attn_implementation", None)
        return [
            reason
            for failed, reason in (
                (self.oscar_config.attention == "portable", "attention='portable'"),
                (not _HAS_TRITON, "triton is not installed"),
                (implementation != "sdpa", f"the model's attn_implementation is {implementation!r}, not 'sdpa'"),
                (head_dim not in DECODE_HEAD_DIMS, f"head_dim {head_dim} is not one of {DECODE_HEAD_DIMS}"),
                (group > DECODE_MAX_QUERY_ROWS, f"{group} query heads per KV head exceed {DECODE_MAX_QUERY_ROWS}"),
                (
                    not all(isinstance(layer, OscarLayer) for layer in self.layers),
                    "the model has layers other than full attention",
                ),
                (self.offloading, "cache offloading is on"),
                (
                    self.tp_group is not None or any(getattr(layer, "head_group", None) for layer in self.layers),
                    "tensor parallel: the token norms' all-reduce over the ranks' KV heads runs in eager code",
                ),
                (
                    any(
                        isinstance(layer, OscarLayer) and layer.is_initialized and not layer.use_kernels
                        for layer in self.layers
                    ),
                    "the fused kernels do not apply to the K/V this cache holds (see OscarConfig.attention)",
                ),
                (
                    any(isinstance(layer, OscarLayer) and layer.max_cache_len is None for layer in self.layers),
                    "no maximum length is reserved",
                ),
            )
            if failed
        ]

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
                (not _HAS_TRITON, "triton is not installed"),
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
