"""`generate()` end to end: registration, plumbing proven lossless, and a real offline model."""

import json
import logging

import pytest
import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    MllamaConfig,
    MllamaForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.generation import configuration_utils
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.testing_utils import CaptureLogger

import oscar_hf
from oscar_hf import OscarCache, OscarConfig, OscarLayer, cache_kwargs
from oscar_hf import config as config_module
from oscar_hf.cache import key_rotation
from oscar_hf.integrations import fused_attention
from oscar_hf.integrations.fused_attention import recording_query_moments
from oscar_hf.reference import query_rotation_choice

GREEDY = dict(do_sample=False, return_dict_in_generate=True)


def _left_padded(lengths, vocab=97, pad=0):
    """A left-padded batch of random prompts of the given lengths (token ids avoid pad/bos/eos)."""
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(3, vocab, (length,))
        mask[row, width - length :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------
# Plumbing with quantization made lossless (tests/conftest.py: ExactOscarCache): positions, masks, flushes,
# residual window, crop and beam reordering must reproduce DynamicCache token for token.


@pytest.mark.parametrize(
    "lengths, config",
    [([150], None), ([150, 90, 20], None), ([150, 90, 20], OscarConfig(key_bits=4, value_bits=2, sink_tokens=0))],
    ids=["single", "left-padded-batch", "left-padded-batch-K4V2"],
)
def test_exact_cache_generate_equals_dynamic_cache(tiny_llama, exact_oscar_cache, lengths, config):
    model = tiny_llama()
    ids, mask = _left_padded(lengths)
    options = dict(max_new_tokens=150, min_new_tokens=150, **GREEDY)  # 150 + 150 tokens: flushes at 128 and 256
    want = model.generate(ids, attention_mask=mask, **cache_kwargs(DynamicCache(config=model.config)), **options)
    cache = exact_oscar_cache(model.config, config)
    got = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), **options)
    assert torch.equal(got.sequences, want.sequences)
    assert cache.layers[0].quantized_length == 256 and cache.get_seq_length() == ids.shape[1] + 149


def test_exact_cache_multi_turn_equals_dynamic_cache(tiny_llama, exact_oscar_cache):
    """A second prompt arriving with history attends to the stored history plus its own exact tokens."""
    model = tiny_llama()
    first, follow_up = torch.randint(3, 97, (1, 100)), torch.randint(3, 97, (1, 70))
    results = []
    for cache in (DynamicCache(config=model.config), exact_oscar_cache(model.config)):
        out = model.generate(first, **cache_kwargs(cache), max_new_tokens=40, min_new_tokens=40, **GREEDY)
        second = torch.cat([out.sequences, follow_up], dim=1)  # 140 cached + 70 new
        out = model.generate(second, **cache_kwargs(cache), max_new_tokens=30, min_new_tokens=30, **GREEDY)
        results.append(out.sequences)
    assert torch.equal(results[0], results[1])


def test_exact_cache_beam_search_equals_dynamic_cache(tiny_llama, exact_oscar_cache):
    model = tiny_llama()
    ids = torch.randint(3, 97, (2, 140))
    options = dict(num_beams=3, num_return_sequences=2, max_new_tokens=20, min_new_tokens=20, **GREEDY)
    want = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), **options)
    got = model.generate(ids, **cache_kwargs(exact_oscar_cache(model.config)), **options)
    assert torch.equal(got.sequences, want.sequences)


def test_exact_cache_prompt_lookup_decoding_crops_and_equals_greedy(tiny_llama, exact_oscar_cache, monkeypatch):
    """Prompt-lookup (assisted) decoding verifies candidate tokens and crops the rejected ones from the cache."""
    model = tiny_llama()
    crops = []
    original = OscarLayer.crop
    monkeypatch.setattr(OscarLayer, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    pattern = torch.randint(3, 97, (1, 9))
    ids = torch.cat([pattern.repeat(1, 14), pattern[:, :4]], dim=1)  # repeats give the lookup candidates
    options = dict(max_new_tokens=60, min_new_tokens=60, do_sample=False)
    want = model.generate(ids, **options)
    got = model.generate(ids, **cache_kwargs(exact_oscar_cache(model.config)), prompt_lookup_num_tokens=5, **options)
    assert torch.equal(got, want)
    assert any(n < 0 for n in crops)


def test_exact_cache_hybrid_sliding_model_equals_dynamic_cache(exact_oscar_cache, gemma3_config):
    model = Gemma3ForCausalLM(gemma3_config).eval()
    ids = torch.randint(3, 97, (1, 140))
    options = dict(max_new_tokens=130, min_new_tokens=130, **GREEDY)
    want = model.generate(ids, **cache_kwargs(DynamicCache(config=model.config)), **options)
    cache = exact_oscar_cache(model.config)
    got = model.generate(ids, **cache_kwargs(cache), **options)
    assert torch.equal(got.sequences, want.sequences)
    assert [type(layer).__name__ for layer in cache.layers][:2] == ["DynamicSlidingWindowLayer", "ExactOscarLayer"]


def tiny_mllama() -> MllamaForConditionalGeneration:
    """A tiny Mllama: text layers 0 and 2 self-attend, layer 1 cross-attends to one 28x28 image tile."""
    vision = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_global_layers=1,
        attention_heads=2,
        image_size=28,
        patch_size=14,
        max_num_tiles=1,
        vision_output_dim=64,
        intermediate_layers_indices=[0],
        supported_aspect_ratios=[[1, 1]],
    )
    text = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        cross_attention_layers=[1],
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=96)
    return MllamaForConditionalGeneration(config).eval()


def test_cross_attention_model_is_refused():
    """Mllama reads the dense `keys` of every cache layer (to find its cross-attention layers' image K/V), which an
    OscarLayer does not hold: refused with the layer type named, not an AttributeError inside the model."""
    model = tiny_mllama()
    message = r"cross-attention layers: this MllamaTextConfig \(cross_attention_layers=\[1\]\)"
    with pytest.raises(ValueError, match=message):
        OscarCache(model.config, OscarConfig(bits=2, sink_tokens=0))
    ids = torch.cat([torch.tensor([[96]]), torch.randint(3, 90, (1, 9))], 1)  # the image token, then text
    inputs = dict(
        input_ids=ids,
        pixel_values=torch.randn(1, 1, 1, 3, 28, 28),
        aspect_ratio_ids=torch.tensor([[1]]),
        aspect_ratio_mask=torch.ones(1, 1, 1, dtype=torch.long),
        cross_attention_mask=torch.ones(1, ids.shape[1], 1, 1, dtype=torch.long),
    )
    assert model.generate(**inputs, max_new_tokens=2, **GREEDY).sequences.shape[1] == 12  # the default cache works
    with pytest.raises(ValueError, match=message):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="oscar")


# ---------------------------------------------------------------------------------------------------------------
# Registration


@pytest.mark.parametrize("bits", [{"bits": 4}, {"key_bits": 4, "value_bits": 2}], ids=["K4V4", "K4V2"])
def test_generate_builds_an_oscar_cache_from_cache_config(tiny_llama, tmp_path, bits):
    model = tiny_llama()
    out = model.generate(
        torch.randint(3, 97, (1, 140)),
        max_new_tokens=4,
        min_new_tokens=4,
        cache_implementation="oscar",
        cache_config={**bits, "residual_length": 64},
        **GREEDY,
    )
    cache = out.past_key_values
    assert isinstance(cache, OscarCache) and cache.oscar_config == OscarConfig(**bits, residual_length=64).resolve(
        "sdpa"
    )
    assert cache.layers[0].quantized().value_codes.shape[2] == 128 * OscarConfig(**bits).value_bits // 32
    assert cache.layers[0].quantized_length == 128 and cache.get_seq_length() == 143
    # generate(cache_implementation=...) leaves the model's own generation config alone: nothing to save or leak
    assert model.generation_config.cache_implementation is None
    model.generation_config.save_pretrained(tmp_path)
    assert "oscar" not in json.dumps(json.loads((tmp_path / "generation_config.json").read_text()))


def test_generate_accepts_an_oscar_config_object(tiny_llama):
    out = tiny_llama().generate(
        torch.randint(3, 97, (1, 140)),
        max_new_tokens=2,
        cache_implementation="oscar",
        cache_config=OscarConfig(bits=4, residual_length=64, sink_tokens=0),
        **GREEDY,
    )
    # method="auto" resolved for this sdpa model: the query rule
    assert out.past_key_values.oscar_config == OscarConfig(bits=4, residual_length=64, method="oscar", sink_tokens=0)
    assert out.past_key_values.layers[0].quantized_length == 128


@pytest.mark.parametrize("given", ["cache_implementation", "past_key_values"])
def test_generate_keeps_what_padding_holds_out_of_the_quantized_history(tiny_llama, given):
    """generate hands the prompt's mask to the cache (`OscarCache.set_padding`), built from `cache_implementation` or
    passed in: a left-padded row's stored history and answer do not depend on the padding's token ids, although its
    100 padding tokens share a key group (of 32) with its real tokens. Without the mask the padding's keys would set
    that group's per-channel min/max."""
    model = tiny_llama(dtype=torch.float64)
    ids, mask = _left_padded([300, 200])
    options = {"scale_dtype": "float32"}
    results = []
    for pad in (0, 7):  # the padding's token ids: what the model computes there changes, nothing else may
        ids = ids.masked_fill(mask == 0, pad)
        if given == "cache_implementation":
            cache = dict(cache_implementation="oscar", cache_config=options)
        else:
            cache = cache_kwargs(OscarCache(model.config, options))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=3, **cache, **GREEDY)
        keys, values = out.past_key_values.layers[0].dense_history()
        results.append((out.sequences[1, 100:], keys[1, :, 100:], values[1, :, 100:]))
    assert out.past_key_values.layers[0].quantized_length == 256
    for got, want in zip(*results):
        assert torch.equal(got, want)


@pytest.mark.parametrize("prompt", [300, 40])
def test_generate_method_oscar_chooses_each_heads_rotation_from_the_prompts_queries(tiny_llama, prompt):
    """The sdpa entry hands each layer the queries of the prefill (its blocks wait for them, exact), and the settled
    choice is the reference's, from the prompt's keys and queries, also for a prompt shorter than a block; on a model
    whose attention does not hand them over, an explicit method="oscar" chooses from the keys alone, saying so once
    with the fix."""
    model = tiny_llama(dtype=torch.float64, num_key_value_heads=4, num_attention_heads=8)
    ids = torch.randint(3, 97, (2, prompt))
    exact, moments = DynamicCache(config=model.config), {}
    with recording_query_moments(moments):
        model(ids, **cache_kwargs(exact))
    options = {"method": "oscar", "scale_dtype": "float32", "bits": 2, "sink_tokens": 0}
    out = model.generate(ids, max_new_tokens=2, cache_implementation="oscar", cache_config=options, **GREEDY)
    chosen = []
    for idx, layer in enumerate(out.past_key_values.layers):
        keys = exact.layers[idx].keys  # the whole prompt
        assert torch.equal(layer.key_rotated, query_rotation_choice(keys, moments[idx], OscarConfig(**options)))
        chosen.append(layer.key_rotated)
    assert torch.cat(chosen).any() and not torch.cat(chosen).all()  # both choices occur: the test can fail
    model.set_attn_implementation("eager")
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: once per process and message
    with CaptureLogger(key_rotation.logger) as captured:
        out = model.generate(ids, max_new_tokens=2, cache_implementation="oscar", cache_config=options, **GREEDY)
    assert captured.out.count("from its keys alone") == 1 and "observe_queries" in captured.out, captured.out
    isotropic = torch.eye(32, dtype=torch.float64).expand(2, 4, 32, 32)
    for layer in out.past_key_values.layers:  # the keys of this run's prompt (eager attention)
        keys = layer.dense_history()[0][:, :, :prompt] if prompt < 128 else None
        if keys is not None:  # a prompt within the residual window: its keys are held exact
            assert torch.equal(layer.key_rotated, query_rotation_choice(keys, isotropic, OscarConfig(**options)))
        assert layer.key_rotated is not None and layer.rotation.final


def test_default_method_is_the_query_rule_where_the_cache_sees_queries_and_the_papers_elsewhere(tiny_llama):
    """The default (method="auto") is the query rule on an sdpa model; on an eager-attention model, whose queries the
    cache cannot see, it is the paper's method, said once in a warning that names the fix, and visible in
    `cache.oscar_config`: tokens and storage are exactly those of method="paper"."""
    model = tiny_llama(dtype=torch.float64)
    ids = torch.randint(3, 97, (1, 150))
    out = model.generate(ids, max_new_tokens=3, cache_implementation="oscar", **GREEDY)
    assert out.past_key_values.oscar_config.method == "oscar"
    assert all(layer.key_rotated is not None for layer in out.past_key_values.layers)
    model.set_attn_implementation("eager")
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once: once per process and message
    with CaptureLogger(config_module.logger) as captured:
        runs = [model.generate(ids, max_new_tokens=3, cache_implementation="oscar", **GREEDY) for _ in range(2)]
    assert captured.out.count("not 'sdpa'") == 1 and "attn_implementation='sdpa'" in captured.out, captured.out
    paper = model.generate(
        ids, max_new_tokens=3, cache_implementation="oscar", cache_config={"method": "paper"}, **GREEDY
    )
    for out in runs:
        cache = out.past_key_values
        assert cache.oscar_config.method == "paper" and cache.layers[0].key_rotated is None
        assert torch.equal(out.sequences, paper.sequences)
        for got, want in zip(cache.layers[0].dense_history(), paper.past_key_values.layers[0].dense_history()):
            assert torch.equal(got, want)


def test_other_cache_implementations_are_untouched(tiny_llama):
    model = tiny_llama()
    ids = torch.randint(3, 97, (1, 20))
    for options in ({}, {"cache_implementation": "dynamic"}):
        out = model.generate(ids, max_new_tokens=3, **options, **GREEDY)
        assert type(out.past_key_values) is DynamicCache


def test_register_is_idempotent_and_unregister_restores_transformers(tiny_llama):
    from transformers.generation.utils import GenerationMixin

    wrapped = GenerationMixin._prepare_cache_for_generation
    oscar_hf.register()
    assert GenerationMixin._prepare_cache_for_generation is wrapped
    assert configuration_utils.ALL_CACHE_IMPLEMENTATIONS.count("oscar") == 1
    model = tiny_llama()
    try:
        oscar_hf.unregister()
        assert "oscar" not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS
        assert not hasattr(GenerationMixin._prepare_cache_for_generation, "_oscar_original")
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward
        with pytest.raises(ValueError, match="cache_implementation"):
            model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=2, cache_implementation="oscar")
    finally:
        oscar_hf.register()
    assert GenerationMixin._prepare_cache_for_generation is not wrapped  # a fresh wrapper of the original
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is fused_attention.fused_sdpa
    out = model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=2, cache_implementation="oscar", **GREEDY)
    assert isinstance(out.past_key_values, OscarCache)


class _Attention(torch.nn.Module):
    """What transformers' sdpa reads from an attention module."""

    is_causal = True
    layer_idx, num_key_value_groups = 0, 2


def test_the_sdpa_entry_traces_in_one_graph():
    """The registered sdpa entry is a plain function that dynamo traces whole, as a compiled forward (a chunked
    prefill, a decode step) calls it: a `functools.wraps(functools.partial(...))` wrapper made
    `generate(prefill_chunk_size=...)` under compile fail with "can't trace functools.wraps" (issue 37). Calls whose
    keys carry no fused step give transformers' own sdpa."""
    module = _Attention()
    query, keys, values = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)

    def attend(query, keys, values):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, keys, values, None, scaling=0.25)[0]

    torch._dynamo.reset()
    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    expected = sdpa_attention_forward(module, query, keys, values, None, scaling=0.25)[0]
    torch.testing.assert_close(compiled(query, keys, values), expected, atol=0, rtol=0)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is fused_attention.fused_sdpa


def test_bad_generate_arguments_are_refused(tiny_llama):
    model = tiny_llama()
    ids = torch.randint(3, 97, (1, 5))
    with pytest.raises(ValueError, match=r"Unknown OscarCache option\(s\) \['nbits'\]; valid options are"):
        model.generate(ids, max_new_tokens=2, cache_implementation="oscar", cache_config={"nbits": 2})
    with pytest.raises(ValueError, match="bits=5"):
        model.generate(ids, max_new_tokens=2, cache_implementation="oscar", cache_config={"bits": 5})
    with pytest.raises(ValueError, match="past_key_values"):
        model.generate(ids, max_new_tokens=2, cache_implementation="oscar", **cache_kwargs(DynamicCache()))


def test_encoder_decoder_model_is_refused():
    config = T5Config(vocab_size=50, d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(config).eval()
    with pytest.raises(ValueError, match="decoder-only"):
        model.generate(torch.randint(3, 50, (1, 5)), max_new_tokens=2, cache_implementation="oscar")


def test_latent_attention_model_is_refused():
    """DeepSeek-V3's multi-head latent attention caches a latent and a rotary part in place of K/V: quantizing them as
    K/V would be silently wrong, so both ways of building the cache refuse it."""
    config = DeepseekV3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=64,
        q_lora_rank=None,
        qk_rope_head_dim=32,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    )
    message = r"multi-head latent attention: this DeepseekV3Config \(kv_lora_rank=64, qk_rope_head_dim=32\)"
    with pytest.raises(ValueError, match=message):
        OscarCache(config, OscarConfig(bits=2, sink_tokens=0))
    model = DeepseekV3ForCausalLM(config).eval()
    with pytest.raises(ValueError, match=message):
        model.generate(torch.randint(3, 97, (1, 5)), max_new_tokens=2, cache_implementation="oscar")


# ---------------------------------------------------------------------------------------------------------------
# A real model, offline: SmolLM2-135M-Instruct (head_dim 64, 3 KV heads), float32 on the CPU.

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _passkey_prompt(key: str, repeats: int) -> str:
    return (
        f"There is an important pass key hidden in this text. Remember it. The pass key is {key}. "
        + FILLER * repeats
        + "What is the pass key? The pass key is"
    )


@pytest.mark.slow
def test_real_model_retrieves_a_passkey_from_quantized_history(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer(_passkey_prompt("71432", 14), return_tensors="pt")
    assert inputs.input_ids.shape[1] > 300  # the passkey sits in the quantized blocks, far from the residual
    options = dict(max_new_tokens=8, **GREEDY)
    baseline = model.generate(**inputs, **options)
    out = model.generate(**inputs, cache_implementation="oscar", **options)
    new = slice(inputs.input_ids.shape[1], None)
    assert "71432" in tokenizer.decode(baseline.sequences[0, new])  # the task is within the model's reach
    assert "71432" in tokenizer.decode(out.sequences[0, new])
    memory = out.past_key_values.memory_footprint()
    assert out.past_key_values.layers[0].quantized_length == 256
    assert memory.quantized_ratio_vs_bf16 >= 4  # 5.19x at head_dim 64 with fp16 scales and 3 KV heads


@pytest.mark.slow
def test_real_model_left_padded_batch_answers_like_each_row_alone(smollm2):
    """Rows of a left-padded batch give the same answer as alone. Plumbing equality is exact (see the exact-cache
    tests); with real 2-bit codes the padding shifts which tokens share a key quantization group, so later tokens
    may differ slightly, as they would between any two quantization layouts."""
    model, tokenizer = smollm2
    prompts = [_passkey_prompt("71432", 14), _passkey_prompt("5809", 9)]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    options = dict(max_new_tokens=5, cache_implementation="oscar", do_sample=False)
    together = model.generate(**batch, **options)[:, batch.input_ids.shape[1] :]
    for row, prompt in enumerate(prompts):
        inputs = tokenizer(prompt, return_tensors="pt")
        alone = model.generate(**inputs, **options)[0, inputs.input_ids.shape[1] :]
        assert torch.equal(together[row], alone), (tokenizer.decode(together[row]), tokenizer.decode(alone))


@pytest.mark.slow
def test_real_model_beam_search_runs(smollm2):
    model, tokenizer = smollm2
    inputs = tokenizer(_passkey_prompt("2718", 12), return_tensors="pt")
    out = model.generate(**inputs, num_beams=2, max_new_tokens=6, cache_implementation="oscar", **GREEDY)
    assert "2718" in tokenizer.decode(out.sequences[0, inputs.input_ids.shape[1] :])
