"""`model.generate(cache_implementation="oscar", cache_config={...})`.

transformers has no registry of cache implementations: `GenerationConfig.validate()` checks the name against the
module-level tuple `ALL_CACHE_IMPLEMENTATIONS` (read at call time), and `GenerationMixin._prepare_cache_for_generation`
is a hard-coded if/else that would silently fall back to a DynamicCache for an unknown name. `register()` therefore
extends the tuple and wraps that method; every other cache name goes to the original method untouched. The wrapper
also hands the prompt's attention mask to whichever OscarCache generate will use (built here or passed as
`past_key_values`), so that padding stays out of the quantization (`OscarCache.set_padding`). Chunked prefill
(`prefill_chunk_size`) into an OscarCache runs eagerly even where generate compiles its forward (`_wrap_prefill`).
`register()` also makes
`fused_attention.fused_sdpa` the `sdpa` attention entry (fused decode steps and the query rule's queries; every other
call is transformers' sdpa, untouched). All steps are idempotent and undone by `unregister()`. Nothing is written
into a model's `generation_config`, so a saved generation_config.json never names "oscar".

generate keeps the cache in its `model_kwargs` under the first of its `ALL_CACHE_NAMES`: "past_key_values" up to
transformers 5.23, "cache" from 5.24 (where `past_key_values=` became the deprecated spelling of `cache=`). The wrapper
reads and writes it under that name, so that generate's own checks (a cache passed with a cache_implementation, its
auto-compile criteria) see the cache it builds, and a cache passed by the user gets the padding mask.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
from transformers.generation import configuration_utils
from transformers.generation.utils import ALL_CACHE_NAMES, GenerationMixin

from ..cache import OscarCache
from ..serving import hooks as continuous_batching
from . import fused_attention

CACHE_IMPLEMENTATION = "oscar"
_WRAPPED_MARK = "_oscar_original"
# The name under which generate's model_kwargs, and a decoder's forward, take the cache (see the module docstring)
CACHE_KWARG = ALL_CACHE_NAMES[0]


def cache_kwargs(cache) -> dict:
    """The keyword argument that hands `cache` to `generate` or a model's forward under the installed transformers'
    name for it: `model.generate(ids, **cache_kwargs(cache))` (`cache=` from transformers 5.24, where
    `past_key_values=` is deprecated; `past_key_values=` before)."""
    return {CACHE_KWARG: cache}


def _prepare_oscar_cache(self, generation_config, model_kwargs: dict, max_cache_length: int) -> None:
    if model_kwargs.get(CACHE_KWARG) is not None:
        raise ValueError(
            'Passing both `cache_implementation="oscar"` and a cache (`past_key_values` or `cache`) is unsupported; '
            "use one of the two."
        )
    if self.config.is_encoder_decoder or not self._supports_default_dynamic_cache():
        raise ValueError(
            f'cache_implementation="oscar" needs a decoder-only model with a standard KV cache; '
            f"{type(self).__name__} does not use one."
        )
    cache = OscarCache(  # cache_config: a dict of OscarConfig fields, or an OscarConfig
        self.config, generation_config.cache_config, tp_group=_tensor_parallel_group(self)
    )
    cache.reserve(max_cache_length)
    if generation_config.is_assistant:
        cache.activate_past_recording()
    model_kwargs[CACHE_KWARG] = cache


def _tensor_parallel_group(model):
    """The process group of a model sharded with `tp_plan` (its device mesh's "tp" dimension), or None (the cache
    then uses the whole world when it finds sharded KV heads)."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        return None
    if "tp" in (mesh.mesh_dim_names or ()):
        return mesh.get_group("tp")
    return mesh.get_group() if mesh.ndim == 1 else None


def _wrap(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        result = None
        if generation_config.cache_implementation != CACHE_IMPLEMENTATION or generation_config.use_cache is False:
            result = original(self, generation_config, model_kwargs, *args, **kwargs)
        else:
            bound = signature.bind(self, generation_config, model_kwargs, *args, **kwargs)
            _prepare_oscar_cache(self, generation_config, model_kwargs, bound.arguments["max_cache_length"])
        cache = model_kwargs.get(CACHE_KWARG)
        if isinstance(cache, OscarCache):  # built above or passed by the user: it quantizes around the padding
            # The mask covers every position from the cache's first (expanded for beams already); generate drops it
            # (None) when it has no zero.
            cache.set_padding(model_kwargs.get("attention_mask"))
        return result

    setattr(_prepare_cache_for_generation, _WRAPPED_MARK, original)
    return _prepare_cache_for_generation


def _wrap_prefill(original):
    """generate's chunked prefill calls its compiled forward (the decode steps' graph) on every chunk, where the
    StaticCache has fixed shapes; an OscarLayer stores a multi-token chunk in eager code only (quantizing whole blocks,
    growing lengths), and its compiled graph takes single-token steps (`compiled.refuse_step`). Into an OscarCache the
    chunks therefore run eagerly, as an unchunked prefill does, and the decode steps that follow still compile.
    After the prefill, eagerly and before the first decode step, bits="auto" chooses each layer's widths
    (`OscarCache.choose_bits`), so that compiled steps see fixed widths."""

    @functools.wraps(original)
    def _prefill(self, input_ids, generation_config, model_kwargs, *args, **kwargs):
        cache = model_kwargs.get(CACHE_KWARG)
        if not isinstance(cache, OscarCache):
            return original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        chunked = generation_config.prefill_chunk_size is not None
        with torch.compiler.set_stance("force_eager") if chunked else contextlib.nullcontext():
            outputs = original(self, input_ids, generation_config, model_kwargs, *args, **kwargs)
        cache.choose_bits()
        return outputs

    setattr(_prefill, _WRAPPED_MARK, original)
    return _prefill


# The GenerationMixin methods `register()` wraps, and their wrappers.
_WRAPPERS = {"_prepare_cache_for_generation": _wrap, "_prefill": _wrap_prefill}


def register() -> None:
    """Make `cache_implementation="oscar"` available to `generate` and to continuous batching (the 2-bit pool,
    `oscar_hf.serving`), and install the fused `sdpa` entry (idempotent; `import oscar_hf` calls it)."""
    fused_attention.register()
    continuous_batching.register()
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS += (CACHE_IMPLEMENTATION,)
    for name, wrap in _WRAPPERS.items():
        if not hasattr(getattr(GenerationMixin, name), _WRAPPED_MARK):
            setattr(GenerationMixin, name, wrap(getattr(GenerationMixin, name)))


def unregister() -> None:
    """Undo `register()`: transformers behaves exactly as before."""
    names = configuration_utils.ALL_CACHE_IMPLEMENTATIONS
    configuration_utils.ALL_CACHE_IMPLEMENTATIONS = tuple(n for n in names if n != CACHE_IMPLEMENTATION)
    for name in _WRAPPERS:
        original = getattr(getattr(GenerationMixin, name), _WRAPPED_MARK, None)
        if original is not None:
            setattr(GenerationMixin, name, original)
    continuous_batching.unregister()
    fused_attention.unregister()
