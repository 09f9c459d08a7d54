"""Triton kernels of oscar-hf, installed as `oscar_hf.kernels` (never a top-level `kernels`).

Launchers only, imported lazily so that `import oscar_hf.kernels` works where Triton is absent:

- `quantize_kv_triton(keys, values, config) -> QuantizedKV` and `flush_residual_triton(residual_keys,
  residual_values, storage, length, config)` (kernels/quantize_pack.py)
- `dequantize_kv_triton(quantized, config, key_rotated, out) -> (keys, values)` (kernels/dequantize.py): the dense
  history a prefill chunk attends to through the model's sdpa; `fake_quantize_kv_triton(keys, values, key_rotated,
  config, valid)` and `fake_quantize_keys_triton(keys, rotated, config, valid)` (same file): the round trips that
  bits="auto" costs each width with, and method="oscar"'s key rotation choice its keys
- `decode_attention_triton(query, quantized, residual_keys, residual_values, key_padding_mask, scaling, config)`
  (kernels/decode_attention.py, the launcher: the Triton split kernel of kernels/decode_triton.py, on CUDA GPUs the
  usual decode step's full blocks through the Gluon kernel of kernels/decode_gluon.py, the merge of
  kernels/decode_merge.py; launch choices in kernels/decode_tuning.py)
- `chunk_attention_triton(query, quantized, exact_keys, exact_values, key_padding_mask, scaling, config)` and
  `chunk_attention_flash(...)` (kernels/chunk_attention.py): a prefill chunk's attention over the packed history and
  its exact tokens, by the fused kernel or, for a long chunk without padding, by flash attention over the history
  dequantized piece by piece (`chunk_attention.chunk_attention` picks)

and the decode kernel's limits, which callers check before choosing it (importing them needs no Triton).
"""

from __future__ import annotations

import importlib
import importlib.metadata

# This folder found as the top-level package `kernels` (the checkout's root on sys.path) while HuggingFace's `kernels`
# is installed: transformers would import this one in its place. Without HuggingFace's, transformers finds no version
# here and takes `kernels` as absent, as it is.
if __name__ == "kernels" and any(importlib.metadata.distributions(name="kernels")):
    raise ImportError(
        "Python found the oscar-hf checkout's kernels/ folder as the package `kernels`, which is HuggingFace's "
        "(transformers >= 5.25 imports it): the checkout's root is on sys.path, as the current directory of `python "
        "-c`, `python -m` or a REPL started there. Run from another directory, or with `python -P`."
    )

__all__ = [
    "chunk_attention_flash",
    "chunk_attention_triton",
    "DECODE_HEAD_DIMS",
    "DECODE_MAX_QUERY_ROWS",
    "DECODE_MAX_QUERY_TOKENS",
    "decode_attention_triton",
    "dequantize_kv_triton",
    "fake_quantize_keys_triton",
    "fake_quantize_kv_triton",
    "flush_residual_triton",
    "quantize_kv_triton",
]

DECODE_HEAD_DIMS = (64, 128, 256)  # head dims the decode kernel is compiled for
DECODE_MAX_QUERY_TOKENS = 16  # query tokens per call (speculative decoding) ...
DECODE_MAX_QUERY_ROWS = 64  # ... and query rows per KV head, (Hq / Hkv) * Tq

_HOMES = {
    "chunk_attention_flash": ".chunk_attention",
    "chunk_attention_triton": ".chunk_attention",
    "quantize_kv_triton": ".quantize_pack",
    "flush_residual_triton": ".quantize_pack",
    "decode_attention_triton": ".decode_attention",
    "dequantize_kv_triton": ".dequantize",
    "fake_quantize_keys_triton": ".dequantize",
    "fake_quantize_kv_triton": ".dequantize",
}


def __getattr__(name: str):
    if name in _HOMES:  # imported once: later lookups (every decode step's) find the launcher in this module
        launcher = globals()[name] = getattr(importlib.import_module(_HOMES[name], __name__), name)
        return launcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
