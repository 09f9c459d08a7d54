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

import torch
from transformers.generation.continuous_batching.cache_allocators import FULL_ATTENTION, CacheAllocator, CachePool

from .pages import PageLayout, TailLayout

_INDEX_PATHS = "the 2-bit pool reads and writes its pages in OscarPagedCache.update, not through per-token indices"


def quantized_pages(length: int, sinks: int, page_tokens: int) -> int:
    """Pages a request of `length` tokens holds: its complete blocks of `page_tokens` after the `sinks` first tokens,
    but the newest (it stays exact in the window until the next update)."""
    return max(length - sinks - 1, 0) // page_tokens


class _PoolAllocator(CacheAllocator):
    """What both allocators share: no per-token index path, no kernel block table (yet)."""

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
        return past_length + query_length  # attention reads the whole history, then the new tokens

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
    (`PageLayout`) of the same R tokens. Complete pages are shared between requests with the same prefix (transformers'
    block hashing), when the pool allows it (`OscarPagedCache`)."""

    supports_block_sharing = True
    layer_type = FULL_ATTENTION

    def __init__(self, index: int, layer_indices: list[int], page: PageLayout, sinks: int, allow_block_sharing: bool):
        self.page, self.sinks = page, sinks
        self._before_cache_tensor_init(index, layer_indices, page.tokens, page.bytes, allow_block_sharing)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self._register(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        self.views = [self.page.views(cache_tensor, self.bytes_per_block, i) for i in range(self.pages_per_block)]

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        held = len(self.block_table.get(request_id, []))
        return max(quantized_pages(past_length + query_length, self.sinks, self.tokens_per_page) - held, 0)


class TailAllocator(_PoolAllocator):
    """One tail block per running request (`TailLayout`), padded to a whole number of page blocks so that sectors hold
    both kinds without waste beyond that padding. Never shared."""

    supports_block_sharing = False
    layer_type = "oscar_tail"  # never one of the model's layer types: transformers' batch inputs skip it

    def __init__(self, index: int, tail: TailLayout, block_bytes: int):
        self.tail = tail
        self._before_cache_tensor_init(index, [], tail.slots, block_bytes, allow_block_sharing=False)
        self.pages_per_block, self.bytes_per_block = 1, block_bytes  # one "page": the whole tail, padded

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self._register(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
        self.views = [self.tail.views(cache_tensor, self.bytes_per_block, i) for i in range(self.tail.layers)]

    def needs_new_blocks(self, request_id: str, past_length: int, query_length: int) -> int:
        return 0 if request_id in self.block_table else 1

    def block_of(self, request_id: str) -> int:
        return self.block_table[request_id][0]
