"""Fused decode under the model's own `sdpa` attention, with nothing for the user to change.

transformers never passes the cache to attention functions: a module calls `past_key_values.update(k, v)` and then
its attention function on what `update` returned. An `OscarLayer` that can decode with the Triton kernel therefore
stores the step's tokens in `update`, records a *fused step* naming itself and the key/value tensors it returns, and
returns the new tokens only. The `sdpa` entry of transformers' `AttentionInterface`, wrapped by `install()` once an
OscarCache decides to use kernels, recognises those tensors and runs the fused kernel on the packed storage. Every
other call (other models, other caches, prefill) goes straight to the original sdpa.

A step stays valid until its layer's next update, for every call that receives exactly the returned tensors: a
layer that reuses another layer's K/V (Gemma 3n, Gemma 4 KV sharing) attends over the producer's whole history.
Anything that would attend to the new tokens only is an error instead of a wrong answer:

* while a step is not yet attended, an sdpa call that is not for it (the model changed the keys after `update`,
  e.g. MLA latents expanded or K/V padded), or that passes other values (DiffLlama's split values), or a query the
  step was not prepared for (batch, tokens, head_dim, heads);
* a new update while a step was never attended (the model's attention does not go through this wrapper).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch
from transformers.modeling_utils import AttentionInterface

from ..kernels import DECODE_MAX_QUERY_ROWS

# Attention features the fused kernel does not implement; a call using them attends over the dense history instead.
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")
_WRAPPED_MARK = "_oscar_original"
_FIX = "Use OscarConfig(attention='portable') for this model."


@dataclass
class FusedStep:
    """A decode step an `OscarLayer` stored in `update`: the K/V it returned (the new tokens only) stand for the
    layer's whole history in the sdpa calls that receive them."""

    layer: object  # the OscarLayer
    keys: torch.Tensor
    values: torch.Tensor


class _Steps(threading.local):
    """This thread's live steps, by `id(keys)` (a step holds its `keys`, so the id is not reused meanwhile), and the
    one waiting for its first attention call (at most one: each update is followed by its attention)."""

    def __init__(self):
        self.live: dict[int, FusedStep] = {}
        self.waiting: FusedStep | None = None

    def clear(self) -> None:
        self.live.clear()
        self.waiting = None


_steps = _Steps()


def expect_fused_decode(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Called by `OscarLayer.update`: sdpa calls receiving `keys`/`values` attend over `layer`'s storage."""
    if _steps.waiting is not None:
        _steps.clear()
        raise RuntimeError(
            "OscarCache: the previous decode step's attention did not run through the fused sdpa path (the model "
            "uses its own attention function, or an attention call raised), so it would have attended to the new "
            f"tokens only. {_FIX}"
        )
    live = _steps.live
    for key in [key for key, step in live.items() if step.layer is layer]:
        del live[key]  # the layer's previous step ends with its next update
    _steps.waiting = live[id(keys)] = FusedStep(layer, keys, values)


def _check_call(step: FusedStep | None, query: torch.Tensor, value: torch.Tensor) -> None:
    """Raise unless this sdpa call is one the fused kernel answers correctly (see the module docstring)."""
    waiting = _steps.waiting
    if step is None or (waiting is not None and step is not waiting):
        problem = (
            "received keys that are not the ones the cache returned (the model changed them after the cache update, "
            "e.g. expanded MLA latents, padding or concatenation)"
            if step is None
            else "belongs to another layer's decode step"
        )
        raise RuntimeError(
            f"OscarCache: an attention call made while a fused decode step was waiting for its attention {problem}; "
            f"the fused kernel cannot attend over the whole history for it. {_FIX}"
        )
    if value is not step.values:
        raise RuntimeError(
            "OscarCache: an attention call received the keys of a fused decode step with other values (the model "
            f"changed the values after the cache update); the fused kernel reads the stored values. {_FIX}"
        )
    keys = step.keys
    batch, kv_heads, tokens, head_dim = keys.shape
    q_batch, q_heads, q_tokens, q_dim = query.shape
    if (
        (q_batch, q_tokens, q_dim) != (batch, tokens, head_dim)
        or q_heads % kv_heads
        or q_heads // kv_heads * q_tokens > DECODE_MAX_QUERY_ROWS
    ):
        raise RuntimeError(
            f"OscarCache: an attention call with query {tuple(query.shape)} does not match the fused decode step it "
            f"uses (keys {tuple(keys.shape)}: same batch, tokens and head_dim, query heads a multiple of the KV "
            f"heads, at most {DECODE_MAX_QUERY_ROWS} query rows per KV head). {_FIX}"
        )


def _fused_sdpa(original, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    step = _steps.live.get(id(key))  # a live step holds its keys: an equal id is the same tensor
    if step is None and _steps.waiting is None:  # not a fused step's call: untouched
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _check_call(step, query, value)
    _steps.waiting = None
    layer = step.layer
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dropout or any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS):
        keys, values = layer.dense_history()  # includes this step's tokens: `update` stored them already
        return original(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = layer.fused_attention(query, attention_mask, scaling)  # [B, Hq, Tq, D]
    return out.transpose(1, 2).contiguous(), None  # sdpa's layout: [B, Tq, Hq, D]


def install() -> None:
    """Wrap transformers' `sdpa` attention entry (idempotent). Called as a new cache starts using the kernels, so it
    also forgets the steps of earlier caches (and one left waiting by a forward that raised between `update` and
    attention)."""
    _steps.clear()
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
    _steps.clear()


def is_installed() -> bool:
    return hasattr(AttentionInterface._global_mapping["sdpa"], _WRAPPED_MARK)
