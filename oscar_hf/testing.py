"""What the kernel tests (tests/kernels) and the GPU kernel fuzzer (benchmarks/fuzz_kernels.py) hold a kernel's output
to: the tolerances against the float64 reference, and the decode attention cases both draw (a case's random inputs, a
random case, one case checked against the reference)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from .config import SUPPORTED_WIDTHS, OscarConfig
from .kernels import DECODE_MAX_QUERY_ROWS, decode_attention_triton
from .layout import QuantizedKV
from .reference import decode_attention as decode_attention_reference
from .reference import quantize_kv

# Tolerances against the float64 reference computed from the same stored codes, so they only cover arithmetic:
# quantized-part dot operands are fp16 (relative rounding 2^-11 ~ 5e-4 per operand), or float32 with float32 scales
# (three TF32 products: a single one truncates to 10 mantissa bits, a bias that measured 2.1e-3 relative RMSE on an
# H100 for fuzz case 907 of seed 0, against 2e-4 in the interpreter), residual operands and the probabilities are
# in the model dtype (bf16: 2^-8 ~ 4e-3), and the output is rounded once to the model dtype.
# Relative RMSE bounds are ~3x the errors observed; max-abs bounds are relative to the largest reference value.
TOLERANCES = {  # dtype: (relative RMSE, max-abs / max|ref|)
    torch.bfloat16: (1.2e-2, 3e-2),
    torch.float16: (2e-3, 6e-3),
    torch.float32: (2e-3, 6e-3),
}


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, label: str) -> None:
    """Raise AssertionError unless `out` (a kernel's, in `dtype`) is finite and within `TOLERANCES[dtype]` of the
    float64 reference `ref`: relative RMSE and max-abs error, the message naming the worst positions."""
    rmse_tol, max_tol = TOLERANCES[dtype]
    out64 = out.double()
    if not torch.isfinite(out64).all():
        raise AssertionError(f"{label}: non-finite outputs at {torch.nonzero(~torch.isfinite(out64))[:8]}")
    err = out64 - ref
    rel_rmse = (err.norm() / ref.norm()).item()
    max_abs = err.abs().max().item()
    scale = ref.abs().max().item()
    if rel_rmse > rmse_tol or max_abs > max_tol * scale:
        worst = torch.nonzero(err.abs() > max_tol * scale)[:8].tolist()
        raise AssertionError(
            f"{label}: relative RMSE {rel_rmse:.3e} (tol {rmse_tol:.1e}), max-abs {max_abs:.3e} "
            f"(tol {max_tol * scale:.3e}); worst [b, h, t, d]: {worst}"
        )


@dataclass(frozen=True)
class Case:
    """One kernel test's K/V: `batch` rows of `kv_heads` heads of `head_dim` in `dtype`, `quantized` tokens stored at
    the storage options below, then `residual` exact tokens, of which the last `q_len` are the step's own (a decode
    step: a few; a prefill chunk: many), read by `gqa` query heads per KV head; row 0's first `left_pad` positions
    are padding (another row's fewer, as each test's inputs say). `views`: tensors as transformers and the cache
    hand them over (HF's [B, T, H, D] transposed, capacity buffers); `row_major`: storage as the cache allocates it
    (the reference quantizer's is channel-major); `extreme_norms`: one key token 100x smaller, one 100x larger. The
    quantizer's tests read the K/V of `quantized` tokens alone. `id`: a readable test id."""

    batch: int = 2
    kv_heads: int = 2
    gqa: int = 4
    q_len: int = 1
    head_dim: int = 64
    quantized: int = 96
    residual: int = 5
    dtype: torch.dtype = torch.bfloat16
    key_bits: int = 2
    value_bits: int = 2
    rotation: bool = True
    token_scaling: bool = True
    group_size: int = 32
    scale_dtype: str = "float16"
    left_pad: int = 0
    extreme_norms: bool = False
    views: bool = False
    method: str = "paper"
    row_major: bool = False

    @property
    def id(self) -> str:
        flags = "".join(
            f
            for f, on in (
                ("-noRot", not self.rotation),
                ("-noScale", not self.token_scaling),
                (f"-pad{self.left_pad}", self.left_pad),
                ("-extreme", self.extreme_norms),
                ("-views", self.views),
                ("-rowMajor", self.row_major),
                ("-perHeadKeyRotation", self.method == "oscar"),
                (f"-G{self.group_size}", self.group_size != 32),
                ("-fp32scales", self.scale_dtype != "float16"),
            )
            if on
        )
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"B{self.batch}-Hkv{self.kv_heads}-g{self.gqa}-Tq{self.q_len}-D{self.head_dim}-L{self.quantized}-"
            f"R{self.residual}-{dtype}-K{self.key_bits}V{self.value_bits}{flags}"
        )

    def config(self) -> OscarConfig:
        """The storage options as the kernels take them (no sink slots: the tests that have sinks say so)."""
        return OscarConfig(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            rotation=self.rotation,
            token_scaling=self.token_scaling,
            group_size=self.group_size,
            scale_dtype=self.scale_dtype,
            method=self.method,
            sink_tokens=0,
        )


def _capacity_view(t: torch.Tensor, dim: int, extra: int) -> torch.Tensor:
    """`t` copied into a larger buffer (garbage beyond it) and returned as a view with the buffer's strides."""
    shape = list(t.shape)
    shape[dim] += extra
    if t.is_floating_point():
        buf = torch.randn(shape, device=t.device).to(t.dtype)
    else:
        buf = torch.full(shape, 0x12345678, dtype=t.dtype, device=t.device)
    view = buf.narrow(dim, 0, t.shape[dim])
    view.copy_(t)
    return view


def decode_inputs(case: Case, seed: int = 0, device: str | torch.device | None = None) -> tuple:
    """`decode_attention_triton`'s arguments for `case`, random (seeded) on `device` (default: CUDA where there is
    one): the query, K/V quantized by the reference quantizer (`reference.quantize_kv`), the residual window, the
    padding mask, the scaling, the config and the per-head key rotation flags."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=case.dtype)

    config = case.config()
    # method="oscar": a random per-(row, head) choice, both kinds present whenever there are two heads
    key_rotated = None
    if case.rotation and case.method == "oscar":
        key_rotated = (torch.arange(case.batch * case.kv_heads) + seed) % 2 == 0
        key_rotated = key_rotated[torch.randperm(key_rotated.numel(), generator=gen)].view(case.batch, case.kv_heads)
        key_rotated = key_rotated.to(device)
    q_heads = case.kv_heads * case.gqa
    if case.views:  # HF's layout: [B, T, H, D] transposed to [B, H, T, D]
        query = randn(case.batch, case.q_len, q_heads, case.head_dim).transpose(1, 2)
    else:
        query = randn(case.batch, q_heads, case.q_len, case.head_dim)
    quantized = None
    if case.quantized:
        keys = randn(case.batch, case.kv_heads, case.quantized, case.head_dim)
        values = randn(case.batch, case.kv_heads, case.quantized, case.head_dim)
        if case.extreme_norms:
            keys[:, :, 3] *= 0.01
            keys[:, :, case.quantized // 2 + 1] *= 100.0
        quantized = quantize_kv(keys, values, config, key_rotated)
        if case.row_major:
            quantized = QuantizedKV(*(None if t is None else t.contiguous() for t in quantized))
        if case.views:
            quantized = QuantizedKV(*(None if t is None else _capacity_view(t, 2, 48) for t in quantized))
    residual_keys = randn(case.batch, case.kv_heads, case.residual, case.head_dim)
    residual_values = randn(case.batch, case.kv_heads, case.residual, case.head_dim)
    if case.views:
        residual_keys = _capacity_view(residual_keys, 2, 128 - case.residual)
        residual_values = _capacity_view(residual_values, 2, 128 - case.residual)
    mask = None
    if case.left_pad:
        mask = torch.ones(case.batch, case.quantized + case.residual, dtype=torch.bool, device=device)
        mask[0, : case.left_pad] = False
        if case.batch > 1:
            mask[1, : case.left_pad // 2] = False
    return query, quantized, residual_keys, residual_values, mask, 1.0 / math.sqrt(case.head_dim), config, key_rotated


def random_decode_case(rng: random.Random, max_tokens: int, max_batch: int = 64, max_kv_heads: int = 8) -> Case:
    """A random decode case (the kernel fuzzer's, benchmarks/fuzz_kernels.py; CI runs a seeded slice of it).

    Lengths are multiples of nothing but the group size the storage requires; `max_tokens` bounds
    batch * KV heads * (quantized + residual) so the float64 reference fits. Compile-time choices (query tokens,
    flags, dtypes) come from short lists so that a thousand cases need a few hundred compilations, not one each.
    """
    head_dim = rng.choice((64, 128, 256))
    group_size = 64 if rng.random() < 0.2 else 32
    gqa = rng.choice((1, 2, 4, 5, 8))
    residual = rng.randint(1, 128)
    q_len = rng.choice([t for t in (1, 1, 1, 3, 8) if t <= residual and gqa * t <= DECODE_MAX_QUERY_ROWS])
    paper = rng.random() < 0.8  # rotation and token scaling both on: the default
    kv_heads = rng.randint(1, max_kv_heads)
    batch = min(max_batch, max(1, int(2 ** rng.uniform(0, 6))))  # 1 .. 64, log-uniform
    per_row = max_tokens // (batch * kv_heads)
    quantized = group_size * rng.randint(1, max(1, (per_row - residual) // group_size))
    batch = max(1, min(batch, max_tokens // (kv_heads * (quantized + residual))))
    key_bits = rng.choices(SUPPORTED_WIDTHS, weights=[2 if bits == 2 else 1 for bits in SUPPORTED_WIDTHS])[0]
    return Case(
        batch=batch,
        kv_heads=kv_heads,
        gqa=gqa,
        q_len=q_len,
        head_dim=head_dim,
        quantized=quantized,
        residual=residual,
        dtype=rng.choice((torch.bfloat16, torch.float16)),
        key_bits=key_bits,
        value_bits=key_bits if rng.random() < 0.7 else rng.choice([b for b in SUPPORTED_WIDTHS if b != key_bits]),
        rotation=paper or rng.random() < 0.5,
        token_scaling=paper or rng.random() < 0.5,
        group_size=group_size,
        scale_dtype="float32" if rng.random() < 0.05 else "float16",
        left_pad=rng.randint(1, quantized + residual - q_len) if rng.random() < 0.3 else 0,
        views=rng.random() < 0.3,
        method="oscar" if rng.random() < 0.2 else "paper",
        row_major=rng.random() < 0.5,
    )


def check_decode_case(case: Case, seed: int) -> float:
    """Run one case against the float64 reference; return the relative RMSE (raises on a tolerance breach)."""
    inputs = decode_inputs(case, seed=seed)
    out = decode_attention_triton(*inputs)
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, case.dtype, case.id)
    return ((out.double() - ref).norm() / ref.norm()).item()
