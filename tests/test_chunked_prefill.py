"""Chunked prefill into an OscarCache (issue 37): `generate(prefill_chunk_size=...)` and a loop of forward calls over
a cache the user owns. With quantization made exact (tests/conftest.py's `ExactOscarCache`) every chunk attends to
exactly what an unchunked prefill sees, so the generated tokens are the same; chunk sizes that are not multiples of
the residual length (128) move the window's boundary inside chunks."""

import pytest
import torch
from transformers import Gemma3ForCausalLM

from oscar_hf import OscarCache, cache_kwargs

GREEDY = dict(do_sample=False, return_dict_in_generate=True)
PROMPT = 300  # two quantized blocks of 128 and 44 exact tokens after the prefill


def _tiny_gemma3(gemma3_config):
    return Gemma3ForCausalLM(gemma3_config).eval()


@pytest.fixture(params=["llama", "gemma3"])
def model(request, tiny_llama, gemma3_config):
    return tiny_llama() if request.param == "llama" else _tiny_gemma3(gemma3_config)


@pytest.mark.parametrize("chunk", [100, 128, 257])
def test_generate_chunked_prefill_equals_unchunked(model, exact_oscar_cache, chunk):
    ids = torch.randint(3, 97, (2, PROMPT))
    options = dict(max_new_tokens=40, min_new_tokens=40, **GREEDY)
    want = model.generate(ids, **cache_kwargs(exact_oscar_cache(model.config)), **options)
    cache = exact_oscar_cache(model.config)
    got = model.generate(ids, **cache_kwargs(cache), prefill_chunk_size=chunk, **options)
    assert torch.equal(got.sequences, want.sequences)
    layer = next(layer for layer in cache.layers if type(layer).__name__ == "ExactOscarLayer")
    assert layer.quantized_length == 256 and cache.get_seq_length() == PROMPT + 39


def test_forward_loop_over_an_owned_cache_equals_one_prefill(model, exact_oscar_cache):
    """A cache the user owns, filled by forward calls of 70, 130 and 100 tokens, then greedy decode steps."""
    ids = torch.randint(3, 97, (1, PROMPT))

    def decode(cache, chunks):
        with torch.no_grad():
            start = 0
            for size in chunks:
                out = model(ids[:, start : start + size], **cache_kwargs(cache), use_cache=True)
                start += size
            logits, tokens = [out.logits[:, -1]], [out.logits[:, -1:].argmax(-1)]
            for _ in range(20):
                out = model(tokens[-1], **cache_kwargs(cache), use_cache=True)
                logits.append(out.logits[:, -1])
                tokens.append(out.logits[:, -1:].argmax(-1))
        return torch.cat(tokens, 1), torch.stack(logits)

    want_tokens, want_logits = decode(exact_oscar_cache(model.config), [PROMPT])
    got_tokens, got_logits = decode(exact_oscar_cache(model.config), [70, 130, 100])
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-4)  # float32, attention split differently


def test_generate_chunked_prefill_with_the_real_quantizer_runs_every_model(model):
    """The real 2-bit cache (no hook): chunks attend to the dequantized history; the tokens stay in the vocabulary and
    the cache holds the prompt and the generated tokens."""
    ids = torch.randint(3, 97, (2, PROMPT))
    cache = OscarCache(model.config)
    options = dict(prefill_chunk_size=100, max_new_tokens=5, min_new_tokens=5, **GREEDY)
    out = model.generate(ids, **cache_kwargs(cache), **options)
    assert out.sequences.shape == (2, PROMPT + 5) and cache.get_seq_length() == PROMPT + 4
