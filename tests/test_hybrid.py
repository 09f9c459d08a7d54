"""Hybrid models (issue 36): with the maximum length reserved, an OscarCache's sliding-window layers become static
(`CompiledSlidingWindowLayer`, transformers' `StaticSlidingWindowLayer`), so that the whole decode step can compile;
without it they stay transformers' dynamic layers."""

import inspect

import pytest
import torch
import torch._dynamo
from transformers import DynamicCache, Gemma3ForCausalLM, Gemma3TextConfig, Qwen3NextForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from oscar_hf import OscarCache, OscarConfig, OscarLayer, cache_kwargs
from oscar_hf.cache.compiled import CompiledSlidingWindowLayer
from oscar_hf.cache.history import DecodeHistory
from oscar_hf.integrations import fused_attention

GREEDY = dict(do_sample=False, return_dict_in_generate=True)


def _sdpa(config):
    config._attn_implementation = "sdpa"
    return config


def test_reserve_makes_sliding_layers_static_only_where_compiled_decode_may_apply(gemma3_config):
    cache = OscarCache(_sdpa(gemma3_config), OscarConfig(bits=2, sink_tokens=0))
    cache.reserve(100)
    assert [type(layer) for layer in cache.layers] == [CompiledSlidingWindowLayer, OscarLayer] * 2
    assert [layer.max_cache_len for layer in cache.layers] == [16, 100] * 2  # the window, or the reserved length
    cache.reserve(10)  # a shorter reservation before the prefill: a window that never fills
    assert cache.layers[0].max_cache_len == 10
    assert not any("layers that cannot run compiled" in reason for reason in cache.compile_blockers())

    portable = OscarCache(gemma3_config, OscarConfig(attention="portable", bits=2, sink_tokens=0))
    portable.reserve(100)  # compiled decode cannot apply: eager use stays as without a reservation
    assert [type(layer) for layer in portable.layers] == [DynamicSlidingWindowLayer, OscarLayer] * 2
    assert "the model has layers that cannot run compiled (DynamicSlidingWindowLayer)" in portable.compile_blockers()
    unreserved = OscarCache(gemma3_config, OscarConfig(bits=2, sink_tokens=0))
    assert type(unreserved.layers[0]) is DynamicSlidingWindowLayer
    assert "the model has layers that cannot run compiled (DynamicSlidingWindowLayer)" in unreserved.compile_blockers()


def test_gemma3_shapes_compile_when_reserved():
    """Gemma 3's real head_dim (256) with sdpa: nothing blocks compiled decode once the length is reserved."""
    config = Gemma3TextConfig(num_hidden_layers=6, head_dim=256, num_attention_heads=8, num_key_value_heads=4)
    assert config.layer_types.count("full_attention") == 1
    cache = OscarCache(_sdpa(config), OscarConfig(bits=2, sink_tokens=0))
    assert cache.compile_blockers() == [
        "the model has layers that cannot run compiled (DynamicSlidingWindowLayer)",
        "no maximum length is reserved",
    ]
    cache.reserve(32768 + 32)
    assert cache.compile_blockers() == [] and cache.is_compileable
    assert all(layer.max_cache_len == config.sliding_window for layer in cache.layers if layer.is_sliding)


def test_kv_sharing_models_compile_from_transformers_5_24(gemma3n_config):
    """Gemma 3n: from transformers 5.24 its sharing layers are `DummyLayer`s handed the producer's K/V as returned
    (compiled in tests/kernels/test_compiled_decode.py); before, a named blocker."""
    cache = OscarCache(_sdpa(gemma3n_config), OscarConfig(bits=2, sink_tokens=0))
    cache.reserve(100)
    if getattr(gemma3n_config, "kv_sharing_modes", None) is not None:
        assert cache.compile_blockers() == [] and type(cache.layers[-1]).__name__ == "DummyLayer"
    else:
        assert any(reason.startswith("KV-sharing layers") for reason in cache.compile_blockers())


def test_assisted_decoding_keeps_croppable_sliding_layers(exact_oscar_cache, gemma3_config):
    """Prompt-lookup decoding crops rejected candidates, which a static window past its length cannot undo: the
    reserved cache's sliding layers go back to transformers' dynamic ones when past recording starts, and the tokens
    are greedy decoding's."""
    model = Gemma3ForCausalLM(_sdpa(gemma3_config)).eval()
    pattern = torch.randint(3, 97, (1, 9))
    ids = torch.cat([pattern.repeat(1, 6), pattern[:, :4]], dim=1)  # repeats give the lookup candidates
    options = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    want = model.generate(ids, **options)
    cache = exact_oscar_cache(model.config)
    cache.reserve(ids.shape[1] + 40)
    assert type(cache.layers[0]) is CompiledSlidingWindowLayer
    got = model.generate(ids, **cache_kwargs(cache), prompt_lookup_num_tokens=5, **options)
    assert torch.equal(got, want)
    assert type(cache.layers[0]) is DynamicSlidingWindowLayer and cache.layers[0].record_past


@pytest.mark.parametrize("lengths", [[40], [40, 25]], ids=["single", "left-padded-batch"])
def test_exact_cache_with_static_sliding_layers_equals_dynamic_cache(exact_oscar_cache, gemma3_config, lengths):
    """The reserved configuration, quantization made lossless: 40 prompt tokens and 150 new ones, past the window of
    16 and across the block flush at 128 (a left-padded row too), token for token as DynamicCache."""
    model = Gemma3ForCausalLM(_sdpa(gemma3_config)).eval()
    ids = torch.randint(3, 97, (len(lengths), max(lengths)))
    mask = torch.ones_like(ids)
    mask[1:, : max(lengths) - min(lengths)] = 0
    options = dict(attention_mask=mask, max_new_tokens=150, min_new_tokens=150, **GREEDY)
    want = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), **options)
    cache = exact_oscar_cache(model.config)
    cache.reserve(ids.shape[1] + 150)
    got = model.generate(ids, **cache_kwargs(cache), **options)
    assert torch.equal(got.sequences, want.sequences)
    assert [type(layer) for layer in cache.layers][:2] == [CompiledSlidingWindowLayer, type(cache.layers[1])]
    assert cache.layers[1].quantized_length == 128 and cache.get_seq_length() == ids.shape[1] + 149
    assert cache.layers[0].keys.shape[-2] == 16  # the window's buffer


def test_linear_attention_hybrid_compiles_and_its_exact_cache_equals_dynamic_cache(exact_oscar_cache, qwen3next_config):
    """Qwen3-Next: the linear-attention layers keep transformers' `LinearAttentionLayer` (static state, compileable),
    the full-attention layer is an OScaR layer; reserved, nothing blocks compiled decode, and with quantization made
    lossless the tokens are DynamicCache's across the flush at 128."""
    model = Qwen3NextForCausalLM(_sdpa(qwen3next_config)).eval()
    ids = torch.randint(3, 97, (1, 100))
    options = dict(max_new_tokens=40, min_new_tokens=40, **GREEDY)
    want = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), **options)
    cache = exact_oscar_cache(model.config)
    cache.reserve(ids.shape[1] + 40)
    assert [type(layer).__name__ for layer in cache.layers] == ["LinearAttentionLayer"] * 3 + ["ExactOscarLayer"]
    assert OscarCache(model.config, OscarConfig(attention="fused", bits=2, sink_tokens=0)).compile_blockers() == [
        "no maximum length is reserved"
    ]
    got = model.generate(ids, **cache_kwargs(cache), **options)
    assert torch.equal(got.sequences, want.sequences)
    assert cache.layers[3].quantized_length == 128


def test_static_sliding_layer_contract_of_transformers():
    """What `CompiledSlidingWindowLayer` relies on in transformers' `StaticSlidingWindowLayer` (5.17 to 5.24): its
    constructor, a buffer of `min(window, max_cache_len)` tokens, the host length `cumulative_length_int` that its
    eager methods read, the device counter `cumulative_length`. Fails loudly if transformers changes them."""
    parameters = list(inspect.signature(StaticSlidingWindowLayer.__init__).parameters)
    assert parameters[:3] == ["self", "max_cache_len", "sliding_window"]
    for method in (StaticSlidingWindowLayer.update, StaticSlidingWindowLayer.get_mask_sizes):
        assert "self.cumulative_length_int" in inspect.getsource(method)
    assert "sliding_window" in inspect.signature(DynamicSlidingWindowLayer.__init__).parameters
    assert DynamicSlidingWindowLayer(sliding_window=7).sliding_window == 7


@pytest.mark.parametrize("prompt", [3, 9, 20], ids=["fills-during-decode", "fills-at-the-prompt", "past-the-window"])
def test_sliding_layer_eager_and_compiled_steps_equal_transformers_static_layer(prompt):
    """Eager updates behave as transformers' layer; single-token steps in a compiled function (dynamo, one graph)
    leave the same buffer, returned K/V, lengths and mask sizes, before and after the window (8) fills."""
    window, steps = 8, 14
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randn(2, 3, n, 16, generator=gen) for n in [prompt] + [1] * steps]
    theirs, ours = StaticSlidingWindowLayer(100, window), CompiledSlidingWindowLayer(100, window)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(lambda k, v: tuple(t.clone() for t in ours.update(k, v)), backend="eager", fullgraph=True)
    for index, keys in enumerate(tokens):
        values = keys * 2
        want = theirs.update(keys, values)
        got = ours.update(keys, values) if index < 2 else step(keys, values)  # the first decode step eager
        for a, b in zip(got, want):
            assert torch.equal(a, b), index
        assert ours.get_seq_length() == theirs.get_seq_length() == sum(t.shape[-2] for t in tokens[: index + 1])
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    ours.reset()
    assert ours.get_seq_length() == 0 and int(ours.cumulative_length) == 0


def test_only_the_oscar_layers_calls_are_fused(gemma3_config, monkeypatch):
    """Reserved, on the fused path: each decode step's sliding-window calls (`sliding_window=16`) reach transformers'
    sdpa untouched with the static layer's window buffer, and only the full-attention layers' calls run the fused
    kernel (the compiled forward traces these same calls: tests/kernels/test_compiled_decode.py). On a GPU, CUDA
    tensors (the fused path takes CPU ones only under Triton's interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Gemma3ForCausalLM(_sdpa(gemma3_config)).eval().to(device)
    cache = OscarCache(model.config, OscarConfig(attention="fused", residual_length=32, bits=2, sink_tokens=0))
    cache.reserve(60)
    passed, fused = [], []
    original_sdpa, original_fused = fused_attention.sdpa_attention_forward, DecodeHistory.attention

    def sdpa(module, query, key, value, *args, **kwargs):
        passed.append((module.layer_idx, kwargs.get("sliding_window"), key))
        return original_sdpa(module, query, key, value, *args, **kwargs)

    monkeypatch.setattr(fused_attention, "sdpa_attention_forward", sdpa)

    def fused_kernel(history, *args):
        fused.append(history.storage)
        return original_fused(history, *args)

    monkeypatch.setattr(DecodeHistory, "attention", fused_kernel)
    with torch.no_grad():
        token = model(torch.randint(3, 97, (1, 20), device=device), **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
        for _ in range(3):
            passed.clear()
            fused.clear()
            token = model(input_ids=token, **cache_kwargs(cache)).logits[:, -1:].argmax(-1)
            assert [(index, window) for index, window, _ in passed] == [(0, 16), (2, 16)]
            assert all(key is cache.layers[index].keys for index, _, key in passed)
            assert fused == [cache.layers[1].storage, cache.layers[3].storage]
