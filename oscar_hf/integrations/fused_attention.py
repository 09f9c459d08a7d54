"""Fused decode under the model's own `sdpa` attention, with nothing for the user to change.

transformers never passes the cache to attention functions: a module calls `past_key_values.update(k, v)` and then
its attention function on what `update` returned. An `OscarLayer` that decodes with the Triton kernel therefore
stores the step's tokens in `update` and returns them (the new tokens only) *carrying the step*: the returned keys
have the `FusedStep` as an attribute (`STEP`), which names the layer whose storage they stand for. `fused_sdpa`, the
`sdpa` entry of transformers' `AttentionInterface` (registered by `register()` when oscar_hf is imported, removed by
`unregister()`), reads it off the keys it receives and runs the fused kernel on that layer's packed storage. Keys
carrying no step (other models, other caches, a prefill without history) go to transformers' own
`sdpa_attention_forward` untouched. A prefill chunk arriving with history is a step too: its keys carry the
`ChunkHistory` it attends to (cache/history.py), which the chunk kernel reads.
The step travels with the data: no cache is held by this module or by any thread-local or global. `fused_sdpa` is a
plain function whose lookup reads tensor attributes, so dynamo traces it (`torch.compile(fullgraph=True)`).

The tensor attribute is the channel that works on every supported transformers version: 5.24 also calls
`cache.update(k, v, layer_idx, kwargs=kwargs)` with the very dict its attention call then unpacks, and `OscarCache`
puts the step in it (`hand_over`) so that the attention call is told which step it must serve; 5.17 to 5.23 call
`update` without it, and a layer reading another layer's K/V (Gemma 3n, Gemma 4 KV sharing) never updates at all
but receives the producer's keys, step included, and attends over the producer's whole history.

The same entry hands the queries of each attention call to a layer that waits for them (method="oscar" chooses its
key rotation from the queries that read the prompt): the prefill's keys carry that layer (`AWAITS_QUERIES`).

A step stays valid until its layer's next update, for every call that receives exactly the returned tensors.
Anything that would attend to the new tokens only is an error instead of a wrong answer:

* an sdpa call handed a step (transformers >= 5.24) whose keys are not that step's (the model changed the keys after
  `update`, e.g. MLA latents expanded or K/V padded, or passed another layer's keys); a call with the step's keys and
  other values (DiffLlama's split values), or a query the step was not prepared for (batch, tokens, head_dim, heads);
* a new update of the cache while a step was never attended (the model's attention does not go through this entry,
  or, before transformers 5.24, which hands no step to the attention call, the model changed the keys after `update`:
  there the error comes at the next update instead of at the attention call).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from ..cache.backends import attention_blockers
from ..cache.key_rotation import CHOICE_TOKENS
from ..cache.step import AWAITS_QUERIES, FIX, STEP, FusedStep, step_of
from ..reference import query_moment


def _step_for(key: torch.Tensor, handed: FusedStep | None) -> FusedStep | None:
    """The step this call serves: the one its keys carry, which must be the one handed to it, if any."""
    step = step_of(key)
    if handed is not None and step is not handed:
        problem = (
            "received keys that are not the ones the cache returned (the model changed them after the cache update, "
            "e.g. expanded MLA latents, padding or concatenation)"
            if step is None
            else "belongs to another layer's decode step"
        )
        raise RuntimeError(
            f"OscarCache: an attention call made while a fused decode step was waiting for its attention {problem}; "
            f"the fused kernel cannot attend over the whole history for it. {FIX}"
        )
    return step


def fused_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' `sdpa` attention, except for keys that carry a fused step: attention over the step's layer's
    whole storage by the fused kernels (`[B, Tq, Hq, D]`, None), or over its dense history where the call uses
    features the kernels do not implement (`attention_blockers`)."""
    awaiting = getattr(key, AWAITS_QUERIES, None)
    step = _step_for(key, kwargs.pop(STEP, None))
    if awaiting is not None and step is not None and step.chunk is not None:
        # A chunk attends before its queries reach the key-rotation choice, which may quantize the history again:
        # it reads the history its update found, as the portable path's dense K/V are.
        out = _fused(module, step, query, value, attention_mask, dropout, scaling, kwargs)
        awaiting.observe_queries(query, key)
        return out
    if awaiting is not None:
        awaiting.observe_queries(query, key)
    if step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _fused(module, step, query, value, attention_mask, dropout, scaling, kwargs)


def _fused(module, step: FusedStep, query, value, attention_mask, dropout, scaling, kwargs):
    """`fused_sdpa` for keys that carry `step`."""
    step.check(query, value)
    step.attended = True
    # The layer holds its step only until it is attended (a KV-sharing layer finds it on the keys it is handed).
    # Left in place, a prefill chunk's K/V and exact buffers would outlive the layer's forward, every layer's until
    # the next chunk: a large share of what bounds the serving batch (docs/kernels.md). Compiled, they would be two more
    # graph outputs per layer, which CUDA-graph replays rebuild as tensors on the host while the GPU waits (generate
    # synchronises every step).
    step.layer.fused_step = None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if attention_blockers(dropout, kwargs):
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "OscarCache: compiled decode supports plain causal attention only (no dropout, softcap, sliding "
                "window or sinks). Run this model eagerly."
            )
        keys, values = step.dense_history()  # includes this step's tokens: `update` stored them already
        mask = step.dense_mask(attention_mask, query)
        return sdpa_attention_forward(module, query, keys, values, mask, dropout=dropout, scaling=scaling, **kwargs)
    out = step.attention(query, attention_mask, scaling)  # [B, Hq, Tq, D]
    return out.transpose(1, 2).contiguous(), None  # sdpa's layout: [B, Tq, Hq, D]


@contextlib.contextmanager
def recording_query_moments(moments: dict, horizon: int = CHOICE_TOKENS):
    """While active, each sdpa attention call adds the second moment of its queries (`reference.query_moment`) at the
    layer's first `horizon` positions (calls in position order, as a prefill makes them) under its module's
    `layer_idx`: a prefill through any cache records what `OscarLayer.observe_query_moment` takes (the lm-eval wrapper
    fills method caches from one exact prefill; a cache with S sinks reads S positions more, `horizon=S +
    CHOICE_TOKENS`)."""
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    seen: dict[int, int] = {}  # positions recorded per layer

    def recording(module, query, key, *args, **kwargs):
        index = module.layer_idx
        start = seen.get(index, 0)
        seen[index] = start + query.shape[-2]
        moment = query_moment(query[:, :, : max(horizon - start, 0)], key.shape[1])
        moments[index] = moment if index not in moments else moments[index] + moment
        return original(module, query, key, *args, **kwargs)

    AttentionInterface.register("sdpa", recording)
    try:
        yield moments
    finally:
        AttentionInterface.register("sdpa", original)


def register() -> None:
    """Make `fused_sdpa` transformers' `sdpa` entry (idempotent; `oscar_hf.register()` calls it)."""
    AttentionInterface.register("sdpa", fused_sdpa)


def unregister() -> None:
    """Restore transformers' own `sdpa` entry, if `register()` replaced it."""
    if is_registered():
        AttentionInterface.register("sdpa", sdpa_attention_forward)


def is_registered() -> bool:
    return ALL_ATTENTION_FUNCTIONS["sdpa"] is fused_sdpa
