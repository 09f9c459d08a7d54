"""Fused decode under the model's own `sdpa` attention, with nothing for the user to change.

transformers never passes the cache to attention functions: a module calls `past_key_values.update(k, v)` and then
its attention function on what `update` returned. An `OscarLayer` that can decode with the Triton kernel therefore
stores the step's tokens in `update`, leaves a *pending decode* naming itself and the key tensor it returns, and
returns the new tokens only. The `sdpa` entry of transformers' `AttentionInterface`, wrapped by `install()` once an
OscarCache on a CUDA device decides to use kernels, recognises that key tensor and runs the fused kernel on the
packed storage. Every other call (other models, other caches, prefill) goes straight to the original sdpa.

A pending decode that no attention call consumed means the model's attention did not go through this wrapper: the
next `update` raises instead of letting a model attend to the new tokens only.
"""

from __future__ import annotations

import functools
import threading

import torch
from transformers.modeling_utils import AttentionInterface

# Attention features the fused kernel does not implement; a call using them attends over the dense history instead.
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")
_WRAPPED_MARK = "_oscar_original"
_local = threading.local()


def expect_fused_decode(layer, keys: torch.Tensor) -> None:
    """Called by `OscarLayer.update`: the next sdpa call receiving `keys` is this layer's fused decode step."""
    stale = getattr(_local, "pending", None)
    _local.pending = (keys, layer)
    if stale is not None:
        raise RuntimeError(
            "OscarCache: the previous decode step's attention did not run through the fused sdpa path (the model "
            "changed the keys after the cache update, or uses its own attention function), so it would have attended "
            "to the new tokens only. Use OscarConfig(attention='portable') for this model."
        )


def _fused_sdpa(original, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    pending = getattr(_local, "pending", None)
    if pending is None or pending[0] is not key:
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _local.pending = None
    layer = pending[1]
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dropout or any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS):
        keys, values = layer.dense_history()  # includes this step's tokens: `update` stored them already
        return original(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = layer.fused_attention(query, attention_mask, scaling)  # [B, Hq, Tq, D]
    return out.transpose(1, 2).contiguous(), None  # sdpa's layout: [B, Tq, Hq, D]


def install() -> None:
    """Wrap transformers' `sdpa` attention entry (idempotent). Called as a new cache starts using the kernels, so it
    also forgets a step left pending by a forward that raised between `update` and attention."""
    _local.pending = None
    original = AttentionInterface._global_mapping["sdpa"]
    if hasattr(original, _WRAPPED_MARK):
        return
    wrapper = functools.wraps(original)(functools.partial(_fused_sdpa, original))
    setattr(wrapper, _WRAPPED_MARK, original)
    AttentionInterface.register("sdpa", wrapper)


def uninstall() -> None:
    """Restore transformers' own `sdpa` entry."""
    original = getattr(AttentionInterface._global_mapping["sdpa"], _WRAPPED_MARK, None)
    if original is not None:
        AttentionInterface.register("sdpa", original)
    _local.pending = None


def is_installed() -> bool:
    return hasattr(AttentionInterface._global_mapping["sdpa"], _WRAPPED_MARK)
