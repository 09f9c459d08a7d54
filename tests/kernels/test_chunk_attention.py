"""Fused chunk attention (kernels/chunk_attention.py) vs the float64 reference: dequantization + plain softmax
attention (`oscar_hf.reference.decode_attention`, whose contract holds for any number of queries).

The quantized inputs come from `oscar_hf.reference.quantize_kv` on fresh random K/V, so these tests check the attention
kernel alone. Small shapes run everywhere (CPU: Triton's interpreter); the `gpu`-marked one needs CUDA.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest
import torch
from oscar_hf.kernels.chunk_attention import ChunkTuning, chunk_attention_triton
from reference_checks import assert_close_to_reference

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV
from oscar_hf.reference import decode_attention as attention_reference
from oscar_hf.reference import quantize_kv

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


# The decode kernel's tolerances (reference_checks.py): the chunk kernel's arithmetic is the same (fp16 operands
# for the quantized part, the model dtype for the exact part and the probabilities that weigh it).
@dataclass(frozen=True)
class Case:
    chunk: int = 37  # query tokens T
    quantized: int = 96  # L, a multiple of the group size
    window: int = 7  # exact tokens before the chunk (the residual window held)
    gqa: int = 4
    head_dim: int = 64
    left_pad: int = 0
    dtype: torch.dtype = torch.float16
    method: str = "paper"
    rotation: bool = True
    token_scaling: bool = True
    scale_dtype: str = "float16"
    batch: int = 2
    kv_heads: int = 2
    key_bits: int = 2
    value_bits: int = 2

    @property
    def id(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        extra = "".join(
            f
            for f, on in (
                (f"-pad{self.left_pad}", self.left_pad),
                ("-oscar", self.method == "oscar"),
                ("-noRot", not self.rotation),
                ("-noScale", not self.token_scaling),
                ("-fp32scales", self.scale_dtype != "float16"),
                (f"-K{self.key_bits}V{self.value_bits}", (self.key_bits, self.value_bits) != (2, 2)),
            )
            if on
        )
        return f"T{self.chunk}-L{self.quantized}-E{self.window}-g{self.gqa}-D{self.head_dim}-{dtype}{extra}"


BASE = Case()
CASES = [
    # chunk lengths 1 .. past a 64-token block and a 128-row tile, history lengths incl. none, partial windows
    *(replace(BASE, chunk=t) for t in (1, 16, 70)),
    replace(BASE, chunk=130, gqa=1, batch=1),
    *(replace(BASE, quantized=n, window=e) for n, e in ((0, 0), (0, 31), (32, 32), (160, 1))),
    # GQA 1 and 4, head_dim 64 and 128, the model dtypes
    replace(BASE, gqa=1, head_dim=128, dtype=torch.bfloat16),
    replace(BASE, head_dim=128, dtype=torch.bfloat16, chunk=20),
    replace(BASE, dtype=torch.float32),
    # left padding: inside the quantized region, and past it into the window and the chunk
    replace(BASE, left_pad=45),
    replace(BASE, left_pad=100, quantized=96, window=9, chunk=24),
    # method="oscar" (per-head key rotation), the method switches, fp32 scales
    replace(BASE, method="oscar", left_pad=13, head_dim=128),
    replace(BASE, rotation=False, token_scaling=False),
    replace(BASE, rotation=False),
    replace(BASE, scale_dtype="float32", quantized=64),
    # key and value bit widths of their own (a 4-bit and a 2-bit tile order their tokens differently)
    *(replace(BASE, key_bits=k, value_bits=v, left_pad=13) for k, v in ((4, 4), (4, 2), (2, 4))),
]


def make_inputs(case: Case, seed: int = 0):
    """query [B, Hq, T, D] (HF's layout, transposed), a quantized region of L tokens as views of larger buffers (as
    the cache stores them), exact K/V [B, Hkv, E + T, D], a padding mask, the scaling, config and flags."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=case.dtype)

    config = OscarConfig(
        rotation=case.rotation,
        token_scaling=case.token_scaling,
        scale_dtype=case.scale_dtype,
        method=case.method,
        key_bits=case.key_bits,
        value_bits=case.value_bits,
    )
    batch, kv_heads, dim = case.batch, case.kv_heads, case.head_dim
    key_rotated = None
    if case.rotation and case.method == "oscar":  # both kinds present
        key_rotated = (torch.arange(batch * kv_heads) % 2 == 0)[torch.randperm(batch * kv_heads, generator=gen)]
        key_rotated = key_rotated.view(batch, kv_heads).to(DEVICE)
    query = randn(batch, case.chunk, kv_heads * case.gqa, dim).transpose(1, 2)
    quantized = None
    if case.quantized:
        stored = quantize_kv(
            randn(batch, kv_heads, case.quantized, dim),
            randn(batch, kv_heads, case.quantized, dim),
            config,
            key_rotated,
        )
        quantized = QuantizedKV(*(None if t is None else _capacity_view(t.contiguous()) for t in stored))
    exact = case.window + case.chunk
    exact_keys, exact_values = randn(batch, kv_heads, exact, dim), randn(batch, kv_heads, exact, dim)
    mask = None
    if case.left_pad:
        mask = torch.ones(batch, case.quantized + exact, dtype=torch.bool, device=DEVICE)
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
    """A seeded draw over chunk lengths, history (quantized and window) lengths, padding, GQA 1/4, head_dim 64/128
    and the model dtypes; small 32-row tiles of 16-token steps, so that every draw crosses tiles and blocks."""
    rng = random.Random(37)
    for seed in range(6):
        quantized = 32 * rng.randrange(0, 5)
        window = rng.randrange(0 if quantized == 0 else 1, 33)
        case = Case(
            chunk=rng.randrange(1, 50),
            quantized=quantized,
            window=window,
            gqa=rng.choice((1, 4)),
            head_dim=rng.choice((64, 128)),
            left_pad=rng.choice((0, rng.randrange(0, quantized + window + 1))),
            dtype=rng.choice((torch.bfloat16, torch.float16, torch.float32)),
            method=rng.choice(("paper", "oscar")),
            key_bits=rng.choice((2, 4)),
            value_bits=rng.choice((2, 4)),
            batch=2,
            kv_heads=1,
        )
        _check(case, seed, ChunkTuning(block_m=32, block_n=16, num_warps=4))


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
    case = Case(chunk=1000, quantized=2048, window=128, gqa=gqa, head_dim=128, left_pad=300, dtype=torch.bfloat16,
                method="oscar", batch=2, kv_heads=4)  # fmt: skip
    _check(case)
