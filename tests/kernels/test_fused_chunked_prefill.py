"""Chunked prefill on the fused path: every chunk that arrives with history attends with the chunk kernel
(kernels/chunk_attention.py) over the packed history in place, never through a dense history, and gives the portable
path's logits. On CPU the kernels run in Triton's interpreter (tests/kernels/conftest.py), with attention="fused"."""

import pytest
import torch
from oscar_hf.kernels import chunk_attention

from oscar_hf import OscarCache, OscarConfig, cache_kwargs
from oscar_hf.cache.storage import KVStorage

FUSED = "auto" if torch.cuda.is_available() else "fused"
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _chunked_prefill(model, ids, mask, attention, chunk, method, sinks=0):
    """The logits of a left-padded prompt fed to a cache the caller owns in chunks of `chunk` tokens."""
    config = OscarConfig(attention=attention, residual_length=32, method=method, sink_tokens=sinks)
    cache = OscarCache(model.config, config)
    cache.set_padding(mask)
    logits = []
    for start in range(0, ids.shape[1], chunk):
        end = start + chunk
        out = model(ids[:, start:end], attention_mask=mask[:, :end], **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits.float())
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("method, sinks, tokens", [("oscar", 0, 96), ("paper", 0, 96), ("paper", 4, 144)])
def test_fused_chunked_prefill_matches_portable(tiny_llama, monkeypatch, method, sinks, tokens):
    """Chunks of 24 tokens (the 32-token window boundary falls inside chunks) over 2 layers with GQA 4, a left-padded
    row: the fused path's logits at every real position within bf16 noise of the portable path's, the same argmax
    wherever the portable top-2 margin is decisive, with one kernel call per layer and chunk with history, and no
    dense history built. With 4 sinks, 4 + 37 positions stay exact: the second chunk fills them and spills over, and
    the last two chunks read a quantized block that follows them."""
    shape = dict(vocab_size=101, hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=8,
                 num_key_value_heads=2, num_hidden_layers=2)  # fmt: skip
    model = tiny_llama(torch.bfloat16, **shape).to(DEVICE)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(3, 101, (2, tokens), device=DEVICE)
    mask = torch.ones_like(ids)
    ids[1, :37], mask[1, :37] = 0, 0
    portable = _chunked_prefill(model, ids, mask, "portable", 24, method, sinks)

    calls = []
    kernel = chunk_attention.chunk_attention_triton
    monkeypatch.setattr(chunk_attention, "chunk_attention_triton", lambda *a, **k: calls.append(1) or kernel(*a, **k))

    def no_dense_history(*args, **kwargs):
        raise AssertionError("the fused path built a dense history")

    monkeypatch.setattr(KVStorage, "history", no_dense_history)
    fused = _chunked_prefill(model, ids, mask, FUSED, 24, method, sinks)
    assert len(calls) == 2 * (tokens // 24 - 1)  # 2 layers x the chunks after the first

    real = mask.bool()
    a, b = fused[real], portable[real]
    # Both paths read the same codes; they differ by the kernel's fp16/bf16 dot operands with fp32 accumulation
    # against dequantize-to-bf16 + sdpa: bf16-level (2^-8) relative noise on the logits, as on the fused decode path.
    err = ((a - b).norm() / b.norm()).item()
    assert err < 2e-2, err
    top2 = b.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > 4 * (a - b).abs().amax()
    assert decisive.any() and torch.equal(a.argmax(-1)[decisive], b.argmax(-1)[decisive])
