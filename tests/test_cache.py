"""Cache mechanics: OscarCache against the independent float64 oracle, and every layer operation transformers uses."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, MistralConfig
from transformers.cache_utils import DynamicSlidingWindowLayer, QuantizedCache

from oscar_hf import OscarCache, OscarConfig, OscarLayer, average_bits, effective_bits, kv_memory
from oscar_hf.reference import dequantize_kv, quantize_kv, query_moment, query_rotation_choice

B, HKV, D = 2, 2, 32


def _cache(config=None, layers=2, heads=HKV, head_dim=D):
    """A cache for a bare Llama config, filled by hand. The config names no attention implementation, so the default
    method ("auto") resolves to the paper's (with a warning): tests of the query rule pass method="oscar" and hand
    each update's queries over (`observe_queries`), as the model's sdpa attention does."""
    model_config = LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=4 * heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        hidden_size=4 * heads * head_dim,
    )
    return OscarCache(model_config, config or OscarConfig(scale_dtype="float32", bits=2, sink_tokens=0))


def _expected_history(oracle, keys, values, config, memo=None, stored=False, queries=None, prompt=None):
    """What attention sees of a history of T tokens: every complete block quantized (the oracle's values), the rest
    exact. method="oscar" decides its key rotation from the `prompt` keys and their `queries`. `stored=True`: what the
    layer holds after its update instead, the newest block still exact until the next update. `memo` reuses the
    oracle's blocks between steps (they only change at a flush)."""
    window = config.residual_length
    quantized = (max(keys.shape[2] - 1, 0) if stored else keys.shape[2]) // window * window
    memo = {} if memo is None else memo
    if quantized not in memo:
        memo[quantized] = oracle(
            keys[:, :, :quantized], values[:, :, :quantized], config, queries=queries, prompt=prompt
        )
    k_hat, v_hat = memo[quantized]
    return torch.cat([k_hat, keys[:, :, quantized:]], 2), torch.cat([v_hat, values[:, :, quantized:]], 2)


def _with_new(history, keys, values, start, end):
    return tuple(torch.cat([h, t[:, :, start:end]], 2) for h, t in zip(history, (keys, values)))


def _assert_history(got, want, what):
    for g, w, name in zip(got, want, ("keys", "values")):
        assert g.shape == w.shape, (what, name, g.shape, w.shape)
        # One float32 ulp of the magnitude (scales/mins are stored in float32, see test_reference); a wrong code
        # or a misplaced token is off by a whole quantization step.
        torch.testing.assert_close(g, w, rtol=0, atol=2 * torch.finfo(torch.float32).eps * w.abs().amax().item())


@pytest.mark.parametrize("prefill", [50, 128, 300])
@pytest.mark.parametrize(
    "options",
    [
        {"bits": 2, "method": "paper"},
        {"bits": 2, "rotation": False, "token_scaling": False},
        {"bits": 4, "residual_length": 64, "method": "paper"},
        {"bits": 2, "method": "oscar", "residual_length": 64},
        {"key_bits": 4, "value_bits": 2, "method": "oscar", "residual_length": 64},
    ],
)
def test_prefill_then_decode_matches_oracle(oracle, prefill, options):
    config = OscarConfig(scale_dtype="float32", sink_tokens=0, **options)
    cache = _cache(config)
    total = prefill + 2 * config.residual_length + 40  # the decode steps cross two flushes whatever the prefill
    scale = torch.logspace(-1, 1, total, dtype=torch.float64)[:, None]  # token norms spanning 100x
    keys = torch.randn(B, HKV, total, D, dtype=torch.float64) * scale
    values = torch.randn(B, HKV, total, D, dtype=torch.float64)
    queries = torch.randn(B, 4 * HKV, total, D, dtype=torch.float64)
    # method="oscar" chooses when the prefill's queries arrive, from its keys (all of them: whole key groups or not,
    # a whole block or not) and those queries; later steps' queries change nothing.
    prompt, seen = keys[:, :, :prefill], queries[:, :, :prefill]
    flushes, memo = 0, {}
    for start, end in [(0, prefill)] + [(t, t + 1) for t in range(prefill, total)]:
        before = cache.layers[0].quantized_length
        got = cache.update(keys[:, :, start:end], values[:, :, start:end], layer_idx=0)
        cache.layers[0].observe_queries(queries[:, :, start:end], got[0])  # what the attention call hands over
        flushes += cache.layers[0].quantized_length > before
        if start == 0:  # a chunk without history attends to its own exact K/V
            assert torch.equal(got[0], keys[:, :, :end]) and torch.equal(got[1], values[:, :, :end])
        else:  # the history as stored, then the new exact token
            history = keys[:, :, :start], values[:, :, :start]
            want = _expected_history(oracle, *history, config, memo, queries=seen, prompt=prompt)
            _assert_history(got, _with_new(want, keys, values, start, end), end)
        layer = cache.layers[0]
        assert (layer.key_rotated is not None) == (config.method == "oscar")  # decided at the end of the prefill
        assert cache.get_seq_length() == end
        assert cache.get_mask_sizes(1, 0) == (end + 1, 0)
        assert layer.quantized_length == (end - 1) // config.residual_length * config.residual_length
        assert 1 <= layer.residual_length <= config.residual_length
    assert flushes >= 2
    want = _expected_history(oracle, keys, values, config, stored=True, queries=seen, prompt=prompt)
    _assert_history(cache.layers[0].dense_history(), want, "")


def test_chunks_arriving_with_history_match_oracle(oracle):
    """Multi-turn / chunked prefill: chunks of any size attend to the stored history plus their own exact tokens."""
    config = OscarConfig(scale_dtype="float32", method="paper", bits=2, sink_tokens=0)
    cache = _cache(config)
    chunks = [70, 200, 1, 57, 128, 3]
    keys = torch.randn(B, HKV, sum(chunks), D, dtype=torch.float64)
    values = torch.randn_like(keys)
    start = 0
    for size in chunks:
        end = start + size
        got = cache.update(keys[:, :, start:end], values[:, :, start:end], layer_idx=1)
        if start:
            # 70 tokens wait in the residual; the 200 that follow flush (70 + 200 - 1) // 128 blocks: 256 tokens.
            want = _expected_history(oracle, keys[:, :, :start], values[:, :, :start], config)
            _assert_history(got, _with_new(want, keys, values, start, end), end)
        start = end
    assert cache.get_seq_length(1) == sum(chunks) and cache.get_seq_length(0) == 0


def test_oscar_method_keeps_each_rows_key_rotation_through_later_blocks_and_batch_ops(oracle):
    """method="oscar" decides each (row, head)'s key rotation from the prompt and keeps it once decoding started:
    later blocks with other statistics (a new turn's chunk) use the same choice, and batch reordering carries it with
    its row."""
    config = OscarConfig(scale_dtype="float32", method="oscar", bits=2, sink_tokens=0)
    cache = _cache(config)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(B, HKV, 500, D, dtype=torch.float64, generator=gen)

    def with_spikes(x):  # rare large values in every channel: heavy tails that the rotation spreads out
        return torch.where(torch.rand(x.shape, generator=gen) < 0.03, 30 * x, x)

    keys[0, 0, :300, :4] = 0.01 * keys[0, 0, :300, :4] + 30  # quiet offset channels: keep unrotated
    keys[1, 1] = with_spikes(keys[1, 1])  # rotate
    keys[0, 0, 300:] = with_spikes(keys[0, 0, 300:])  # later tokens that alone would choose the rotation
    values = torch.randn_like(keys)
    queries = torch.randn(B, 4 * HKV, 500, D, dtype=torch.float64, generator=gen)
    queries[0, :4, :, :4] *= 20  # row 0, KV head 0's queries weigh the offset channels
    layer = cache.layers[0]
    got = cache.update(keys[:, :, :300], values[:, :, :300], layer_idx=0)  # flushes 256 tokens
    layer.observe_queries(queries[:, :, :300], got[0])
    choice = layer.key_rotated.clone()
    assert not choice[0, 0] and choice[1, 1], choice
    moment = query_moment(queries[:, :, :300], HKV)
    later = query_rotation_choice(keys[:, :, 256:384], moment, config)
    assert later[0, 0]  # the next block alone would rotate row 0, head 0
    got = cache.update(keys[:, :, 300:301], values[:, :, 300:301], layer_idx=0)  # a decode step: the choice is final
    layer.observe_queries(queries[:, :, 300:301], got[0])
    got = cache.update(keys[:, :, 301:], values[:, :, 301:], layer_idx=0)
    layer.observe_queries(queries[:, :, 301:], got[0])
    assert layer.quantized_length == 384 and torch.equal(layer.key_rotated, choice)
    prompt = keys[:, :, :300]
    want = _expected_history(oracle, keys, values, config, stored=True, queries=queries[:, :, :300], prompt=prompt)
    _assert_history(layer.dense_history(), want, "after a later block")
    cache.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(layer.key_rotated, choice.flip(0))
    _assert_history(layer.dense_history(), tuple(t.flip(0) for t in want), "after reordering")


def test_bf16_prefill_returns_exact_tokens_and_stores_packed_blocks():
    cache = _cache(OscarConfig(bits=2, sink_tokens=0))
    keys = torch.randn(1, HKV, 300, D, dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    got_k, got_v = cache.update(keys, values, layer_idx=0)
    assert got_k is keys and got_v is values
    layer = cache.layers[0]
    stored = layer.quantized()
    assert stored.key_codes.shape == (1, HKV, 256 // 16, D) and stored.key_codes.dtype == torch.int32
    assert stored.key_scale.dtype == torch.float16 and stored.key_norms.shape == (1, 1, 256)
    dense_k, _ = layer.dense_history()
    assert dense_k.dtype == torch.bfloat16 and dense_k.shape == keys.shape
    assert torch.equal(dense_k[:, :, 256:], keys[:, :, 256:])
    rel = (dense_k[:, :, :256].float() - keys[:, :, :256].float()).norm() / keys[:, :, :256].float().norm()
    assert 0 < rel < 0.5  # 2-bit keys of Gaussian data: lossy but bounded


def test_storage_grows_by_doubling_and_reserve_preallocates():
    cache = _cache(OscarConfig(bits=2, sink_tokens=0))
    layer = cache.layers[0]
    capacities = []
    for _ in range(10):
        cache.update(torch.randn(1, HKV, 128, D), torch.randn(1, HKV, 128, D), layer_idx=0)
        capacities.append(0 if layer.storage.buffers is None else layer.storage.buffers.key_scale.shape[2] * 32)
    assert capacities == [0, 128, 256, 512, 512, 1024, 1024, 1024, 1024, 2048]
    long = _cache(OscarConfig(bits=2, sink_tokens=0))  # a long prompt, quantized in several slices, grows once
    long.update(torch.randn(1, HKV, 9000, D), torch.randn(1, HKV, 9000, D), layer_idx=0)
    assert long.layers[0].storage.buffers.key_scale.shape[2] * 32 == 8960  # doubling per 4096-token slice made it 16384
    reserved = _cache(OscarConfig(bits=2, sink_tokens=0))
    reserved.reserve(1000)
    reserved.update(torch.randn(1, HKV, 129, D), torch.randn(1, HKV, 129, D), layer_idx=0)
    assert reserved.layers[0].storage.buffers.key_scale.shape[2] * 32 == 896  # 1000 rounded down to whole blocks


@pytest.mark.parametrize(
    "options,min_ratio",
    [
        ({"scale_dtype": "float16", "bits": 2}, 5.2),
        ({"scale_dtype": "float32", "bits": 2}, 3.9),
        ({"scale_dtype": "float16", "key_bits": 4, "value_bits": 2}, 3.9),
        ({"scale_dtype": "float16", "key_bits": 2, "value_bits": 4}, 3.9),
    ],
)
def test_memory_footprint_counts_real_bytes(options, min_ratio):
    heads, dim, tokens = 8, 128, 1000
    config = OscarConfig(sink_tokens=0, **options)
    cache = _cache(config, heads=heads, head_dim=dim)
    for layer_idx in range(2):
        kv = torch.randn(1, heads, tokens, dim, dtype=torch.bfloat16)
        cache.update(kv, kv.clone(), layer_idx)
    mem = cache.memory_footprint()
    quantized, exact = 896, tokens - 896
    param_bytes = 2 if config.scale_dtype == "float16" else 4
    # Per token and head: K and V codes (at their own bits), K scale+min per channel per 32 tokens, V scale+min per
    # 32 channels; plus one float32 norm per token shared by all heads.
    codes = dim * (config.key_bits + config.value_bits) // 8
    per_token = heads * (codes + 2 * 2 * param_bytes * dim // 32) + 4
    assert mem.quantized_bytes == 2 * quantized * per_token
    elements = 2 * quantized * heads * 2 * dim  # layers, tokens, heads, K and V, head_dim
    assert 8 * mem.quantized_bytes / elements == average_bits(config, dim, heads)
    assert mem.quantized_bf16_bytes == 2 * quantized * heads * dim * 2 * 2
    assert mem.exact_bytes == mem.exact_bf16_bytes == 2 * exact * heads * dim * 2 * 2
    assert mem.quantized_ratio_vs_bf16 > min_ratio
    assert mem.allocated_bytes >= mem.total_bytes


def test_average_bits_counts_every_stored_bit():
    """Codes, fp16 scales and minimums and a float32 token norm per token and KV head, over its 2 x 128 K/V elements:
    100 bytes at 2 bits, 164 at 4 bits, 132 with 4-bit keys and 2-bit values. A layer's KV heads share the norm."""
    per_token_and_head = {
        OscarConfig(bits=2, sink_tokens=0): 100,
        OscarConfig(bits=4, sink_tokens=0): 164,
        OscarConfig(key_bits=4, value_bits=2, sink_tokens=0): 132,
    }
    for config, stored in per_token_and_head.items():
        assert average_bits(config, 128) == 8 * stored / 256
    assert average_bits(OscarConfig(key_bits=2, value_bits=4, sink_tokens=0), 128) == average_bits(
        OscarConfig(key_bits=4, sink_tokens=0), 128
    )
    assert average_bits(OscarConfig(bits=2, sink_tokens=0), 128, kv_heads=4) == 8 * (96 + 4 / 4) / 256
    assert (
        average_bits(OscarConfig(token_scaling=False, scale_dtype="float32", bits=2, sink_tokens=0), 64)
        == 8 * (32 + 32) / 128
    )


def test_effective_bits_counts_the_exact_tokens_at_their_mean_fill():
    """A hand count at head_dim 128, one KV head: 100 bytes per quantized token (2 bits), 512 per exact bf16 token
    (2 x 128 elements); 4 sinks and a window of 128 holding 64.5 tokens on average (1 to 128)."""
    config = OscarConfig(bits=2, sink_tokens=4)
    exact = 4 + 64.5
    assert effective_bits(config, 128, context=4096) == pytest.approx(
        8 * (100 * (4096 - exact) + 512 * exact) / (256 * 4096)
    )
    # a 64-token window and no sinks: 32.5 exact tokens; 4-bit keys: 132 bytes per quantized token
    config = OscarConfig(key_bits=4, value_bits=2, sink_tokens=0, residual_length=64)
    assert effective_bits(config, 128, context=2048) == pytest.approx(
        8 * (132 * (2048 - 32.5) + 512 * 32.5) / (256 * 2048)
    )
    # bits="auto": the quantized region at the budget, or at the bits a cache reports after its choice
    auto = OscarConfig(avg_bits=3.6)
    assert effective_bits(auto, 128, context=1000) == pytest.approx((3.6 * (1000 - 68.5) + 16 * 68.5) / 1000)
    assert effective_bits(auto, 128, context=1000, stored_bits=3.3) == pytest.approx(
        (3.3 * (1000 - 68.5) + 16 * 68.5) / 1000
    )
    # a context shorter than the exact tokens is all exact; a float32 model's exact tokens cost 32 bits
    assert effective_bits(auto, 128, context=50) == 16
    assert effective_bits(OscarConfig(bits=2, sink_tokens=0), 128, context=64.5, exact_bits=32) == 32
    with pytest.raises(ValueError, match="context=0 must be a positive number"):
        effective_bits(auto, 128, context=0)


def test_memory_reports_whole_cache_ratios_vs_model_dtype_and_bf16():
    """A float32 cache of 1000 tokens: 896 quantized, 104 exact. The whole-cache ratios count the exact residual,
    and `str()` shows them."""
    cache = _cache(OscarConfig(bits=2, sink_tokens=0), heads=2, head_dim=64)
    for layer_idx in range(2):
        cache.update(*torch.randn(2, 1, 2, 1000, 64), layer_idx)
    mem = cache.memory_footprint()
    elements = 2 * 2 * 2 * 64 * 1000  # layers, K and V, heads, head_dim, tokens
    assert mem.model_dtype_bytes == 4 * elements and mem.bf16_bytes == 2 * elements
    assert mem.ratio_vs_model_dtype == pytest.approx(4 * elements / (mem.quantized_bytes + mem.exact_bytes))
    assert mem.ratio_vs_model_dtype == pytest.approx(2 * mem.ratio_vs_bf16)
    assert 1 < mem.ratio_vs_bf16 < mem.quantized_ratio_vs_bf16
    text = str(mem)
    for number in (mem.ratio_vs_model_dtype, mem.ratio_vs_bf16, mem.quantized_ratio_vs_bf16):
        assert f"{number:.2f}x" in text, text
    assert f"{mem.total_bytes / 2**20:.2f} MiB" in text
    dynamic = DynamicCache()
    dynamic.update(torch.randn(1, 2, 10, 64), torch.randn(1, 2, 10, 64), 0)
    assert kv_memory(dynamic).ratio_vs_model_dtype == 1.0 and "quantized" not in str(kv_memory(dynamic))


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_memory_counts_transformers_quantized_cache(backend):
    """transformers' QuantizedCache: its quantized states counted by their stored bytes (2-bit codes, and a float32
    scale and shift per group of 32 elements: 4 bits an element), beside its exact window."""
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    cache = QuantizedCache(backend, config, nbits=2, q_group_size=32, residual_length=16)
    for tokens in (40, 1, 1, 1):  # the prompt is quantized at once; the decode tokens wait in the window
        for layer_idx in range(2):
            cache.update(*torch.randn(2, 1, 2, tokens, 32), layer_idx)
    mem = kv_memory(cache)
    quantized, exact = 2 * 2 * 2 * 32 * 40, 2 * 2 * 2 * 32 * 3  # layers, K and V, heads, head_dim, tokens
    assert (mem.quantized_bf16_bytes, mem.exact_bytes, mem.model_dtype_bytes) == (
        2 * quantized,
        4 * exact,
        4 * (quantized + exact),
    )
    assert mem.quantized_bytes == quantized * 4 // 8
    assert mem.quantized_ratio_vs_bf16 == 4.0


def test_memory_counts_layers_left_in_full_precision(gemma3_config):
    cache = OscarCache(gemma3_config, OscarConfig(bits=2, sink_tokens=0))
    for layer_idx in range(len(cache.layers)):
        cache.update(torch.randn(1, 1, 200, 64), torch.randn(1, 1, 200, 64), layer_idx)
    mem = cache.memory_footprint()
    others = [layer for layer in cache.layers if not isinstance(layer, OscarLayer)]
    sliding_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in others)
    residual_bytes = sum(layer.residual_length for layer in cache.layers if isinstance(layer, OscarLayer)) * 2 * 64 * 4
    assert sliding_bytes > 0 and mem.exact_bytes == sliding_bytes + residual_bytes


def _filled(tokens=300, batch=4):
    cache = _cache()
    for layer_idx in range(2):
        cache.update(*torch.randn(2, batch, HKV, tokens, D, dtype=torch.float64), layer_idx)
    return cache


@pytest.mark.parametrize(
    "operation,index",
    [
        (lambda c: c.reorder_cache(torch.tensor([2, 0, 0, 3])), lambda t: t[[2, 0, 0, 3]]),
        (lambda c: c.batch_select_indices(torch.tensor([1, 3])), lambda t: t[[1, 3]]),
        (lambda c: c.batch_repeat_interleave(2), lambda t: t.repeat_interleave(2, 0)),
    ],
    ids=["reorder_cache", "batch_select_indices", "batch_repeat_interleave"],
)
def test_batch_operations_are_lossless(operation, index):
    cache = _filled()
    before = [layer.dense_history() for layer in cache.layers]
    operation(cache)
    for layer, (k, v) in zip(cache.layers, before):
        got_k, got_v = layer.dense_history()
        assert torch.equal(got_k, index(k)) and torch.equal(got_v, index(v))
    # the cache keeps working afterwards, across a flush
    cache.update(*torch.randn(2, got_k.shape[0], HKV, 200, D, dtype=torch.float64), layer_idx=0)
    assert cache.get_seq_length() == 500


@pytest.mark.parametrize("remove", [1, 43, 44, 45, 172, 300])
def test_crop_keeps_what_attention_saw(remove):
    cache = _filled(tokens=300)  # 256 quantized + 44 exact
    before = cache.layers[0].dense_history()
    cache.crop(-remove)
    layer = cache.layers[0]
    assert cache.get_seq_length() == 300 - remove
    assert layer.quantized_length % 128 == 0 and layer.residual_length <= 128
    after = layer.dense_history()
    kept = 300 - remove
    assert torch.equal(after[0], before[0][:, :, :kept]) and torch.equal(after[1], before[1][:, :, :kept])
    cache.update(*torch.randn(2, 4, HKV, 130, D, dtype=torch.float64), layer_idx=0)
    assert cache.get_seq_length() == kept + 130


def test_crop_rejects_positive_lengths():
    with pytest.raises(ValueError, match="negative"):
        _filled().crop(10)


def test_reset_and_reuse():
    cache = _filled()
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.memory_footprint().total_bytes == 0
    cache.update(torch.randn(1, HKV, 5, D), torch.randn(1, HKV, 5, D), 0)
    assert cache.get_seq_length() == 5


def test_offload_and_prefetch_round_trip():
    cache = _filled()
    before = cache.layers[0].dense_history()
    cache.layers[0].offload()
    cache.layers[0].prefetch()
    assert torch.equal(cache.layers[0].dense_history()[0], before[0])


def test_hybrid_model_quantizes_only_full_attention_layers(gemma3_config):
    cache = OscarCache(gemma3_config, OscarConfig(bits=2, sink_tokens=0))
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, OscarLayer, DynamicSlidingWindowLayer, OscarLayer]


def test_model_without_full_attention_is_refused():
    config = MistralConfig(num_hidden_layers=2, sliding_window=64, head_dim=64, hidden_size=128, num_attention_heads=2)
    with pytest.raises(ValueError, match="no standard full-attention layer"):
        OscarCache(config, OscarConfig(bits=2, sink_tokens=0))


def _padded_batch(paddings, tokens, gen):
    """Keys and values `[B, HKV, tokens, D]` whose row r starts with `paddings[r]` padding positions holding loud
    values and a NaN (what a model computes there must never matter), and the attention mask of the batch."""
    keys = torch.randn(B, HKV, tokens, D, dtype=torch.float64, generator=gen)
    values = torch.randn_like(keys)
    mask = torch.ones(B, tokens, dtype=torch.long)
    for row, p in enumerate(paddings):
        if p:
            keys[row, :, :p] = 1000 * torch.randn(HKV, p, D, dtype=torch.float64, generator=gen)
            keys[row, 0, 0, 0] = values[row, -1, 0, 0] = float("nan")
            mask[row, :p] = 0
    return keys, values, mask


@pytest.mark.parametrize("method", ["paper", "oscar"])
def test_left_padded_row_stores_its_tokens_as_alone(method):
    """Padding of a whole block (128 tokens, a multiple of the group size): the padded row's history is exactly the
    same row's history in a cache of its own (codes, scales, norms and key-rotation choice), shifted by the padding,
    and the padding reads back as zeros."""
    config = OscarConfig(scale_dtype="float32", method=method, bits=2, sink_tokens=0)
    keys, values, mask = _padded_batch([128, 0], 400, torch.Generator().manual_seed(1))
    queries = torch.randn(B, 4 * HKV, 400, D, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    queries[0, :, :128] = float("nan")  # padding queries: whatever the model computed there must not count
    cache, alone = _cache(config), _cache(config)
    cache.set_padding(mask)
    for start, end in ((0, 300), (300, 400)):  # a prefill, then a chunk that flushes one more block
        got = cache.update(keys[:, :, start:end], values[:, :, start:end], layer_idx=0)
        cache.layers[0].observe_queries(queries[:, :, start:end], got[0])
        real = slice(max(start, 128), end)
        got = alone.update(keys[:1, :, real], values[:1, :, real], layer_idx=0)
        alone.layers[0].observe_queries(queries[:1, :, real], got[0])
    layer, alone_layer = cache.layers[0], alone.layers[0]
    assert (layer.quantized_length, alone_layer.quantized_length) == (384, 256)
    for got, want in zip(layer.dense_history(), alone_layer.dense_history()):
        assert torch.equal(got[:1, :, 128:], want)
        assert torch.equal(got[0, :, :128], torch.zeros_like(got[0, :, :128]))
    if method == "oscar":
        assert torch.equal(layer.key_rotated[:1], alone_layer.key_rotated)


def _spiky_and_offset_keys(keys, gen, tokens):
    """Keys where the rule's two choices both occur: row 0, KV head 0 has quiet offset channels (keep unrotated),
    row 1, KV head 1 rare large values in every channel (rotate); queries weighing the offset channels."""
    keys[0, 0, :, :4] = 0.01 * keys[0, 0, :, :4] + 30
    keys[1, 1] = torch.where(torch.rand(keys[1, 1].shape, generator=gen) < 0.03, 30 * keys[1, 1], keys[1, 1])
    queries = torch.randn(B, 4 * HKV, tokens, D, dtype=torch.float64, generator=gen)
    queries[0, :4, :, :4] *= 20
    return queries


@pytest.mark.parametrize("prompt", [40, 300])
def test_key_rotation_is_chosen_at_the_end_of_the_prefill_from_the_prompt(prompt):
    """method="oscar" decides every (row, KV head)'s key rotation when the prefill's queries arrive, from all the
    prompt's keys the layer holds (the quantized blocks and the residual window; key groups from the first real
    position or not, padding left out), even when no block is full (a 40-token prompt: the first flush then happens in
    a decode step, which may be compiled). Eager decoding across the next flush stores that block as the reference
    quantizes it with that choice."""
    config = OscarConfig(scale_dtype="float32", method="oscar", bits=2, sink_tokens=0)
    gen = torch.Generator().manual_seed(2)
    keys, values, mask = _padded_batch([9, 0], prompt + 150, gen)
    queries = _spiky_and_offset_keys(keys, gen, prompt)
    cache = _cache(config)
    cache.set_padding(mask[:, :prompt])
    layer = cache.layers[0]
    got = cache.update(keys[:, :, :prompt], values[:, :, :prompt], layer_idx=0)
    assert layer.key_rotated is None and layer.rotation.wants_queries  # blocks quantized so far are provisional
    layer.observe_queries(queries, got[0])
    valid = mask[:, :prompt].bool()
    choice = query_rotation_choice(keys[:, :, :prompt], query_moment(queries, HKV, valid), config, valid)
    assert torch.equal(layer.key_rotated, choice) and choice[1, 1] and not choice[0, 0], choice
    for t in range(prompt, prompt + 150):  # decode steps: the choice stays, the next block is flushed with it
        cache.update(keys[:, :, t : t + 1], values[:, :, t : t + 1], layer_idx=0)
    assert torch.equal(layer.key_rotated, choice)
    end = layer.quantized_length
    assert end >= 128
    full = torch.cat([valid, valid.new_ones(B, keys.shape[2] - prompt)], 1)[:, :end]
    stored = quantize_kv(keys[:, :, :end], values[:, :, :end], config, choice, valid=full)
    want = dequantize_kv(stored, config, torch.float64, choice)
    _assert_history((t[:, :, :end] for t in layer.dense_history()), want, "the blocks quantized with the choice")


def test_a_row_whose_prompt_is_all_padding_keeps_its_keys_unrotated():
    """A row with no real prompt token has nothing to choose from: its keys stay unrotated (KIVI-style), whatever its
    padding held; the other row chooses from its prompt, and blocks that follow store finite values."""
    config = OscarConfig(scale_dtype="float32", method="oscar", bits=2, sink_tokens=0)
    gen = torch.Generator().manual_seed(4)
    keys, values, mask = _padded_batch([20, 0], 200, gen)
    queries = _spiky_and_offset_keys(keys, gen, 20)
    cache = _cache(config)
    cache.set_padding(mask[:, :20])
    layer = cache.layers[0]
    layer.observe_queries(queries, cache.update(keys[:, :, :20], values[:, :, :20], layer_idx=0)[0])
    choice = query_rotation_choice(keys[1:, :, :20], query_moment(queries[1:], HKV), config)
    assert not layer.key_rotated[0].any() and torch.equal(layer.key_rotated[1], choice[0])
    for t in range(20, 200):
        cache.update(keys[:, :, t : t + 1], values[:, :, t : t + 1], layer_idx=0)
    assert layer.quantized_length == 128 and all(torch.isfinite(t).all() for t in layer.dense_history())


def test_set_padding_refuses_a_mask_it_cannot_use():
    cache = _cache()
    with pytest.raises(ValueError, match="2D attention mask"):
        cache.set_padding(torch.ones(B, 1, 1, 200))
    cache.set_padding(torch.ones(B + 1, 200).index_fill(1, torch.tensor([0]), 0))
    keys = torch.randn(B, HKV, 200, D)
    with pytest.raises(ValueError, match="padding mask given to set_padding has 3 rows"):
        cache.update(keys, keys, layer_idx=0)
