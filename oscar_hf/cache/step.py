"""A step an `OscarLayer` attends in place: the new tokens its `update` stored and returned, the keys carrying the
step (`STEP`), which stands for the layer's whole history in the sdpa calls that receive them until its next update.
The sdpa entry (`integrations/fused_attention.py`) reads it off the keys and answers it with the step's history
(`history.DecodeHistory`, `history.ChunkHistory`); that module's docstring says how the step travels, and why as a
tensor attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..kernels import DECODE_MAX_QUERY_ROWS

if TYPE_CHECKING:
    from .compiled import CompiledStep
    from .history import ChunkHistory, DecodeHistory
    from .layer import OscarLayer

STEP = "oscar_fused_step"  # the attribute of a fused step's keys, and the attention kwarg that hands it over
AWAITS_QUERIES = "oscar_awaits_queries"  # the attribute of the prefill keys of a layer that waits for its queries
FIX = "Use OscarConfig(attention='portable') for this model."
UNATTENDED_STEP = (
    "OscarCache: the previous decode step's attention did not run through the fused sdpa path (the model uses its "
    f"own attention function, or an attention call raised), so it would have attended to the new tokens only. {FIX}"
)


@dataclass(eq=False)
class FusedStep:
    """A decode step or a prefill chunk an `OscarLayer` stored in `update`: the K/V it returned (the new tokens only,
    the keys carrying this step) stand for the layer's whole history in the sdpa calls that receive them, until its
    next update."""

    layer: OscarLayer  # whose storage the step's K/V stand for; it holds the step as `fused_step` until attended
    values: torch.Tensor
    keys_shape: torch.Size
    history: DecodeHistory | ChunkHistory | CompiledStep  # what it attends to
    attended: bool = False

    @classmethod
    def start(
        cls, layer, keys: torch.Tensor, values: torch.Tensor, history: DecodeHistory | ChunkHistory | CompiledStep
    ) -> None:
        """Make the step of `layer` that returns `keys`/`values` its `fused_step`, carried by `keys`."""
        step = cls(layer, values, keys.shape, history)
        setattr(keys, STEP, step)
        layer.fused_step = step

    @property
    def chunk(self) -> ChunkHistory | None:
        """What a prefill chunk arriving with history attends to; None for a decode step."""
        return None if self.history.decode else self.history

    @property
    def unattended(self) -> bool:
        """Whether no attention call used this step yet while it is still its layer's (a reset layer drops it)."""
        return not self.attended and self.layer.fused_step is self

    def check(self, query: torch.Tensor, value: torch.Tensor) -> None:
        """Raise unless the fused kernel answers this call correctly (see the module docstring)."""
        if value is not self.values:
            raise RuntimeError(
                "OscarCache: an attention call received the keys of a fused decode step with other values (the model "
                f"changed the values after the cache update); the fused kernel reads the stored values. {FIX}"
            )
        batch, kv_heads, tokens, head_dim = self.keys_shape
        q_batch, q_heads, q_tokens, q_dim = query.shape
        if (
            (q_batch, q_tokens, q_dim) != (batch, tokens, head_dim)
            or q_heads % kv_heads
            or (self.chunk is None and q_heads // kv_heads * q_tokens > DECODE_MAX_QUERY_ROWS)
        ):
            kind = "decode step" if self.chunk is None else "prefill chunk"
            raise RuntimeError(
                f"OscarCache: an attention call with query {tuple(query.shape)} does not match the fused {kind} it "
                f"uses (keys {tuple(self.keys_shape)}: same batch, tokens and head_dim, query heads a multiple of the "
                f"KV heads, at most {DECODE_MAX_QUERY_ROWS} query rows per KV head for a decode step). {FIX}"
            )

    def dense_history(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the step attends to as dense K/V (for attention features the fused kernels lack)."""
        return self.history.dense()

    def dense_mask(self, attention_mask: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor | None:
        """The mask of `dense_history` (a chunk's mask may cover its own tokens only: `ChunkHistory.dense_mask`)."""
        return self.history.dense_mask(attention_mask, query.shape[-2])

    def attention(self, query: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """The step's attention by the fused kernels, `[B, Hq, Tq, D]`."""
        return self.history.attention(query, attention_mask, scaling)


def step_of(keys: torch.Tensor) -> FusedStep | None:
    """The fused step that `keys` stand for, or None."""
    return getattr(keys, STEP, None)


def await_queries(layer, keys: torch.Tensor) -> None:
    """Called by `OscarLayer.update` on a prefill of method="oscar": the attention call that receives `keys` hands
    its queries to `layer`."""
    setattr(keys, AWAITS_QUERIES, layer)


def hand_over(keys: torch.Tensor, attention_kwargs: dict | None) -> None:
    """Called by `OscarCache.update`: where transformers gave `update` the kwargs of the attention call that follows
    (5.24 on), put the step that `keys` carry there, so that the call is checked against it."""
    step = step_of(keys)
    if step is not None and isinstance(attention_kwargs, dict):
        attention_kwargs[STEP] = step
