"""Triton kernels of oscar-hf, installed as `oscar_hf.kernels` (never a top-level `kernels`).

Launchers only, imported lazily so that `import oscar_hf.kernels` works where Triton is absent:

- `quantize_kv_triton(keys, values, config) -> QuantizedKV` (kernels/quantize_pack.py)
- `decode_attention_triton(query, quantized, residual_keys, residual_values, key_padding_mask, scaling, config)`
  (kernels/decode_attention.py)
"""

from __future__ import annotations

import importlib

__all__ = ["decode_attention_triton", "quantize_kv_triton"]

_HOMES = {"quantize_kv_triton": ".quantize_pack", "decode_attention_triton": ".decode_attention"}


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
