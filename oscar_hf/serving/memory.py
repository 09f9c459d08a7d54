"""What the 2-bit pool costs beside its blocks, for transformers' memory handler (`PagedAttentionMemoryHandler`).

transformers charges each readable cache token, beside its bytes in the cache, its dense read-back at the attention
peak (the K/V `update` returns, repeated to the query heads for sdpa) and its column of the sdpa masks (`[M, N + M]`
per layer type, M = `max_batch_tokens`, N the readable tokens). A pool whose attention reads its pages in place
(`OscarPagedCache.in_place`) returns no dense history, and transformers' masks then span the batch's own tokens only
(`READ_COLUMNS` more: `OscarPagedCache` sets `max_tokens_read` to it), so `InPlaceMemoryHandler` charges a readable
token only its share of the largest transient the in-place reads make: a prompt chunk's pages gathered into one
quantized region, one layer at a time (`history.PagedHistory`), and its entry in the decode fast path's block table,
whose rows span the pages of the longest request the pool holds (`OscarPagedCache.fill_block_table`: a readable page
adds a column to each of its rows). The rest is transformers' own accounting: per batch token (IO tensors, activation
peaks), fixed (trash sectors, logit rows).
"""

from __future__ import annotations

import torch
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

from .history import TABLE_HEADER

# The tokens a batch reads through transformers' index tensors and masks beyond its own when attention reads the pool
# in place: none, but transformers' scheduler ends a batch at a budget (`max_tokens_read`) of 0.
READ_COLUMNS = 1


class InPlaceMemoryHandler(PagedAttentionMemoryHandler):
    """transformers' handler for a pool read in place (module docstring).

    Args:
        gathered_bytes_per_token (`int`): bytes one token of one layer's pages takes (a chunk's history is gathered
            from its pages, one layer at a time).
        table_rows (`int`): the block table's rows (transformers' `max_requests_per_batch`, at most).
        page_tokens (`int`): tokens a page holds (a column of the table).
        *args, **kwargs: `PagedAttentionMemoryHandler`'s.
    """

    def __init__(self, *args, gathered_bytes_per_token: int, table_rows: int, page_tokens: int, **kwargs):
        self.gathered_bytes_per_token = gathered_bytes_per_token
        self.table_rows, self.page_tokens = table_rows, page_tokens
        super().__init__(*args, **kwargs)

    @property
    def bytes_per_cache_token(self) -> int:
        """One layer's gathered copy of the token, and its share of a page's column in each IO set's block table."""
        column = self.table_rows * torch.int32.itemsize
        return self.gathered_bytes_per_token + self.io_multiplier * -(-column // self.page_tokens)

    @property
    def fixed_overhead_bytes(self) -> int:
        """transformers', and the table's header columns (`TABLE_HEADER`)."""
        header = self.io_multiplier * self.table_rows * TABLE_HEADER * torch.int32.itemsize
        return super().fixed_overhead_bytes + header

    def attention_mask_bytes(self, max_batch_tokens: int, num_sectors: int) -> int:
        """transformers' masks `[M, READ_COLUMNS + M]`, whatever the cache holds."""
        numel = max_batch_tokens * (READ_COLUMNS + max_batch_tokens)
        return self.io_multiplier * self.num_attention_masks * self.activation_dtype.itemsize * numel
