"""Exact attention sinks (`sink_tokens`): the first tokens of each sequence kept exact next to the residual window,
against the float64 oracle (tests/conftest.py) of "the sinks exact, complete blocks after them quantized, the rest
exact", on the portable path (the fused kernels: tests/kernels/test_fused_generate.py and
test_fused_chunked_prefill.py)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from oscar_hf import OscarCache, OscarConfig, cache_kwargs

B, HKV, D = 2, 2, 32


def _cache(config, layers=1):
    model_config = LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=4 * HKV,
        num_key_value_heads=HKV,
        head_dim=D,
        hidden_size=4 * HKV * D,
    )
    return OscarCache(model_config, config)


def _expected(oracle, keys, values, config, stored=False, queries=None, prompt=None, memo=None):
    """What attention sees of a history of T tokens: the first `sink_tokens` exact, every complete block of
    `residual_length` tokens after them quantized (the oracle's values), the rest exact. `stored=True`: what the layer
    holds after its update, the newest block still exact. `memo` reuses the oracle's blocks between steps."""
    sinks, window = config.sink_tokens, config.residual_length
    rest = max(keys.shape[2] - sinks, 0)
    quantized = (max(rest - 1, 0) if stored else rest) // window * window
    if not quantized:
        return keys, values
    end, memo = sinks + quantized, {} if memo is None else memo
    if quantized not in memo:
        memo[quantized] = oracle(keys[:, :, sinks:end], values[:, :, sinks:end], config, queries=queries, prompt=prompt)
    k_hat, v_hat = memo[quantized]
    return tuple(torch.cat([t[:, :, :sinks], hat, t[:, :, end:]], 2) for t, hat in ((keys, k_hat), (values, v_hat)))


def _assert_history(got, want, what):
    for g, w in zip(got, want):
        assert g.shape == w.shape, (what, g.shape, w.shape)
        # one float32 ulp of the magnitude (scales stored in float32); a misplaced token is off by a whole step
        torch.testing.assert_close(g, w, rtol=0, atol=2 * torch.finfo(torch.float32).eps * w.abs().amax().item())


@pytest.mark.parametrize(
    "sinks, prefill, method",
    [(4, 3, "paper"), (4, 50, "oscar"), (16, 100, "paper"), (64, 150, "oscar")],
    ids=["prompt-inside-the-sinks", "S4-oscar", "S16-paper", "S64-oscar"],
)
def test_prefill_then_decode_keeps_the_sinks_exact(oracle, sinks, prefill, method):
    config = OscarConfig(scale_dtype="float32", method=method, residual_length=64, sink_tokens=sinks, bits=2)
    cache = _cache(config)
    total = prefill + 2 * config.residual_length + 20  # decode steps across two flushes
    scale = torch.logspace(-1, 1, total, dtype=torch.float64)[:, None]
    keys = torch.randn(B, HKV, total, D, dtype=torch.float64) * scale
    values = torch.randn(B, HKV, total, D, dtype=torch.float64)
    queries = torch.randn(B, 4 * HKV, total, D, dtype=torch.float64)
    # method="oscar" chooses from the prompt's keys after the sinks (they are never quantized) and all its queries
    prompt, seen, memo = keys[:, :, sinks:prefill], queries[:, :, :prefill], {}
    for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, total)]:
        got = cache.update(keys[:, :, start:end], values[:, :, start:end], layer_idx=0)
        cache.layers[0].observe_queries(queries[:, :, start:end], got[0])
        if start:
            history = keys[:, :, :start], values[:, :, :start]
            want = _expected(oracle, *history, config, queries=seen, prompt=prompt, memo=memo)
            want = tuple(torch.cat([w, t[:, :, start:end]], 2) for w, t in zip(want, (keys, values)))
            _assert_history(got, want, end)
        layer = cache.layers[0]
        assert cache.get_seq_length() == end
        assert layer.quantized_length == max(end - sinks - 1, 0) // 64 * 64
    want = _expected(oracle, keys, values, config, stored=True, queries=seen, prompt=prompt)
    _assert_history(cache.layers[0].dense_history(), want, "stored")


def test_chunks_crossing_the_sinks_attend_to_exact_sinks(oracle):
    """Multi-turn / chunked prefill: a chunk may end inside the sinks, fill them and spill into the window."""
    config = OscarConfig(scale_dtype="float32", method="paper", sink_tokens=16, bits=2)
    cache = _cache(config)
    chunks = [3, 70, 200, 1, 57, 128]
    keys = torch.randn(B, HKV, sum(chunks), D, dtype=torch.float64)
    values = torch.randn_like(keys)
    start = 0
    for size in chunks:
        end = start + size
        got = cache.update(keys[:, :, start:end], values[:, :, start:end], layer_idx=0)
        if start:
            want = _expected(oracle, keys[:, :, :start], values[:, :, :start], config)
            want = tuple(torch.cat([w, t[:, :, start:end]], 2) for w, t in zip(want, (keys, values)))
            _assert_history(got, want, end)
        start = end
    assert cache.layers[0].quantized_length == (sum(chunks) - 16 - 1) // 128 * 128


def _padded_prefill(config, keys, values, queries, mask):
    cache = _cache(config)
    cache.set_padding(mask)
    for start, end in ((0, 300), (300, 400)):  # a prefill, then a chunk that flushes one more block
        got = cache.update(keys[:, :, start:end], values[:, :, start:end], layer_idx=0)
        cache.layers[0].observe_queries(queries[:, :, start:end], got[0])
    return cache.layers[0]


@pytest.mark.parametrize("method", ["paper", "oscar"])
def test_a_left_padded_rows_sinks_are_its_own_first_real_tokens(oracle, method):
    """Row 0 has 40 padding positions: its sinks are its first 4 real tokens (positions 40-43), kept exact in the
    same 4 slots as row 1's (positions 0-3); quantization counts neither row's padding nor its sinks, so making the
    sinks loud (as attention sinks are) changes nothing else the layer holds."""
    config = OscarConfig(scale_dtype="float32", method=method, sink_tokens=4, bits=2)
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(B, HKV, 400, D, dtype=torch.float64, generator=gen)
    values = torch.randn_like(keys)
    keys[0, :, :40] = 1000 * torch.randn(HKV, 40, D, dtype=torch.float64, generator=gen)  # loud padding
    mask = torch.ones(B, 400, dtype=torch.long)
    mask[0, :40] = 0
    queries = torch.randn(B, 4 * HKV, 400, D, dtype=torch.float64, generator=gen)
    sinks = torch.zeros(B, 400, dtype=torch.bool)
    sinks[0, 40:44] = sinks[1, :4] = True
    made_loud = (sinks | ~mask.bool())[:, None, :, None]  # the sinks and row 0's padding
    loud_keys, loud_values = torch.where(made_loud, 1000 * keys, keys), torch.where(made_loud, 100 * values, values)
    layer = _padded_prefill(config, keys, values, queries, mask)
    loud = _padded_prefill(config, loud_keys, loud_values, queries, mask)
    assert (layer.storage.sinks, layer.quantized_length, layer.residual_length) == (4, 384, 12)
    counted = mask.bool() & ~sinks
    for got, got_loud, exact, exact_loud in zip(
        layer.dense_history(), loud.dense_history(), (keys, values), (loud_keys, loud_values)
    ):
        sinks_view, counted_view = (m[:, None, :, None].expand_as(got) for m in (sinks, counted))
        assert torch.equal(got[sinks_view], exact[sinks_view])
        assert torch.equal(got_loud[sinks_view], exact_loud[sinks_view])
        assert torch.equal(got[:, :, 388:], exact[:, :, 388:])  # the window
        assert torch.equal(got[counted_view], got_loud[counted_view])
    if method == "oscar":
        assert torch.equal(layer.key_rotated, loud.key_rotated)
        return
    # the quantized region (positions 4-387) against the oracle of the same tokens with padding and sinks left out
    want = oracle(keys[:, :, 4:388], values[:, :, 4:388], config, valid=counted[:, 4:388])
    for got, w in zip(layer.dense_history(), want):
        real = counted[:, None, 4:388, None].expand_as(w)
        _assert_history((got[:, :, 4:388][real],), (w[real],), "quantized")


def _filled(sinks=16, tokens=300):
    cache = _cache(OscarConfig(method="paper", sink_tokens=sinks, bits=2), layers=2)
    for layer_idx in range(2):
        cache.update(*torch.randn(2, 3, HKV, tokens, D, dtype=torch.float64), layer_idx=layer_idx)
    return cache


@pytest.mark.parametrize("keep", [10, 16, 17, 150, 299])
def test_crop_across_the_sinks_keeps_what_attention_saw_and_refills_them(keep):
    cache = _filled()  # 16 sinks + 256 quantized + 28 exact
    before = cache.layers[0].dense_history()
    cache.crop(keep - 300)
    layer = cache.layers[0]
    assert cache.get_seq_length() == keep
    after = layer.dense_history()
    assert torch.equal(after[0], before[0][:, :, :keep]) and torch.equal(after[1], before[1][:, :, :keep])
    new = torch.randn(2, 3, HKV, 130, D, dtype=torch.float64)
    cache.update(*new, layer_idx=0)
    assert cache.get_seq_length() == keep + 130
    refilled = cache.layers[0].dense_history()
    if keep < 16:  # the new tokens fill the sinks again: exact
        assert torch.equal(refilled[0][:, :, keep:16], new[0][:, :, : 16 - keep])
    assert torch.equal(refilled[0][:, :, : min(keep, 16)], before[0][:, :, : min(keep, 16)])


def test_batch_operations_carry_the_sinks():
    cache = _filled()
    before = [layer.dense_history() for layer in cache.layers]
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    cache.batch_select_indices(torch.tensor([0, 2]))
    for layer, (k, v) in zip(cache.layers, before):
        got_k, got_v = layer.dense_history()
        assert torch.equal(got_k, k[[2, 1]]) and torch.equal(got_v, v[[2, 1]])


def test_memory_counts_the_sinks_as_exact_tokens():
    sinks, plain = _filled(sinks=16), _filled(sinks=0)
    got, base = sinks.memory_footprint(), plain.memory_footprint()
    per_token = 2 * 2 * 3 * HKV * D * 8  # K and V, 2 layers, batch 3, float64
    # 300 tokens: 16 sinks + 256 quantized + 28 exact, against 256 quantized + 44 exact without sinks
    assert got.exact_bytes == (16 + 28) * per_token and base.exact_bytes == 44 * per_token
    assert got.quantized_bytes == base.quantized_bytes


@pytest.mark.parametrize("value", [-1, True, 2.5, None])
def test_sink_tokens_must_be_a_non_negative_int(value):
    with pytest.raises(ValueError, match="sink_tokens"):
        OscarConfig(sink_tokens=value, bits=2)


def test_exact_cache_generate_with_sinks_equals_dynamic_cache(tiny_llama, exact_oscar_cache):
    """Quantization made lossless (tests/conftest.py): the sinks change where tokens are kept, never what attention
    sees (positions, masks, the flushes after the sinks), so a left-padded batch generates DynamicCache's tokens."""
    model = tiny_llama()
    lengths, width = [150, 90, 20], 150
    ids = torch.randint(3, 97, (3, width))
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : width - length] = 0
        mask[row, width - length :] = 1
    options = dict(max_new_tokens=150, min_new_tokens=150, do_sample=False, return_dict_in_generate=True)
    want = model.generate(ids, attention_mask=mask, **cache_kwargs(DynamicCache(config=model.config)), **options)
    cache = exact_oscar_cache(model.config, OscarConfig(sink_tokens=4, bits=2))
    got = model.generate(ids, attention_mask=mask, **cache_kwargs(cache), **options)
    assert torch.equal(got.sequences, want.sequences)
    layer = cache.layers[0]
    # 4 sink slots, each row's own; 299 tokens held: 4 sinks, 256 quantized, 39 in the window
    assert (layer.storage.sinks, layer.quantized_length, layer.residual_length) == (4, 256, 39)
