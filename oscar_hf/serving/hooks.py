"""`cache_implementation="oscar"` in transformers' continuous batching (`generate_batch`, `init_continuous_batching`,
`transformers serve --continuous-batching`): the generation config that names it gets the 2-bit pool.

Continuous batching has no plugin point for its cache, and its internals change with every minor release, so the pool
supports one release line (`SUPPORTED_TRANSFORMERS`) and `register()` (run by `import oscar_hf`) installs, there only:

* a wrapper of `ContinuousBatchingManager.__init__`: for a generation config with `cache_implementation="oscar"`, it
  resolves `cache_config` for the pool (`pool_config`), refuses what the pool cannot serve (with an error naming what
  to do instead), keeps the model off flash attention (the pool is read through sdpa or eager attention), and marks
  the manager's resolved `ContinuousBatchingConfig` with the pool's config (`POOL_CONFIG`);
* `continuous_api.PagedAttentionCache`, the name the manager builds its cache with, becomes `paged_cache`: the pool
  for a marked config, transformers' `PagedAttentionCache` otherwise;
* a wrapper of `ContinuousBatchingManager._create_batch_processor` giving the pool the stream its forwards run on
  (`OscarPagedCache.compute_stream`);
* a wrapper of `ContinuousBatchingManager.add_request` refusing a request longer than an empty pool holds
  (a `ValueError`, which `transformers serve` answers with HTTP 400), where transformers' scheduler would otherwise stop
  the whole loop.

On any other transformers version, only the `__init__` wrapper is installed, and it refuses `cache_implementation=
"oscar"` with an error naming the supported versions. Managers of other caches are untouched. `unregister()` undoes it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import time

import transformers
from packaging.specifiers import SpecifierSet

from ..config import OscarConfig

try:  # the names the hooks replace (continuous batching may be laid out otherwise on an unsupported version)
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import continuous_api
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
except ImportError:  # no continuous batching to hook
    continuous_api = ContinuousBatchingManager = None
# The pool itself (`.pool`, built on the supported release's internals) is imported where it is used, on a supported
# version only: `import oscar_hf` must work with any transformers `generate` supports.

CACHE_IMPLEMENTATION = "oscar"
SUPPORTED_TRANSFORMERS = SpecifierSet(">=5.25,<5.26")
POOL_CONFIG = "oscar_pool_config"  # the attribute of a manager's resolved ContinuousBatchingConfig
_WRAPPED_MARK = "_oscar_original"
_WIDTHS = ("bits", "key_bits", "value_bits", "avg_bits")


def supported(version: str | None = None) -> bool:
    """Whether the installed transformers (or `version`) is one the pool supports."""
    return (version or transformers.__version__) in SUPPORTED_TRANSFORMERS


def pool_config(cache_config: dict | OscarConfig | None) -> OscarConfig:
    """`cache_config` as the pool runs it.

    Args:
        cache_config (`dict`, `OscarConfig` or None): the generation config's `cache_config`: `OscarConfig` fields.

    Two defaults differ from `generate`'s, because the pool stores fixed layouts: no width given means `bits=2` (the
    paper's setting; `generate`'s default, bits="auto", chooses each layer's widths from its prompt, so a layer's pages
    would have a size per request), and method "auto" means "paper" (every key rotated; the query rule chooses a
    rotation per request from its prompt's queries). An explicit bits="auto", `avg_bits` or method="oscar" is refused.
    `attention` chooses the pool's backend as it chooses a cache layer's: "auto" reads pages in place where the
    kernels apply (CUDA, sdpa), "fused" demands it (on a CPU, under TRITON_INTERPRET=1), "portable" never."""
    if isinstance(cache_config, OscarConfig):
        options = dataclasses.asdict(cache_config)
    else:
        options = dict(cache_config or {})
        if not any(options.get(name) is not None for name in _WIDTHS):
            options["bits"] = 2
    if options.get("method", "auto") == "auto":
        options["method"] = "paper"
    config = OscarConfig.from_dict(options)
    if config.auto_bits:
        raise ValueError(
            "The 2-bit pool stores one width per layer for every request, so bits='auto' (widths chosen per prompt) "
            "and avg_bits do not apply; pass fixed widths: bits=2 (the pool's default), bits=4, or key_bits=4 (or 3), "
            "value_bits=2."
        )
    if config.method == "oscar" and config.rotation:
        raise ValueError(
            "The 2-bit pool does not support method='oscar' (a key-rotation choice per request, from its prompt's "
            "queries) yet; pass method='paper' (the pool's default: every key rotated) or rotation=False."
        )
    return config


def _refuse_before(model, generation_config, cb_config, oscar: OscarConfig) -> None:
    """Refuse what the pool cannot serve, from the manager's arguments."""
    from transformers.utils.generic import is_flash_attention_requested

    from .pool import layer_groups

    if is_flash_attention_requested(model.config):
        raise ValueError(
            f"The 2-bit pool is read through the model's attention, which must be 'sdpa' or 'eager'; this model "
            f"uses {model.config._attn_implementation!r}. Load it with attn_implementation='sdpa'."
        )
    text_config = model.config.get_text_config()
    if getattr(text_config, "kv_lora_rank", None) is not None:
        raise ValueError(
            "The 2-bit pool quantizes per-head keys and values; latent attention (MLA: kv_lora_rank) caches latents. "
            "Use continuous batching without cache_implementation='oscar' for this model."
        )
    layer_groups(text_config)  # refuses a model without full-attention layers
    window = oscar.residual_length
    if cb_config.page_size not in (ContinuousBatchingConfig.page_size, window):
        raise ValueError(
            f"The 2-bit pool's pages hold residual_length={window} tokens (a quantized block); page_size="
            f"{cb_config.page_size} cannot apply. Leave page_size at its default or set it to {window}."
        )
    if cb_config.cpu_offload_space != 0:
        raise ValueError(
            "The 2-bit pool cannot offload requests to the CPU yet (their exact tails would be lost); pass "
            "cpu_offload_space=0 (the default)."
        )


def _cuda_graphs(model, oscar: OscarConfig, requested) -> tuple[bool, bool]:
    """The (varlen, decode) CUDA graphs of the pool's manager, from the user's `use_cuda_graph` (`requested`, before
    transformers resolves it): decode-only forwards replay graphs where they run on the decode fast path (`pool.
    decode_fast_path`) on CUDA, by default and when asked; forwards with prompt chunks never (the pool plans them on
    the host)."""
    from transformers.generation.continuous_batching.utils import get_accelerator_graph_name

    from .pool import decode_fast_path

    available = get_accelerator_graph_name() is not None and decode_fast_path(oscar, model.config, model.device)
    if requested is None:
        return False, available
    varlen, decode = (requested, requested) if isinstance(requested, bool) else requested
    if varlen:
        raise ValueError(
            "The 2-bit pool plans each forward with prompt chunks on the host (the moves of its update, the pages "
            "each chunk reads), which a replayed CUDA graph would skip; pass use_cuda_graph=(False, True) for graphs "
            "of the decode-only forwards, or leave it unset."
        )
    if decode and not available:
        raise ValueError(
            "The 2-bit pool replays CUDA graphs of decode-only forwards only on a GPU where attention reads its "
            "pages in place (cache_config attention='auto' or 'fused', the sdpa attention, no sliding-window layers); "
            "pass use_cuda_graph=False."
        )
    return False, decode


def _refuse_after(manager) -> None:
    """Refuse what the resolved continuous-batching config asks and the pool cannot do."""
    from .pool import refuse_tensor_parallel

    cb_config = manager.continuous_batching_config
    refuse_tensor_parallel(manager.distributed_helper.tp_size)
    if cb_config.varlen_compile_config is not None or cb_config.decode_compile_config is not None:
        raise ValueError(
            "The 2-bit pool's update is not compiled yet; leave default_compile_level at 0 and pass no compile configs."
        )


def _wrap_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        generation_config = bound.arguments.get("generation_config")
        if getattr(generation_config, "cache_implementation", None) != CACHE_IMPLEMENTATION:
            return original(self, *args, **kwargs)
        if not supported():
            raise ValueError(
                f"cache_implementation='oscar' in continuous batching needs transformers {SUPPORTED_TRANSFORMERS} "
                f"(its continuous batching changes with every release); this is {transformers.__version__}. "
                "Install a supported version, or use model.generate(cache_implementation='oscar')."
            )
        model, cb_config = bound.arguments["model"], bound.arguments["continuous_batching_config"]
        oscar = pool_config(generation_config.cache_config)
        _refuse_before(model, generation_config, cb_config, oscar)
        graphs = _cuda_graphs(model, oscar, cb_config.use_cuda_graph)
        cb_config = copy.deepcopy(cb_config)
        cb_config.auto_switch_to_flash = False  # the pool reads through sdpa or eager attention
        bound.arguments["continuous_batching_config"] = cb_config
        original(*bound.args, **bound.kwargs)
        try:
            _refuse_after(self)
        except ValueError:
            if self._original_attn_impl is not None:  # the manager switched eager to paged|eager: switch back
                model.set_attn_implementation(self._original_attn_impl)
            raise
        self.continuous_batching_config.use_cuda_graph = graphs
        setattr(self.continuous_batching_config, POOL_CONFIG, oscar)

    setattr(__init__, _WRAPPED_MARK, original)
    return __init__


def _pool_cache(manager):
    """The pool of `manager` (built now if its loop has not started; waited for if its loop is building it)."""
    if manager.batch_processor is None and not manager.is_running():
        manager.batch_processor = manager._create_batch_processor()  # as `warmup` does
    while manager.batch_processor is None and manager.is_running():
        time.sleep(0.01)
    processor = manager.batch_processor
    return None if processor is None else processor.cache


def _wrap_add_request(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def add_request(self, *args, **kwargs):
        if getattr(self.continuous_batching_config, POOL_CONFIG, None) is not None and self.is_tp_driver:
            bound = signature.bind(self, *args, **kwargs)
            prompt = len(bound.arguments["input_ids"])
            new = bound.arguments.get("max_new_tokens")
            new = self.generation_config.max_new_tokens if new is None else new
            cache = _pool_cache(self)
            length = prompt + (new or 0)
            if cache is not None and length > cache.max_request_tokens:
                raise ValueError(
                    f"This request needs {length} tokens of cache ({prompt} of prompt, {new or 0} new), more than the "
                    f"2-bit pool holds for one request ({cache.max_request_tokens}). Shorten it, or give the pool more "
                    "memory (ContinuousBatchingConfig num_blocks or max_memory_percent)."
                )
        return original(self, *args, **kwargs)

    setattr(add_request, _WRAPPED_MARK, original)
    return add_request


def _wrap_create_batch_processor(original):
    @functools.wraps(original)
    def _create_batch_processor(self):
        processor = original(self)
        if getattr(self.continuous_batching_config, POOL_CONFIG, None) is not None:
            processor.cache.compute_stream = processor.inputs_and_outputs.compute_stream
        return processor

    setattr(_create_batch_processor, _WRAPPED_MARK, original)
    return _create_batch_processor


def paged_cache(*args, continuous_batching_config, **kwargs):
    """What continuous batching builds its cache with: the 2-bit pool for a config marked by the manager, transformers'
    `PagedAttentionCache` otherwise."""
    from .pool import OscarPagedCache

    oscar = getattr(continuous_batching_config, POOL_CONFIG, None)
    if oscar is None:
        return PagedAttentionCache(*args, continuous_batching_config=continuous_batching_config, **kwargs)
    return OscarPagedCache(oscar, *args, continuous_batching_config=continuous_batching_config, **kwargs)


def register() -> None:
    """Install the hooks (idempotent): all of them on a supported transformers, the refusal otherwise."""
    if ContinuousBatchingManager is None:
        return
    wrappers = {"__init__": _wrap_init}
    if supported():
        wrappers["add_request"] = _wrap_add_request
        wrappers["_create_batch_processor"] = _wrap_create_batch_processor
        continuous_api.PagedAttentionCache = paged_cache
    for name, wrap in wrappers.items():
        if not hasattr(getattr(ContinuousBatchingManager, name), _WRAPPED_MARK):
            setattr(ContinuousBatchingManager, name, wrap(getattr(ContinuousBatchingManager, name)))


def unregister() -> None:
    """Undo `register()`."""
    if ContinuousBatchingManager is None:
        return
    for name in ("__init__", "add_request", "_create_batch_processor"):
        original = getattr(getattr(ContinuousBatchingManager, name), _WRAPPED_MARK, None)
        if original is not None:
            setattr(ContinuousBatchingManager, name, original)
    if continuous_api.PagedAttentionCache is paged_cache:
        continuous_api.PagedAttentionCache = PagedAttentionCache
