"""How an `OscarLayer`'s blocks are quantized and read back: by the Triton kernels on the fused path, by the
reference (`oscar_hf.reference`) elsewhere, every quantized block checked finite."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import OscarConfig
from ..decode_path import DecodePath
from ..layout import QuantizedKV
from ..reference import dequantize_kv, finite_flags, quantize_kv, token_norms
from .finite import FiniteCheck

if TYPE_CHECKING:
    from .storage import KVStorage


class BlockCodec:
    """Quantizes blocks of one layer into the storage contract (`oscar_hf.layout`) and dequantizes them back."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self.finite = FiniteCheck(config)

    def quantize(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        key_rotated: torch.Tensor | None,
        valid: torch.Tensor | None,
        path: DecodePath,
        into: tuple[KVStorage, int] | None = None,
    ) -> QuantizedKV:
        """Quantize a block (`valid`: False at padding, left out), refusing a non-finite one (`FiniteCheck`: with the
        other blocks of its update, on CUDA without waiting). `into`: (storage, quantized token): the block is written
        there (by the Triton kernel in place, checked finite on the way: no copy, no extra pass); None: a new block.
        Returns the block."""
        norms = None
        if path.head_group is not None and self.config.token_scaling:
            norms = token_norms(keys, path.head_group)  # over the heads of every rank: one all-reduce per block
        if path.fused:
            from ..kernels import quantize_kv_triton

            storage, start = into or (None, 0)
            out = None if storage is None else storage.buffers
            flags = self.finite.flags(keys.device)
            block = quantize_kv_triton(
                keys, values, self.config, key_rotated, norms, valid, out=out, start=start, finite=flags
            )
        else:
            block = quantize_kv(keys, values, self.config, key_rotated, norms=norms, valid=valid)
            flags = finite_flags(block, keys, values, valid)
            if into is not None:
                into[0].write(into[1], block)
        self.finite.check(flags)
        return block

    def dequantize(
        self,
        rows: QuantizedKV,
        key_rotated: torch.Tensor | None,
        path: DecodePath,
        dtype: torch.dtype,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of the quantized `rows`, in `dtype`, written into `out` when given: on the fused path by the
        Triton kernel (straight from the packed codes to `dtype`), elsewhere by the reference in float32 (float64
        for a float64 model)."""
        if path.fused:
            from ..kernels import dequantize_kv_triton

            return dequantize_kv_triton(rows, self.config, key_rotated, out, dtype)
        math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        keys, values = dequantize_kv(rows, self.config, math_dtype, key_rotated)
        if out is None:
            return keys.to(dtype), values.to(dtype)
        out[0].copy_(keys)
        out[1].copy_(values)
        return out
