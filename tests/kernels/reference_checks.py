"""What the kernel tests hold a kernel's output to against the float64 reference (tests/kernels/test_*.py and
benchmarks/fuzz_kernels.py import it; pytest finds it through `pythonpath` in pyproject.toml)."""

from __future__ import annotations

import torch

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
