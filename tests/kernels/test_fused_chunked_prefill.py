"""Chunked prefill on the fused path: every chunk that arrives with history attends with the chunk kernel
(kernels/chunk_attention.py) over the packed history in place, never through a dense history, and gives the portable
path's logits. On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py), with attention="fused"."""

import gc
import weakref

import pytest
import torch
from devices import DEVICE, slow_on_cpu
from oscar_hf.kernels import chunk_attention

from oscar_hf import OscarCache, OscarConfig, cache_kwargs
from oscar_hf.cache.history import ChunkHistory
from oscar_hf.cache.step import FusedStep
from oscar_hf.cache.storage import KVStorage
from oscar_hf.integrations import fused_attention

FUSED = "auto" if torch.cuda.is_available() else "fused"


def _chunked_prefill(model, ids, mask, attention, chunk, method, sinks=0, set_padding=True):
    """The logits of a left-padded prompt fed to a cache the caller owns in chunks of `chunk` tokens."""
    config = OscarConfig(attention=attention, residual_length=32, method=method, sink_tokens=sinks, bits=2)
    cache = OscarCache(model.config, config)
    if set_padding:
        cache.set_padding(mask)
    logits = []
    for start in range(0, ids.shape[1], chunk):
        end = start + chunk
        out = model(ids[:, start:end], attention_mask=mask[:, :end], **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits.float())
    return torch.cat(logits, dim=1)


def _model_and_prompt(tiny_llama, tokens: int):
    """2 layers with GQA 4 in bf16, sdpa; a batch of two prompts, the second left-padded by 37 tokens."""
    shape = dict(vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=8,
                 num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip
    model = tiny_llama(torch.bfloat16, **shape).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(3, 101, (2, tokens), device=DEVICE)
    mask = torch.ones_like(ids)
    ids[1, :37], mask[1, :37] = 0, 0
    return model, ids, mask


def _assert_bf16_close(fused: torch.Tensor, portable: torch.Tensor, mask: torch.Tensor) -> None:
    """Logits at every real position within bf16 noise of the portable path's, the same argmax wherever the portable
    top-2 margin is decisive."""
    real = mask.bool()
    a, b = fused[real], portable[real]
    # Both paths read the same codes; they differ by the kernel's fp16/bf16 dot operands with fp32 accumulation
    # against dequantize-to-bf16 + sdpa: bf16-level (2^-8) relative noise on the logits, as on the fused decode path.
    err = ((a - b).norm() / b.norm()).item()
    assert err < 2e-2, err
    top2 = b.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 4 * (a - b).abs().amax()
    assert decisive.any() and torch.equal(a.argmax(-1)[decisive], b.argmax(-1)[decisive])


@pytest.mark.parametrize(
    "method, sinks, tokens", [("oscar", 0, 96), slow_on_cpu("paper", 0, 96), ("paper", 4, 144)]
)  # the paper's method with sinks covers it without them on a CPU
def test_fused_chunked_prefill_matches_portable(tiny_llama, monkeypatch, method, sinks, tokens):
    """Chunks of 24 tokens (the 32-token window boundary falls inside chunks) over 2 layers with GQA 4, a left-padded
    row: the fused path's logits at every real position within bf16 noise of the portable path's, the same argmax
    wherever the portable top-2 margin is decisive, with one kernel call per layer and chunk with history, and no
    dense history built. With 4 sinks, row 1's (positions 37-40) arrive in the second chunk, which reads them as its
    own tokens; the later chunks read them from their slots, not their copies in the quantized blocks."""
    model, ids, mask = _model_and_prompt(tiny_llama, tokens)
    portable = _chunked_prefill(model, ids, mask, "portable", 24, method, sinks)

    calls = []
    kernel = chunk_attention.chunk_attention_triton
    monkeypatch.setattr(chunk_attention, "chunk_attention_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))

    def no_dense_history(*args, **kwargs):
        raise AssertionError("the fused path built a dense history")

    monkeypatch.setattr(KVStorage, "history", no_dense_history)
    fused = _chunked_prefill(model, ids, mask, FUSED, 24, method, sinks)
    assert len(calls) == 2 * (tokens // 24 - 1)  # 2 layers x the chunks after the first
    _assert_bf16_close(fused, portable, mask)


def test_a_chunk_with_history_gets_the_mask_of_its_own_tokens(tiny_llama, monkeypatch):
    """With the padding given (`set_padding`, as generate does), the mask transformers builds for a chunk arriving
    with history covers the chunk's tokens only ([B, 1, T, T], or none where they hold no padding: nothing that grows
    with the prompt), the history's padding coming from the cache; without it, the mask spans the history as for any
    cache. The logits are the portable path's."""
    model, ids, mask = _model_and_prompt(tiny_llama, 96)
    widths = []
    attention = ChunkHistory.attention

    def recording(self, query, attention_mask, scaling):
        widths.append(None if attention_mask is None else attention_mask.shape[-1])
        return attention(self, query, attention_mask, scaling)

    monkeypatch.setattr(ChunkHistory, "attention", recording)
    given = _chunked_prefill(model, ids, mask, FUSED, 24, "paper")
    # 2 layers x the 3 chunks after the first; the second chunk holds padding of the second row (positions 24 to 36),
    # the others none, so transformers builds no mask for them
    assert widths == [24, 24, None, None, None, None]
    widths.clear()
    _chunked_prefill(model, ids, mask, FUSED, 24, "paper", set_padding=False)
    assert widths == [48, 48, 72, 72, 96, 96]
    portable = _chunked_prefill(model, ids, mask, "portable", 24, "paper")
    _assert_bf16_close(given, portable, mask)


def test_a_chunk_the_kernel_cannot_serve_gets_the_mask_of_its_whole_history(tiny_llama, monkeypatch):
    """An attention call with a feature the chunk kernel lacks (here: every call, forced) attends over the dense
    history with the model's sdpa, the mask of the chunk's own tokens widened to the history (its padding from the
    cache): the portable path's logits."""
    model, ids, mask = _model_and_prompt(tiny_llama, 96)
    portable = _chunked_prefill(model, ids, mask, "portable", 24, "paper")
    monkeypatch.setattr(fused_attention, "attention_blockers", lambda dropout, kwargs: ["a feature the kernel lacks"])
    dense = ChunkHistory.dense
    calls = []
    monkeypatch.setattr(ChunkHistory, "dense", lambda self: calls.append(1) or dense(self))
    fused = _chunked_prefill(model, ids, mask, FUSED, 24, "paper")
    assert len(calls) == 6
    _assert_bf16_close(fused, portable, mask)


def test_a_chunk_s_buffers_do_not_outlive_its_attention(tiny_llama, monkeypatch):
    """A chunk's step (its K/V, and the exact buffers of its history) is freed once its layer attended: at most the
    cache's latest step (kept to check that it was attended) survives a forward, not one per layer until the next
    chunk, which would bound the serving batch (every layer's chunk buffers held at once)."""
    model, ids, mask = _model_and_prompt(tiny_llama, 96)
    made = []
    start = FusedStep.start.__func__

    def recording(cls, layer, keys, values, history):
        start(cls, layer, keys, values, history)
        made.append(weakref.ref(history.keys))

    monkeypatch.setattr(FusedStep, "start", classmethod(recording))
    cache = OscarCache(
        model.config, OscarConfig(attention=FUSED, residual_length=32, method="paper", bits=2, sink_tokens=0)
    )
    cache.set_padding(mask)
    for end in (24, 48, 72):
        model(ids[:, end - 24 : end], attention_mask=mask[:, :end], **cache_kwargs(cache), use_cache=True)
        gc.collect()
        assert sum(ref() is not None for ref in made) <= 1, f"chunk buffers alive after the forward up to {end}"
    assert len(made) == 4  # 2 layers x the chunks with history
    assert all(layer.fused_step is None for layer in cache.layers)


@pytest.mark.gpu
def test_generate_chunked_prefill_takes_flash_for_long_chunks_without_padding(tiny_llama, monkeypatch):
    """generate(prefill_chunk_size=FLASH_MIN_QUERIES) of a batch without padding: every chunk with history attends
    by flash over the dequantized history (`chunk_attention.chunk_attention`), and the logits are the portable
    path's; a left-padded batch takes the fused kernel."""
    model, ids, mask = _model_and_prompt(tiny_llama, 3 * chunk_attention.FLASH_MIN_QUERIES + 37)
    ids, mask = ids[:, 37:], mask[:, 37:]  # no padding left: 3 whole chunks
    calls = {"flash": 0, "fused": 0}
    for name, path in (("flash", "chunk_attention_flash"), ("fused", "chunk_attention_triton")):
        kernel = getattr(chunk_attention, path)
        monkeypatch.setattr(
            chunk_attention, path, lambda *a, _k=kernel, _n=name, **k: calls.update({_n: calls[_n] + 1}) or _k(*a, **k)
        )

    def logits(attention, ids, mask):
        out = model.generate(
            ids, attention_mask=mask, cache_implementation="oscar", cache_config=dict(attention=attention),
            prefill_chunk_size=chunk_attention.FLASH_MIN_QUERIES, max_new_tokens=1, do_sample=False,
            output_logits=True, return_dict_in_generate=True, disable_compile=True,
        )  # fmt: skip
        return out.logits[0].float()

    fused = logits("auto", ids, mask)
    assert calls == {"flash": 2 * 2, "fused": 0}  # 2 layers x the 2 chunks after the first
    portable = logits("portable", ids, mask)
    assert ((fused - portable).norm() / portable.norm()).item() < 2e-2
    padded_ids = torch.cat((torch.zeros_like(ids[:, :8]), ids[:, :-8]), dim=1)
    padded_mask = torch.cat((torch.zeros_like(mask[:, :8]), mask[:, :-8]), dim=1)
    padded_mask[0, :8] = 1
    logits("auto", padded_ids, padded_mask)
    assert calls == {"flash": 4, "fused": 4}
