"""`dequantize_kv_triton` (kernels/dequantize.py) against `reference.dequantize_kv` in float64, on fresh random
storage: every code pattern, random scales/mins/norms and per-head rotation flags, storage read through views of
larger capacity buffers and written into a slice of a larger dense buffer, as the cache does."""

import pytest
import torch
from devices import DEVICE, slow_on_cpu
from oscar_hf.kernels import dequantize_kv_triton
from transformers import LlamaConfig

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.layout import StorageLayout
from oscar_hf.reference import dequantize_kv, quantize_kv

B, H = 2, 3


def _random_storage(config: OscarConfig, head_dim: int, tokens: int):
    """Random fields of `tokens` quantized tokens, as views of buffers of twice the capacity (the cache's doubling)."""
    layout = StorageLayout.of(config)
    full = layout.empty(B, H, head_dim, H, head_dim, 2 * tokens, DEVICE)
    for field in full:
        if field is None:
            continue
        if field.dtype == torch.int32:  # every bit pattern: all codes, sign bit included
            field.copy_(torch.randint(-(2**31), 2**31, field.shape, dtype=torch.int64).to(torch.int32))
        else:
            field.copy_(torch.randn(field.shape).to(field.dtype))
    if full.key_norms is not None:
        full.key_norms.copy_(torch.rand(full.key_norms.shape) * 3 + 0.1)
    for scale in (full.key_scale, full.value_scale):
        scale.abs_()
    return layout.rows(full, 0, tokens)


def _flags(config):
    if config.rotation and config.method == "oscar":
        return torch.rand(B, H) < 0.5
    return None


# (key_bits, value_bits, head_dim): both widths at every head dim, keys and values at different widths at one each
# (3-bit planes of 32 tokens: a D=256 tile of 16 tokens reads half of each plane word)
WIDTHS_AND_HEAD_DIMS = [*((b, b, d) for b in (2, 3, 4) for d in (64, 128, 256)), (4, 2, 128), (2, 4, 64), (3, 2, 256)]
# more mixed widths with 3-bit planes, in the slow run on a CPU
MORE_WIDTHS = [(3, 2, 128), (2, 3, 64), (4, 3, 256)]
# (method, token_scaling, scale_dtype, group_size)
OPTIONS = [(m, *storage) for m in ("oscar", "paper") for storage in ((True, "float16", 32), (False, "float32", 64))]
# Every width and head dim with every method and storage options; on a CPU the default run takes each width and head
# dim once, the options in turn (each twice)
DEQUANTIZE_CASES = [
    (*widths, *options) if j == i % len(OPTIONS) else slow_on_cpu(*widths, *options)
    for i, widths in enumerate(WIDTHS_AND_HEAD_DIMS)
    for j, options in enumerate(OPTIONS)
] + [slow_on_cpu(*widths, *options) for widths in MORE_WIDTHS for options in OPTIONS]


@pytest.mark.parametrize(
    "key_bits, value_bits, head_dim, method, token_scaling, scale_dtype, group_size", DEQUANTIZE_CASES
)
def test_dequantize_matches_the_float64_reference(
    key_bits, value_bits, head_dim, method, token_scaling, scale_dtype, group_size
):
    config = OscarConfig(
        key_bits=key_bits,
        value_bits=value_bits,
        method=method,
        token_scaling=token_scaling,
        scale_dtype=scale_dtype,
        group_size=group_size,
        sink_tokens=0,
    )
    tokens = 3 * group_size
    stored = _random_storage(config, head_dim, tokens)
    flags = _flags(config)
    want_keys, want_values = dequantize_kv(
        type(stored)(*(None if t is None else t.cpu() for t in stored)),
        config,
        torch.float64,
        None if flags is None else flags.cpu(),
    )
    # The cache's dense buffer: quantized tokens, then window and new tokens (left poisoned here)
    dense = torch.full((2, B, H, tokens + 40, head_dim), float("nan"), device=DEVICE)
    flags = None if flags is None else flags.to(DEVICE)
    keys, values = dequantize_kv_triton(stored, config, flags, out=(dense[0, :, :, :tokens], dense[1, :, :, :tokens]))
    assert dense[:, :, :, tokens:].isnan().all()  # nothing past the quantized tokens is written
    # float32 math: code * scale + min, the norm and log2(D) butterfly stages each round to float32 (2^-24)
    for got, want in ((keys, want_keys), (values, want_values)):
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_writes_the_model_dtype_within_one_rounding(dtype):
    """bf16/fp16 outputs are the float32 results converted once: within an ulp of the float64 reference (2^-7
    relative for bf16, 2^-10 for fp16: a GPU rounds to nearest, half an ulp; Triton's interpreter truncates, under an
    ulp), plus the float32 error (atol, as above)."""
    config = OscarConfig(method="oscar", bits=2, sink_tokens=0)
    stored = _random_storage(config, 128, 64)
    flags = _flags(config).to(DEVICE)  # the reference takes them where the storage is
    want = dequantize_kv(stored, config, torch.float64, flags)
    got = dequantize_kv_triton(stored, config, flags, dtype=dtype)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-10
    for g, w in zip(got, want):
        assert g.dtype == dtype
        torch.testing.assert_close(g.double().cpu(), w.cpu(), rtol=ulp, atol=1e-5 * w.abs().max().item())


def test_dequantize_padded_storage_matches_the_reference():
    """Storage of a left-padded batch (`quantize_kv` with `valid`): padding groups of scale 0 and min 0, norm 1."""
    config = OscarConfig(method="oscar", bits=2, sink_tokens=0)
    keys, values = torch.randn(2, B, H, 128, 128, dtype=torch.float64).unbind(0)
    valid = torch.ones(B, 128, dtype=torch.bool)
    valid[1, :45] = False
    flags = torch.rand(B, H) < 0.5
    stored = quantize_kv(keys.float(), values.float(), config, flags, valid=valid)
    want = dequantize_kv(stored, config, torch.float64, flags)
    on_device = type(stored)(*(t.to(DEVICE) for t in stored))
    got = dequantize_kv_triton(on_device, config, flags.to(DEVICE))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def test_dequantize_refuses_a_missing_rotation_flag():
    config = OscarConfig(method="oscar", bits=2, sink_tokens=0)
    with pytest.raises(ValueError, match="needs key_rotated"):
        dequantize_kv_triton(_random_storage(config, 64, 32), config)


@pytest.mark.parametrize("method", ["oscar", "paper"])
def test_a_chunk_with_history_has_the_kernels_dense_history(method):
    """On the fused path (CUDA; Triton's interpreter on CPU) a chunk arriving with history carries the history it
    attends to; its dense form (what attention features the chunk kernel lacks get) is one buffer: the quantized
    region dequantized by the kernel (the reference's values, float32 rounding), the exact window and the chunk itself
    (bit for bit), for chunk sizes that move the window boundary inside chunks."""
    model_config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2 * H, num_key_value_heads=H, head_dim=64, hidden_size=2 * H * 64
    )
    model_config._attn_implementation = "sdpa"
    config = OscarConfig(method=method, attention="auto" if DEVICE.type == "cuda" else "fused", bits=2, sink_tokens=0)
    cache = OscarCache(model_config, config)
    layer = cache.layers[0]
    for step, size in enumerate([70, 200, 57, 128]):
        new_keys, new_values = torch.randn(2, B, H, size, 64, device=DEVICE).unbind(0)
        if step:
            stored, window = (
                layer.quantized(),
                (
                    layer.storage.keys[:, :, : layer.residual_length],
                    layer.storage.values[:, :, : layer.residual_length],
                ),
            )
            window = tuple(t.clone() for t in window)  # `update` rewrites the window buffer
        keys, values = cache.update(new_keys, new_values, 0)
        if step:
            assert keys is new_keys and layer.fused_step.chunk is not None  # the chunk alone, carrying its history
            keys, values = layer.fused_step.dense_history()
            layer.fused_step.attended = True  # this test reads the history; the attention: test_chunk_attention.py
        if step == 0:
            assert layer.use_kernels
            if method == "oscar":
                layer.observe_queries(torch.randn(B, 2 * H, size, 64, device=DEVICE), keys)
            continue
        length = 0 if stored is None else stored.value_scale.shape[2]
        assert keys.shape[2] == length + window[0].shape[2] + size
        if stored is not None:
            want = dequantize_kv(stored, config.resolve("sdpa"), torch.float64, layer.key_rotated)
            for got, exact in zip((keys, values), want):
                torch.testing.assert_close(got[:, :, :length].double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max())
        for got, exact in zip((keys, values), window):
            assert torch.equal(got[:, :, length : length + exact.shape[2]], exact)
        assert torch.equal(keys[:, :, -size:], new_keys) and torch.equal(values[:, :, -size:], new_values)
