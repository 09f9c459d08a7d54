"""What a full-attention layer of the 2-bit pool attends to in place: `PagedHistory`, the history of the `FusedStep`
(oscar_hf/cache/step.py) that the pool's `update` returns with the batch's new tokens, which the sdpa entry
(integrations/fused_attention.py) answers as it answers a cache layer's step.

Each request of the forward (`plan.RequestReads`) attends to its own history:

- the decode steps (one query token each), together, by the paged decode kernel (kernels/decode_paged.py): each
  request's pages read through the block table, its exact tokens (sinks, window, its own token) from its tail
  (`PagedBatch`: the block table, page counts, tail blocks and exact token counts, made once per forward);
- a prompt chunk, by the cache's chunk attention (`TritonBackend.chunk_attention`) over its pages gathered into one
  quantized region (`pages.gather_pages`: the 2-bit bytes of one request and one layer) and its exact tokens (the
  sinks and the window before it, then its own, causal); a request's first chunk over its own tokens only. torch's
  flash kernel before cuDNN's (`prefer_flash`): a step's chunk lengths are new at every step, and cuDNN plans each.

Nothing of the batch's dense K/V and no batch-wide mask: `dense()` and `dense_mask()` build them only for attention
features the kernels lack (`backends.attention_blockers`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers.generation.continuous_batching.utils import build_attention_mask

from ..cache.backends import TritonBackend
from ..cache.step import FusedStep
from ..config import OscarConfig
from ..layout import QuantizedKV
from .pages import PageCodec, gather_pages
from .plan import RequestReads


class PoolLayer:
    """A full-attention layer of the pool as `FusedStep` sees it: it holds its latest step until that is attended."""

    fused_step: FusedStep | None = None


TABLE_HEADER = 3  # a request's row of the decode fast path's block table: pages, tail block, exact tokens, then pages


class PagedBatch:
    """The reads of one forward (`reads`, in batch order) and what every layer's kernels take of them, on `device`;
    or a decode-only forward's, from the block table (`from_table`)."""

    def __init__(self, reads: list[RequestReads], device: torch.device):
        self.reads = reads
        self.chunks = [read for read in reads if read.new > 1]
        self.chunk_pages = [torch.tensor(read.pages, dtype=torch.long, device=device) for read in self.chunks]
        decode = [read for read in reads if read.new == 1]
        self.decode_rows = None  # the decode steps' query rows: a slice where they follow each other, else a tensor
        if not decode:
            return
        rows = [read.query_at for read in decode]
        start, count = rows[0], len(rows)
        contiguous = rows == list(range(start, start + count))
        self.decode_rows = slice(start, start + count) if contiguous else torch.tensor(rows, device=device)
        width = max(len(read.pages) for read in decode)
        table = [[*read.pages, *[0] * (width - len(read.pages))] for read in decode]
        # each of the four sections 16-byte aligned (a multiple of 4 entries before it): the kernel's pointers then
        # specialise alike at every batch size (kernels/decode_paged.py)
        padded = -(-count // 4) * 4
        counts = [[len(read.pages) for read in decode], [read.tail for read in decode], [read.exact for read in decode]]
        counts = [[*column, *[0] * (padded - count)] for column in counts]
        flat = torch.tensor(list(itertools.chain(*counts, *table)), dtype=torch.int32).to(device)  # one copy
        self.page_counts, self.tail_blocks, self.exact_tokens = flat[: 3 * padded].view(3, padded)[:, :count]
        self.block_table = flat[3 * padded :].view(count, width)

    @classmethod
    def from_table(cls, table: torch.Tensor, trash_tail: int) -> PagedBatch:
        """A decode-only forward's reads from its rows of the block table (`[requests, width]` int32 on the device,
        `OscarPagedCache.fill_block_table`'s layout), on the device only: what a CUDA graph replays. Rows transformers
        pads the batch with (every entry -1) hold no page and one exact token, in tail block `trash_tail` (the
        write-trash sector's), where their token is written and read. `tail_index`/`slot_index`: where each request's
        new token goes (its tail block, its last exact slot)."""
        batch = cls.__new__(cls)
        batch.reads, batch.chunks, batch.chunk_pages = None, [], []
        batch.decode_rows = slice(0, table.shape[0])
        padding = table[:, 0] < 0
        pages = table[:, 0].clamp(min=0)
        tails = torch.where(padding, trash_tail, table[:, 1])
        exact = table[:, 2].clamp(min=1)
        batch.page_counts, batch.tail_blocks, batch.exact_tokens = (t.contiguous() for t in (pages, tails, exact))
        batch.block_table = table[:, TABLE_HEADER:]
        batch.tail_index, batch.slot_index = tails.long(), exact.long() - 1
        return batch


@dataclass(eq=False)
class PagedHistory:
    """One full-attention layer's reads of `batch` (see the module docstring): its page views `pages`
    (`PageLayout.views`), tail views `tails` (`TailLayout.views`) and the chunks' exact tokens copied before the
    update wrote the tails (`exact`, `[rows, Hkv, D]` each; None without chunks); `codec` and `layer` dequantize its
    pages for `dense`."""

    batch: PagedBatch
    pages: QuantizedKV
    tails: tuple[torch.Tensor, torch.Tensor]
    exact: tuple[torch.Tensor, torch.Tensor] | None
    codec: PageCodec
    layer: int
    backend: TritonBackend
    config: OscarConfig
    decode = False  # a batch of requests: `FusedStep.check`'s query-rows limit is one decode step's, not theirs

    def attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The batch's attention `[1, Hq, T, D]` (a view of a `[1, T, Hq, D]` tensor); `attention_mask` (transformers'
        mask of the batch's own tokens) is not needed."""
        from ..kernels.decode_paged import paged_decode_attention

        batch = self.batch
        _, heads, tokens, dim = query.shape
        out = query.new_empty(1, tokens, heads, dim).transpose(1, 2)
        if batch.decode_rows is not None:
            rows = batch.decode_rows
            queries = query[0][:, rows].transpose(0, 1).unsqueeze(2)  # [requests, Hq, 1, D]
            tables = (batch.block_table, batch.page_counts, batch.tail_blocks, batch.exact_tokens)
            decoded = paged_decode_attention(queries, self.pages, *self.tails, *tables, scaling, self.config)
            out[0][:, rows] = decoded[:, :, 0].transpose(0, 1)
        for read, pages in zip(batch.chunks, batch.chunk_pages):
            rows = slice(read.query_at, read.query_at + read.new)
            keys, values = (own.transpose(0, 1)[None] for own in self._exact_of(read))
            quantized = gather_pages(self.pages, pages) if read.pages else None
            out[:, :, rows] = self.backend.chunk_attention(
                query[:, :, rows], quantized, keys, values, None, scaling, self.config, None, prefer_flash=True
            )
        return out

    def _exact_of(self, read: RequestReads) -> tuple[torch.Tensor, torch.Tensor]:
        """The exact tokens `read` attends to, `[exact, Hkv, D]` each."""
        if read.exact_at is None:
            return tuple(tail[read.tail, : read.exact] for tail in self.tails)
        return tuple(exact[read.exact_at : read.exact_at + read.exact] for exact in self.exact)

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The same history as the dense K/V of the pool's portable path, `[1, Hkv, sum of past + new, D]`: each
        request's sinks, dequantized pages and other exact tokens in position order."""
        reads = self.batch.reads
        if reads is None:
            raise RuntimeError(
                "OscarPagedCache: the decode fast path reads pages in place only; an attention call needs them as "
                "dense K/V (a feature the kernels lack), which the pool refuses the fast path for."
            )
        exact = [self._exact_of(read) for read in reads]
        dtype, device = exact[0][0].dtype, exact[0][0].device
        blocks = torch.tensor([block for read in reads for block in read.pages], dtype=torch.long, device=device)
        pages = [[], []]
        if len(blocks):  # every request's pages dequantized at once, then split: `[tokens, Hkv, D]` per request
            sizes = [len(read.pages) * self.config.residual_length for read in reads]
            pages = [kv.transpose(1, 2).flatten(0, 1).split(sizes) for kv in self.codec.read(self.layer, blocks, dtype)]
        keys, values = [], []
        for i, read in enumerate(reads):
            for out, own, middle in zip((keys, values), exact[i], pages):
                out.extend((own[: read.sinks], *middle[i : i + 1], own[read.sinks :]))
        return tuple(torch.cat(parts).transpose(0, 1).unsqueeze(0) for parts in (keys, values))

    def dense_mask(self, attention_mask: torch.Tensor | None, tokens: int) -> torch.Tensor:
        """The block-diagonal causal mask of `dense()` (transformers', built by its own `build_attention_mask`)."""
        reads = self.batch.reads
        queries = [0, *itertools.accumulate(read.new for read in reads)]
        keys = [0, *itertools.accumulate(read.past + read.new for read in reads)]
        dtype, device = self.tails[0].dtype, self.tails[0].device
        mask = torch.empty(1, 1, queries[-1], keys[-1], dtype=dtype, device=device).fill_(torch.finfo(dtype).min)
        build_attention_mask(mask, queries, keys)
        return mask
