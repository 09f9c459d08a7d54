"""The pool's two allocators, on transformers' sector machinery (`CacheAllocator`, `CachePool`): page blocks for the
quantized history of the full-attention layers, and one tail block per running request for its exact tokens. Both
take their blocks from the same sectors, so memory moves between pages and tails as the load needs (many short
requests: many tails; few long ones: many pages).

A request of L tokens holds the pages of its complete blocks but the newest: `quantized_pages(L)`, as an `OscarLayer`
holds them after an update (the newest complete block is quantized when the next update begins, which allocates for
it). Reads and writes go through `OscarPagedCache.update`; the per-token index paths of transformers' allocators
(`get_read_indices`, `update`, block tables for flash) do not apply and raise.
"""

from __future__ import annotations

import math

import torch
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, CacheAllocator, CachePool

from .pages import PAGE_ALIGN, PageLayout, TailLayout, round_up, stack_views

_INDEX_PATHS = "the 2-bit pool reads and writes its pages in OscarPagedCache.update, not through per-token indices"


def quantized_pages(length: int, sinks: int, page_tokens: int) -> int:
    """Pages a request of `length` tokens holds: its complete blocks of `page_tokens` after the `sinks` first tokens,
    but the newest (it stays exact in the window until the next update)."""
    return max(length - sinks - 1, 0) // page_tokens


def exact_tokens(length: int, sinks: int, page_tokens: int) -> int:
    """Exact tokens a request of `length` tokens holds in its tail: its sinks, then the window of tokens after its
    `quantized_pages`."""
    return min(length, sinks) + max(length - sinks - quantized_pages(length, sinks, page_tokens) * page_tokens, 0)


class _PoolAllocator(CacheAllocator):
    """What both allocators share: blocks of one padded size (one transformers "page" each: `pages_per_block` 1), no
    per-token index path, no kernel block table (yet)."""

    supports_block_table = False
    rows_per_token = 1  # transformers' stride of token rows: the pool has none, its blocks are addressed by views

    def _register(self, bytes_per_sector: int, non_trash_bytes: int, cache_tensor: torch.Tensor, pool: CachePool):
        self.bytes_per_sector = bytes_per_sector
        self._copy_view = cache_tensor.view(-1, self.bytes_per_block)
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    def allocate_cache_to_request(self, request_id: str, past_length: int, query_length: int) -> None:
        needed = self.needs_new_blocks(request_id, past_length, query_length)
        self.block_table.setdefault(request_id, []).extend(self.pool.get_free_blocks(self.index, needed))

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        raise NotImplementedError(_INDEX_PATHS)

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        raise NotImplementedError(_INDEX_PATHS)

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        raise NotImplementedError(_INDEX_PATHS)

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table) -> None:
        raise NotImplementedError(_INDEX_PATHS)

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
        raise NotImplementedError(_INDEX_PATHS)

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError(_INDEX_PATHS)


class PageAllocator(_PoolAllocator):
    """Page blocks of the full-attention layers `layer_indices`: block b holds, for each of them in order, its page
    (`PageLayout`) of the same R tokens, in `block_bytes` (at least the pages' bytes). Complete pages are shared
    between requests with the same prefix (transformers' block hashing), when the pool allows it (`OscarPagedCache`).
    `in_place`: attention reads the pages in place (`history.PagedHistory`), so transformers' masks for these layers
    span each request's new tokens only (`get_seqlen_k`)."""

    supports_block_sharing = True
    layer_type = FULL_ATTENTION

    def __init__(
        self,
        index: int,
        layer_indices: list[int],
        page: PageLayout,
        block_bytes: int,
        sinks: int,
        allow_block_sharing: bool,
        in_place: bool,
    ):
        self.page, self.sinks, self.in_place = page, sinks, in_place
        self._before_cache_tensor_init(index, layer_indices, page.tokens, block_bytes, allow_block_sharing)
        self.pages_per_block, self.bytes_per_block = 1, block_bytes  # the layers' pages, padded (`sector_geometry`)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self._register(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        self.views = [self.page.views(cache_tensor, self.bytes_per_block, i) for i in range(len(self.layer_indices))]

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        """The keys transformers' mask gives a request: its whole history then its new tokens (the dense K/V
        `OscarPagedCache.update` returns), or, read in place, its new tokens only."""
        return query_length if self.in_place else past_length + query_length

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        held = len(self.block_table.get(request_id, []))
        return max(quantized_pages(past_length + query_length, self.sinks, self.tokens_per_page) - held, 0)


class TailAllocator(_PoolAllocator):
    """One tail block per running request (`TailLayout`), padded to divide the sector (`sector_geometry`). Never
    shared."""

    supports_block_sharing = False
    layer_type = "oscar_tail"  # never one of the model's layer types: transformers' batch inputs skip it

    def __init__(self, index: int, tail: TailLayout, block_bytes: int):
        self.tail = tail
        self._before_cache_tensor_init(index, [], tail.slots, block_bytes, allow_block_sharing=False)
        self.pages_per_block, self.bytes_per_block = 1, block_bytes  # one "page": the whole tail, padded

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self._register(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        self.views = [self.tail.views(cache_tensor, self.bytes_per_block, i) for i in range(self.tail.layers)]
        self.layers = tuple(stack_views(list(kv)) for kv in zip(*self.views))  # [blocks, layers, slots, heads, D]
        # each layer's keys and values together, `[blocks, slots, 2, heads, D]`: one index moves both
        self.kv_views = [stack_views(list(kv)).transpose(1, 2) for kv in self.views]

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        return 0 if request_id in self.block_table else 1

    def block_of(self, request_id: str) -> int:
        return self.block_table[request_id][0]


def _divisors(number: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(number) + 1) if number % d == 0]
    return sorted({*small, *(number // d for d in small)})


def sector_geometry(page_block: int, tail_block: int, sliding_block: int | None) -> tuple[int, int, int]:
    """(sector, page block, tail block) bytes: the blocks padded (to multiples of `PAGE_ALIGN`) so that both divide
    the sector, which `sliding_block` (transformers' sliding-window blocks, fixed) must divide too.

    Without sliding-window layers the tail is padded to a whole number of page blocks, and the sector is one tail.
    With them, the sector is a small multiple of the sliding block and each block the smallest of its divisors that
    holds it, the multiple chosen to waste the least of a page block first (a request holds many pages, one tail),
    then of a tail: the least common multiple of arbitrary sizes could be gigabytes."""
    page_block = round_up(page_block, PAGE_ALIGN)
    if sliding_block is None:
        tail_block = round_up(tail_block, page_block)
        return tail_block, page_block, tail_block
    base = math.lcm(sliding_block, PAGE_ALIGN)
    best = None
    for multiple in range(1, -(-max(page_block, tail_block) // base) + 16):
        sector = base * multiple
        sizes = [PAGE_ALIGN * d for d in _divisors(sector // PAGE_ALIGN)]
        page = next((size for size in sizes if size >= page_block), None)
        tail = next((size for size in sizes if size >= tail_block), None)
        if page is None or tail is None:
            continue
        key = (round(page / page_block, 3), round(tail / tail_block, 2), sector)
        if best is None or key < best[0]:
            best = key, (sector, page, tail)
    return best[1]
