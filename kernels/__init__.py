"""Triton kernels of oscar-hf, installed as `oscar_hf.kernels` (found as a top-level `kernels`, this folder hands
over to HuggingFace's package of that name: `_hand_over_to_huggingface`).

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
import importlib.machinery
import importlib.util
import os
import sys


def _hand_over_to_huggingface() -> None:
    """Put HuggingFace's `kernels` package, found on the rest of sys.path, in this module's place in sys.modules.

    Python finds this folder as the top-level package `kernels` wherever the checkout's root is on sys.path (`python
    -c`, `python -m pytest`, a REPL or a Jupyter kernel started there), before HuggingFace's `kernels`, which
    transformers >= 5.25 imports. An import returns what `sys.modules[name]` holds once the module's file has run, so
    `import kernels` gets HuggingFace's package; sys.path and the environment stay as they are. Without HuggingFace's
    package this module stays: transformers finds no `kernels` distribution (no version) and takes it as absent.
    """
    # (A namespace folder, no __init__.py, would let a regular package found later win, but setuptools' editable
    # finder maps `oscar_hf.kernels` to this folder only through this file: the package would vanish.)
    here = os.path.realpath(os.path.dirname(__file__))
    elsewhere = [p for p in sys.path if os.path.realpath(os.path.join(p or os.curdir, "kernels")) != here]
    for finder in sys.meta_path:  # the path finder without this folder; other finders (editable installs') as they are
        spec = finder.find_spec(__name__, elsewhere if finder is importlib.machinery.PathFinder else None)
        if spec is not None:
            break
    else:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules[__name__] = module  # before it runs: its submodules import it by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[__name__]
        raise


if __name__ == "kernels":
    _hand_over_to_huggingface()

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
