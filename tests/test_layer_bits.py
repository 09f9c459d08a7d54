"""bits="auto": layer-wise key/value widths chosen from the prompt under an average-bits budget (cache/layer_bits.py):
the costs and the greedy of the reference, the config, the conversion of each layer's storage, and generate."""

import dataclasses
import logging

import pytest
import torch
from devices import slow_on_cpu
from oscar_hf.kernels import dequantize_kv_triton, quantize_kv_triton

from oscar_hf import OscarCache, OscarConfig, average_bits, cache_kwargs
from oscar_hf.cache import layer_bits
from oscar_hf.cache.key_rotation import CHOICE_TOKENS
from oscar_hf.config import DEFAULT_AUTO_WIDTHS, DEFAULT_AVG_BITS, SUPPORTED_WIDTHS
from oscar_hf.layer_widths import (
    add_bit_cost_sums,
    bit_cost_sums,
    choose_layer_bits,
    layer_bit_costs,
    uniform_start,
)
from oscar_hf.reference import (
    dequantize_kv,
    fake_quantize_keys,
    key_error_sums,
    quantize_kv,
    query_moment,
    query_weighted_key_error,
)

GREEDY = dict(do_sample=False, pad_token_id=0)


def _bits_table(layers: int, head_dim: int = 128, kv_heads: int = 8) -> torch.Tensor:
    config = OscarConfig(bits=2, sink_tokens=0)
    row = [
        [average_bits(config.with_widths(k, v), head_dim, kv_heads) for v in SUPPORTED_WIDTHS] for k in SUPPORTED_WIDTHS
    ]
    return torch.tensor([row] * layers, dtype=torch.float64)


def _average(chosen, bits, weights) -> float:
    index = {w: i for i, w in enumerate(SUPPORTED_WIDTHS)}
    spent = sum(float(w * bits[layer, index[k], index[v]]) for layer, ((k, v), w) in enumerate(zip(chosen, weights)))
    return spent / float(weights.sum())


# ----------------------------------------------------------------------------------------------------------------------
# reference: costs and greedy
def test_query_weighted_key_error_is_the_centred_error_weighted_by_the_queries():
    keys, queries = torch.randn(2, 3, 64, 32, dtype=torch.float64), torch.randn(2, 6, 40, 32, dtype=torch.float64)
    config = OscarConfig(key_bits=2, sink_tokens=0)
    error = fake_quantize_keys(keys, True, config) - keys
    centred = error - error.mean(-2, keepdim=True)
    logits = queries.unflatten(1, (3, 2)).flatten(2, 3) @ centred.transpose(-1, -2)  # [B, Hkv, g * Tq, N]
    want = logits.square().sum((-2, -1))
    got = query_weighted_key_error(*key_error_sums(keys, True, config), query_moment(queries, 3))
    torch.testing.assert_close(got, want)


def test_cost_sums_of_chunks_add_up_to_the_whole_prompts():
    """Chunks starting on key-group boundaries add up to the whole prompt's sums (the cache adds each update's)."""
    keys, values = torch.randn(2, 2, 96, 32, dtype=torch.float64), torch.randn(2, 2, 96, 32, dtype=torch.float64)
    valid = torch.ones(2, 96, dtype=torch.bool)
    valid[1, :7] = False
    config = OscarConfig(method="oscar", auto_widths=SUPPORTED_WIDTHS, sink_tokens=0)
    whole = bit_cost_sums(keys, values, config, (True, False), valid)
    parts = None
    for start, end in ((0, 32), (32, 96)):
        chunk = bit_cost_sums(
            keys[:, :, start:end], values[:, :, start:end], config, (True, False), valid[:, start:end]
        )
        parts = add_bit_cost_sums(parts, chunk)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b)
    assert whole.tokens.flatten().tolist() == [96, 89]


def test_layer_bit_costs_match_the_attention_error_model():
    """Keys: scaling^2 tr(E_c^T E_c M) / N times the values' spread; values: the mean squared round-trip error; a
    wider width costs less; each head takes its cheaper rotation."""
    keys, values = torch.randn(1, 2, 64, 32, dtype=torch.float64), torch.randn(1, 2, 64, 32, dtype=torch.float64)
    moment = query_moment(torch.randn(1, 4, 16, 32, dtype=torch.float64), 2) / (16 * 2)
    config = OscarConfig(method="oscar", auto_widths=SUPPORTED_WIDTHS, sink_tokens=0)
    key_costs, value_costs, rotated = layer_bit_costs(
        bit_cost_sums(keys, values, config, (True, False)), moment, (True, False), 32**-0.5
    )
    spread = (values - values.mean(-2, keepdim=True)).square().sum(-1).mean(-1)  # [B, Hkv]
    for i, bits in enumerate(SUPPORTED_WIDTHS):
        width = config.with_widths(bits, bits)
        per_rotation = torch.stack(
            [query_weighted_key_error(*key_error_sums(keys, r, width), moment) for r in (True, False)]
        )
        want = (per_rotation.min(0).values / 64 * spread / 32).sum()
        torch.testing.assert_close(key_costs[i], want)
        assert torch.equal(rotated[i], per_rotation[0] < per_rotation[1])
        k_hat, v_hat = dequantize_kv(quantize_kv(keys, values, width), width, torch.float64)
        torch.testing.assert_close(value_costs[i], (v_hat - values).square().sum(-1).mean(-1).sum())
    assert key_costs[1] < key_costs[0] and value_costs[1] < value_costs[0]


def test_a_layer_with_outlier_key_channels_gets_wider_keys_first():
    """Three layers of random keys and values; the middle one's keys carry outlier channels that its queries read.
    With the budget of one key upgrade, it is that layer's keys that get the next width (3 bits)."""
    config = OscarConfig(method="oscar", auto_widths=SUPPORTED_WIDTHS, sink_tokens=0)
    key_costs, value_costs = [], []
    for layer in range(3):
        keys, values = torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64)
        queries = torch.randn(1, 4, 128, 64)
        if layer == 1:
            keys[..., :4] += 6 * torch.randn(1, 2, 128, 4)
            queries[..., :4] *= 3
        moment = query_moment(queries, 2) / (128 * 2)
        k, v, _ = layer_bit_costs(bit_cost_sums(keys, values, config, (True, False)), moment, (True, False), 0.125)
        key_costs.append(k)
        value_costs.append(v)
    bits, weights = _bits_table(3, 64, 2), torch.full((3,), 128.0)
    one_upgrade = (2 * bits[0, 0, 0] + bits[0, 1, 0]) / 3
    chosen = choose_layer_bits(
        torch.stack(key_costs), torch.stack(value_costs), bits, weights, float(one_upgrade), SUPPORTED_WIDTHS
    )
    assert chosen == [(2, 2), (3, 2), (2, 2)]


def test_a_budget_that_affords_a_fixed_config_keeps_every_layer_at_it_or_wider():
    """Three layers whose costs make a mix attractive (the values of the first and last layers cost most): at the
    bits of K3V2 everywhere the greedy starts from it (`uniform_start`) and has no bit left for the mix it would have
    taken from K2V2; with a little more, it upgrades those layers' values on top. The start chain is K2V2, K3V2,
    K3V3, K4V3, K4V4."""
    key_costs = torch.tensor([[90.0, 20.0, 4.0], [12.0, 3.0, 0.5], [60.0, 12.0, 2.0]])
    value_costs = torch.tensor([[25.0, 6.0, 1.0], [7.0, 2.0, 0.3], [30.0, 8.0, 1.0]])
    bits, weights = _bits_table(3, 256, 1), torch.full((3,), 256.0)
    k3v2 = _average([(3, 2)] * 3, bits, weights)
    assert choose_layer_bits(key_costs, value_costs, bits, weights, k3v2, SUPPORTED_WIDTHS) == [(3, 2)] * 3
    assert choose_layer_bits(key_costs, value_costs, bits, weights, k3v2 + 0.4, SUPPORTED_WIDTHS) == [
        (3, 3),
        (3, 2),
        (3, 3),
    ]
    # below K3V2's bits it starts from K2V2: keys where they pay most
    assert choose_layer_bits(key_costs, value_costs, bits, weights, k3v2 - 0.1, SUPPORTED_WIDTHS) == [
        (3, 2),
        (2, 2),
        (3, 2),
    ]
    for start, widths in enumerate([(2, 2), (3, 2), (3, 3), (4, 3), (4, 4)]):
        index = ((start + 1) // 2, start // 2)
        assert uniform_start(bits, weights, 3 * 256 * _average([widths] * 3, bits, weights)) == index, widths
    assert uniform_start(bits, weights, 0.0) == (0, 0)


@pytest.mark.parametrize("seed", range(5))
def test_the_greedy_never_exceeds_the_budget_and_stops_only_when_no_upgrade_fits(seed):
    generator = torch.Generator().manual_seed(seed)
    layers = 7
    widths = len(SUPPORTED_WIDTHS)
    key_costs = torch.rand(layers, widths, generator=generator).sort(dim=1, descending=True).values
    value_costs = torch.rand(layers, widths, generator=generator).sort(dim=1, descending=True).values
    wider = dict(zip(SUPPORTED_WIDTHS, SUPPORTED_WIDTHS[1:]))  # each width's next one up
    kv_heads = torch.randint(1, 9, (layers,), generator=generator)
    bits = torch.stack([_bits_table(1, 128, int(h))[0] for h in kv_heads])
    weights = (kv_heads * 128).double()
    low, high = _average([(2, 2)] * layers, bits, weights), _average([(4, 4)] * layers, bits, weights)
    for budget in torch.linspace(low, high, 9, dtype=torch.float64).tolist():
        chosen = choose_layer_bits(key_costs, value_costs, bits, weights, budget, SUPPORTED_WIDTHS)
        spent = _average(chosen, bits, weights)
        assert spent <= budget + 1e-9
        for layer, (k, v) in enumerate(chosen):  # every upgrade left out (one half one width up) breaks the budget
            for upgraded in ((wider.get(k), v), (k, wider.get(v))):
                if None not in upgraded:
                    trial = chosen[:layer] + [upgraded] + chosen[layer + 1 :]
                    assert _average(trial, bits, weights) > budget
    assert choose_layer_bits(key_costs, value_costs, bits, weights, high, SUPPORTED_WIDTHS) == [(4, 4)] * layers
    assert choose_layer_bits(key_costs, value_costs, bits, weights, low, SUPPORTED_WIDTHS) == [(2, 2)] * layers


# ----------------------------------------------------------------------------------------------------------------------
# config
def test_auto_bits_config_is_validated():
    config = OscarConfig(bits="auto", avg_bits=4.1, sink_tokens=0)
    assert config.auto_bits and config.key_bits is None and config.value_bits is None
    assert OscarConfig.from_dict(config.to_dict()) == config
    assert config.with_widths(4, 2) == OscarConfig(key_bits=4, value_bits=2, sink_tokens=0)
    with pytest.raises(ValueError, match="avg_bits is the average stored bits.*got avg_bits=nan"):
        OscarConfig(bits="auto", avg_bits=float("nan"), sink_tokens=0)
    with pytest.raises(ValueError, match="avg_bits=3.6 belongs to bits='auto'"):
        OscarConfig(bits=2, avg_bits=3.6, sink_tokens=0)
    with pytest.raises(ValueError, match="drop key_bits=4"):
        OscarConfig(bits="auto", avg_bits=3.6, key_bits=4, sink_tokens=0)
    with pytest.raises(ValueError, match="bits='fast' is not supported; use 'auto'"):
        OscarConfig(bits="fast", sink_tokens=0)
    with pytest.raises(ValueError, match="cache.average_bits"):
        average_bits(config, 128)


def test_a_budget_below_the_all_2_bit_cost_is_refused_with_the_minimum(tiny_llama):
    config = tiny_llama().config
    low = average_bits(OscarConfig(bits=2, sink_tokens=0), 32, 2)
    with pytest.raises(ValueError, match=f"pass avg_bits >= {low:.4g}"):
        OscarCache(config, OscarConfig(bits="auto", avg_bits=low - 0.01, sink_tokens=0))
    OscarCache(config, OscarConfig(bits="auto", avg_bits=low, sink_tokens=0))


def test_the_default_budget_is_the_all_2_bit_cost_where_that_exceeds_3_2_bits(tiny_llama):
    """head_dim 32 stores more than DEFAULT_AVG_BITS at 2 bits everywhere (its scales and norms per element): the
    default budget is then that cost, every layer 2-bit, where a given budget below it is refused (above)."""
    model = tiny_llama()
    low = average_bits(OscarConfig(bits=2), 32, 2)
    assert low > DEFAULT_AVG_BITS
    cache = _filled(model, torch.randint(3, 97, (1, 300)))
    cache.choose_bits()
    assert not cache.bits_open and cache.average_bits() == low
    assert all((layer.config.key_bits, layer.config.value_bits) == (2, 2) for layer in cache.layers)


# ----------------------------------------------------------------------------------------------------------------------
# the cache
def _filled(model, prompt, **options):
    cache = OscarCache(model.config, OscarConfig(**options))
    with torch.no_grad():
        model(prompt, **cache_kwargs(cache), use_cache=True)
    return cache


def _fill_by_hand(cache, tokens: int, device="cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four layers' K/V (head_dim 64) put in by hand, with the queries handed over: layers whose outlier key channels
    differ, the first with quiet keys and loud values, so that a budget between K3V3's and K4V4's bits mixes the widths
    (4-bit values first, then the loudest keys). Drawn on the CPU (the same inputs, and widths, on either device);
    returns each layer's keys and values."""
    torch.manual_seed(0)
    prompts = []
    for index in range(4):
        keys, values = torch.randn(1, 2, tokens, 64), torch.randn(1, 2, tokens, 64)
        queries = torch.randn(1, 4, tokens, 64)
        keys[..., :2] *= 4 * index + 1
        keys *= 0.05 if index == 0 else 1
        values *= 4 if index == 0 else 1
        returned, _ = cache.update(keys.to(device), values.to(device), index)
        cache.layers[index].observe_queries(queries.to(device), returned)
        prompts.append((keys, values))
    return prompts


@pytest.mark.parametrize(
    "method, attention",
    [("oscar", "portable"), ("paper", "portable"), ("paper", "fused"), slow_on_cpu("oscar", "fused")],
)  # the query rule on the fused path: 12 s in the interpreter
def test_choosing_converts_each_layers_4_bit_blocks_to_its_widths(tiny_llama, method, attention, monkeypatch):
    """The stored region after the choice is dequantize(4-bit) -> quantize(width) (the reference's on the portable
    path, the Triton kernels' on the fused one), with the key rotation the choice made at that width; a half whose
    width and rotation stay keeps its 4-bit codes. method="oscar" (its choice open, the exact keys held) quantizes the
    converted keys from the exact ones instead, as a cache of those widths would have stored them. Filled by hand,
    with the queries handed over: layers whose outlier key channels differ, the first with quiet keys, so that the
    budget buys 4-bit values there (its keys converted), 4-bit keys elsewhere (its values converted). Converted one
    block per slice (the float32 K/V of 32 tokens here), so that the slices' seams are checked too."""
    monkeypatch.setattr(layer_bits, "CONVERT_SLICE_BYTES", 1 * 2 * 64 * 2 * 4 * 32)
    config = tiny_llama(num_hidden_layers=4, head_dim=64).config  # a head_dim the kernels take
    config._attn_implementation = "sdpa"
    options = dict(
        bits="auto", avg_bits=4.5, auto_widths=SUPPORTED_WIDTHS, residual_length=32, method=method, attention=attention
    )
    cache = OscarCache(config, OscarConfig(**options))
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the fused path: the kernels, or Triton's interpreter
    prompts = _fill_by_hand(cache, 100, device)
    before = [
        (layer.quantized(), None if layer.key_rotated is None else layer.key_rotated.clone()) for layer in cache.layers
    ]
    before = [(type(q)(*(None if t is None else t.clone() for t in q)), r) for q, r in before]
    assert all(layer.config.key_bits == layer.config.value_bits == 4 for layer in cache.layers)
    cache.choose_bits()
    widths = [(layer.config.key_bits, layer.config.value_bits) for layer in cache.layers]
    # each half converted while the other stays, and both converted
    assert {(3, 4), (4, 3), (3, 3)} <= set(widths), widths
    assert cache.average_bits() <= 4.5
    four = OscarConfig(bits=4, method=method, sink_tokens=0)
    for layer, (stored, rotated), (exact_keys, exact_values) in zip(cache.layers, before, prompts):
        quantize = quantize_kv_triton if attention == "fused" else quantize_kv
        if attention == "fused":
            keys, values = dequantize_kv_triton(stored, four, rotated, dtype=torch.float32)
        else:
            keys, values = dequantize_kv(stored, four, torch.float32, rotated)
        want = quantize(keys, values, layer.config, layer.key_rotated)
        if method == "oscar":  # the quantized tokens follow the 4 sinks
            span = slice(4, 4 + layer.quantized_length)
            exact = quantize(exact_keys[:, :, span].to(device), exact_values[:, :, span].to(device), layer.config,
                             layer.key_rotated)  # fmt: skip
            want = want._replace(**{name: getattr(exact, name) for name in want._fields if name.startswith("key")})
        same_rotation = rotated is None or torch.equal(rotated, layer.key_rotated)
        got = layer.quantized()
        for name in got._fields:
            kept = (name.startswith("key") and layer.config.key_bits == 4 and same_rotation) or (
                name.startswith("value") and layer.config.value_bits == 4
            )
            expected = getattr(stored if kept else want, name)
            if expected is None:
                assert getattr(got, name) is None
                continue
            assert torch.equal(getattr(got, name), expected), (name, layer.config)
    cache.choose_bits()  # once chosen, nothing changes
    assert widths == [(layer.config.key_bits, layer.config.value_bits) for layer in cache.layers]


def test_a_prompt_held_exact_chooses_the_widths_its_next_blocks_take(tiny_llama):
    """A prompt no longer than the sinks and the window (a short perplexity window, a short first turn) quantizes
    nothing: choosing then has no block to convert, also in a layer that keeps one half's width and changes the other
    (which read the quantized region that did not exist), and the first blocks quantized afterwards are stored at the
    widths chosen, with the key rotation chosen (the reference's quantization, on the portable path)."""
    config = tiny_llama(num_hidden_layers=4, head_dim=64).config
    config._attn_implementation = "sdpa"
    options = dict(avg_bits=4.5, auto_widths=SUPPORTED_WIDTHS, residual_length=32, attention="portable")
    cache = OscarCache(config, OscarConfig(**options))
    prompts = _fill_by_hand(cache, 20)
    assert all(layer.quantized_length == 0 for layer in cache.layers)
    cache.choose_bits()
    widths = [(layer.config.key_bits, layer.config.value_bits) for layer in cache.layers]
    assert (4, 3) in widths and (3, 3) in widths, widths  # keys kept and values changed; both changed
    for index, (layer, (keys, values)) in enumerate(zip(cache.layers, prompts)):
        more_keys, more_values = torch.randn(1, 2, 80, 64), torch.randn(1, 2, 80, 64)
        cache.update(more_keys, more_values, index)
        sinks = layer.storage.sinks
        assert layer.quantized_length == 64 and (layer.layout.key_bits, layer.layout.value_bits) == widths[index]
        span = slice(sinks, sinks + 64)
        want = quantize_kv(
            torch.cat([keys, more_keys], 2)[:, :, span], torch.cat([values, more_values], 2)[:, :, span],
            layer.config, layer.key_rotated,
        )  # fmt: skip
        got = layer.quantized()
        for name in got._fields:
            expected = getattr(want, name)
            assert (getattr(got, name) is None) if expected is None else torch.equal(getattr(got, name), expected)


def test_the_4_bit_round_trip_adds_little_to_the_2_bit_error():
    """What converting costs: keys and values quantized at 2 bits from their 4-bit round trip are within 0.2 % of the
    error of quantizing the exact ones (measured: +0.06 % for keys, +0.00 % for values); 4-bit keys quantized again
    would add 0.5 % (token norms of the round trip), which is why a half that stays 4-bit keeps its codes."""
    keys, values = torch.randn(2, 4, 256, 128), torch.randn(2, 4, 256, 128)
    keys[..., 3] += 8 * torch.randn(2, 4, 256)
    keys = keys * 3 * torch.rand(1, 1, 256, 1)
    four, two = OscarConfig(bits=4, method="paper", sink_tokens=0), OscarConfig(bits=2, method="paper", sink_tokens=0)
    k4, v4 = dequantize_kv(quantize_kv(keys, values, four), four)
    direct = dequantize_kv(quantize_kv(keys, values, two), two)
    converted = dequantize_kv(quantize_kv(k4, v4, two), two)
    for exact, a, b in zip((keys, values), direct, converted):
        assert (b - exact).norm() <= 1.002 * (a - exact).norm()


@pytest.mark.parametrize("prompt_tokens", [150, 10])  # 10: the prompt is held exact when the widths are chosen
def test_generate_with_auto_bits_respects_the_budget_and_says_what_it_chose(tiny_llama, caplog, prompt_tokens):
    model = tiny_llama(num_hidden_layers=4)
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 97, (1, prompt_tokens))
    low, high = (
        average_bits(OscarConfig(bits=2, sink_tokens=0), 32, 2),
        average_bits(OscarConfig(bits=4, sink_tokens=0), 32, 2),
    )
    for budget in (low, (low + high) / 2, high):
        options = {"bits": "auto", "avg_bits": budget, "sink_tokens": 0, "residual_length": 32}
        with caplog.at_level(logging.INFO, logger="oscar_hf"):
            out = model.generate(
                prompt, max_new_tokens=40, min_new_tokens=40, cache_implementation="oscar", cache_config=options,
                return_dict_in_generate=True, **GREEDY,
            )  # fmt: skip
        cache = out.past_key_values
        assert out.sequences.shape[1] == prompt_tokens + 40 and cache.get_seq_length() == prompt_tokens + 39
        assert cache.average_bits() <= budget + 1e-9
        assert f"OscarCache(bits='auto', avg_bits={budget})" in caplog.text
        memory = cache.memory_footprint()
        want = sum(
            average_bits(layer.config, 32, 2) / 8 * 2 * 2 * 32 * layer.quantized_length for layer in cache.layers
        )
        assert memory.quantized_bytes == want  # each layer's own widths
        if budget == low:
            assert all(layer.config.bits == 2 for layer in cache.layers)
        if budget == high:
            assert all(layer.config.bits == 4 for layer in cache.layers)


def test_auto_bits_generates_what_a_cache_of_the_chosen_fixed_widths_generates(tiny_llama):
    """method="paper" (no rotation choice): the chosen widths, given to each layer up front, give the same tokens; the
    auto cache's 2-bit halves come from the 4-bit round trip, within rounding of the direct ones."""
    model = tiny_llama(num_hidden_layers=4)
    prompt = torch.randint(3, 97, (1, 150))
    options = {"bits": "auto", "avg_bits": 4.0, "sink_tokens": 0, "residual_length": 32, "method": "paper"}
    out = model.generate(
        prompt, max_new_tokens=20, cache_implementation="oscar", cache_config=options,
        return_dict_in_generate=True, output_logits=True, **GREEDY,
    )  # fmt: skip
    fixed = OscarCache(model.config, OscarConfig(residual_length=32, method="paper", bits=2, sink_tokens=0))
    for i, layer in enumerate(out.past_key_values.layers):
        fixed.layers[i] = type(layer)(layer.config)
    again = model.generate(
        prompt, max_new_tokens=20, **cache_kwargs(fixed), return_dict_in_generate=True, output_logits=True, **GREEDY
    )
    assert torch.equal(again.sequences, out.sequences)
    for a, b in zip(out.logits, again.logits):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=0)


def test_a_cache_filled_by_hand_chooses_from_the_keys_at_its_first_decode_step(tiny_llama, caplog):
    """No attention call hands queries over: the keys are costed against isotropic queries (said once), and the first
    single-token update chooses before it is stored."""
    config = tiny_llama(num_hidden_layers=3).config
    cache = OscarCache(config, OscarConfig(bits="auto", avg_bits=3.9, residual_length=32, sink_tokens=0))
    for idx in range(3):
        cache.update(torch.randn(1, 2, 100, 32) * (1 + 3 * idx), torch.randn(1, 2, 100, 32), idx)
    assert all(layer.bits_open for layer in cache.layers)
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: once per process and message
    with caplog.at_level(logging.WARNING, logger="oscar_hf"):
        for idx in range(3):
            cache.update(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32), idx)
    assert "costed against isotropic queries" in caplog.text
    assert not any(layer.bits_open for layer in cache.layers)
    assert cache.average_bits() <= 3.9 and cache.get_seq_length() == 101
    keys, _ = cache.layers[2].dense_history()
    assert keys.shape[-2] == 101
    cache.reset()  # the next prompt chooses again
    assert all(layer.bits_open and layer.config.bits == 4 for layer in cache.layers)
    cache.update(torch.randn(1, 2, 100, 32), torch.randn(1, 2, 100, 32), 0)
    assert cache.layers[0].quantized().key_codes.shape[2] == 96 // 8  # 4-bit codes: 8 tokens per word


def test_a_reserved_length_is_allocated_once_the_widths_are_chosen(tiny_llama):
    """`reserve` (generate's maximum length) under bits="auto": while the choice is open each layer's 4-bit blocks grow
    with the prompt (reserved at 4 bits, the whole length would be the prefill's peak); the choice allocates the
    reserved length at each layer's widths, and after a reset the next prompt again grows until its choice."""
    config = tiny_llama(num_hidden_layers=3).config
    options = dict(avg_bits=4.1, auto_widths=SUPPORTED_WIDTHS, residual_length=32, sink_tokens=0)
    cache = OscarCache(config, OscarConfig(**options))
    cache.reserve(1000)
    for _ in range(2):
        for idx in range(3):
            cache.update(torch.randn(1, 2, 100, 32) * (1 + 3 * idx), torch.randn(1, 2, 100, 32), idx)
        assert [layer.storage.capacity for layer in cache.layers] == [96] * 3  # the prompt's 3 complete blocks
        before = [layer.dense_history()[0] for layer in cache.layers]
        cache.choose_bits()
        assert [layer.storage.capacity for layer in cache.layers] == [992] * 3  # 1000 tokens in whole blocks
        widths = {(layer.config.key_bits, layer.config.value_bits) for layer in cache.layers}
        assert len(widths) > 1, widths  # converted layers and a kept one both reserve
        for layer, keys in zip(cache.layers, before):
            after = layer.dense_history()[0]
            assert after.shape == keys.shape
            if layer.config.key_bits == 4:
                torch.testing.assert_close(after, keys, rtol=0, atol=0)  # kept codes
        cache.reset()


def test_a_prompt_fed_in_chunks_chooses_after_the_last_chunk(tiny_llama):
    """generate's chunked prefill: the widths are chosen once, after the last chunk, within the budget, as for the
    prompt fed whole."""
    model = tiny_llama(num_hidden_layers=4)
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(3, 97, (1, 150))
    options = {"bits": "auto", "avg_bits": 3.9, "sink_tokens": 0, "residual_length": 32}
    runs = [
        model.generate(
            prompt, max_new_tokens=3, cache_implementation="oscar", cache_config=options, prefill_chunk_size=chunk,
            return_dict_in_generate=True, **GREEDY,
        ).past_key_values
        for chunk in (None, 48)
    ]  # fmt: skip
    for cache in runs:
        assert cache.average_bits() <= 3.9 and not any(layer.bits_open for layer in cache.layers)
    assert [layer.config for layer in runs[0].layers] == [layer.config for layer in runs[1].layers]


def test_a_long_prompt_fed_in_chunks_chooses_once_the_costs_are_complete(tiny_llama):
    """A cache fed chunk by chunk with no decode step (scoring, a long chunked prefill) chooses at the first update
    that finds the first `CHOICE_TOKENS` tokens held, before storing it: the rest of the prompt is stored at the chosen
    widths, not at 4 bits."""
    model = tiny_llama(num_hidden_layers=3)
    model.config._attn_implementation = "sdpa"
    cache = OscarCache(model.config, OscarConfig(bits="auto", avg_bits=3.5, sink_tokens=0))
    prompt = torch.randint(3, 97, (1, CHOICE_TOKENS + 1024))
    with torch.no_grad():
        for start in range(0, prompt.shape[1], 1024):
            model(prompt[:, start : start + 1024], **cache_kwargs(cache), use_cache=True)
            chosen = not any(layer.bits_open for layer in cache.layers)
            assert chosen == (start + 1024 > CHOICE_TOKENS)
    assert cache.average_bits() <= 3.5
    assert any(layer.config.key_bits == 2 or layer.config.value_bits == 2 for layer in cache.layers)


def test_auto_widths_default_and_refusals():
    """bits="auto" chooses among `DEFAULT_AUTO_WIDTHS` (2 and 4 bits) unless told; `auto_widths` is refused with fixed
    widths and where it is not a subset of the supported widths, narrowest first; a list becomes a tuple."""
    assert OscarConfig().chooser_widths == DEFAULT_AUTO_WIDTHS == (2, 4)
    assert OscarConfig(auto_widths=[2, 3, 4]).auto_widths == (2, 3, 4)
    assert OscarConfig(auto_widths=(2, 3, 4)).with_widths(3, 2).auto_widths is None
    assert dataclasses.replace(OscarConfig(), bits=2).key_bits == 2  # the default's widths are not a given field
    for bad, message in (((4, 2), "narrowest first"), ((2, 5), "narrowest first"), ((), "narrowest first")):
        with pytest.raises(ValueError, match=message):
            OscarConfig(auto_widths=bad)
    with pytest.raises(ValueError, match="auto_widths=.* belongs to bits='auto'"):
        OscarConfig(bits=2, auto_widths=(2, 4))


@pytest.mark.parametrize("auto_widths", [None, (2, 3, 4)])
def test_the_chooser_picks_only_its_widths(tiny_llama, auto_widths):
    """Three layers filled by hand under the budget of K3V2 everywhere (less than K4V2's): every layer's widths are
    among the config's `auto_widths`, so the default never stores 3 bits; with (2, 3, 4) the chain starts every layer
    at K3V2 (`uniform_start`)."""
    model_config = tiny_llama(num_hidden_layers=3).config
    dim, heads = model_config.head_dim, model_config.num_key_value_heads
    k3v2 = average_bits(OscarConfig(key_bits=3, sink_tokens=0), dim, heads)
    config = OscarConfig(avg_bits=k3v2, auto_widths=auto_widths, residual_length=32, sink_tokens=0)
    cache = OscarCache(model_config, config)
    for tokens in (100, 1):  # a prompt, then the first decode step, which chooses
        for idx in range(3):
            cache.update(torch.randn(1, heads, tokens, dim) * (1 + 3 * idx), torch.randn(1, heads, tokens, dim), idx)
    widths = [(layer.config.key_bits, layer.config.value_bits) for layer in cache.layers]
    assert all(k in config.chooser_widths and v in config.chooser_widths for k, v in widths), widths
    if auto_widths:
        assert widths == [(3, 2)] * 3, widths
