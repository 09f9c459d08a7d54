"""One forward's moves through the 2-bit pool, planned once for all its full-attention layers.

For a request whose update brings tokens [P, P + T) (S sinks, pages of R tokens), as an `OscarLayer` does it:

1. quantize the pages that are complete and not yet quantized: the window if it filled in an earlier update (the
   flush), then every page the new tokens complete but the newest (from the window's exact tokens and the new ones);
2. attend to: the sinks (exact), the pages complete before this update (dequantized), the window (exact), the new
   tokens (exact), in position order: the dense K/V transformers' mask expects (`P + T` keys per request);
3. write the new tokens that stay exact: into the sink slots, and into the window (the newest page's tokens).

Every move is a gather or a scatter with index tensors built here, vectorized over the batch (no per-token Python).
Where attention reads the pages in place (`history.PagedHistory`), each request's reads are a `RequestReads`: its page
blocks, and its exact tokens, for a decode step in its tail after the update, for a chunk in a copy taken before it
(the chunk's tail write may overwrite the window it attends to).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .allocators import exact_tokens, quantized_pages


@dataclass(frozen=True)
class RequestStep:
    """One request's part of a forward: `past` tokens held, `new` tokens arriving; its tail block, the pages it had
    quantized before (`quantized`) and its page blocks (allocated for `past + new` tokens)."""

    past: int
    new: int
    tail: int
    quantized: int
    pages: list[int]


def _ranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """cat(arange(start, start + length)) over the pairs, vectorized."""
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    total = int(lengths_t.sum())
    if not total:
        return torch.zeros(0, dtype=torch.long)
    offsets = torch.cumsum(lengths_t, 0) - lengths_t
    shift = torch.tensor(starts, dtype=torch.long) - offsets
    return torch.arange(total) + torch.repeat_interleave(shift, lengths_t)


def _repeat(values: list[int], lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.tensor(values, dtype=torch.long), torch.tensor(lengths, dtype=torch.long))


@dataclass(frozen=True)
class RequestReads:
    """What one request's queries (rows `[query_at, query_at + new)` of the batch, at positions `past` on) attend to:
    the pages `pages` (its page blocks complete before the update, quantized before it attends), and `exact` exact
    tokens, the first `sinks` of them before the pages in position order, the rest after them. A decode step
    (`new == 1`) finds them in slots `[0, exact)` of tail block `tail` after the update (its own token last); a chunk
    in rows `[exact_at, exact_at + exact)` of the forward's copy (`BatchPlan.exact_tail`, `exact_new`), its own
    tokens last."""

    query_at: int
    new: int
    past: int
    pages: list[int]
    tail: int
    sinks: int
    exact: int
    exact_at: int | None  # None: a decode step, read from its tail


class _Moves:
    """Gathers and scatters of one kind: rows `dst` of the destination take rows `src` of the source; for a tail,
    `block` and `slot` address it (source or destination)."""

    def __init__(self):
        self.dst_start, self.src_start, self.block, self.length = [], [], [], []

    def add(self, dst: int, src: int, length: int, block: int = 0) -> None:
        if length > 0:
            self.dst_start.append(dst)
            self.src_start.append(src)
            self.block.append(block)
            self.length.append(length)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dst rows, src rows, blocks), on the host."""
        return (
            _ranges(self.dst_start, self.length),
            _ranges(self.src_start, self.length),
            _repeat(self.block, self.length),
        )


def _to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """1-D long tensors on `device` through one host-to-device copy (views of one buffer): a forward's plan is a
    dozen index tensors, and copied one by one they left the GPU idle ~5 ms of a prompt step (H100 profile)."""
    return list(torch.cat(tensors).to(device).split([len(t) for t in tensors]))


class BatchPlan:
    """The index tensors of one forward (see the module docstring) and the pages each request holds after it; step 2's
    for dense K/V (`dense`), or for attention reading the pages in place (`reads`, and the chunks' exact copy)."""

    def __init__(self, steps: list[RequestStep], sinks: int, page_tokens: int, device: torch.device, dense: bool):
        S, R = sinks, page_tokens
        out_tail, out_deq, out_new = _Moves(), _Moves(), _Moves()
        stage_tail, stage_new, tail_writes = _Moves(), _Moves(), _Moves()
        exact_tail, exact_new = _Moves(), _Moves()
        dequantized, quantized = [], []
        self.quantized_after: list[int] = []
        self.reads: list[RequestReads] = []
        out_at = new_at = stage_at = exact_at = 0
        for step in steps:
            P, T, L = step.past, step.new, step.past + step.new
            sinks_held = min(P, S)
            complete = max(P - S, 0) // R  # pages complete before this update: quantized before it attends
            window = max(P - S, 0) - complete * R
            after = quantized_pages(L, S, R)
            first = step.quantized  # the first page not quantized yet (the flushed window, or a new one)
            # 1. pages [first, after): the window's exact tokens, then new ones
            quantized += step.pages[first:after]
            span = S + first * R  # the first position to quantize
            from_tail = max(min(P, S + after * R) - span, 0)
            stage_tail.add(stage_at, S, from_tail, step.tail)
            from_new = max(S + after * R - max(P, span), 0)
            stage_new.add(stage_at + from_tail, new_at + max(P, span) - P, from_new)
            stage_at += (after - first) * R
            # 2. the dense K/V: sinks, pages complete before the update, window, new tokens
            out_tail.add(out_at, 0, sinks_held, step.tail)
            out_deq.add(out_at + sinks_held, len(dequantized) * R, complete * R)
            dequantized += step.pages[:complete]
            out_tail.add(out_at + sinks_held + complete * R, S, window, step.tail)
            out_new.add(out_at + P, new_at, T)
            # 3. the new tokens that stay exact: sinks, then the newest page's
            tail_writes.add(P, new_at, min(L, S) - P, step.tail)
            start = max(P, S + after * R)
            tail_writes.add(S + (start - S - after * R), new_at + start - P, L - start, step.tail)
            # in-place reads: a decode step's exact tokens after the update, a chunk's copied before it
            history = step.pages[:complete]
            if T == 1:  # a decode step completes no page: `after == complete`
                exact = exact_tokens(L, S, R)
                self.reads.append(RequestReads(new_at, T, P, history, step.tail, min(L, S), exact, None))
            else:
                exact = sinks_held + window + T
                exact_tail.add(exact_at, 0, sinks_held, step.tail)
                exact_tail.add(exact_at + sinks_held, S, window, step.tail)
                exact_new.add(exact_at + sinks_held + window, new_at, T)
                self.reads.append(RequestReads(new_at, T, P, history, step.tail, sinks_held, exact, exact_at))
                exact_at += exact
            self.quantized_after.append(after)
            out_at, new_at = out_at + L, new_at + T

        self.requests = len(steps)
        # 2. as dense K/V for the model's attention, or in place: the chunks' exact tokens, copied before the tails are
        # written
        block_lists = [quantized, dequantized] if dense else [quantized]
        moves = [
            stage_tail,
            stage_new,
            tail_writes,
            *((out_tail, out_deq, out_new) if dense else (exact_tail, exact_new)),
        ]
        host = [torch.tensor(ids, dtype=torch.long) for ids in block_lists]
        host += [tensor for move in moves for tensor in move.tensors()]
        on_device = _to_device(host, device)
        blocks, rest = on_device[: len(block_lists)], on_device[len(block_lists) :]
        self.quantize_blocks = blocks[0]
        self.stage_tail, self.stage_new, self.tail_writes, *reads = (
            tuple(rest[i : i + 3]) for i in range(0, len(rest), 3)
        )
        if dense:
            self.tokens = out_at  # dense K/V rows of the batch
            self.dequantize_blocks = blocks[1]
            self.out_tail, self.out_deq, self.out_new = reads
        else:
            self.exact_tokens = exact_at  # rows of the copy
            self.exact_tail, self.exact_new = reads
