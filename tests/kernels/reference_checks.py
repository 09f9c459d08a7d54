"""What the kernel tests run on (the device, the cases they describe) and what they hold a kernel's output to
against the float64 reference (tests/kernels/test_*.py and benchmarks/fuzz_kernels.py import it; pytest finds it
through `pythonpath` in pyproject.toml)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from oscar_hf.config import OscarConfig

# CUDA when there is a GPU; otherwise CPU tensors, the kernels in Triton's interpreter (tests/conftest.py)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def slow_on_cpu(*values):
    """A parameter set that only repeats, at other sizes or options, what the default run checks on a CPU, where
    Triton's interpreter makes it long: slow there, in the default run on a GPU (tests/conftest.py)."""
    return pytest.param(*values, marks=pytest.mark.slow_on_cpu)


@dataclass(frozen=True)
class Case:
    """One kernel test's K/V: `batch` rows of `kv_heads` heads of `head_dim` in `dtype`, `quantized` tokens stored at
    the storage options below, then `residual` exact tokens, of which the last `q_len` are the step's own (a decode
    step: a few; a prefill chunk: many), read by `gqa` query heads per KV head; row 0's first `left_pad` positions
    are padding (another row's fewer, as each test's inputs say). `views`: tensors as transformers and the cache
    hand them over (HF's [B, T, H, D] transposed, capacity buffers); `row_major`: storage as the cache allocates it
    (the reference quantizer's is channel-major); `extreme_norms`: one key token 100x smaller, one 100x larger. The
    quantizer's tests read the K/V of `quantized` tokens alone."""

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
    rmse_tol, max_tol = TOLERANCES[dtype]
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"{label}: non-finite outputs at {torch.nonzero(~torch.isfinite(out64))[:8]}"
    err = out64 - ref
    rel_rmse = (err.norm() / ref.norm()).item()
    max_abs = err.abs().max().item()
    scale = ref.abs().max().item()
    worst = torch.nonzero(err.abs() > max_tol * scale)[:8].tolist()
    assert rel_rmse <= rmse_tol and max_abs <= max_tol * scale, (
        f"{label}: relative RMSE {rel_rmse:.3e} (tol {rmse_tol:.1e}), max-abs {max_abs:.3e} "
        f"(tol {max_tol * scale:.3e}); worst [b, h, t, d]: {worst}"
    )
