"""`cache_implementation="oscar"` in transformers' continuous batching: every request's greedy tokens equal
`generate(cache_implementation="oscar")`'s for the same prompt and options (tiny random models, CPU: a GQA Llama and a
Gemma 3 sliding/full hybrid; prompts below, at and past a page and over several; requests joining while others decode;
prompts the scheduler splits; shared prefixes); with lossless quantization they equal stock continuous batching's;
what the pool cannot serve is refused with an error naming what to do."""

import functools
import subprocess
import sys

import pytest
import serving_calls
import torch
import transformers
from serving_calls import cb_config, generation_config, random_prompts, submit_while_decoding
from transformers import GenerationConfig
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache

import oscar_hf
from oscar_hf.serving.pages import PageCodec
from oscar_hf.serving.pool import OscarPagedCache

NEW_TOKENS = 24
# Lengths around a page (128 tokens) with the default 4 sinks: below, at, past it, and over several pages.
PROMPTS = (5, 127, 132, 133, 300, 700)


# every call here generates NEW_TOKENS tokens
generate_batch = functools.partial(serving_calls.generate_batch, new_tokens=NEW_TOKENS)
generate = functools.partial(serving_calls.generate, new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def llama(tiny_llama):
    """A tiny GQA Llama with no end-of-sequence token (every request generates all its tokens)."""
    torch.manual_seed(0)
    return tiny_llama(eos_token_id=None)


@pytest.fixture(scope="module")
def gemma(tiny_gemma3):
    """A tiny Gemma 3: sliding-window (16 tokens) and full-attention layers alternate."""
    torch.manual_seed(0)
    return tiny_gemma3(eos_token_id=None)


@pytest.mark.parametrize(
    "options",
    [{}, {"sink_tokens": 0}, {"key_bits": 4, "value_bits": 2, "sink_tokens": 2}, {"key_bits": 3, "value_bits": 2}],
    ids=["2bit", "nosinks", "k4v2", "k3v2"],
)
def test_llama_tokens_equal_generate(llama, options):
    """All prompts fit one batch's token budget (no prompt is split: split prompts have a test of their own)."""
    prompts = random_prompts(PROMPTS)
    batched = generate_batch(llama, prompts, options)
    assert batched == [generate(llama, p, options) for p in prompts]


def test_bfloat16_tokens_equal_generate(tiny_llama):
    """In bfloat16 too (where a prompt split differently from generate's would change tokens: none is split here)."""
    torch.manual_seed(0)
    model = tiny_llama(dtype=torch.bfloat16, eos_token_id=None)
    prompts = random_prompts(PROMPTS)
    assert generate_batch(model, prompts, {}) == [generate(model, p, {}) for p in prompts]


def test_eager_attention_tokens_equal_generate(tiny_llama):
    """A model loaded with eager attention runs on transformers' paged eager attention, switched back afterwards."""
    torch.manual_seed(0)
    model = tiny_llama(eos_token_id=None, attn_implementation="eager")
    prompts = random_prompts((40, 260), seed=5)
    batched = generate_batch(model, prompts, {})
    assert model.config._attn_implementation == "eager"
    assert batched == [generate(model, p, {}) for p in prompts]
    with pytest.raises(ValueError, match="default_compile_level at 0"):
        model.init_continuous_batching(
            generation_config=generation_config({}, NEW_TOKENS),
            continuous_batching_config=cb_config(default_compile_level=1),
        )
    assert model.config._attn_implementation == "eager"  # switched to paged|eager, then back when refused


def test_gemma3_hybrid_tokens_equal_generate(gemma):
    """Sliding-window layers stay exact (transformers' allocator), full-attention ones go to 2-bit pages."""
    prompts = random_prompts((3, 130, 260))
    batched = generate_batch(gemma, prompts, {})
    assert batched == [generate(gemma, p, {}) for p in prompts]


def test_quantization_changes_tokens(llama):
    """The equalities above are not vacuous: on these prompts 2-bit pages change tokens against exact attention."""
    prompts = random_prompts(PROMPTS)
    assert generate_batch(llama, prompts, {"sink_tokens": 0}) != generate_batch(llama, prompts, None)


def test_lossless_pool_equals_stock_continuous_batching(llama, monkeypatch):
    """With pages that read back exactly what was written, the pool's plumbing (tails, sinks, page boundaries, the
    plan's gathers) gives stock continuous batching's tokens."""
    written = []

    class ExactPageCodec(PageCodec):
        """Pages are quantized and stored as usual, and read back as the exact K/V that went in."""

        def __init__(self, config, pages, backend):
            super().__init__(config, pages, backend)
            self.exact = {}

        def write(self, layer, blocks, keys, values):
            super().write(layer, blocks, keys, values)
            for i, block in enumerate(blocks.tolist()):
                self.exact[layer, block] = keys[i].clone(), values[i].clone()
            written.append(len(blocks))

        def read(self, layer, blocks, dtype):
            super().read(layer, blocks, dtype)
            pages = [self.exact[layer, block] for block in blocks.tolist()]
            return tuple(torch.stack(kv).to(dtype) for kv in zip(*pages))

    monkeypatch.setattr(OscarPagedCache, "codec_class", ExactPageCodec)
    prompts = random_prompts(PROMPTS, seed=1)
    assert generate_batch(llama, prompts, {}) == generate_batch(llama, prompts, None)
    assert sum(written) > 0


def test_prompts_split_by_the_scheduler_equal_chunked_generate(llama):
    """A prompt longer than the batch's token budget is prefilled in chunks; each chunk attends to the pages the earlier
    ones left, as generate's chunked prefill does (`prefill_chunk_size`)."""
    prompts = random_prompts((700,), seed=2)
    batched = generate_batch(llama, prompts, {}, max_batch_tokens=256)
    assert batched == [generate(llama, prompts[0], {}, prefill_chunk_size=256)]


def test_requests_joining_while_others_decode(llama):
    """Requests submitted while earlier ones decode join the running batch."""
    prompts = random_prompts((300, 5, 140, 70), seed=3)
    tokens = submit_while_decoding(llama, prompts, generation_config({}, NEW_TOKENS), cb_config(), timeout=10)
    assert tokens == [generate(llama, p, {}) for p in prompts]


def test_shared_prefix_pages(llama, monkeypatch):
    """Without sinks, a request starting with a finished one's complete pages shares them; its suffix attends to them
    as generate's chunked prefill attends to its first chunk."""
    matches = []
    search = OscarPagedCache.search_prefix_match

    def spy(self, request_id, prompt_ids):
        matches.append(search(self, request_id, prompt_ids))
        return matches[-1]

    monkeypatch.setattr(OscarPagedCache, "search_prefix_match", spy)
    options = {"sink_tokens": 0}
    prefix, first, second = random_prompts((256, 40, 60), seed=4)
    manager = llama.init_continuous_batching(
        generation_config=generation_config(options, NEW_TOKENS), continuous_batching_config=cb_config()
    )
    manager.start()
    try:
        tokens = []
        for suffix in (first, second):
            request = manager.add_request(prefix + suffix)
            output = manager.get_result(request, timeout=30)
            assert output is not None and output.error is None, output
            tokens.append(output.generated_tokens)
    finally:
        manager.stop(block=True)
    assert matches == [0, 256]
    assert tokens[0] == generate(llama, prefix + first, options)
    assert tokens[1] == generate(llama, prefix + second, options, prefill_chunk_size=256)


@pytest.mark.parametrize("options", [{}, {"sink_tokens": 0}], ids=["sinks", "shared-pages"])
def test_forked_sequences_equal_chunked_generate(llama, options, monkeypatch):
    """`num_return_sequences` > 1: transformers prefills all but a prompt's last token, then forks the request; each
    child gets the parent's pages (copied, or without sinks shared), a copy of its tail and its quantized count.
    Sampling from the single best token (`top_k=1`), every sequence equals generate's with the prompt split there
    (`prefill_chunk_size`)."""
    copies = []
    copy = OscarPagedCache.perform_cache_copy

    def copied(pool, pairs):
        allocators = {**pool.cache_allocators, pool.tails.layer_type: pool.tails}
        copy(pool, pairs)
        for name, (src, dst) in pairs.items():  # every child's blocks hold its parent's bytes
            view = allocators[name]._copy_view
            assert torch.equal(view[src], view[dst]), name
        copies.append({name: len(src) for name, (src, _) in pairs.items()})

    monkeypatch.setattr(OscarPagedCache, "perform_cache_copy", copied)
    prompts = random_prompts((134, 300), seed=6)  # one page held at the fork, two pages
    config = generation_config(options, 6, do_sample=True, top_k=1, num_return_sequences=3)
    outputs = llama.generate_batch(prompts, generation_config=config, continuous_batching_config=cb_config())
    assert len(outputs) == 6 and all(o.error is None for o in outputs.values()), outputs
    for i, prompt in enumerate(prompts):
        expected = serving_calls.generate(llama, prompt, options, 6, prefill_chunk_size=len(prompt) - 1)
        for child in ("", "__child#0", "__child#1"):
            assert outputs[f"req_{i}{child}"].generated_tokens == expected, (i, child)
    pages, tails = sum(c.get("full_attention", 0) for c in copies), sum(c.get("oscar_tail", 0) for c in copies)
    assert tails == 4 and pages == (0 if options else 2 * (1 + 2)), copies  # two children a prompt


def test_request_longer_than_the_pool_is_refused(llama):
    manager = llama.init_continuous_batching(
        generation_config=generation_config({}, NEW_TOKENS), continuous_batching_config=cb_config(num_blocks=8)
    )
    manager.warmup()  # builds the pool, as generate_batch and transformers serve do before any request
    manager.start()
    try:
        limit = manager.batch_processor.cache.max_request_tokens
        with pytest.raises(ValueError, match=f"more than the 2-bit pool holds for one request \\({limit}\\)"):
            manager.add_request(list(range(3, 3 + limit)), max_new_tokens=1)
        request = manager.add_request(random_prompts((10,))[0], max_new_tokens=4)
        assert len(manager.get_result(request, timeout=30).generated_tokens) == 4  # still serving
    finally:
        manager.stop(block=True)


@pytest.mark.parametrize(
    "options, cb_options, generation, match",
    [
        ({"bits": "auto"}, {}, {}, "bits=2 \\(the pool's default\\)"),
        ({"avg_bits": 3.6}, {}, {}, "pass fixed widths"),
        ({"method": "oscar"}, {}, {}, "pass method='paper'"),
        ({}, {"page_size": 64}, {}, "page_size=64 cannot apply"),
        ({}, {"cpu_offload_space": 1.0}, {}, "cpu_offload_space=0"),
        ({}, {"default_compile_level": 1}, {}, "default_compile_level at 0"),
        ({}, {"use_cuda_graph": True}, {}, "pass use_cuda_graph=\\(False, True\\)"),
        ({"attention": "portable"}, {"use_cuda_graph": (False, True)}, {}, "pages in place"),
    ],
)
def test_refusals(llama, options, cb_options, generation, match):
    config = generation_config(options, NEW_TOKENS, **generation)
    with pytest.raises(ValueError, match=match):
        llama.init_continuous_batching(generation_config=config, continuous_batching_config=cb_config(**cb_options))
    assert llama.config._attn_implementation == "sdpa"  # a refused manager leaves the model as it was


def test_refused_models(tiny_llama, tiny_gemma3):
    flash = tiny_llama()
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="Load it with attn_implementation='sdpa'"):
        flash.init_continuous_batching(generation_config=generation_config({}, NEW_TOKENS))
    latent = tiny_llama()
    latent.config.kv_lora_rank = 16
    with pytest.raises(ValueError, match="latent attention"):
        latent.init_continuous_batching(generation_config=generation_config({}, NEW_TOKENS))
    sliding = tiny_gemma3(layer_types=["sliding_attention"] * 2, eos_token_id=None)
    with pytest.raises(ValueError, match="has none"):
        sliding.init_continuous_batching(generation_config=generation_config({}, NEW_TOKENS))


def test_unsupported_transformers_is_refused(llama, monkeypatch):
    monkeypatch.setattr(transformers, "__version__", "5.24.0")
    with pytest.raises(ValueError, match="needs transformers .*5\\.25.*this is 5\\.24\\.0"):
        llama.init_continuous_batching(generation_config=generation_config({}, NEW_TOKENS))


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: ~5-10 s
def test_an_unsupported_transformers_imports_no_pool():
    """On another transformers version, `import oscar_hf` leaves continuous batching as it is (the pool, built on 5.25's
    internals, is not even imported) and refuses cache_implementation="oscar" there, naming the supported versions."""
    code = """
import sys, transformers
transformers.__version__ = "5.23.0"
import oscar_hf
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.continuous_batching import cache, continuous_api
assert "oscar_hf.serving.pool" not in sys.modules
assert continuous_api.PagedAttentionCache is cache.PagedAttentionCache
model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=32, num_attention_heads=2))
try:
    model.init_continuous_batching(generation_config=GenerationConfig(cache_implementation="oscar"))
except ValueError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "needs transformers" in result.stdout and "this is 5.23.0" in result.stdout


def test_register_is_undone(llama):
    """`unregister()` gives transformers its cache class and manager back; other caches never see the pool."""
    try:
        oscar_hf.unregister()
        assert continuous_api.PagedAttentionCache is PagedAttentionCache
        for name in ("__init__", "add_request", "_create_batch_processor"):
            assert not hasattr(getattr(continuous_api.ContinuousBatchingManager, name), "_oscar_original"), name
    finally:
        oscar_hf.register()
    assert continuous_api.PagedAttentionCache is not PagedAttentionCache
    stock = llama.init_continuous_batching(generation_config=GenerationConfig(), continuous_batching_config=cb_config())
    assert type(stock._create_batch_processor().cache) is PagedAttentionCache


def test_the_pool_runs_on_the_forwards_stream(llama, monkeypatch):
    """The manager hands the pool the stream its forwards run on (`compute_stream`: where a flush must run, ordered
    between the forward that filled the window and the next; a sentinel here, as a CPU has no stream)."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    stream, init = object(), ContinuousBatchingIOs.__init__

    def with_stream(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.compute_stream = stream

    monkeypatch.setattr(ContinuousBatchingIOs, "__init__", with_stream)
    manager = llama.init_continuous_batching(
        generation_config=generation_config({}, 2), continuous_batching_config=cb_config()
    )
    assert manager._create_batch_processor().cache.compute_stream is stream
