"""bits="auto": each full-attention layer's key and value widths, chosen from the prompt under an average-bits budget
(`OscarConfig.avg_bits`), with no calibration data.

While the choice is open, every layer stores its blocks at the widest widths (4-bit keys and values: the prefill's
peak is the 4-bit cache) and sums, over the first `CHOICE_TOKENS` tokens of each sequence, what each width would cost
its attention (`reference.bit_cost_sums`: the key round trip's error Gram matrices at each width, with and without the
key rotation where method="oscar" chooses it, and the value round trip's errors). The queries come from the query rule
(`KeyRotation`'s running moment; a layer that never saw them costs its keys against isotropic queries, with a warning).

The choice is made once, for every layer together, at the end of the prompt (`OscarCache.choose_bits`): `generate`
calls it after its prefill, before the first decode step, compiled or not; by hand the first single-token update that
follows a prompt (a decode step) makes it, before that step is stored; a compiled step refuses an open choice
(`compiled.refuse_step`). `reference.layer_bit_costs` prices each width (with each head's key rotation the cheaper at
that width: method="oscar"'s choice is made again at the width stored), `reference.choose_layer_bits` spends the
budget greedily, and each layer stores its quantized region again at its widths (`OscarLayer.convert_widths`: the 4-bit
blocks dequantized and quantized again; the 4-bit round trip adds little next to a 2-bit one: tests/test_layer_bits.py
measures it). From then on the layer's storage layout, codec, kernel config and compiled buffers are those widths.

Memory beyond the 4-bit cache while the choice is open: per layer, 2 (widths) x 2 (rotations, method="oscar") float32
D x D matrices per row and KV head (2 MiB per layer at 8 KV heads, head_dim 128, batch 1).
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..config import OscarConfig
from ..reference import LAYER_WIDTHS, BitCostSums, add_bit_cost_sums, bit_cost_sums, layer_bit_costs
from .key_rotation import CHOICE_TOKENS
from .padding import valid

logger = logging.get_logger(__name__)

KEYS_ONLY_MESSAGE = (
    "OscarCache(bits='auto'): no queries reached a layer before its widths were chosen (method='paper', a model "
    "whose attention is not 'sdpa', or a cache filled by hand with `update`), so its key widths were costed against "
    "isotropic queries. For the query-weighted cost, run the prompt through the model's 'sdpa' attention with "
    "method='oscar' (the default there), or hand the queries over: `cache.layers[i].observe_queries(query)`."
)

_BATCH_DIMS = BitCostSums(2, 2, 1, 0, 0, 0)  # where each of the sums has its batch axis


class LayerBits:
    """One layer's side of bits="auto": the cost sums of the prompt's first `CHOICE_TOKENS` tokens (`observe`), until
    `OscarCache.choose_bits` reads them (`costs`)."""

    widest = (LAYER_WIDTHS[-1], LAYER_WIDTHS[-1])  # what a layer stores while the choice is open

    def __init__(self, config: OscarConfig):
        self.config = config
        # the key rotations each width is costed with: both where the query rule chooses, else the one stored
        self.rotations = (True, False) if config.rotation and config.method == "oscar" else (config.rotation,)
        self.reset()

    def reset(self) -> None:
        self.open = True  # until `OscarCache.choose_bits` chose the layer's widths
        self.sums: BitCostSums | None = None
        self.positions = 0  # prompt positions summed (the first CHOICE_TOKENS)

    def close(self) -> None:
        """The widths are chosen: the sums are no longer needed."""
        self.open, self.sums = False, None

    def observe(self, layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add the costs of an update's new tokens (before `layer` stores them; padding left out)."""
        take = min(CHOICE_TOKENS - self.positions, key_states.shape[-2])
        if take <= 0:
            return
        keys, values = key_states[:, :, :take], value_states[:, :, :take]
        mask = valid(layer._padding, layer.get_seq_length(), keys)
        self.sums = add_bit_cost_sums(self.sums, bit_cost_sums(keys, values, self.config, self.rotations, mask))
        self.positions += take

    def apply(self, fn) -> None:
        """Follow a batch-axis (or device) transform of the cache (the sums' batch axis: `_BATCH_DIMS`)."""
        if self.sums is not None:
            self.sums = BitCostSums(*(fn(t.movedim(d, 0)).movedim(0, d) for t, d in zip(self.sums, _BATCH_DIMS)))

    def costs(self, layer, query_group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`reference.layer_bit_costs` of `layer` (its queries: `KeyRotation`'s moment over its query rows,
        `query_group` query heads per KV head; isotropic where none came)."""
        rotation, sums = layer.rotation, self.sums
        batch, heads, dim = sums.key_total.shape[2:]
        if rotation.moment is not None:
            rows = rotation.positions.clamp_min(1) * query_group
            moment = rotation.moment / rows[:, None, None, None].to(rotation.moment.device)
        else:
            logger.warning_once(KEYS_ONLY_MESSAGE)
            moment = torch.eye(dim, device=sums.key_gram.device).expand(batch, heads, dim, dim)
        return layer_bit_costs(sums, moment.to(sums.key_gram.device), self.rotations, dim**-0.5)
