"""Fused decode under the model's own `sdpa` attention, with nothing for the user to change.

transformers never passes the cache to attention functions: a module calls `past_key_values.update(k, v)` and then
its attention function on what `update` returned. An `OscarLayer` that can decode with the Triton kernel therefore
stores the step's tokens in `update`, records a *fused step* (the key/value tensors it returns, the new tokens only)
and returns them. The `sdpa` entry of transformers' `AttentionInterface`, wrapped by `install()` once an OscarCache
decides to use kernels, finds the step through the cache that recorded it (`register_cache`), at the layer named by
the attention module's `layer_idx` (or, for a layer reading another layer's K/V, by scanning the layers), and runs the
fused kernel on the packed storage. Every other call (other models, other caches, prefill) goes straight to the
original sdpa. The lookup compares tensors by identity and reads plain attributes, so dynamo traces it
(`torch.compile(fullgraph=True)`) like eager code.

The same wrapper hands the queries of each attention call to a layer that waits for them (method="oscar" chooses
its key rotation from the queries that read the prompt), when the call received the keys that layer's update returned.

A step stays valid until its layer's next update, for every call that receives exactly the returned tensors: a
layer that reuses another layer's K/V (Gemma 3n, Gemma 4 KV sharing) attends over the producer's whole history.
Anything that would attend to the new tokens only is an error instead of a wrong answer:

* while a step is not yet attended, an sdpa call that is not for it (the model changed the keys after `update`,
  e.g. MLA latents expanded or K/V padded), or that passes other values (DiffLlama's split values), or a query the
  step was not prepared for (batch, tokens, head_dim, heads);
* a new update while a step was never attended (the model's attention does not go through this wrapper).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers.modeling_utils import AttentionInterface

from ..kernels import DECODE_MAX_QUERY_ROWS
from ..reference import query_moment

# Attention features the fused kernel does not implement; a call using them attends over the dense history instead.
_UNSUPPORTED_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")
_WRAPPED_MARK = "_oscar_original"
_FIX = "Use OscarConfig(attention='portable') for this model."


@dataclass
class FusedStep:
    """A decode step an `OscarLayer` stored in `update`: the K/V it returned (the new tokens only) stand for the
    layer's whole history in the sdpa calls that receive them, until the layer's next update."""

    keys: torch.Tensor
    values: torch.Tensor


class _Dispatch(threading.local):
    """This thread's cache whose layers hold fused steps (a weak reference: the cache dies with its last user
    reference), and the layer whose step waits for its first attention call (at most one: each update is followed
    by its attention)."""

    def __init__(self):
        self.cache = None
        self.waiting = None

    def clear(self) -> None:
        self.cache = self.waiting = None


_dispatch = _Dispatch()


def register_cache(cache) -> None:
    """Called by `OscarCache.update` on the fused path: attention calls look for fused steps in `cache`'s layers."""
    _dispatch.cache = weakref.ref(cache)


def expect_fused_decode(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Called by `OscarLayer.update`: sdpa calls receiving `keys`/`values` attend over `layer`'s storage."""
    if _dispatch.waiting is not None:
        _dispatch.waiting = None
        raise RuntimeError(
            "OscarCache: the previous decode step's attention did not run through the fused sdpa path (the model "
            "uses its own attention function, or an attention call raised), so it would have attended to the new "
            f"tokens only. {_FIX}"
        )
    layer.fused_step = FusedStep(keys, values)
    _dispatch.waiting = layer


def _layer_of(module, key: torch.Tensor):
    """The cache layer whose fused step returned `key`, or None."""
    cache = None if _dispatch.cache is None else _dispatch.cache()
    if cache is None:
        return None
    index = getattr(module, "layer_idx", None)
    if isinstance(index, int) and 0 <= index < len(cache.layers):  # the usual case: the module's own layer
        step = getattr(cache.layers[index], "fused_step", None)
        if step is not None and step.keys is key:
            return cache.layers[index]
    for layer in cache.layers:  # a layer reading another layer's K/V (KV sharing)
        step = getattr(layer, "fused_step", None)
        if step is not None and step.keys is key:
            return layer
    return None


def _check_call(layer, query: torch.Tensor, value: torch.Tensor) -> None:
    """Raise unless this sdpa call is one the fused kernel answers correctly (see the module docstring)."""
    waiting = _dispatch.waiting
    if layer is None or (waiting is not None and layer is not waiting):
        problem = (
            "received keys that are not the ones the cache returned (the model changed them after the cache update, "
            "e.g. expanded MLA latents, padding or concatenation)"
            if layer is None
            else "belongs to another layer's decode step"
        )
        raise RuntimeError(
            f"OscarCache: an attention call made while a fused decode step was waiting for its attention {problem}; "
            f"the fused kernel cannot attend over the whole history for it. {_FIX}"
        )
    step = layer.fused_step
    if value is not step.values:
        raise RuntimeError(
            "OscarCache: an attention call received the keys of a fused decode step with other values (the model "
            f"changed the values after the cache update); the fused kernel reads the stored values. {_FIX}"
        )
    batch, kv_heads, tokens, head_dim = step.keys.shape
    q_batch, q_heads, q_tokens, q_dim = query.shape
    if (
        (q_batch, q_tokens, q_dim) != (batch, tokens, head_dim)
        or q_heads % kv_heads
        or q_heads // kv_heads * q_tokens > DECODE_MAX_QUERY_ROWS
    ):
        raise RuntimeError(
            f"OscarCache: an attention call with query {tuple(query.shape)} does not match the fused decode step it "
            f"uses (keys {tuple(step.keys.shape)}: same batch, tokens and head_dim, query heads a multiple of the KV "
            f"heads, at most {DECODE_MAX_QUERY_ROWS} query rows per KV head). {_FIX}"
        )


def _hand_queries(module, query: torch.Tensor, key: torch.Tensor) -> None:
    """method="oscar": give the queries to the cache layer whose update returned `key` and waits for them (it chooses
    its key rotation from them)."""
    cache = None if _dispatch.cache is None else _dispatch.cache()
    index = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(index, int) or not 0 <= index < len(cache.layers):
        return
    layer = cache.layers[index]
    if getattr(layer, "wants_queries", False):
        layer.observe_queries(query, key)


@contextlib.contextmanager
def recording_query_moments(moments: dict):
    """While active, each sdpa attention call adds the second moment of its queries (`reference.query_moment`) under
    its module's `layer_idx`: a prefill through any cache records what `OscarLayer.observe_query_moment` takes (the
    lm-eval wrapper fills method caches from one exact prefill)."""
    original = AttentionInterface._global_mapping["sdpa"]

    def recording(module, query, key, *args, **kwargs):
        moment = query_moment(query, key.shape[1])
        index = module.layer_idx
        moments[index] = moment if index not in moments else moments[index] + moment
        return original(module, query, key, *args, **kwargs)

    AttentionInterface.register("sdpa", recording)
    try:
        yield moments
    finally:
        AttentionInterface.register("sdpa", original)


def _fused_sdpa(original, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    _hand_queries(module, query, key)
    layer = _layer_of(module, key)
    if layer is None and _dispatch.waiting is None:  # not a fused step's call: untouched
        return original(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _check_call(layer, query, value)
    _dispatch.waiting = None
    if torch.compiler.is_compiling():
        # A compiled model has no layer reading another's K/V (`OscarCache.compile_blockers`), so the step is used up.
        # Left in place, its K/V would outlive the traced forward: two more graph outputs per layer, which CUDA-graph
        # replays rebuild as tensors on the host while the GPU waits (generate synchronises every step).
        layer.fused_step = None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if dropout or any(kwargs.get(name) is not None for name in _UNSUPPORTED_KWARGS):
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "OscarCache: compiled decode supports plain causal attention only (no dropout, softcap, sliding "
                "window or sinks). Run this model eagerly."
            )
        keys, values = layer.dense_history()  # includes this step's tokens: `update` stored them already
        return original(module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    out = layer.fused_attention(query, attention_mask, scaling)  # [B, Hq, Tq, D]
    return out.transpose(1, 2).contiguous(), None  # sdpa's layout: [B, Tq, Hq, D]


def install() -> None:
    """Wrap transformers' `sdpa` attention entry (idempotent). Called as a new cache starts using the kernels, so it
    also forgets a step left waiting by a forward that raised between `update` and attention."""
    _dispatch.clear()
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
    _dispatch.clear()


def is_installed() -> bool:
    return hasattr(AttentionInterface._global_mapping["sdpa"], _WRAPPED_MARK)
