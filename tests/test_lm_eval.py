"""The lm-eval wrapper: scoring through the cache, agreement with lm-eval's HFLM, and the oscar-eval CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer, Gemma3ForCausalLM, Gemma3TextConfig, LlamaForCausalLM

from oscar_hf import OscarCache, OscarConfig, cache_kwargs
from oscar_hf.cache import key_rotation
from oscar_hf.integrations.lm_eval import METHODS, OscarHFLM, effective_avg_bits, kv_heads_and_dim
from oscar_hf.integrations.transformers import CACHE_KWARG
from oscar_hf.offline_models import model_path

EVAL_CONFIGS = Path(__file__).resolve().parents[1] / "eval_configs"
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "seven", "wizards", "judge", "boxing"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(model_path("smollm2-135m"))


def tiny_gemma3(vocab_size: int) -> Gemma3ForCausalLM:
    """Hybrid layers: one sliding-window (kept by OscarCache as transformers' own layer), one full attention."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    )
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def model(tokenizer, tiny_llama):
    return llama(tiny_llama, tokenizer)


def llama(tiny_llama, tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=4096)


def text(n_words: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n_words,), generator=g).tolist())


def requests(kind: str, pairs) -> list[Instance]:
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(pairs)]


# Contexts past the 128-token residual window (so oscar quantizes some of them), one sharing a context twice, and
# continuations of one token (scored from the prefill alone) and several tokens (scored through the cache).
PAIRS = [(text(300, 0), " " + text(6, 1)), (text(300, 0), " " + text(1, 2)), (text(150, 3), " " + text(9, 4))]


def test_bf16_loglikelihood_matches_hflm(model, tokenizer):
    expected = HFLM(pretrained=model, tokenizer=tokenizer).loglikelihood(requests("loglikelihood", PAIRS))
    got = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="bf16").loglikelihood(
        requests("loglikelihood", PAIRS)
    )
    for (ll, greedy), (ll_ref, greedy_ref) in zip(got, expected, strict=True):
        assert ll == pytest.approx(ll_ref, abs=1e-4)
        assert greedy == greedy_ref


def test_bf16_rolling_matches_hflm(model, tokenizer):
    # max_length 256 splits the document into several windows; each goes through the cache in 128-token chunks.
    docs = requests("loglikelihood_rolling", [(text(700, 5),)])
    expected = HFLM(pretrained=model, tokenizer=tokenizer, max_length=256).loglikelihood_rolling(docs)
    got = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="bf16", max_length=256).loglikelihood_rolling(docs)
    assert got == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    "method",
    # transformers' QuantizedCache backends are baselines, and slow on a CPU (quanto: minutes)
    [
        "oscar-int2",
        "oscar-auto-3.6",
        "kivi-int2",
        pytest.param("hf-quanto-int2", marks=pytest.mark.slow),
        "hf-hqq-int2",
        "tiny-turboquant-k3v2",
        "tiny-turboquant-k4v4",
    ],
)
def test_quantized_scores_differ_and_are_finite(model, tokenizer, method):
    pytest.importorskip({"hf-quanto-int2": "optimum.quanto", "hf-hqq-int2": "hqq"}.get(method, "oscar_hf"))
    base = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="bf16")
    quantized = OscarHFLM(pretrained=model, tokenizer=tokenizer, method=method)
    ll_base = [ll for ll, _ in base.loglikelihood(requests("loglikelihood", PAIRS))]
    ll_quant = [ll for ll, _ in quantized.loglikelihood(requests("loglikelihood", PAIRS))]
    assert all(math.isfinite(x) for x in ll_quant)
    assert ll_quant[1] == pytest.approx(ll_base[1], abs=1e-5)  # one token: the exact prefill's prediction
    assert ll_quant[0] != pytest.approx(ll_base[0], abs=1e-4)  # later tokens attend to the quantized context
    docs = requests("loglikelihood_rolling", [(text(500, 6),)])
    (rolled,) = quantized.loglikelihood_rolling(docs)
    (rolled_base,) = base.loglikelihood_rolling(docs)
    assert math.isfinite(rolled) and rolled != pytest.approx(rolled_base, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3-hybrid"])
def test_shared_prefill_equals_prefill_through_the_cache(tokenizer, tiny_llama, arch):
    """The wrapper fills each method's cache from one exact prefill: that must equal prefilling the cache itself."""
    model = llama(tiny_llama, tokenizer) if arch == "llama" else tiny_gemma3(len(tokenizer))
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="oscar-int2")
    context = tokenizer(PAIRS[0][0]).input_ids
    continuation = tokenizer(PAIRS[0][1]).input_ids
    got = wrapper._continuation_logprobs(context, continuation)
    with torch.no_grad():
        cache = OscarCache(model.config, OscarConfig(bits=2, sink_tokens=0))
        first = model(torch.tensor([context]), **cache_kwargs(cache)).logits[0, -1:]
        rest = model(torch.tensor([continuation[:-1]]), **cache_kwargs(cache)).logits[0]
    expected = torch.log_softmax(torch.cat([first, rest]).float(), dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_the_shared_prefill_records_the_queries_a_cache_with_sinks_reads(tokenizer, tiny_llama, monkeypatch):
    """With S sinks the query rule reads S positions more than without (`KeyRotation.horizon`): the wrapper's exact
    prefill records the queries of those positions too, so the filled cache holds the query moment its own prefill
    would (a context longer than the horizon: `CHOICE_TOKENS` made 160 here), and scores the same."""
    monkeypatch.setattr(key_rotation, "CHOICE_TOKENS", 160)  # `choice_horizon` reads it, for the cache and the wrapper
    model = llama(tiny_llama, tokenizer)
    context = tokenizer(PAIRS[0][0]).input_ids
    continuation = tokenizer(PAIRS[0][1]).input_ids
    assert len(context) > 160 + 32
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="oscar-int2", cache_config={"sink_tokens": 32})
    _, filled = wrapper._prefill(context)
    got = wrapper._continuation_logprobs(context, continuation)
    with torch.no_grad():
        cache = OscarCache(model.config, OscarConfig(bits=2, sink_tokens=32))
        first = model(torch.tensor([context]), **cache_kwargs(cache)).logits[0, -1:]
        moments = [layer.rotation.moment.clone() for layer in cache.layers]
        rest = model(torch.tensor([continuation[:-1]]), **cache_kwargs(cache)).logits[0]
    for layer, moment in zip(filled.layers, moments):
        torch.testing.assert_close(layer.rotation.moment, moment, rtol=1e-5, atol=1e-6)
    expected = torch.log_softmax(torch.cat([first, rest]).float(), dim=-1)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("method", "implementation"), [("oscar-int2", "oscar"), ("hf-quanto-int4", "quantized"), ("bf16", None)]
)
def test_generate_until_uses_the_method_cache(model, tokenizer, monkeypatch, method, implementation):
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method=method)
    seen = {}
    original = model.generate

    def spy(*args, **kwargs):
        # what the wrapper passed, as passed: transformers 5.17 adds keys to the cache_config it gets (5.20 copies it)
        seen.update({name: dict(value) if isinstance(value, dict) else value for name, value in kwargs.items()})
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    (out,) = wrapper.generate_until(
        requests("generate_until", [(PAIRS[0][0], {"until": ["\n"], "max_gen_toks": 4, "do_sample": False})])
    )
    assert isinstance(out, str)
    assert seen.get("cache_implementation") == implementation
    assert seen.get("cache_config") == (METHODS[method][1] or None)


def test_generate_until_hands_tiny_turboquant_its_cache(model, tokenizer, monkeypatch):
    """tiny-turboquant's cache is no cache_implementation of transformers: generate gets a fresh TinyKVCache object,
    and stores the prompt in it (quantized past its 128 to 255 exact recent tokens)."""
    from tiny_turboquant import TinyKVCache
    from tiny_turboquant.cache import TinyKVLayer

    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="tiny-turboquant-k3v2")
    seen = {}
    original = model.generate

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", spy)
    wrapper.generate_until(
        requests("generate_until", [(PAIRS[0][0], {"until": ["\n"], "max_gen_toks": 4, "do_sample": False})])
    )
    cache = seen[CACHE_KWARG]
    assert isinstance(cache, TinyKVCache) and "cache_implementation" not in seen
    assert (cache.key_bits, cache.value_bits, cache.value_group_size) == (3, 2, 32)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(type(layer) is TinyKVLayer and layer._n_quantized > 0 for layer in cache.layers)


@pytest.mark.parametrize(
    ("method", "layer_class"),
    [
        ("oscar-int2", "OscarLayer"),
        ("hf-quanto-int4", "QuantoQuantizedLayer"),
        ("tiny-turboquant-k4v4", "TinyKVLayer"),
    ],
)
def test_the_shared_prefill_fills_each_method_cache(model, tokenizer, method, layer_class):
    """Every layer of the cache the wrapper scores through is the method's own (tiny-turboquant's cache creates its
    layers as they are first updated), and holds the context."""
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method=method)
    context = tokenizer(PAIRS[0][0]).input_ids
    _, cache = wrapper._prefill(context)
    assert [type(layer).__name__ for layer in cache.layers] == [layer_class] * model.config.num_hidden_layers
    assert cache.get_seq_length() == len(context)


def test_rolling_perplexity_chooses_auto_bits_after_the_first_chunk(model, tokenizer, monkeypatch):
    """bits="auto" in perplexity scoring: the widths are chosen once the first chunk is in (it read nothing
    quantized), before the second chunk reads the history, and within the budget."""
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="oscar-auto-3.6", rolling_chunk=32)
    caches = []
    make_cache = wrapper.make_cache
    monkeypatch.setattr(wrapper, "make_cache", lambda: caches.append(make_cache()) or caches[-1])
    forward = wrapper.model.forward
    open_at_call = []

    def recording_forward(*args, **kwargs):
        open_at_call.append(caches[-1].bits_open)
        return forward(*args, **kwargs)

    monkeypatch.setattr(wrapper.model, "forward", recording_forward)
    (rolled,) = wrapper.loglikelihood_rolling(requests("loglikelihood_rolling", [(text(500, 6),)]))
    assert math.isfinite(rolled) and len(open_at_call) > 2
    assert open_at_call[0] and not any(open_at_call[1:])  # the second chunk already reads the chosen widths
    assert caches[-1].average_bits() <= 3.6  # chosen within the budget (all 4-bit would store 5.125)


def test_the_shared_prefill_chooses_auto_bits_within_the_budget(model, tokenizer):
    """bits="auto": the context is the prompt, so the wrapper's prefill chooses every layer's widths, and the
    recorded `avg_bits` is the budget they stay within."""
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="oscar-auto-3.6")
    _, cache = wrapper._prefill(tokenizer(PAIRS[0][0]).input_ids)
    assert not any(layer.bits_open for layer in cache.layers)
    assert cache.average_bits() <= wrapper.avg_bits == 3.6


def test_a_full_length_cache_is_not_filled_from_a_sliding_window_prefill(tokenizer):
    """tiny-turboquant keeps sliding-window layers full-length; the shared exact prefill kept only their window, so
    replaying it would leave the layer short of the context (and its positions wrong): refused, naming the cause."""
    model = tiny_gemma3(len(tokenizer))
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="tiny-turboquant-k3v2")
    with pytest.raises(ValueError, match="layer 0 of the 'tiny-turboquant-k3v2' cache keeps every token"):
        wrapper._prefill(tokenizer(PAIRS[0][0]).input_ids)


def stored_bits(cache) -> tuple[int, int]:
    """(bits stored for the quantized region, its K/V elements) of layer 0 of a cache, read from the tensors its
    implementation keeps (the exact recent window left out, as `avg_bits` leaves it out)."""
    layer = cache.layers[0]
    name = type(layer).__name__
    if name == "OscarLayer":
        memory = layer.memory()
        return 8 * memory.quantized_bytes, memory.quantized_bf16_bytes // 2
    if name == "QuantoQuantizedLayer":  # quanto's WeightQBitsTensor: packed codes, scale and shift per group
        tensors = [(q._data._data, q._scale, q._shift, q) for q in (layer._quantized_keys, layer._quantized_values)]
        return sum(8 * t.nbytes for parts in tensors for t in parts[:3]), sum(parts[3].numel() for parts in tensors)
    if name == "HQQQuantizedLayer":  # hqq: packed codes and (scale, zero) in `meta`
        parts = (layer._quantized_keys, layer._quantized_values)
        bits = sum(8 * (codes.nbytes + meta["scale"].nbytes + meta["zero"].nbytes) for codes, meta in parts)
        return bits, sum(math.prod(meta["shape"]) for _, meta in parts)
    if name == "TinyKVLayer":
        elements = 2 * layer._n_quantized * math.prod(layer._residual_keys.shape) // layer._residual_keys.shape[-2]
        return 8 * layer.memory_report()["compressed_storage_bytes"], elements
    raise AssertionError(f"no byte count for {name}")


@pytest.mark.parametrize(
    "method",
    [
        "oscar-int2",
        "oscar-int4",
        "kivi-int2",
        "oscar-k4v2",
        "hf-quanto-int2",
        "hf-quanto-int4",
        "hf-hqq-int2",
        "tiny-turboquant-k3v2",
        "tiny-turboquant-k4v4",
    ],
)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_avg_bits_is_what_the_cache_stores(tokenizer, tiny_llama, method, head_dim):
    """The `avg_bits` each accuracy entry records equals the bits the method's own cache holds per quantized K/V
    element, in a bf16 model (QuantizedCache keeps its scales and zero points in the model's dtype)."""
    model = tiny_llama(dtype=torch.bfloat16, vocab_size=len(tokenizer), head_dim=head_dim)
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method=method)
    cache = wrapper.make_cache()
    shape = (1, model.config.num_key_value_heads, 512, head_dim)
    cache.update(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16), 0)
    bits, elements = stored_bits(cache)
    assert elements >= 2 * math.prod(shape) // 2  # at least half of the tokens are quantized
    assert wrapper.avg_bits == bits / elements


def held_bits(cache) -> int:
    """Every bit layer 0 of a cache holds (quantized region, exact sinks and recent tokens), from its tensors."""
    layer = cache.layers[0]
    name = type(layer).__name__
    if name == "OscarLayer":
        return 8 * layer.memory().total_bytes
    if name == "TinyKVLayer":
        return 8 * layer.memory_report()["total_storage_bytes"]
    bits, _ = stored_bits(cache)  # QuantizedCache: the quantized tokens, then its window `keys` and `values`
    return bits + 8 * (layer.keys.nbytes + layer.values.nbytes)


@pytest.mark.parametrize(
    "method",
    ["bf16", "oscar-int2", "oscar-k4v2", "oscar-int2-sinks4", "hf-quanto-int2", "tiny-turboquant-k3v2"],
)
def test_effective_bits_is_what_the_cache_holds_over_a_decode(tokenizer, tiny_llama, method):
    """`effective_avg_bits` at a context is what the method's cache holds per K/V element, exact tokens included,
    averaged over a decode's cycle through its window (128 steps after a 512-token prompt, bf16 model): the held bits
    are linear in the context, so their mean over the cycle is the count at the cycle's mean context."""
    model = tiny_llama(dtype=torch.bfloat16, vocab_size=len(tokenizer), head_dim=64)
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method=method)
    cache = wrapper.make_cache()
    heads, dim = kv_heads_and_dim(model.config)
    shape = (1, heads, 512, dim)
    cache.update(torch.randn(shape, dtype=torch.bfloat16), torch.randn(shape, dtype=torch.bfloat16), 0)
    held, contexts = [], []
    for step in range(1, 129):
        token = torch.randn(1, heads, 1, dim, dtype=torch.bfloat16)
        cache.update(token, token.clone(), 0)
        held.append(held_bits(cache) if METHODS[method][0] else 16 * 2 * heads * dim * (512 + step))
        contexts.append(512 + step)
    context = sum(contexts) / len(contexts)
    measured = sum(held) / (2 * heads * dim * context * len(held))
    assert effective_avg_bits(method, wrapper.cache_config, dim, heads, context) == pytest.approx(measured, rel=1e-12)
    assert measured > wrapper.avg_bits or method == "bf16"  # the exact tokens cost more than the quantized ones


def test_bad_method_or_option_fails_early(model, tokenizer):
    with pytest.raises(ValueError, match="Unknown method"):
        OscarHFLM(pretrained=model, tokenizer=tokenizer, method="int2")
    with pytest.raises(ValueError, match="Unknown OscarCache option"):
        OscarHFLM(pretrained=model, tokenizer=tokenizer, method="oscar-int2", cache_config={"bitz": 2})


def test_an_oscar_config_is_taken_whole_where_the_method_agrees(model, tokenizer):
    config = OscarConfig(bits=4, residual_length=64, sink_tokens=0)
    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="oscar-int4", cache_config=config)
    # taken whole, with method="auto" resolved for this sdpa model: the query rule
    assert wrapper.make_cache().oscar_config == OscarConfig(bits=4, residual_length=64, method="oscar", sink_tokens=0)
    assert wrapper.rolling_chunk == 64
    with pytest.raises(ValueError, match=r"'kivi-int2' sets .* but the OscarConfig has \{'rotation': True"):
        OscarHFLM(
            pretrained=model, tokenizer=tokenizer, method="kivi-int2", cache_config=OscarConfig(bits=2, sink_tokens=0)
        )
    with pytest.raises(ValueError, match="does not use an OscarCache"):
        OscarHFLM(pretrained=model, tokenizer=tokenizer, method="bf16", cache_config=OscarConfig(bits=2, sink_tokens=0))


def test_oscar_eval_help_is_its_own_lists_the_methods_and_imports_nothing_heavy():
    """`--help` imports neither lm-eval nor oscar_hf (whose registration imports torch and transformers): those take
    seconds, the help a tenth of one."""
    probe = (
        "import sys\nfrom oscar_eval import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('imported:', sorted({'lm_eval', 'oscar_hf', 'torch', 'transformers'} & set(sys.modules)))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("usage: oscar-eval") and "imported: []" in result.stdout, result.stdout
    for method, (_, options) in METHODS.items():
        assert f"  {method} " in result.stdout and str(options or "DynamicCache") in result.stdout, method
    assert "--model MODEL" not in result.stdout  # lm-eval's own usage is behind --lm-eval-help


def test_oscar_eval_without_lm_eval_names_the_install(monkeypatch):
    """Issue 38: lm-eval is an extra; without it, oscar-eval says how to install it instead of a bare import error."""
    import oscar_eval

    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # `import lm_eval.__main__` fails as if not installed
    with pytest.raises(SystemExit, match=r'lm-eval.*pip install -e "\.\[eval\]"'):
        oscar_eval.main(["--tasks", "oscar_passkey_1k"])


def test_oscar_eval_hides_lm_eval_advice_that_does_not_apply(monkeypatch, caplog):
    import logging

    import lm_eval.__main__

    import oscar_eval

    def fake_cli():  # what lm-eval logs while loading one of our tasks, and a warning that does apply
        task_logger = logging.getLogger("lm_eval.api.task")
        task_logger.warning("oscar_passkey_1k: Custom kwargs can be passed to `--metadata` in console (as json string)")
        task_logger.warning("--limit SHOULD ONLY BE USED FOR TESTING.")

    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", fake_cli)
    monkeypatch.setattr(sys, "argv", ["oscar-eval"])
    with caplog.at_level(logging.WARNING):
        oscar_eval.main(["--tasks", "oscar_passkey_1k"])
    assert sys.argv == ["oscar-eval", "--tasks", "oscar_passkey_1k", "--model", "oscar-hf"]
    assert "--metadata" not in caplog.text and "--limit SHOULD ONLY" in caplog.text


@pytest.mark.slow
def test_oscar_eval_cli_end_to_end(tmp_path, monkeypatch):
    """The console script on the real SmolLM2, offline, one document each of a likelihood and a generation task."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if not (EVAL_CONFIGS / "data" / "niah_1k.jsonl").exists():  # never rebuild over the user's (or a benchmark's) data
        subprocess.run([sys.executable, str(EVAL_CONFIGS / "build_data.py"), "--lengths", "1k"], check=True)
    script = Path(sys.executable).with_name("oscar-eval")
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from oscar_eval import main; main()"]
    run = subprocess.run(
        [
            *command,
            "--model_args",
            "pretrained=smollm2-135m",
            "--method",
            "oscar-int2",
            "--cache_config",
            '{"residual_length": 64}',
            "--include_path",
            str(EVAL_CONFIGS),
            "--tasks",
            "oscar_niah_1k,oscar_passkey_gen_1k",
            "--limit",
            "1",
            "--output_path",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # the task data must load from anywhere, not only from the repository root
    )
    assert run.returncode == 0, run.stderr[-5000:]
    # lm-eval's warnings that do not apply to oscar-hf runs are not shown
    assert "not of type `str`" not in run.stderr and "--metadata" not in run.stderr, run.stderr[-5000:]
    (result_file,) = tmp_path.rglob("results_*.json")
    results = json.loads(result_file.read_text())
    assert results["config"]["model"] == "oscar-hf"
    assert results["config"]["model_args"]["cache_config"] == {"residual_length": 64}
    assert 0.0 <= results["results"]["oscar_niah_1k"]["acc,none"] <= 1.0
    assert 0.0 <= results["results"]["oscar_passkey_gen_1k"]["exact_match,first_number"] <= 1.0
