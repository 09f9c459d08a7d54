"""`OscarPagedCache`: transformers' continuous-batching cache (`PagedAttentionCache`) with the full-attention layers'
history in 2-bit pages.

Memory: one flat buffer cut into sectors, as transformers does, shared by three allocators: the 2-bit page blocks
(`PageAllocator`), one tail per running request (`TailAllocator`: its sinks and window, exact), and, on a hybrid model,
transformers' own sliding-window allocator (exact, pages of R tokens). Every block size divides the sector, the
pool's blocks padded so that sectors stay small (`allocators.sector_geometry`). The memory handler is transformers'
(`PagedAttentionMemoryHandler`): it sizes the sectors from free memory (or `num_blocks`: page blocks of R tokens), with
the real bytes of a page block; it charges each readable token the dense read-back and mask that sdpa/eager attention
over dense K/V costs, unless attention reads the pages in place (`memory.InPlaceMemoryHandler`).

Updates: a forward's requests are recorded as transformers prepares the batch (`extend_read_and_write_indices`); the
first full-attention layer's `update` plans the forward's moves once (`plan.BatchPlan`), and each full-attention
layer then quantizes the pages that complete, stores the new exact tokens in the tails and returns what its attention
reads: on the Triton backend (`in_place`) the new tokens, carrying the step that the sdpa entry answers by reading the
pages in place (`history.PagedHistory`); else dense K/V (exact sinks and window, dequantized pages, exact new tokens)
for the model's attention. Sliding-window layers go to transformers' own update. Every quantize/dequantize call is
`PageCodec`'s (`codec_class`: the test hook).

Streams: transformers runs the forwards on a compute stream of its own and prepares the next batch on the host
meanwhile (asynchronous batching: batch N + 1 prepared while batch N computes). The pool's only device work outside a
forward, the flush of a filled window on the decode fast path (`fill_block_table`), runs on that stream
(`compute_stream`, given by `hooks`), after the forward that filled the window and before the one that reads its page.
"""

from __future__ import annotations

import functools

import torch
from transformers.generation.continuous_batching.cache import (
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.cache_allocators import (
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    CachePool,
    SlidingAttentionCacheAllocator,
)
from transformers.generation.continuous_batching.initialization import FALLBACK_DEFAULTS
from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens
from transformers.generation.continuous_batching.utils import (
    find_head_dim,
    find_num_key_value_heads,
    logger,
    stream_context,
)

from ..cache.backends import TritonBackend, choose_backend
from ..cache.step import FusedStep, hand_over
from ..config import OscarConfig
from ..reference import check_head_dim
from .allocators import PageAllocator, TailAllocator, exact_tokens, quantized_pages, sector_geometry
from .history import TABLE_HEADER, PagedBatch, PagedHistory, PoolLayer
from .memory import READ_COLUMNS, InPlaceMemoryHandler
from .pages import PageCodec, PageLayout, TailLayout
from .plan import BatchPlan, RequestStep


def refuse_tensor_parallel(tp_size: int) -> None:
    if tp_size > 1:
        raise ValueError(
            "The 2-bit pool does not support tensor parallelism yet (its token norms span every KV head); run "
            "continuous batching on one device, or drop cache_implementation='oscar'."
        )


def layer_groups(config) -> dict[str, list[int]]:
    """transformers' layer groups by attention type, refusing a model without full-attention layers."""
    groups = group_layers_by_attn_type(config)
    if FULL_ATTENTION not in groups:
        raise ValueError(
            "The 2-bit pool quantizes full-attention layers, and this model has none (sliding-window layers only); "
            "use continuous batching without cache_implementation='oscar'."
        )
    return groups


# Pages dequantized per read: bounds the float32 transients of the portable path (64 pages: 8192 tokens of a layer).
DEQUANTIZE_PAGES = 64
UNATTENDED_STEP = (
    "OscarPagedCache: the previous forward's attention of a full-attention layer did not run through the fused sdpa "
    "entry (the model uses its own attention function, or an attention call raised), so it would have attended to the "
    "new tokens only. Use cache_config attention='portable' for this model."
)


def reads_in_place(backend, config) -> bool:
    """Whether the pool's attention reads its pages in place: on the Triton backend (CUDA, or the interpreter with
    attention="fused"), for a model whose config shows no attention feature the kernels lack (logit soft-capping)."""
    return isinstance(backend, TritonBackend) and getattr(config, "attn_logit_softcapping", None) is None


def reads_pages_only(backend, config, groups: dict[str, list[int]]) -> bool:
    """Whether every attention read of the pool is an in-place read of its pages and tails (`reads_in_place`), none
    through transformers' own index tensors and masks (sliding-window layers): then the memory handler charges what
    the in-place reads need, and decode-only forwards take transformers' decode fast path (its block table, no host
    plan: what a CUDA graph can replay)."""
    return reads_in_place(backend, config) and SLIDING_ATTENTION not in groups


def decode_fast_path(oscar_config: OscarConfig, config, device) -> bool:
    """Whether the pool for this model (`config`, its text config taken) on `device` runs decode-only forwards on
    transformers' decode fast path (`reads_pages_only`), before the pool exists."""
    config = config.get_text_config()
    heads, head_dim = find_num_key_value_heads(config), find_head_dim(config)
    backend = choose_backend(oscar_config, config, False, torch.device(device), (head_dim, head_dim), heads)
    return reads_pages_only(backend, config, layer_groups(config))


class OscarPagedCache(PagedAttentionCache):
    """The 2-bit paged pool (see the module docstring). Built by continuous batching when its generation config says
    `cache_implementation="oscar"` (`oscar_hf.serving.hooks`).

    Args:
        oscar_config (`OscarConfig`): the pool's options, fixed widths (`hooks.pool_config` resolves them).
        config, continuous_batching_config, device, distributed_helper, dtype, model_supports_logits_to_keep:
            transformers' `PagedAttentionCache` arguments (the model's text config, the resolved continuous-batching
            config, ...); `dtype` is the model's, that of the tails and of the K/V returned.
    """

    codec_class = PageCodec  # the pool's quantize/dequantize backend (tests swap in a lossless one)

    def __init__(
        self,
        oscar_config: OscarConfig,
        config,
        continuous_batching_config,
        device,
        distributed_helper,
        dtype: torch.dtype = torch.float16,
        model_supports_logits_to_keep: bool = False,
    ) -> None:
        refuse_tensor_parallel(distributed_helper.tp_size)
        self.config, self.dtype, self.device = config, dtype, device
        self.oscar_config = oscar_config
        self.max_blocks_per_request = continuous_batching_config.max_blocks_per_request or 0
        heads, head_dim = find_num_key_value_heads(config), find_head_dim(config)
        check_head_dim(head_dim, oscar_config)
        sinks, window = oscar_config.sink_tokens, oscar_config.residual_length
        # Sharing a page is exact when it is a function of the prefix alone: without sinks (a request that matches a
        # prefix never computes its first tokens, which the pool keeps only in the finished request's tail).
        sharing = continuous_batching_config.allow_block_sharing and sinks == 0

        groups = layer_groups(config)
        page = PageLayout.of(oscar_config, heads, head_dim)
        backend = choose_backend(oscar_config, config, False, torch.device(device), (head_dim, head_dim), heads)
        self.in_place = reads_in_place(backend, config)
        lean = reads_pages_only(backend, config, groups)
        sliding = None
        if SLIDING_ATTENTION in groups:
            sliding = SlidingAttentionCacheAllocator(
                index=list(groups).index(SLIDING_ATTENTION),
                config=config,
                num_key_value_heads=heads,
                cache_dtype=dtype,
                page_size=window,
                layer_indices=groups[SLIDING_ATTENTION],
                allow_block_sharing=sharing,
            )
        full = groups[FULL_ATTENTION]
        tail = TailLayout(len(full), sinks, window, heads, head_dim, dtype)
        self.bytes_per_sector, page_block, tail_block = sector_geometry(
            len(full) * page.bytes, tail.bytes, None if sliding is None else sliding.bytes_per_block
        )
        self.pages = PageAllocator(
            list(groups).index(FULL_ATTENTION), full, page, page_block, sinks, sharing, self.in_place
        )
        self.cache_allocators = {t: self.pages if t == FULL_ATTENTION else sliding for t in groups}
        self.tails = TailAllocator(len(groups), tail, tail_block)
        self.layer_to_allocator = {i: a for a in self.cache_allocators.values() for i in a.layer_indices}
        allocators = [*self.cache_allocators.values(), self.tails]
        self.tokens_per_sector = max(
            self.bytes_per_sector // a.bytes_per_block * a.tokens_per_page for a in self.cache_allocators.values()
        )
        bytes_per_block = sum(a.bytes_per_block for a in self.cache_allocators.values())  # R tokens of every layer
        handler = PagedAttentionMemoryHandler
        if lean:
            rows = continuous_batching_config.max_requests_per_batch or FALLBACK_DEFAULTS["max_requests_per_batch"]
            handler = functools.partial(
                InPlaceMemoryHandler,
                gathered_bytes_per_token=-(-page.bytes // page.tokens),
                table_rows=rows,
                page_tokens=window,
            )
        self.max_batch_tokens, self.num_sectors = handler(
            config=config,
            cb_config=continuous_batching_config,
            dtype=dtype,
            bytes_per_sector=self.bytes_per_sector,
            tokens_per_sector=self.tokens_per_sector,
            bytes_per_block=bytes_per_block,
            attn_types=list(self.cache_allocators),
            model_supports_logits_to_keep=model_supports_logits_to_keep,
        ).infer_max_batch_tokens_and_num_sectors()
        non_trash_bytes = self.num_sectors * self.bytes_per_sector
        # two trash sectors first, as transformers lays it out (the sliding allocator writes padding there)
        self.cache_tensor = torch.zeros(non_trash_bytes + 2 * self.bytes_per_sector, dtype=torch.uint8, device=device)
        self.pool = CachePool(self.num_sectors, len(allocators))
        for allocator in allocators:
            allocator.register_cache_tensor(self.bytes_per_sector, non_trash_bytes, self.cache_tensor, self.pool)

        self.allow_block_sharing = sharing
        self.use_prefix_sharing = sharing and all(a.use_block_sharing for a in self.cache_allocators.values())
        self.num_blocks = non_trash_bytes // bytes_per_block
        self.read_cache_limit = self._infer_read_cache_limit()
        self.max_decode_fast_path_length = self._infer_max_decode_fast_path_length()
        self.max_tokens_read = max(a.tokens_per_page * a.num_blocks for a in self.cache_allocators.values())

        self.backend = backend
        self.codec = self.codec_class(oscar_config, self.pages.views, backend)
        self._layer_position = {layer: i for i, layer in enumerate(self.pages.layer_indices)}
        self._layers = [PoolLayer() for _ in self.pages.layer_indices]  # their in-place steps, until attended
        self._quantized: dict[str, int] = {}  # request id -> pages quantized so far
        self._steps: list[tuple[str, int, int]] = []  # the requests of the forward being prepared, not planned yet
        self._plan: BatchPlan | None = None
        self._batch: PagedBatch | None = None  # the forward's in-place reads
        self.compute_stream: torch.cuda.Stream | None = None  # transformers' (hooks set it); None: the current one
        # The longest request (prompt and new tokens) an empty pool holds, its tail included: longer ones are refused
        # when they are submitted (`hooks`), since transformers' scheduler could never place them.
        self.max_request_tokens = infer_max_single_request_tokens(self)
        if lean:
            # transformers' decode fast path (its block table, `fill_block_table`) where every full-attention layer
            # reads in place (`decode_fast_path`): a decode-only forward then needs no host plan, and a CUDA graph can
            # replay it; a row addresses the pages of the longest request the pool holds
            pages = quantized_pages(self.max_request_tokens, sinks, window)
            self.max_blocks_per_request = TABLE_HEADER + pages
            self.max_decode_fast_path_length = sinks + pages * window  # transformers takes a past below it: it fits
            # transformers' scheduler charges each request its history against the batch's read budget
            # (`max_tokens_read`, which also sizes its masks and index tensors); here it reads none of it
            self.read_cache_limit, self.max_tokens_read = 0, READ_COLUMNS
        logger.info(
            f"OScaR 2-bit pool: {self.num_sectors} sectors of {self.bytes_per_sector / 2**20:.2f} MiB, each "
            f"{self.bytes_per_sector // self.pages.bytes_per_block} page blocks of {self.pages.tokens_per_page} tokens "
            f"or {self.bytes_per_sector // self.tails.bytes_per_block} request tails; one request up to "
            f"{self.max_request_tokens} tokens; attention reads {'pages in place' if self.in_place else 'dense K/V'}"
        )

    # ---------------------------------------------------------------------------------------------------------
    # blocks: transformers' bookkeeping, with the tails beside the model's allocators
    def _allocators(self) -> list:
        return [*self.cache_allocators.values(), self.tails]

    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """transformers' check-and-allocate, for the tail of a request that has none as well as its blocks."""
        past = state.current_len()
        needed = [(a, a.needs_new_sectors(state.request_id, past, request_len)) for a in self._allocators()]
        enough = self.pool.num_free_sectors >= sum(sectors for _, sectors in needed)
        if dry_run or not enough:
            return enough
        for allocator, sectors in needed:
            for _ in range(sectors):
                self.pool.allocate_sector(allocator.index)
        for allocator in self._allocators():
            allocator.allocate_cache_to_request(state.request_id, past, request_len)
        return True

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache)
        self.tails.free_blocks(request_id, no_cache)
        self._quantized.pop(request_id, None)
        # A forward's requests are freed only after it ran (finished, cancelled, offloaded before the next batch is
        # prepared) or when it failed: requests recorded and not planned belong to a forward that never reached the
        # pool. So is a step of such a forward left unattended.
        self._steps = []
        self._drop_steps()

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        self.tails.free_all_requests()
        self._quantized.clear()
        self._steps, self._plan, self._batch = [], None, None
        self._drop_steps()

    def _drop_steps(self) -> None:
        for layer in self._layers:
            layer.fused_step = None

    def compute_free_capacity(self, relative: bool = True) -> int | float:
        free = super().compute_free_capacity(relative=False)
        free += self.pool.count_free_blocks(self.tails.index) * self.tails.bytes_per_block
        return free / (self.num_sectors * self.bytes_per_sector) if relative else free

    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """transformers' prefix match; the shared pages are quantized already."""
        prefix = super().search_prefix_match(request_id, prompt_ids)
        if prefix:
            self._quantized[request_id] = prefix // self.pages.tokens_per_page  # no sinks when sharing
        return prefix

    def prepare_fork_request(self, src_state, dst_req_ids, copy_src_and_dst) -> list[str]:
        """transformers' fork (`num_return_sequences` > 1: a request prefilled but for its last prompt token, then
        forked into children that each sample on), over the pool's three allocators: each child gets the parent's pages
        (shared where pages are shared, else copied; quantizing them again would give the same bytes), a copy of its
        tail and its count of quantized pages. Children are forked in order while the pool has room; the ids forked
        are returned, and `perform_cache_copy` makes the copies."""
        request_id, past = src_state.request_id, src_state.current_len()
        allocators = {**self.cache_allocators, self.tails.layer_type: self.tails}
        needed = {name: a.count_non_shareable_blocks(request_id, past) for name, a in allocators.items()}
        forked = []
        for child in dst_req_ids:
            sectors = {
                name: -(-max(needed[name] - self.pool.count_free_blocks(a.index), 0) // a.blocks_per_sector)
                for name, a in allocators.items()
            }
            if self.pool.num_free_sectors < sum(sectors.values()):
                break
            for name, count in sectors.items():
                for _ in range(count):
                    self.pool.allocate_sector(allocators[name].index)
            for name, allocator in allocators.items():
                sources, destinations = copy_src_and_dst.setdefault(name, ([], []))
                copy_from, copy_to = allocator.fork_blocks(request_id, child, past)
                sources.extend(copy_from)
                destinations.extend(copy_to)
            self._quantized[child] = self._quantized.get(request_id, 0)
            forked.append(child)
        return forked

    def perform_cache_copy(self, copy_src_and_dst: dict[str, tuple[list[int], list[int]]]) -> None:
        """The forks' block copies (`prepare_fork_request`), the tails' too."""
        name = self.tails.layer_type
        super().perform_cache_copy({other: pairs for other, pairs in copy_src_and_dst.items() if other != name})
        sources, destinations = copy_src_and_dst.get(name, ([], []))
        if sources:
            self.tails.copy_blocks(sources, destinations)

    # ---------------------------------------------------------------------------------------------------------
    # a forward
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        """Record the request for the forward's plan; transformers' allocators (sliding window) get their indices."""
        if self._plan is not None:  # the first request of a new forward
            self._plan = None
        self._steps.append((request_id, past_length, query_length))
        lists = zip(self.cache_allocators.values(), write_index, read_index or [None] * len(write_index))
        for allocator, writes, reads in lists:
            if allocator is self.pages:
                continue
            writes.extend(allocator.get_write_indices(request_id, past_length, query_length))
            if reads is not None:
                reads.extend(allocator.get_read_indices(request_id, past_length, query_length))

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table) -> None:
        """A decode step on transformers' decode fast path: quantize the request's window if it filled in an earlier
        update (the flush, now: the forward runs without a host plan), then write its row of the block table
        (`block_table[i]`: the pool's, device int32): [pages, tail block, exact tokens, page blocks...] (`TABLE_HEADER`
        columns, then the pages complete before this step in position order)."""
        if query_length != 1:
            raise RuntimeError(f"OscarPagedCache: the decode fast path got {query_length} new tokens for a request")
        sinks, page_tokens = self.oscar_config.sink_tokens, self.pages.tokens_per_page
        length = past_length + 1
        pages = quantized_pages(length, sinks, page_tokens)  # a decode step completes none: those before it
        # A request no forward of this pool computed (transformers' warmup makes them up, with a past nobody wrote)
        # has nothing to quantize: its pages hold whatever they hold.
        first = self._quantized.get(request_id, pages)
        tail = self.tails.block_of(request_id)
        blocks = self.pages.block_table[request_id][:pages]
        if pages > first:
            self._flush(tail, blocks[first:])
            self._quantized[request_id] = pages
        row = torch.tensor([pages, tail, exact_tokens(length, sinks, page_tokens), *blocks], dtype=torch.int32)
        # The host's copy of the table under asynchronous batching (transformers copies it to the device, on a stream
        # the forward waits for), else the device's: a blocking copy, done before the forward is launched.
        block_table[self.pages.index, : len(row)].copy_(row)

    def _flush(self, tail: int, blocks: list[int]) -> None:
        """Quantize the window of tail block `tail` (its R tokens after the sinks) into page block `blocks[0]`, every
        full-attention layer's in one call."""
        if len(blocks) != 1:
            raise RuntimeError(f"OscarPagedCache: a decode step found {len(blocks)} pages to quantize, not one")
        sinks, page_tokens = self.oscar_config.sink_tokens, self.pages.tokens_per_page
        window = [kv[tail, :, sinks : sinks + page_tokens].transpose(1, 2) for kv in self.tails.layers]  # [L, H, R, D]
        # On the forwards' stream (ordered after the forward that wrote the window, which may still be running), and
        # checked behind the kernels on CUDA: the host does not wait for them
        with stream_context(self.compute_stream), self.codec.finite.gathered():
            self.codec.write_layers(blocks[0], *window)

    def _batch_plan(self, cu_seq_lens_q: torch.Tensor) -> BatchPlan:
        """The forward's plan, made at its first full-attention layer from the recorded requests."""
        if self._steps:
            steps = [
                RequestStep(
                    past,
                    new,
                    self.tails.block_of(request_id),
                    self._quantized.get(request_id, 0),
                    self.pages.block_table.get(request_id, []),
                )
                for request_id, past, new in self._steps
            ]
            sinks, page_tokens = self.oscar_config.sink_tokens, self.pages.tokens_per_page
            self._plan = BatchPlan(steps, sinks, page_tokens, self.device, dense=not self.in_place)
            if self.in_place:
                self._batch = PagedBatch(self._plan.reads, self.device)
            for (request_id, _, _), after in zip(self._steps, self._plan.quantized_after):
                self._quantized[request_id] = after
            self._steps = []
        # transformers pads a batch under CUDA graphs with empty sequences at its end (and tokens no request owns)
        if self._plan is None or self._plan.requests > len(cu_seq_lens_q) - 1:
            raise RuntimeError(
                "OscarPagedCache: a forward reached the pool without the batch transformers prepared for it (its "
                "requests were not recorded through extend_read_and_write_indices)."
            )
        return self._plan

    @torch.compiler.disable  # index ops on views of the pool, as transformers' own update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, kwargs: dict
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens of layer `layer_idx` (`[1, heads, tokens, head_dim]`) and return what its attention
        reads: read in place (`in_place`), the new tokens, the keys carrying the step (`history.PagedHistory`); else
        the dense K/V (`[1, heads, sum over requests of past + new, head_dim]`, each request's history then its new
        tokens)."""
        if self.layer_to_allocator[layer_idx] is not self.pages:
            return super().update(key_states, value_states, layer_idx, kwargs)
        kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][FULL_ATTENTION].to(torch.int32)
        kwargs["max_length_k"] = kwargs["max_length_k"][FULL_ATTENTION]
        layer = self._layer_position[layer_idx]
        if kwargs.get("block_table") is not None:
            return self._table_step(layer, key_states, value_states, kwargs)
        plan = self._batch_plan(kwargs["cu_seq_lens_q"])
        tails, tails_kv = self.tails.views[layer], self.tails.kv_views[layer]
        new = [states[0].transpose(0, 1) for states in (key_states, value_states)]  # [tokens, heads, head_dim]
        new_kv = torch.stack(new, 1)  # [tokens, 2, heads, head_dim]: keys and values move together
        heads, dim, page_tokens = new[0].shape[1], new[0].shape[2], self.pages.tokens_per_page

        pages = len(plan.quantize_blocks)
        if pages:  # 1. the pages that complete, from the window's exact tokens and the new ones
            stage = new_kv.new_empty(pages * page_tokens, 2, heads, dim)
            _gather(stage, plan.stage_tail, tails_kv)
            _gather(stage, plan.stage_new, new_kv)
            staged = stage.view(pages, page_tokens, 2, heads, dim).transpose(1, 3)  # [pages, heads, 2, R, D]
            self.codec.write(layer, plan.quantize_blocks, staged[:, :, 0], staged[:, :, 1])
        if self.in_place:
            return self._in_place_step(plan, layer, key_states, value_states, new_kv, kwargs)
        dense = [states.new_empty(plan.tokens, heads, dim) for states in new]
        for out, states, tail in zip(dense, new, tails):
            _gather(out, plan.out_tail, tail)
            _gather(out, plan.out_new, states)
        # 2. the history before the update, dequantized a bounded number of pages at a time into the dense K/V
        rows = plan.out_deq[0]  # the pages' rows of the dense K/V, in page order
        for start in range(0, len(plan.dequantize_blocks), DEQUANTIZE_PAGES):
            blocks = plan.dequantize_blocks[start : start + DEQUANTIZE_PAGES]
            into = rows[start * page_tokens : (start + len(blocks)) * page_tokens]
            for out, pages in zip(dense, self.codec.read(layer, blocks, key_states.dtype)):
                out[into] = pages.transpose(1, 2).reshape(-1, heads, dim)
        self._write_tails(plan, new_kv, tails_kv)
        return tuple(out.transpose(0, 1).unsqueeze(0) for out in dense)

    @staticmethod
    def _write_tails(plan: BatchPlan, new_kv: torch.Tensor, tails_kv: torch.Tensor) -> None:
        """3. the new tokens that stay exact (`new_kv` `[tokens, 2, heads, D]`, into `TailAllocator.kv_views`)."""
        destination, source, blocks = plan.tail_writes
        tails_kv[blocks, destination] = new_kv[source]

    def _table_step(self, layer: int, key_states, value_states, kwargs: dict) -> tuple:
        """A decode-only forward on the fast path: every step of it on the device, from the block table
        (`fill_block_table`), so that a CUDA graph replays it. The first full-attention layer reads the forward's rows
        (`PagedBatch.from_table`); each layer writes each request's new token into its tail and returns it carrying
        the step. Rows transformers pads the batch with (-1) write and read the write-trash sector's tail."""
        if self._layers[layer].fused_step is not None and self._layers[layer].fused_step.unattended:
            raise RuntimeError(UNATTENDED_STEP)
        if layer == 0:
            table = kwargs["block_table"][self.pages.index]  # [requests (padded), width]
            self._batch = PagedBatch.from_table(table, trash_tail=self.tails.blocks_per_sector)
        batch, tails = self._batch, self.tails.views[layer]
        for states, tail in zip((key_states, value_states), tails):
            tail[batch.tail_index, batch.slot_index] = states[0].transpose(0, 1)
        pages = self.pages.views[layer]
        history = PagedHistory(batch, pages, tails, None, self.codec, layer, self.backend, self.oscar_config)
        FusedStep.start(self._layers[layer], key_states, value_states, history)
        hand_over(key_states, kwargs)
        return key_states, value_states

    def _in_place_step(self, plan: BatchPlan, layer: int, key_states, value_states, new_kv, kwargs: dict) -> tuple:
        """2. and 3. read in place: the chunks' exact tokens copied before the tails are written, then the new tokens
        returned carrying the step (handed to the attention call too, as `OscarCache.update` hands its steps)."""
        if self._layers[layer].fused_step is not None and self._layers[layer].fused_step.unattended:
            raise RuntimeError(UNATTENDED_STEP)
        tails, tails_kv = self.tails.views[layer], self.tails.kv_views[layer]
        exact = None
        if plan.exact_tokens:
            exact_kv = new_kv.new_empty(plan.exact_tokens, *new_kv.shape[1:])
            _gather(exact_kv, plan.exact_tail, tails_kv)
            _gather(exact_kv, plan.exact_new, new_kv)
            exact = exact_kv[:, 0], exact_kv[:, 1]
        self._write_tails(plan, new_kv, tails_kv)
        history = PagedHistory(
            self._batch, self.pages.views[layer], tails, exact, self.codec, layer, self.backend, self.oscar_config
        )
        FusedStep.start(self._layers[layer], key_states, value_states, history)
        hand_over(key_states, kwargs)
        return key_states, value_states


def _gather(out: torch.Tensor, moves: tuple[torch.Tensor, torch.Tensor, torch.Tensor], source: torch.Tensor) -> None:
    """out[dst] = source[src] (a tail source `[blocks, slots, ...]`: source[block, src])."""
    destination, rows, blocks = moves
    if source.dim() == out.dim() + 1:
        out[destination] = source[blocks, rows]
    else:
        out[destination] = source[rows]
