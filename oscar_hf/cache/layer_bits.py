"""bits="auto": each full-attention layer's key and value widths, chosen from the prompt under an average-bits budget
(`OscarConfig.avg_bits`), with no calibration data.

While the choice is open, every layer stores its blocks at the widest widths (4-bit keys and values, growing with the
prompt: a maximum length given to `reserve` is allocated only once the widths are chosen) and sums, over the first
`CHOICE_TOKENS` tokens of each sequence, what each width would cost its attention (`layer_widths.bit_cost_sums`: the key
round trip's error Gram matrices at each width, with and without the key rotation where method="oscar" chooses it, and
the value round trip's errors; on the fused path the round trips are the Triton quantizer's and dequantizer's). The
queries come from the query rule (`KeyRotation`'s running moment; a layer that never saw them costs its keys against
isotropic queries, with a warning).

The choice is made once, for every layer together, at the end of the prompt (`OscarCache.choose_bits`): `generate`
calls it after its prefill, before the first decode step, compiled or not; by hand the first single-token update that
follows a prompt (a decode step) makes it, before that step is stored; and any update that finds the first
`CHOICE_TOKENS` tokens held (the cost sums are complete), so that a long prompt fed in chunks, or a stream scored
chunk by chunk, is not stored at 4 bits beyond them. A compiled step refuses an open choice
(`OscarLayer.update`). `layer_widths.layer_bit_costs` prices each width (with each head's key rotation the cheaper at
that width: method="oscar"'s choice is made again at the width stored), `layer_widths.choose_layer_bits` starts every
layer at the widest fixed config the budget affords (with the default `auto_widths` (2, 4): K2V2, K4V2, K4V4; with
(2, 3, 4): K2V2, K3V2, K3V3, K4V3, K4V4) and spends the rest greedily, and
each layer stores its quantized region again at its widths (`OscarLayer.set_widths`: the 4-bit blocks dequantized and
quantized again, the keys from the query rule's exact copies while it holds them, prompts up to its horizon; the 4-bit
round trip adds little next to a 2-bit one: tests/test_layer_bits.py measures it). From then on the layer's storage
layout, codec, kernel config and compiled buffers are those widths.

Memory beyond the 4-bit cache while the choice is open: per layer, W (`auto_widths`) x 2 (rotations, method="oscar")
float32 D x D matrices per row and KV head (1 MiB per width and layer at 8 KV heads, head_dim 128, batch 1); during
the conversion, one slice of float32 K/V (`CONVERT_SLICE_BYTES`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.utils import logging

from ..config import OscarConfig
from ..layer_widths import (
    BitCostSums,
    add_bit_cost_sums,
    bit_cost_sums,
    choose_layer_bits,
    layer_bit_costs,
)
from .key_rotation import CHOICE_TOKENS
from .memory import average_bits

logger = logging.get_logger(__name__)

KEYS_ONLY_MESSAGE = (
    "OscarCache(bits='auto'): no queries reached a layer before its widths were chosen (method='paper', a model "
    "whose attention is not 'sdpa', or a cache filled by hand with `update`), so its key widths were costed against "
    "isotropic queries. For the query-weighted cost, run the prompt through the model's 'sdpa' attention with "
    "method='oscar' (the default there), or hand the queries over: `cache.layers[i].observe_queries(query)`."
)

_BATCH_DIMS = BitCostSums(2, 2, 1, 0, 0, 0)  # where each of the sums has its batch axis

# `OscarLayer.set_widths` dequantizes a layer's blocks in slices of at most this many bytes of float32 K/V: a 32K-token
# prompt of 8 KV heads at head_dim 128 and batch 1 in one slice. The choice runs after the prefill, whose transients
# are as large (one layer's K/V of the whole prompt, its MLP's activations), and each slice costs two launches and
# their Python: few large slices.
CONVERT_SLICE_BYTES = 256 << 20


class LayerBits:
    """One layer's side of bits="auto": the cost sums of the prompt's first `CHOICE_TOKENS` tokens (`observe`), until
    `OscarCache.choose_bits` reads them (`costs`)."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self.widest = (config.chooser_widths[-1],) * 2  # what a layer stores while the choice is open
        # the key rotations each width is costed with: both where the query rule chooses, else the one stored
        self.rotations = (True, False) if config.rotation and config.method == "oscar" else (config.rotation,)
        self.reset()

    def reset(self) -> None:
        self.open = True  # until `OscarCache.choose_bits` chose the layer's widths
        self.sums: BitCostSums | None = None
        self.positions = 0  # prompt positions summed (the first CHOICE_TOKENS)

    def stored_config(self, config: OscarConfig) -> OscarConfig:
        """What a layer stores while the choice is open: `config` at the widest widths."""
        return config.with_widths(*self.widest)

    def close(self) -> None:
        """The widths are chosen: the sums are no longer needed."""
        self.open, self.sums = False, None

    def observe(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        valid: torch.Tensor | None,
        round_trip: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Add the costs of an update's new tokens (before the layer stores them; `valid` `[B, N]`: False at padding),
        each width's round trip by `round_trip` (a backend's `fake_quantize_kv`)."""
        take = min(CHOICE_TOKENS - self.positions, key_states.shape[-2])
        if take <= 0:
            return
        keys, values = key_states[:, :, :take], value_states[:, :, :take]
        valid = None if valid is None else valid[:, :take]
        sums = bit_cost_sums(keys, values, self.config, self.rotations, valid, round_trip)
        self.sums = add_bit_cost_sums(self.sums, sums)
        self.positions += take

    def apply(self, fn) -> None:
        """Follow a batch-axis (or device) transform of the cache (the sums' batch axis: `_BATCH_DIMS`)."""
        if self.sums is not None:
            self.sums = BitCostSums(*(fn(t.movedim(d, 0)).movedim(0, d) for t, d in zip(self.sums, _BATCH_DIMS)))

    def costs(
        self, moment: torch.Tensor | None, positions: torch.Tensor | None, query_group: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`layer_widths.layer_bit_costs` of the layer's sums, its queries the query rule's running `moment` over
        `positions` query positions per row (`KeyRotation`), `query_group` query heads per KV head; isotropic where
        none came (None)."""
        sums = self.sums
        batch, heads, dim = sums.key_total.shape[2:]
        if moment is not None:
            rows = positions.clamp_min(1) * query_group
            moment = moment / rows[:, None, None, None].to(moment.device)
        else:
            logger.warning_once(KEYS_ONLY_MESSAGE)
            moment = torch.eye(dim, device=sums.key_gram.device).expand(batch, heads, dim, dim)
        return layer_bit_costs(sums, moment.to(sums.key_gram.device), self.rotations, dim**-0.5)


def bits_table(config: OscarConfig, shapes: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """For layers of `shapes` (KV heads, head_dim), the stored bits per K/V element at each key and value width of
    `config.chooser_widths` (`[L, W, W]`, `average_bits`) and each layer's K/V elements per token (`[L]`)."""
    widths = config.chooser_widths
    bits = [
        [[average_bits(config.with_widths(k, v), dim, heads) for v in widths] for k in widths] for heads, dim in shapes
    ]
    weights = [heads * dim for heads, dim in shapes]
    return torch.tensor(bits, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64)


def check_budget(config: OscarConfig, shapes: list[tuple[int, int]]) -> tuple[float, torch.Tensor, torch.Tensor]:
    """The budget for layers of `shapes` (`OscarConfig.budget`), with their `bits_table`: a given budget below their
    all-2-bit cost is refused; one above their all-4-bit cost is said."""
    bits, weights = bits_table(config, shapes)
    low, high = ((weights * bits[:, i, i]).sum().item() / weights.sum().item() for i in (0, -1))
    budget = config.budget(low)
    if budget < low - 1e-9:
        raise ValueError(
            f"OscarConfig(bits='auto', avg_bits={budget}): this model's layers store at least {low:.4g} bits per "
            f"K/V element (2-bit keys and values everywhere, all stored bits counted: oscar_hf.average_bits); pass "
            f"avg_bits >= {low:.4g} (up to {high:.4g}, every layer 4-bit), or bits=2."
        )
    if budget > high + 1e-9:
        logger.warning_once(
            f"OscarConfig(bits='auto', avg_bits={budget}): the budget exceeds this model's all-4-bit cost "
            f"({high:.4g} bits per K/V element), so every layer stores 4-bit keys and values, as with bits=4."
        )
    return budget, bits, weights


def choose_widths(layers: dict, config: OscarConfig, query_group: int) -> bool:
    """`OscarCache.choose_bits` over its OScaR `layers` (by index): cost each layer's widths, spend the budget
    (`choose_layer_bits`), convert every layer (`OscarLayer.set_widths`) and say which got which. False (nothing done)
    while a layer holds no prompt yet. Under tensor parallelism every rank chooses from the costs of all heads
    (all-reduced)."""
    if not all(layer.is_initialized and layer.bits.sums is not None for layer in layers.values()):
        return False
    costs = [layer.bit_costs(query_group) for layer in layers.values()]
    first = next(iter(layers.values()))
    totals = torch.stack([torch.stack((key, value)).to(first.device) for key, value, _ in costs])  # [L, 2, W]
    for group in {layer.head_group for layer in layers.values()} - {None}:
        torch.distributed.all_reduce(totals, group=group)
    totals = totals.cpu()  # the costs' one trip to the host
    shapes = [layer.kv_shape for layer in layers.values()]
    budget, bits, weights = check_budget(config, shapes)
    chosen = choose_layer_bits(totals[:, 0], totals[:, 1], bits, weights, budget, config.chooser_widths)
    names = {}
    for (index, layer), (key_bits, value_bits), (_, _, rotated) in zip(layers.items(), chosen, costs):
        flags = rotated[config.chooser_widths.index(key_bits)] if layer.rotation.active else None
        layer.set_widths(key_bits, value_bits, flags)
        names.setdefault(f"K{key_bits}V{value_bits}", []).append(index)
    stored = [average_bits(layer.config, dim, heads) for layer, (heads, dim) in zip(layers.values(), shapes)]
    mean = sum(w * b for w, b in zip(weights.tolist(), stored)) / weights.sum().item()
    widths = "; ".join(f"{name} for layers {indices}" for name, indices in sorted(names.items()))
    logger.info(f"OscarCache(bits='auto', avg_bits={budget:g}): {widths}; {mean:.3f} stored bits per K/V "
                "element on average.")  # fmt: skip
    return True
