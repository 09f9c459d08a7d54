"""method="oscar"'s key-rotation choice while the prompt streams in (`oscar_hf/cache/key_rotation.py`): chunked and
one-shot prompts choose alike, flips are quantized again from exact K/V, the exact copies stop at the horizon, a cache
filled by hand chooses from its keys, and a prompt's blocks are quantized once."""

import logging

import pytest
import torch
from transformers import DynamicCache, LlamaConfig
from transformers.testing_utils import CaptureLogger

from oscar_hf import OscarCache, OscarConfig, OscarLayer, cache_kwargs
from oscar_hf.cache import backends as backends_module
from oscar_hf.cache import key_rotation
from oscar_hf.cache.key_rotation import CHOICE_TOKENS
from oscar_hf.integrations.fused_attention import recording_query_moments
from oscar_hf.reference import quantize_kv, query_moment, query_rotation_choice

GREEDY = dict(do_sample=False, return_dict_in_generate=True)
B, HKV, D = 2, 2, 32


def _exact_history(monkeypatch):
    """Make every OscarLayer read its quantized region back exact (the K/V its updates brought): the model then
    computes the same keys and queries whether the prompt arrives whole or in chunks, so any difference in the choice
    comes from how the cache makes it."""
    update = OscarLayer.update

    def recording(self, key_states, value_states, *args, **kwargs):
        seen = getattr(self, "exact_kv", None)
        new = (key_states, value_states)
        self.exact_kv = new if seen is None else tuple(torch.cat(pair, dim=-2) for pair in zip(seen, new))
        return update(self, key_states, value_states, *args, **kwargs)

    monkeypatch.setattr(OscarLayer, "update", recording)

    def exact(self, start, end, out=None):
        tokens = tuple(t[:, :, start:end] for t in self.exact_kv)
        if out is None:
            return tokens
        for dense, part in zip(out, tokens):
            dense.copy_(part)
        return out

    monkeypatch.setattr(OscarLayer, "_dequantize", exact)


@pytest.mark.parametrize("prompt", [300, 1000])
def test_chunked_prefill_chooses_as_one_prefill(tiny_llama, monkeypatch, prompt):
    """A prompt fed in 64-token chunks (generate's chunked prefill) ends with the flags of the same prompt in one
    prefill, where the first chunk alone chooses otherwise (so a choice locked in by the first call fails this), and
    the generated tokens are the same."""
    _exact_history(monkeypatch)
    model = tiny_llama(dtype=torch.float64, num_key_value_heads=4, num_attention_heads=8)
    ids = torch.randint(3, 97, (2, prompt))
    options = dict(
        cache_implementation="oscar",
        cache_config={"method": "oscar", "scale_dtype": "float32", "bits": 2, "sink_tokens": 0},
    )
    whole = model.generate(ids, max_new_tokens=4, **options, **GREEDY)
    chunked = model.generate(ids, max_new_tokens=4, prefill_chunk_size=64, **options, **GREEDY)
    assert torch.equal(chunked.sequences, whole.sequences)
    first, moments = DynamicCache(config=model.config), {}
    with recording_query_moments(moments):
        model(ids[:, :64], **cache_kwargs(first))
    first_chunk_differs = False
    for idx, (a, b) in enumerate(zip(whole.past_key_values.layers, chunked.past_key_values.layers)):
        assert torch.equal(a.key_rotated, b.key_rotated), idx
        assert a.rotation.final and b.rotation.final and not b.rotation.blocks  # decoding fixed it
        alone = query_rotation_choice(
            first.layers[idx].keys, moments[idx], OscarConfig(scale_dtype="float32", bits=2, sink_tokens=0)
        )
        first_chunk_differs |= not torch.equal(alone, b.key_rotated)
    assert first_chunk_differs


def _cache(**options):
    model_config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=4 * HKV, num_key_value_heads=HKV, head_dim=D, hidden_size=4 * HKV * D
    )
    model_config._attn_implementation = "sdpa"  # the default method resolves to the query rule
    return OscarCache(model_config, OscarConfig(scale_dtype="float32", bits=2, sink_tokens=0, **options))


def _assert_stored_as(layer, keys, values, flags, config):
    """The quantized region holds exactly what a fresh quantization of these K/V with these flags stores."""
    end = layer.quantized_length
    want = quantize_kv(keys[:, :, :end], values[:, :, :end], config, flags)
    for name, got, expected in zip(want._fields, layer.quantized(), want):
        if expected is not None:
            assert torch.equal(got, expected.to(got.dtype)), name  # the storage keeps token norms in float32


def test_a_flipped_head_is_quantized_again_from_its_exact_keys():
    """The second chunk's queries weigh other channels than the first's: some heads flip, and every stored block
    (those written with the first choice included) is what the final flags quantize from the exact K/V."""
    cache = _cache()
    config, layer = cache.oscar_config, cache.layers[0]
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(B, HKV, 600, D, dtype=torch.float64, generator=gen)
    keys[:, :, :, :4] = 0.01 * keys[:, :, :, :4] + 30  # quiet offset channels: unrotated where the queries weigh them
    keys[:, :, :, 4:] = torch.where(torch.rand(keys[:, :, :, 4:].shape, generator=gen) < 0.03, 30, 1) * keys[..., 4:]
    values = torch.randn_like(keys)
    queries = torch.randn(B, 4 * HKV, 600, D, dtype=torch.float64, generator=gen)
    queries[:, :, :300, :4] *= 30  # the first chunk's queries read the offset channels
    queries[:, :, 300:, 4:] *= 30  # the second's the spiky ones
    got = cache.update(keys[:, :, :300], values[:, :, :300], layer_idx=0)
    layer.observe_queries(queries[:, :, :300], got[0])
    before = layer.key_rotated.clone()
    _assert_stored_as(layer, keys, values, before, config)
    got = cache.update(keys[:, :, 300:], values[:, :, 300:], layer_idx=0)
    layer.observe_queries(queries[:, :, 300:], got[0])
    after = query_rotation_choice(keys, query_moment(queries, HKV), config)
    assert torch.equal(layer.key_rotated, after) and not torch.equal(before, after), (before, after)
    assert layer.quantized_length == 512 and not layer.rotation.final
    _assert_stored_as(layer, keys, values, after, config)


@pytest.mark.parametrize("chunk", [1024, CHOICE_TOKENS])
def test_exact_copies_stop_at_the_horizon(chunk):
    """Chunks of `chunk` tokens: the choice reads the keys and the queries of the first CHOICE_TOKENS positions, and
    is final (no exact copy held) from the update that fills them, which chunks of CHOICE_TOKENS tokens do at once:
    later queries change nothing. Until then the written blocks' exact copies are their keys alone. The same prompt
    in one update chooses the same."""
    cache = _cache(method="oscar")
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(6)
    total = CHOICE_TOKENS + 2048
    keys = torch.randn(B, HKV, total, D, generator=gen)
    keys[0, 0, :, :4] = 0.01 * keys[0, 0, :, :4] + 30  # unrotated, read by its queries below
    keys[1, 1] = torch.where(torch.rand(keys[1, 1].shape, generator=gen) < 0.03, 30 * keys[1, 1], keys[1, 1])  # rotated
    values = torch.randn_like(keys)
    queries = torch.randn(B, 4 * HKV, total, D, generator=gen)
    queries[0, :4, :, :4] *= 20
    for start in range(0, total, chunk):
        got = cache.update(keys[:, :, start : start + chunk], values[:, :, start : start + chunk], layer_idx=0)
        layer.observe_queries(queries[:, :, start : start + chunk], got[0])
        held = sum(k.shape[-2] for _, k, _ in layer.rotation.blocks)
        assert held == (0 if start + chunk >= CHOICE_TOKENS else layer.quantized_length) <= CHOICE_TOKENS
        assert all(v is None for _, _, v in layer.rotation.blocks)  # written: a flip needs the exact keys only
        assert layer.rotation.final == (start + chunk >= CHOICE_TOKENS)
    seen = queries[:, :, :CHOICE_TOKENS]
    want = query_rotation_choice(keys[:, :, :CHOICE_TOKENS], query_moment(seen, HKV), cache.oscar_config)
    assert torch.equal(layer.key_rotated, want) and want[0, 0] != want[1, 1]
    _assert_stored_as(layer, keys, values, want, cache.oscar_config)
    whole = _cache(method="oscar")
    got = whole.update(keys, values, layer_idx=0)
    whole.layers[0].observe_queries(queries, got[0])
    assert torch.equal(whole.layers[0].key_rotated, want) and whole.layers[0].rotation.final


def test_a_cache_filled_by_hand_chooses_from_its_keys_and_says_so():
    """The default method on an sdpa model, updated by hand with no attention call: the next update (a decode step)
    chooses from the prompt's keys alone (an isotropic query moment), logs that once with the fix, and decoding
    stores its blocks with that choice."""
    cache = _cache()
    layer = cache.layers[0]
    assert cache.oscar_config.method == "oscar"
    gen = torch.Generator().manual_seed(7)
    keys = torch.randn(B, HKV, 400, D, generator=gen)
    keys[1, 1] = torch.where(torch.rand(keys[1, 1].shape, generator=gen) < 0.03, 30 * keys[1, 1], keys[1, 1])
    values = torch.randn_like(keys)
    logging.Logger.warning_once.cache_clear()
    with CaptureLogger(key_rotation.logger) as captured:
        cache.update(keys[:, :, :300], values[:, :, :300], layer_idx=0)
        for t in range(300, 400):
            cache.update(keys[:, :, t : t + 1], values[:, :, t : t + 1], layer_idx=0)
    assert captured.out.count("from its keys alone") == 1 and "observe_queries" in captured.out, captured.out
    isotropic = torch.eye(D).expand(B, HKV, D, D)
    want = query_rotation_choice(keys[:, :, :300], isotropic, cache.oscar_config)
    assert torch.equal(layer.key_rotated, want) and want.any() and not want.all(), want
    assert layer.rotation.final and layer.quantized_length == 384
    _assert_stored_as(layer, keys, values, want, cache.oscar_config)


def test_a_prompts_blocks_are_quantized_once(tiny_llama, monkeypatch):
    """A one-shot prefill quantizes each of its blocks once, with the choice its queries make (no provisional pass)."""
    quantized = []
    original = backends_module.quantize_kv
    monkeypatch.setattr(
        backends_module,
        "quantize_kv",
        lambda keys, *args, **kwargs: (quantized.append(keys.shape[-2]), original(keys, *args, **kwargs))[1],
    )
    model = tiny_llama(num_hidden_layers=3)
    cache = OscarCache(model.config, OscarConfig(method="oscar", bits=2, sink_tokens=0))
    model(torch.randint(3, 97, (1, 1000)), **cache_kwargs(cache))
    assert quantized == [896] * 3  # (1000 - 1) // 128 * 128 tokens per layer, once each
    assert all(layer.key_rotated is not None and not layer.rotation.unwritten for layer in cache.layers)


def test_recorded_query_moments_stop_at_the_horizon(tiny_llama):
    """`recording_query_moments` (the lm-eval wrapper's hand-over) keeps the queries of each layer's first
    CHOICE_TOKENS positions, as the cache's own attention calls do, across calls in position order: a prompt past
    the horizon, prefilled in two calls, records what its first CHOICE_TOKENS tokens alone record (causal queries)."""
    model = tiny_llama(dtype=torch.float64, max_position_embeddings=CHOICE_TOKENS + 64)
    ids = torch.randint(3, 97, (1, CHOICE_TOKENS + 64))
    split, past = {}, DynamicCache(config=model.config)
    with torch.no_grad(), recording_query_moments(split):
        model(ids[:, :4000], **cache_kwargs(past))
        model(ids[:, 4000:], **cache_kwargs(past))
    prefix = {}
    with torch.no_grad(), recording_query_moments(prefix, horizon=10**9):
        model(ids[:, :CHOICE_TOKENS])
    assert split.keys() == prefix.keys() == {0, 1}
    for index, moment in split.items():
        torch.testing.assert_close(moment, prefix[index], rtol=1e-10, atol=0)
