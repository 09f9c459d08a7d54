"""method="oscar"'s query rule: each (row, KV head) of a layer chooses its key rotation from the queries that read
the prompt, at the end of the prefill, and keeps it from then on."""

from __future__ import annotations

import torch

from ..config import OscarConfig
from ..reference import query_rotation_choice

# The prompt keys a choice reads at most (the provisional blocks, then the residual window).
CHOICE_TOKENS = 4096


class KeyRotation:
    """Which heads rotate their keys (`flags`, `[B, Hkv]` bool, None until chosen: every quantization reads them)
    and, during the prefill (a layer's first update), what waits for the choice: the blocks quantized before the
    prefill's queries came (its attention runs after `update`), exact, to quantize again with the choice; and the
    keys the update returned, which identify the attention call that brings those queries."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self.flags: torch.Tensor | None = None
        self.provisional: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.awaiting_keys: torch.Tensor | None = None

    @property
    def wants_queries(self) -> bool:
        """Whether the layer still waits for the prefill's queries (method="oscar" with rotation, not yet chosen)."""
        return self.config.rotation and self.config.method == "oscar" and self.flags is None

    def start_prefill(self, keys: torch.Tensor) -> None:
        """The prefill's update returns `keys`: its blocks are provisional until the queries reading them arrive."""
        self.provisional, self.awaiting_keys = [], keys

    def flags_for(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        """The flags to quantize this block with: a prefill block before its queries came is kept (exact) to be
        quantized again at the choice, and unrotated for now."""
        if not self.wants_queries:
            return self.flags
        self.provisional.append((keys, values))
        return torch.zeros(keys.shape[:2], dtype=torch.bool, device=keys.device)

    def is_for(self, keys: torch.Tensor | None) -> bool:
        """Whether queries read alongside `keys` (None: handed by hand) are the ones this layer waits for."""
        return self.wants_queries and (keys is None or keys is self.awaiting_keys)

    def choose(self, moment: torch.Tensor, storage, valid_of, quantize) -> None:
        """Each (row, KV head) decides from the prompt's keys the layer holds (its first `CHOICE_TOKENS`: the
        provisional blocks, then the residual window of `storage`, whole key groups or not) and the second moment of
        the prompt's queries (`query_rotation_choice`); `valid_of(keys)` is their padding mask (None: none). A row
        whose prompt is all padding has nothing to decide from: it keeps its keys unrotated. The provisional blocks
        are then quantized again (`quantize(keys, values)`), with the choice, in place in `storage`."""
        held = [keys for keys, _ in self.provisional or ()]
        held.append(storage.window_keys())
        keys = torch.cat(held, dim=-2)[:, :, :CHOICE_TOKENS]
        self.flags = query_rotation_choice(keys, moment.to(keys.device), self.config, valid_of(keys))
        blocks, self.provisional, self.awaiting_keys = self.provisional, None, None
        if blocks:
            end, storage.length = storage.length, 0
            for keys, values in blocks:
                storage.store(quantize(keys, values))
            assert storage.length == end

    def apply(self, fn) -> None:
        """Follow a batch-axis (or device) transform of the cache."""
        if self.flags is not None:
            self.flags = fn(self.flags)

    def reset(self) -> None:
        self.flags = self.provisional = self.awaiting_keys = None

    @staticmethod
    def no_queries_message() -> str:
        return (
            "OscarCache(method='oscar') chooses each KV head's key rotation from the queries that read the prompt, "
            "but none reached this layer: its attention must run through transformers' 'sdpa' attention "
            "(attn_implementation='sdpa') on the keys the cache returned, and the prefill must run eagerly. A cache "
            "filled by hand (update without the model's attention) needs `layer.observe_queries(query)` after its "
            "first update. Or use method='paper' (or the default method='auto', which picks it for such models)."
        )
