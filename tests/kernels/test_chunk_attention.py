"""Chunk attention (kernels/chunk_attention.py: the fused kernel, and flash attention over the history dequantized
piece by piece) vs the float64 reference: dequantization + plain softmax attention
(`oscar_hf.reference.decode_attention`, whose contract holds for any number of queries).

The quantized inputs come from `oscar_hf.reference.quantize_kv` on fresh random K/V, so these tests check the attention
kernel alone. Small shapes run everywhere (CPU: Triton's interpreter and torch's CPU flash kernel); the `gpu`-marked
ones need CUDA.
"""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from devices import DEVICE, slow_on_cpu
from oscar_hf.kernels.chunk_attention import (
    FLASH_MIN_QUERIES,
    ChunkTuning,
    _torch_attention_backend,
    chunk_attention,
    chunk_attention_flash,
    chunk_attention_triton,
    merge_partial,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar_hf.layout import QuantizedKV
from oscar_hf.reference import decode_attention as attention_reference
from oscar_hf.reference import quantize_kv
from oscar_hf.testing import Case, assert_close_to_reference


# The decode kernel's tolerances (oscar_hf/testing.py): the chunk kernel's arithmetic is the same (fp16 operands
# for the quantized part, the model dtype for the exact part and the probabilities that weigh it).
def chunk_case(chunk: int = 37, window: int = 7, **options) -> Case:
    """A chunk of `chunk` query tokens after `window` exact tokens (the residual window held) and the quantized
    history; float16 unless `options` say otherwise."""
    return Case(q_len=chunk, residual=window + chunk, **{"dtype": torch.float16, **options})


BASE = chunk_case()
CASES = [
    # chunk lengths 1 .. past a 64-token block and a 128-row tile, history lengths incl. none, partial windows
    *(chunk_case(t) for t in (1, 16, 70)),
    chunk_case(130, gqa=1, batch=1),
    *(chunk_case(window=e, quantized=n) for n, e in ((0, 0), (0, 31), (32, 32), (160, 1))),
    # GQA 1 and 4, head_dim 64 and 128, the model dtypes
    replace(BASE, gqa=1, head_dim=128, dtype=torch.bfloat16),
    chunk_case(20, head_dim=128, dtype=torch.bfloat16),
    replace(BASE, dtype=torch.float32),
    # left padding: inside the quantized region, and past it into the window and the chunk
    replace(BASE, left_pad=45),
    chunk_case(24, window=9, left_pad=100, quantized=96),
    # method="oscar" (per-head key rotation), the method switches, fp32 scales
    replace(BASE, method="oscar", left_pad=13, head_dim=128),
    replace(BASE, rotation=False, token_scaling=False),
    replace(BASE, rotation=False),
    replace(BASE, scale_dtype="float32", quantized=64),
    # key and value bit widths of their own (2-, 3- and 4-bit tiles order their tokens differently)
    *(replace(BASE, key_bits=k, value_bits=v, left_pad=13) for k, v in ((4, 4), (4, 2), (2, 4), (3, 2))),
    slow_on_cpu(replace(BASE, key_bits=3, value_bits=3, left_pad=13)),
    replace(BASE, key_bits=2, value_bits=3, method="oscar", head_dim=128),
]


def make_inputs(case: Case, seed: int = 0):
    """query [B, Hq, T, D] (HF's layout, transposed), a quantized region of L tokens as views of larger buffers (as
    the cache stores them), exact K/V [B, Hkv, E + T, D], a padding mask, the scaling, config and flags."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=case.dtype)

    config = case.config()
    batch, kv_heads, dim = case.batch, case.kv_heads, case.head_dim
    key_rotated = None
    if case.rotation and case.method == "oscar":  # both kinds present
        key_rotated = (torch.arange(batch * kv_heads) % 2 == 0)[torch.randperm(batch * kv_heads, generator=gen)]
        key_rotated = key_rotated.view(batch, kv_heads).to(DEVICE)
    query = randn(batch, case.q_len, kv_heads * case.gqa, dim).transpose(1, 2)
    quantized = None
    if case.quantized:
        stored = quantize_kv(
            randn(batch, kv_heads, case.quantized, dim),
            randn(batch, kv_heads, case.quantized, dim),
            config,
            key_rotated,
        )
        quantized = QuantizedKV(*(None if t is None else _capacity_view(t.contiguous()) for t in stored))
    exact_keys, exact_values = randn(batch, kv_heads, case.residual, dim), randn(batch, kv_heads, case.residual, dim)
    mask = None
    if case.left_pad:
        mask = torch.ones(batch, case.quantized + case.residual, dtype=torch.bool, device=DEVICE)
        mask[0, : case.left_pad] = False
        mask[-1, : case.left_pad // 3] = False
    return query, quantized, exact_keys, exact_values, mask, 1.0 / math.sqrt(dim), config, key_rotated


def _capacity_view(t: torch.Tensor) -> torch.Tensor:
    """`t` inside a buffer with three more rows of garbage along dim 2, as a view with the buffer's strides."""
    shape = list(t.shape)
    shape[2] += 3
    buf = torch.randn(shape).to(t.dtype) if t.is_floating_point() else torch.full(shape, 0x12345678, dtype=t.dtype)
    view = buf.to(t.device).narrow(2, 0, t.shape[2])
    view.copy_(t)
    return view


def _check(case: Case, seed: int = 0, tuning: ChunkTuning | None = None) -> None:
    inputs = make_inputs(case, seed)
    out = chunk_attention_triton(*inputs, tuning=tuning)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype
    ref = attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, case.dtype, f"{case.id} seed {seed}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_chunk_attention_matches_reference(case: Case):
    _check(case)


def test_chunk_attention_fuzzed():
    """A seeded draw over chunk lengths, history (quantized and window) lengths, padding, GQA 1/4, head_dim 64/128,
    the model dtypes and bit widths; small 32-row tiles of 16-token steps (32 with 3-bit planes, whole 32-token words),
    so that every draw crosses tiles and blocks."""
    rng = random.Random(37)
    for seed in range(6):
        quantized = 32 * rng.randrange(0, 5)
        window = rng.randrange(0 if quantized == 0 else 1, 33)
        case = chunk_case(
            chunk=rng.randrange(1, 50),
            quantized=quantized,
            window=window,
            gqa=rng.choice((1, 4)),
            head_dim=rng.choice((64, 128)),
            left_pad=rng.choice((0, rng.randrange(0, quantized + window + 1))),
            dtype=rng.choice((torch.bfloat16, torch.float16, torch.float32)),
            method=rng.choice(("paper", "oscar")),
            key_bits=rng.choice((2, 3, 4)),
            value_bits=rng.choice((2, 3, 4)),
            batch=2,
            kv_heads=1,
        )
        block_n = 32 if 3 in (case.key_bits, case.value_bits) else 16
        _check(case, seed, ChunkTuning(block_m=32, block_n=block_n, num_warps=4))


def test_chunk_attention_refuses_a_mask_of_the_wrong_width():
    query, quantized, keys, values, _, scaling, config, flags = make_inputs(BASE)
    mask = torch.ones(BASE.batch, BASE.quantized + keys.shape[2] - 1, dtype=torch.bool, device=DEVICE)
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \[B, L \+ E\]"):
        chunk_attention_triton(query, quantized, keys, values, mask, scaling, config, flags)


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 4])
def test_chunk_attention_bf16_on_cuda_at_scale(gqa: int):
    """Llama-like heads (D=128), default tiles, a history of 2048 quantized tokens and a 128-token window, a chunk of
    1000 queries (not a multiple of the tile), left padding."""
    case = chunk_case(chunk=1000, quantized=2048, window=128, gqa=gqa, head_dim=128, left_pad=300, dtype=torch.bfloat16,
                method="oscar", batch=2, kv_heads=4)  # fmt: skip
    _check(case)


def test_merge_partial_equals_softmax_over_all_keys():
    """Attention over 50 keys split 20 / 30, each part normalised with its log-sum-exp, merged: the softmax over all
    50 (float64, so the merge's own arithmetic is all that differs)."""
    gen = torch.Generator().manual_seed(5)
    query, keys, values = (torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for n in (7, 50, 50))
    keys = keys * 3  # peaked softmaxes: the parts' maxima differ by a lot

    def attend(k, v):
        scores = query @ k.transpose(-1, -2)
        return scores.softmax(-1) @ v, scores.logsumexp(-1)

    acc, lse = attend(keys[:, :, :20], values[:, :, :20])
    merge_partial(acc, lse, *attend(keys[:, :, 20:], values[:, :, 20:]))
    whole, whole_lse = attend(keys, values)
    torch.testing.assert_close(acc, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-12, atol=1e-12)


def test_chunk_attention_flash_refuses_without_a_backend_and_bad_shapes():
    inputs = _without_mask(make_inputs(BASE))
    with sdpa_kernel([SDPBackend.MATH]), pytest.raises(ValueError, match="does not take these tensors"):
        chunk_attention_flash(*inputs)
    query, quantized, keys, values, *rest = inputs
    with pytest.raises(ValueError, match=r"chunk_attention_flash: query must be \[B, Hq, T, D\]"):
        chunk_attention_flash(query, quantized, keys, values[:, :, 1:], *rest)


def _without_mask(inputs: tuple) -> tuple:
    query, quantized, keys, values, _, scaling, config, flags = inputs
    return query, quantized, keys, values, scaling, config, flags


FLASH_CASES = [  # each with the piece size (of None and 64) it takes in the default run on a CPU
    (
        chunk_case(chunk=200, quantized=256, window=64, head_dim=128, dtype=torch.bfloat16, method="oscar", kv_heads=4),
        None,
    ),
    (chunk_case(chunk=77, quantized=512, window=3, gqa=1, dtype=torch.float16), 64),
    (chunk_case(chunk=130, quantized=0, window=16, head_dim=128, dtype=torch.bfloat16), None),
    (chunk_case(chunk=64, quantized=96, window=40, dtype=torch.bfloat16, key_bits=4, value_bits=2, method="oscar"), 64),
    (chunk_case(chunk=300, quantized=1024, window=128, head_dim=128, dtype=torch.float16, rotation=False), 64),
]


# torch's backends: cuDNN's and flash attention on CUDA; its CPU flash kernel on CPU tensors (Triton's interpreter)
BACKENDS = (
    [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if DEVICE.type == "cuda" else [SDPBackend.FLASH_ATTENTION]
)


@pytest.mark.parametrize(
    "case, piece_tokens",
    [(case, p) if p == default else slow_on_cpu(case, p) for case, default in FLASH_CASES for p in (None, 64)],
    ids=lambda v: v.id if isinstance(v, Case) else str(v),
)
@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
def test_chunk_attention_flash_matches_reference(case: Case, piece_tokens: int | None, backend: SDPBackend):
    """torch's fused attention over the chunk's own tokens, then the dequantized pieces (one piece, or 64-token pieces:
    up to 16 merges, each in the model dtype) and the exact prefix, GQA 1 / 4, head_dim 64 / 128, both half dtypes,
    per-head key rotation, K4V2, no rotation, no history but a window; through each backend torch has here."""
    inputs = make_inputs(case)
    with sdpa_kernel([backend]):  # the one torch backend this call may use
        out = chunk_attention_flash(*_without_mask(inputs), piece_tokens=piece_tokens)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype
    assert out.transpose(1, 2).is_contiguous()  # the [B, T, Hq, D] layout the attention integration reshapes
    ref = attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, case.dtype, f"{case.id} pieces of {piece_tokens}")


def test_chunk_attention_flash_fuzzed():
    """A seeded draw over chunk lengths, history (quantized and window) lengths, piece sizes, GQA 1/4, head_dim
    64/128, the half dtypes, methods and bit widths, through the backend torch picks here (cuDNN first on CUDA)."""
    rng = random.Random(41)
    for seed in range(6):
        quantized = 32 * rng.randrange(0, 6)
        case = chunk_case(
            chunk=rng.randrange(1, 80),
            quantized=quantized,
            window=rng.randrange(0 if quantized == 0 else 1, 33),
            gqa=rng.choice((1, 4)),
            head_dim=rng.choice((64, 128)),
            dtype=rng.choice((torch.bfloat16, torch.float16)),
            method=rng.choice(("paper", "oscar")),
            key_bits=rng.choice((2, 3, 4)),
            value_bits=rng.choice((2, 3, 4)),
            kv_heads=rng.choice((1, 2)),
        )
        piece_tokens = rng.choice((None, 32, 64))
        inputs = make_inputs(case, seed)
        out = chunk_attention_flash(*_without_mask(inputs), piece_tokens=piece_tokens)
        ref = attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
        assert_close_to_reference(out, ref, case.dtype, f"{case.id} seed {seed} pieces of {piece_tokens}")


def test_chunk_without_history_takes_torch_attention():
    """A chunk over its own tokens only (a request's first chunk in the serving pool) is plain causal attention:
    torch's at any length (here 20 queries, under `FLASH_MIN_QUERIES`), equal to the float64 reference."""
    inputs = make_inputs(chunk_case(20, window=0, quantized=0, head_dim=128, dtype=torch.bfloat16))
    assert inputs[1] is None and inputs[4] is None  # no history, no padding
    out = chunk_attention(*inputs)
    assert torch.equal(out, chunk_attention_flash(*_without_mask(inputs)))
    ref = attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, torch.bfloat16, "own tokens only")


@pytest.mark.gpu
def test_prefer_flash_orders_the_backends():
    """cuDNN first by default, flash first with `prefer_flash` (the serving pool's chunks), each where torch takes the
    tensors; the user's switches still rule."""
    query, _, keys, *_ = make_inputs(FLASH_CASES[0][0])
    assert _torch_attention_backend(query, keys, prefer_flash=True) == "flash"
    assert _torch_attention_backend(query, keys) == ("cudnn" if torch.backends.cuda.cudnn_sdp_enabled() else "flash")
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert _torch_attention_backend(query, keys, prefer_flash=True) == "cudnn"


@pytest.mark.gpu
def test_chunk_attention_takes_flash_for_long_chunks_without_padding():
    """`chunk_attention`: a chunk of FLASH_MIN_QUERIES queries without padding by flash, with padding (or shorter) by
    the fused kernel; each equal to its path's own result."""
    long = chunk_case(chunk=FLASH_MIN_QUERIES, quantized=256, window=64, head_dim=128, dtype=torch.bfloat16, batch=1)
    query, quantized, keys, values, _, scaling, config, flags = make_inputs(long)
    flash = chunk_attention_flash(query, quantized, keys, values, scaling, config, flags)
    assert torch.equal(chunk_attention(query, quantized, keys, values, None, scaling, config, flags), flash)
    padded = make_inputs(replace(long, left_pad=30))
    assert torch.equal(chunk_attention(*padded), chunk_attention_triton(*padded))
    short = make_inputs(replace(long, q_len=FLASH_MIN_QUERIES - 1, residual=long.residual - 1))
    assert torch.equal(chunk_attention(*short), chunk_attention_triton(*short))
