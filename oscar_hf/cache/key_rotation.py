"""method="oscar"'s query rule: each (row, KV head) of a layer chooses whether to rotate its keys from the prompt's
keys and the queries that read them (`reference.query_rotation_choice`).

The choice stays open while the prompt streams in, so that a prompt fed in chunks (chunked prefill, a chat whose first
turn is a short system prompt, scoring in windows) chooses as the same prompt fed in one call:

* the choice reads the prompt's sinks and the `CHOICE_TOKENS` positions after them (the horizon): the keys of the
  latter, and the queries at all of them, which every multi-token update's attention call hands over
  (`OscarLayer.observe_queries`) to the layer's running query moment; the choice is made again from it at each. A
  prompt therefore gets the same flags fed whole or in chunks, given the same keys and queries (up to the summation
  order of the moment). Through a model they differ slightly past the first layer (later chunks attend to the
  quantized history), so a head whose two costs nearly tie may end on the other side;
* while the choice is open, the layer keeps the exact keys of every block it quantized. The blocks of a multi-token
  update that returns dense K/V wait, exact (values too), for that update's queries and are quantized once, with the
  choice; a later choice that flips a head quantizes the held keys again (the values' codes and the token norms do not
  depend on the key rotation, so a flip rewrites the keys' codes, scales and minimums only);
* the choice becomes final, and the copies are dropped, once the layer holds the horizon (nothing later can change it:
  a prefill in chunks of `CHOICE_TOKENS` holds no copy past its first chunk), at a single-token update that follows a
  prompt (a decode step: its query is not the prompt's), at a crop, and when a block was quantized without a copy
  (compiled decode steps flush blocks from the device). A later multi-token call (a new turn) thus revises the choice
  only while the exact copies of every block quantized so far are held; otherwise its queries change nothing. Compiled
  decode reads the flags from a static tensor: a revision writes it in place, and a compiled step never changes it.

Memory beyond the quantized cache, while the choice is open: the exact keys of the quantized tokens inside the horizon,
and the exact values of the blocks waiting for their update's queries.

A layer whose updates' queries never came (a cache filled by hand with `update`, or a model whose attention is not
sdpa) chooses at its next update from the keys alone: an isotropic query moment, so that each head rotates where that
lowers its keys' own round-trip error. It says so once (a warning naming how to get the query rule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from transformers.utils import logging

from ..config import OscarConfig
from ..reference import query_rotation_choice
from .padding import Padding, valid

if TYPE_CHECKING:
    from .storage import KVStorage

logger = logging.get_logger(__name__)

# The prompt positions after the sinks whose keys (and, with the sinks', queries) a choice reads; it is final once a
# layer holds them.
CHOICE_TOKENS = 4096


def choice_horizon(sinks: int) -> int:
    """The prompt positions a choice reads behind `sinks` sink positions: the sinks, then `CHOICE_TOKENS`."""
    return sinks + CHOICE_TOKENS


KEYS_ONLY_MESSAGE = (
    "OscarCache(method='oscar'): no queries reached a layer before it had to choose its key rotation (a cache filled "
    "by hand with `update`, or a model whose attention is not 'sdpa'), so each KV head chose from its keys alone: it "
    "rotates where that lowers the keys' own quantization error. For the query rule, run the prompt through the "
    "model's 'sdpa' attention, or hand each multi-token update's queries over by hand: "
    "`cache.layers[i].observe_queries(query)` (or `observe_query_moment`) after the update."
)


class KeyRotation:
    """Which heads rotate their keys (`flags`, `[B, Hkv]` bool, None until chosen; every quantization reads them) and,
    while the choice is open, what it is made from and what it must redo: the running query moment, and the exact K/V
    of the quantized region's blocks (`blocks`, `(start, keys, values)` in position order, values None once written),
    the last `unwritten` of which wait for the queries of the update that brought them (their rows in the storage are
    not written yet)."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self.active = config.rotation and config.method == "oscar"  # otherwise there is nothing to choose
        self.reset()

    def reset(self) -> None:
        self.flags: torch.Tensor | None = None
        self.moment: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # [B] float: the query positions `moment` sums (padding left out)
        self.blocks: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []
        self.unwritten = 0
        self._deferring = False  # while the layer appends a multi-token update that returns dense K/V (`deferring`)
        self.awaiting_keys: torch.Tensor | None = None  # the keys whose attention call brings the queries awaited
        self.final = not self.active

    @property
    def wants_queries(self) -> bool:
        """Whether the attention call of the layer's latest update still has to hand its queries over."""
        return self.awaiting_keys is not None

    def await_queries(self, keys: torch.Tensor) -> None:
        """The latest update returned `keys`: the queries of the attention call that receives them count."""
        self.awaiting_keys = keys

    def is_for(self, keys: torch.Tensor | None) -> bool:
        """Whether queries read alongside `keys` (None: handed by hand) are the ones this layer waits for (a layer
        reading another's K/V, or a second call with the same keys, adds nothing)."""
        return self.wants_queries and (keys is None or keys is self.awaiting_keys)

    def add(self, moment: torch.Tensor, positions: torch.Tensor) -> None:
        """The awaited queries' second moment (`reference.query_moment`) over `positions` query positions per row
        (`[B]`): add it to the running moment."""
        self.moment = moment if self.moment is None else self.moment + moment.to(self.moment.device)
        positions = positions.to(self.moment.device, torch.float32)
        self.positions = positions if self.positions is None else self.positions + positions
        self.awaiting_keys = None

    @contextlib.contextmanager
    def deferring(self):
        """The blocks quantized inside wait, exact, for the queries of the update that brought them (`hold`)."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def hold(self, start: int, keys: torch.Tensor, values: torch.Tensor, window: torch.Tensor) -> bool:
        """Keep the exact keys of the block quantized at token `start` while the choice is open (a copy when they are
        the `window` buffer, which later updates rewrite), and its values while it is unwritten: True when the block
        must wait for its update's queries (its rows are written by `choose`); otherwise the caller writes it now."""
        values = values if self._deferring else None  # a written block's flip needs its exact keys only
        if keys.data_ptr() == window.data_ptr():
            keys, values = keys.clone(), None if values is None else values.clone()
        self.blocks.append((start, keys, values))
        self.unwritten += self._deferring
        return self._deferring

    def must_choose(self, held: int) -> bool:
        """Whether the layer, holding `held` tokens, must choose before its next update: blocks wait for queries that
        never came, or nothing was chosen yet."""
        return bool(self.unwritten) or (self.flags is None and held > 0)

    def settle(self, tokens: int, held: int, quantized: int) -> None:
        """Before an update of `tokens` tokens to a layer holding `held`, `quantized` of them quantized (after any
        `must_choose` choice): final at a decode step (one token after a prompt) or when blocks were quantized
        without exact copies (compiled steps)."""
        if not self.final and ((tokens == 1 and held) or not self.covers(quantized)):
            self.finalize()

    @staticmethod
    def query_positions(start: int, tokens: int, sinks: int) -> int:
        """Of `tokens` query positions from position `start` of a layer with `sinks` sink slots, how many the choice
        reads: those inside its horizon (`choice_horizon`)."""
        return min(tokens, max(choice_horizon(sinks) - start, 0))

    def covers(self, quantized: int) -> bool:
        """Whether exact copies of all `quantized` tokens of the quantized region are held."""
        return sum(keys.shape[-2] for _, keys, _ in self.blocks) == quantized

    def choose(
        self,
        storage: KVStorage,
        padding: Padding | None,
        round_trip: Callable[..., torch.Tensor],
        head_group=None,
    ) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """Make the choice from the running moment (None: no queries came; an isotropic one, said once) and the first
        `CHOICE_TOKENS` keys held after the sinks of `storage` (the blocks' exact copies, then its window; the sinks
        only while they are all it holds), `padding` left out, each rotation costed by `round_trip` (a backend's
        `fake_quantize_keys`). Returns the blocks to quantize again, `(start, keys, values)` (values None: a block
        written before, whose key fields only change), which the caller writes before anything reads them: those
        waiting for the choice, and those already written if any head's choice flipped (under tensor parallelism,
        `head_group`: any head of any rank, since each quantization all-reduces the token norms, so every rank must
        quantize the same blocks). Final once the storage holds the choice's horizon."""
        held, count = [], 0
        for _, keys, _ in self.blocks:
            if count >= CHOICE_TOKENS:
                break
            held.append(keys)
            count += keys.shape[-2]
        held.append(storage.keys[:, :, : storage.held])
        keys = torch.cat(held, dim=-2)[:, :, :CHOICE_TOKENS]
        first = storage.sinks  # the position of the first key quantized: the sinks never are, nor choose ...
        if not keys.shape[-2]:  # ... unless they are all the layer holds
            keys, first = storage.exact_tokens()[0], 0
        moment = self.moment
        if moment is None:
            logger.warning_once(KEYS_ONLY_MESSAGE)
            batch, heads, _, dim = keys.shape
            moment = torch.eye(dim, device=keys.device).expand(batch, heads, dim, dim)
        flags = query_rotation_choice(
            keys, moment.to(keys.device), self.config, valid(padding, first, keys), round_trip
        )
        if self.flags is None:  # a first choice rewrites nothing: no sync
            flipped = False
            self.flags = flags
            # compiled decode reads the flags: a fixed address, as its buffers (in eager code the mark does nothing)
            torch._dynamo.mark_static_address(flags)
        else:
            flipped = _any_flipped(flags, self.flags, head_group)
            self.flags.copy_(flags)  # compiled decode may hold its address
        redo = self.blocks if flipped else self.blocks[len(self.blocks) - self.unwritten :]
        self.blocks = [(start, keys, None) for start, keys, _ in self.blocks]  # a flip needs the exact keys only
        self.unwritten = 0
        if storage.total >= choice_horizon(storage.sinks):
            self.finalize()
        return redo

    def finalize(self) -> None:
        """Keep the flags from now on; the exact copies are no longer needed."""
        assert not self.unwritten, "blocks still wait for the choice"
        self.blocks, self.awaiting_keys, self.final = [], None, True

    def apply(self, fn) -> None:
        """Follow a batch-axis (or device) transform of the cache."""
        if self.flags is not None:
            self.flags = fn(self.flags)
        if self.moment is not None:
            self.moment, self.positions = fn(self.moment), fn(self.positions)
        self.blocks = [(start, fn(k), None if v is None else fn(v)) for start, k, v in self.blocks]

    @staticmethod
    def unsettled_message() -> str:
        return (
            "OscarCache(method='oscar'): a compiled decode step reached a layer whose key rotation is not chosen yet "
            "(the queries of its last multi-token update never reached it), and a compiled step cannot choose it. Run "
            "the prompt through the model's 'sdpa' attention, or hand its queries over by hand "
            "(`layer.observe_queries(query)` after the update), or run the first decode step eagerly."
        )


def real_positions(
    padding: Padding | None, start: int, tokens: int, batch: int, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The padding mask `[B, tokens]` of positions `start..` (None: no padding) and each row's count of real ones,
    `[B]` float32 (exact: a count in the queries' bf16 would round above 256)."""
    mask = None if padding is None else padding.columns(start, tokens, batch, device)
    count = torch.full((batch,), float(tokens), device=device) if mask is None else mask.sum(-1, dtype=torch.float32)
    return mask, count


def _any_flipped(flags: torch.Tensor, previous: torch.Tensor, head_group) -> bool:
    """Whether any head's choice changed, on any rank of `head_group` (`KeyRotation.choose` says why); reading it
    synchronises the host."""
    flipped = (flags != previous).any().int()
    if head_group is not None:
        torch.distributed.all_reduce(flipped, op=torch.distributed.ReduceOp.MAX, group=head_group)
    return bool(flipped)
