"""bits="auto", executable spec: what each key and value width costs a layer's attention, from sums over its prompt
(additive over chunks), and the greedy that spends an average-bits budget on the layers where 4 bits pay most
(`cache/layer_bits.py` collects the sums and converts the layers). Plain PyTorch, as `reference.py`, on which it
builds: the key error is the query rule's (`reference.key_error_sums`, `reference.query_weighted_key_error`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .config import OscarConfig
from .reference import error_sums, fake_quantize_kv, query_weighted_key_error, whole_key_groups


class BitCostSums(NamedTuple):
    """bits="auto": the sums over a prompt's tokens (additive over its chunks, `add_bit_cost_sums`) from which
    `layer_bit_costs` costs each width of a layer. W = len(config.chooser_widths), R the key rotations costed."""

    key_gram: torch.Tensor  # [W, R, B, Hkv, D, D]: sum_t e_t e_t^T of the key round trip's error
    key_total: torch.Tensor  # [W, R, B, Hkv, D]: sum_t e_t
    value_error: torch.Tensor  # [W, B, Hkv]: sum_t |e_t|^2 of the value round trip's error
    value_square: torch.Tensor  # [B, Hkv]: sum_t |v_t|^2
    value_total: torch.Tensor  # [B, Hkv, D]: sum_t v_t
    tokens: torch.Tensor  # [B, 1, 1]: valid tokens summed


def bit_cost_sums(
    keys: torch.Tensor,
    values: torch.Tensor,
    config: OscarConfig,
    rotations: tuple[bool, ...],
    valid: torch.Tensor | None = None,
    round_trip: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> BitCostSums:
    """`BitCostSums` of these post-RoPE keys and values `[B, Hkv, N, D]` (any N) at every width the config chooses
    among (`chooser_widths`), keys with and without rotation as `rotations` lists (method="oscar": both; the paper's:
    (True,); no rotation: (False,)), in `config`'s groups, token scaling and scale dtype. `valid` (`[B, N]` bool):
    padding counts nowhere. `round_trip`: `reference.fake_quantize_kv` (None) or an implementation of it (a backend's
    `fake_quantize_kv`), called once per width on the K/V repeated along the batch axis, once per rotation."""
    v, _ = whole_key_groups(values, valid, config.group_size)
    k, valid = whole_key_groups(keys, valid, config.group_size)
    rows, heads = k.shape[:2]
    repeat = len(rotations)
    flags = torch.cat([torch.full((rows, heads), rotated, dtype=torch.bool, device=k.device) for rotated in rotations])
    k_all, v_all = k.repeat(repeat, 1, 1, 1), v.repeat(repeat, 1, 1, 1)
    valid_all = None if valid is None else valid.repeat(repeat, 1)
    key_gram, key_total, value_error = [], [], []
    for bits in config.chooser_widths:
        k_hat, v_hat = (round_trip or fake_quantize_kv)(k_all, v_all, flags, config.with_widths(bits, bits), valid_all)
        gram, total, tokens = error_sums(k_hat - k_all, valid_all)
        key_gram.append(gram.unflatten(0, (repeat, rows)))
        key_total.append(total.unflatten(0, (repeat, rows)))
        error = v_hat[:rows] - v  # the values' round trip does not depend on the keys' rotation: the first one's
        if valid is not None:
            error = error.masked_fill(~valid[:, None, :, None], 0)
        value_error.append(error.square().sum((-2, -1)))
    return BitCostSums(
        torch.stack(key_gram), torch.stack(key_total), torch.stack(value_error), v.square().sum((-2, -1)), v.sum(-2),
        tokens[:rows],
    )  # fmt: skip


def add_bit_cost_sums(a: BitCostSums | None, b: BitCostSums) -> BitCostSums:
    """The sums of two chunks of one prompt (`a` None: `b`)."""
    return b if a is None else BitCostSums(*(x + y.to(x.device) for x, y in zip(a, b)))


def layer_bit_costs(
    sums: BitCostSums, moment: torch.Tensor, rotations: tuple[bool, ...], scaling: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bits="auto": what each key width and each value width of the config's `auto_widths` costs a layer's attention,
    `(key_costs [W], value_costs [W], key_rotated [W, B, Hkv] bool)`, from its prompt's `bit_cost_sums` and `moment`
    (`[B, Hkv, D, D]`: the mean of q q^T over the query rows that read a KV head, i.e. its group's query heads at each
    query position; the identity where the queries are unknown; `rotations` as given to `bit_cost_sums`; `scaling`
    the attention's logit scale, e.g. head_dim ** -0.5).

    The cost is the first-order error of the attention output o = sum_t a_t v_t, per query row, summed over KV heads
    and batch rows. A logit error d_t moves it by sum_t a_t (d_t - mean d) (v_t - o), a value error e_t by
    sum_t a_t e_t; for errors independent across tokens both are sum_t a_t^2 times a mean over the tokens:
    keys: scaling^2 tr(E_c^T E_c M) / N (the query rule's query-weighted error, `query_weighted_key_error`, per key)
    times the values' spread mean_t |v_t - mean v|^2; values: mean_t |e_t|^2. The common factor sum_t a_t^2 is
    unknown without the attention weights and left out, so keys and values of one layer are weighed exactly against
    each other, and layers against each other as if their attention were equally spread. Each head's keys take the
    rotation that costs least at each width (the query rule at the width stored): `key_rotated`."""
    tokens = sums.tokens.clamp_min(1)  # [B, 1, 1]
    logit_error = query_weighted_key_error(sums.key_gram, sums.key_total, sums.tokens, moment.to(sums.key_gram.dtype))
    spread = (sums.value_square - sums.value_total.square().sum(-1) / tokens[..., 0]) / tokens[..., 0]
    key_costs = scaling**2 * logit_error / tokens[..., 0] * spread.clamp_min(0)  # [W, R, B, Hkv]
    best, index = key_costs.min(dim=1)
    key_rotated = index == rotations.index(True) if True in rotations else torch.zeros_like(index, dtype=torch.bool)
    value_costs = sums.value_error / tokens[..., 0]
    return best.sum((-2, -1)), value_costs.sum((-2, -1)), key_rotated


def choose_layer_bits(
    key_costs: torch.Tensor,
    value_costs: torch.Tensor,
    bits: torch.Tensor,
    weights: torch.Tensor,
    avg_bits: float,
    widths: tuple[int, ...],
) -> list[tuple[int, int]]:
    """bits="auto"'s greedy rule: each layer's `(key_bits, value_bits)`, from `widths` (the config's `auto_widths`).

    `key_costs`, `value_costs` (`[L, W]`, `layer_bit_costs`): what each width costs each layer; `bits` (`[L, W, W]`):
    the stored bits per K/V element of layer l at key width i and value width j (`oscar_hf.average_bits`); `weights`
    (`[L]`): the K/V elements per token of each layer (KV heads x head_dim). Every layer starts at the widest fixed
    config within the budget of the widths' chain (keys first: `uniform_start`); then, of the
    upgrades that keep the weighted average of `bits` within `avg_bits` (one layer's keys or values to the next width),
    the one that lowers the cost most per added bit is taken, until none fits or none lowers the cost."""
    layers = key_costs.shape[0]
    costs = key_costs.double().cpu()[:, :, None] + value_costs.double().cpu()[:, None, :]  # [L, key width, value width]
    bits, weights = bits.double().cpu(), weights.double().cpu()
    limit = avg_bits * float(weights.sum()) * (1 + 1e-12)  # rounding must not refuse a budget met exactly
    start = uniform_start(bits, weights, limit)
    spent = float((weights * bits[:, start[0], start[1]]).sum())
    costs, bits, weights = costs.tolist(), bits.tolist(), weights.tolist()  # Python floats: no op per comparison
    chosen = [list(start) for _ in range(layers)]
    while True:
        best = None
        for layer, (k, v) in enumerate(chosen):
            for nk, nv in ((k + 1, v), (k, v + 1)):
                if nk >= len(widths) or nv >= len(widths):
                    continue
                added = weights[layer] * (bits[layer][nk][nv] - bits[layer][k][v])
                gain = costs[layer][k][v] - costs[layer][nk][nv]
                if gain <= 0 or spent + added > limit:
                    continue
                if best is None or gain / added > best[0]:
                    best = (gain / added, layer, nk, nv, added)
        if best is None:
            return [(widths[k], widths[v]) for k, v in chosen]
        _, layer, nk, nv, added = best
        chosen[layer] = [nk, nv]
        spent += added


def uniform_start(bits: torch.Tensor, weights: torch.Tensor, limit: float) -> tuple[int, int]:
    """Where `choose_layer_bits` starts every layer: the (key, value) width indices of the widest config of the chain
    of the widths (each step one width up, keys one step ahead of values: keys the sensitive half; with widths 2, 3
    and 4 K2V2, K3V2, K3V3, K4V3, K4V4: no K4V2, which costs K3V3's bits and scored no better, docs/accuracy.md;
    with the default 2 and 4, K2V2, K4V2, K4V4) whose weighted bits
    (`bits` `[L, W, W]` times `weights` `[L]`) stay within `limit` (K2V2 if none does; the budget's check refuses
    that). The greedy's upgrades, priced by a per-layer model of the attention error, only add bits to this, so the
    choice never stores less than the best fixed config it could afford: that model does not see what a layer's error
    costs the model's output, and its mixes lost to the fixed config at the same bits (docs/accuracy.md)."""
    widths = bits.shape[1]
    chain = [((step + 1) // 2, step // 2) for step in range(2 * widths - 1)]
    fits = [(k, v) for k, v in chain if float((weights * bits[:, k, v]).sum()) <= limit]
    return fits[-1] if fits else chain[0]
