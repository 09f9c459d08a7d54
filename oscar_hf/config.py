"""`OscarConfig`: every knob of the OScaR KV cache, validated once, in one place."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

_SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class OscarConfig:
    """Configuration of an `OscarCache`.

    Args:
        bits: bits per stored K/V value, 2 (the paper's setting) or 4.
        group_size: tokens per key quantization group (per channel) and channels per value group (per token).
        residual_length: the most recent tokens kept in full precision; a multiple of `group_size`. Tokens are
            quantized in blocks of this many, so attention always sees 1 to `residual_length` exact recent tokens.
        rotation: Canalized Rotation (Walsh-Hadamard along head_dim) of keys and values (see `method` for keys).
        token_scaling: Omni-Token Scaling (divide each key token by its norm over all KV heads before quantizing).
            With `rotation=False, token_scaling=False` the cache is plain KIVI-style quantization.
        scale_dtype: dtype of the per-group scales and minimums, "float16" (default, the paper's byte count) or
            "float32". bfloat16 is refused: its 8-bit mantissa biases the zero-point.
        method: how `rotation` treats the keys. "paper" (default): every key is rotated, the paper's method (arXiv
            2605.19660). "oscar" (experimental; fused kernels in eager decoding, not yet compiled decode): each
            (batch row, KV head) of each layer decides once, at its first quantized block (the prompt), whether
            rotating its keys lowers the attention-logit error against the queries that read them
            (`reference.query_rotation_choice`; the queries reach the cache through the model's sdpa attention),
            and keeps that choice; values are always rotated. It avoids the rotation's damage on models whose keys
            carry large near-constant channels (Qwen2's k_proj bias, Gemma 3's k_norm) and keeps it where it helps:
            see benchmarks/results/ACCURACY.md.
        attention: "auto" (default) decodes with the fused Triton kernels where they apply (CUDA, an sdpa model,
            head_dim 64/128/256) and with the portable path elsewhere; "fused" demands the kernels (an error names
            what prevents them; on CPU they run only under TRITON_INTERPRET=1); "portable" always dequantizes and
            uses the model's own attention, for comparison.
    """

    bits: int = 2
    group_size: int = 32
    residual_length: int = 128
    rotation: bool = True
    token_scaling: bool = True
    scale_dtype: str = "float16"
    attention: str = "auto"
    method: str = "paper"

    def __post_init__(self):
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"OscarConfig: {message}")

        for name in ("bits", "group_size", "residual_length"):
            value = getattr(self, name)
            check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}.")
        for name in ("rotation", "token_scaling"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name} must be True or False, got {value!r}.")
        check(self.bits in (2, 4), f"bits={self.bits} is not supported; use 2 (default) or 4.")
        check(
            self.group_size in (32, 64, 128),
            f"group_size={self.group_size} is not supported; use 32 (default), 64 or 128.",
        )
        check(
            self.residual_length > 0 and self.residual_length % self.group_size == 0,
            f"residual_length={self.residual_length} must be a positive multiple of group_size={self.group_size} "
            f"(e.g. {4 * self.group_size}), because whole blocks of it are quantized at once.",
        )
        check(
            self.scale_dtype in _SCALE_DTYPES,
            f"scale_dtype={self.scale_dtype!r} is not supported; use one of {sorted(_SCALE_DTYPES)}.",
        )
        check(
            self.method in ("oscar", "paper"),
            f"method={self.method!r} is not supported; use 'paper' (default: the paper's method, every key rotated) "
            "or 'oscar' (experimental: a per-head choice of the key rotation).",
        )
        check(
            self.attention in ("auto", "fused", "portable"),
            f"attention={self.attention!r} is not supported; use 'auto' (fused kernels where they apply), 'fused' "
            "or 'portable'.",
        )

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> OscarConfig:
        """Build from a `cache_config` dict (as passed to `generate`); unknown keys are an error, never ignored."""
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"Unknown OscarCache option(s) {unknown}; valid options are {valid}.")
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
