"""lm-eval model `oscar-hf`: lm-eval's HFLM whose KV cache is an OscarCache (or a baseline cache), in every request.

lm-eval's own HFLM scores loglikelihood requests with one forward pass and a throw-away cache, so KV quantization
would never touch them. `OscarHFLM` scores THROUGH the cache instead, the way a deployed model would see it:

* loglikelihood: the context is prefilled into a fresh cache (the prefill attends to its own exact K/V, then the
  cache stores them: quantized except the residual window); the continuation then attends to what the cache
  stores, plus its own exact tokens. The first continuation token comes from the prefill logits, as the first
  generated token does in `generate`.
* loglikelihood_rolling (perplexity): each window runs through a fresh cache in chunks of `rolling_chunk` tokens
  (default: the residual length, 128). With chunks of the residual length every scored token sees the same mix of
  quantized history and 1..128 exact recent tokens as it would in token-by-token decoding. bits="auto" chooses each
  layer's widths after the first chunk, as after a prompt of that length.
* generate_until: `generate(cache_implementation=..., cache_config=...)`; tiny-turboquant's cache, which is no
  cache_implementation of transformers, is handed to `generate` as a cache object.

The baseline "bf16" (a DynamicCache in the model's dtype) goes through the same two-step scoring, so every method is
compared under the same protocol.

Prefill sharing: the prefill's outputs never depend on what a cache stores afterwards, so the exact per-layer K/V
of a context are kept (in a `PrefillStore`) and every method's cache is filled from them by calling its own
`update`, exactly what the prefill forward would have called. Wrappers that share one store (benchmarks/
run_accuracy.py) prefill each context once for all methods.

Usage:
    oscar-eval --model oscar-hf --model_args pretrained=smollm2-135m,method=oscar-int2 --tasks ...   (CLI)
    simple_evaluate(model=OscarHFLM(pretrained=model, tokenizer=tok, method="kivi-int2"), tasks=[...])  (Python)
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections import OrderedDict

import torch
import torch.nn.functional as F
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm
from transformers import DynamicCache, QuantizedCache
from transformers.cache_utils import QuantizedLayer

from ..cache import OscarCache, OscarLayer, average_bits
from ..cache.key_rotation import choice_horizon
from ..cache.memory import effective_bits, mixed_bits
from ..config import OscarConfig
from ..methods import DEFAULT_METHOD, METHODS
from ..offline_models import MODELS, model_path
from .fused_attention import recording_query_moments
from .transformers import CACHE_KWARG  # past_key_values up to transformers 5.23, cache from 5.24


class PrefillStore:
    """Exact prefills (last-position log-probs, DynamicCache, each layer's query second moments for method="oscar")
    keyed by the positions whose queries they record and the context tokens; LRU with `max_entries` (None: unbounded,
    for wrappers sharing it across methods; clear it between tasks to free memory)."""

    def __init__(self, max_entries: int | None = 1):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple[torch.Tensor, DynamicCache, dict]] = OrderedDict()

    def get(self, key: tuple):
        if key in self._entries:
            self._entries.move_to_end(key)
        return self._entries.get(key)

    def put(self, key: tuple, value: tuple[torch.Tensor, DynamicCache, dict]) -> None:
        self._entries[key] = value
        while self.max_entries is not None and len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()


def _options_of(method: str, config: OscarConfig) -> dict:
    """The `cache_config` dict of a whole `OscarConfig`, refused where it contradicts the method's own options."""
    implementation, defaults = METHODS[method]
    if implementation != "oscar":
        raise ValueError(f"method {method!r} does not use an OscarCache; an OscarConfig does not apply to it.")
    conflicts = {name: getattr(config, name) for name, value in defaults.items() if getattr(config, name) != value}
    if conflicts:
        raise ValueError(
            f"method {method!r} sets {defaults}, but the OscarConfig has {conflicts}; pass a dict of the options to "
            "change, or a method that agrees with the config."
        )
    return config.to_dict()


def kv_heads_and_dim(config) -> tuple[int, int]:
    """(KV heads, channels per KV head) of a model's (text) config."""
    text = config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return heads, getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def avg_bits(method: str, cache_config: dict, head_dim: int, kv_heads: int) -> float:
    """Stored bits per K/V element of a method's quantized region, in a 16-bit (bf16 or fp16) model: codes, scales,
    zero points or minimums, OScaR's token norms; "bf16" (a DynamicCache) stores 16. Not counted (`effective_avg_bits`
    counts them): the window of exact recent tokens each quantized cache keeps (OscarCache: 1 to `residual_length`,
    128; QuantizedCache: 0 to 127; tiny-turboquant: 128 to 255), a fixed number of tokens per sequence whatever its
    length. OscarCache with bits="auto": its `avg_bits` budget, which each prompt's choice of layer widths stays
    within.

    - "quantized" (transformers' QuantizedCache, quanto or hqq): `nbits` per element, and a scale and a zero point in
      the model's dtype per group of `q_group_size` (64) elements along the head dimension, for keys and values alike.
    - "tiny-turboquant" (TinyKVCache): `key_bits` per key element plus a scale and a zero point (fp16) per channel and
      block of `block_size` (128) tokens; `value_bits` per value element plus an fp16 scale and zero point per token
      and `value_group_size` channels (the whole head without it). Codes are bit-packed (3-bit: 8 codes in 3 bytes).
    """
    implementation = METHODS[method][0]
    if implementation is None:
        return 16.0
    if implementation == "oscar":
        config = OscarConfig.from_dict(cache_config)
        if config.auto_bits:  # each prompt chooses its layers' widths within the budget: the budget bounds them
            return config.budget(average_bits(config.with_widths(2, 2), head_dim, kv_heads))
        return average_bits(config, head_dim, kv_heads)
    if implementation == "quantized":
        nbits = cache_config.get("nbits", _default(QuantizedLayer.__init__, "nbits"))
        group = cache_config.get("q_group_size", _default(QuantizedLayer.__init__, "q_group_size"))
        return nbits + 2 * 16 / group
    if implementation == "tiny-turboquant":
        cache_class = _tiny_kv_cache_class()
        block = cache_config.get("block_size", _default(cache_class.__init__, "block_size"))
        value_group = cache_config.get("value_group_size") or head_dim
        per_token = cache_config["key_bits"] * head_dim + 2 * 16 * head_dim / block
        per_token += cache_config["value_bits"] * head_dim + 2 * 16 * head_dim / value_group
        return per_token / (2 * head_dim)
    raise ValueError(f"method {method!r}: no stored-bits count for cache implementation {implementation!r}.")


def effective_avg_bits(
    method: str, cache_config: dict, head_dim: int, kv_heads: int, context: int, stored_bits: float | None = None
) -> float:
    """Every bit a method's cache holds per K/V element of a full-attention layer at `context` tokens, in a 16-bit
    model: its quantized region at `avg_bits`, and the exact recent tokens it keeps at their mean count over a decode
    (at 16 bits), which `avg_bits` leaves out (`oscar_hf.effective_bits`, the same sum for OScaR):

    - OscarCache: the sinks and 1 to `residual_length` (128) recent tokens, mean 64.5 (`cache.memory.exact_tokens`);
    - QuantizedCache: 0 to `residual_length` - 1 (the whole history is quantized again when its window fills), mean
      63.5;
    - tiny-turboquant: `residual_len` to `residual_len` + `block_size` - 1 (128 to 255: a block of 128 is quantized
      once 256 are exact), mean 191.5;
    - "bf16": 16.

    `stored_bits`: the quantized region's bits as measured (an OscarCache's `average_bits()` after its bits="auto"
    choice), instead of `avg_bits` (the budget, for bits="auto").
    """
    implementation = METHODS[method][0]
    stored = avg_bits(method, cache_config, head_dim, kv_heads) if stored_bits is None else stored_bits
    if implementation is None:
        return stored
    if implementation == "oscar":
        return effective_bits(OscarConfig.from_dict(cache_config), head_dim, kv_heads, context, stored_bits=stored)
    if implementation == "quantized":
        window = cache_config.get("residual_length", _default(QuantizedLayer.__init__, "residual_length"))
        return mixed_bits(stored, (window - 1) / 2, context)
    if implementation == "tiny-turboquant":
        cache_class = _tiny_kv_cache_class()
        window = cache_config.get("residual_len", _default(cache_class.__init__, "residual_len"))
        block = cache_config.get("block_size", _default(cache_class.__init__, "block_size"))
        return mixed_bits(stored, window + (block - 1) / 2, context)
    raise ValueError(f"method {method!r}: no effective-bits count for cache implementation {implementation!r}.")


def make_cache(method: str, cache_config: dict, model_config):
    """A fresh, empty cache of `method` (`METHODS`) with `cache_config` (the method's options and any overrides) for a
    model of `model_config`, built as `generate` builds it."""
    implementation = METHODS[method][0]
    if implementation is None:
        return DynamicCache(config=model_config)
    if implementation == "oscar":
        return OscarCache(model_config, OscarConfig.from_dict(cache_config))
    if implementation == "tiny-turboquant":
        return _tiny_kv_cache_class()(**cache_config)
    options = dict(cache_config)
    return QuantizedCache(backend=options.pop("backend"), config=model_config.get_text_config(decoder=True), **options)


@functools.cache
def _tiny_kv_cache_class():
    """tiny-turboquant's TinyKVCache, taking the `update(..., kwargs=...)` call of transformers >= 5.24 (its own
    `update` takes `cache_kwargs`, which it does not use)."""
    try:
        from tiny_turboquant import TinyKVCache
    except ImportError as error:
        raise ImportError(
            'The tiny-turboquant methods need the tiny-turboquant package: pip install -e ".[eval]"'
        ) from error

    class TransformersTinyKVCache(TinyKVCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states, value_states, layer_idx)

    return TransformersTinyKVCache


@register_model("oscar-hf")
class OscarHFLM(HFLM):
    """HFLM with a chosen KV cache method in generation and in (rolling) loglikelihood scoring.

    Args:
        pretrained: a model object, a local path / hub id, or the name of an offline model in
            `oscar_hf.offline_models.MODELS` (e.g. "smollm2-135m"; its tokenizer comes with it).
        method: one of `METHODS` (`DEFAULT_METHOD` by default: the cache's own defaults).
        cache_config: options merged over the method's own (e.g. `{"residual_length": 64}` for an oscar method,
            `{"q_group_size": 32}` for hf-quanto); unknown OscarCache options are an error. An `OscarConfig` is taken
            whole, for an oscar method whose own options it agrees with.
        rolling_chunk: tokens per forward when scoring perplexity through the cache (default: residual length).
        prefill_store: a `PrefillStore` to share exact prefills with other wrappers around the same model.
        **kwargs: HFLM's own arguments (batch_size, max_length, dtype, device, ...).
    """

    def __init__(
        self,
        pretrained,
        method: str = DEFAULT_METHOD,
        cache_config: dict | OscarConfig | None = None,
        rolling_chunk: int | None = None,
        prefill_store: PrefillStore | None = None,
        **kwargs,
    ):
        if method not in METHODS:
            raise ValueError(f"Unknown method {method!r}; choose one of {sorted(METHODS)}.")
        if isinstance(cache_config, OscarConfig):
            cache_config = _options_of(method, cache_config)
        if isinstance(pretrained, str) and pretrained in MODELS:
            # The local float32 folder of the offline model, loaded by HFLM itself as any path would be (a model
            # object would make HFLM warn that its other arguments may be ignored).
            pretrained = str(model_path(pretrained))
        super().__init__(pretrained=pretrained, **kwargs)
        self.method = method
        self.cache_implementation, defaults = METHODS[method]
        self.cache_config = {**defaults, **(cache_config or {})}
        if self.cache_implementation is None and self.cache_config:
            raise ValueError(f"method {method!r} (DynamicCache) takes no cache_config, got {self.cache_config}.")
        self.make_cache()  # fail now, not after the first prefill, on a bad option or an unsupported model
        self.rolling_chunk = rolling_chunk or self.cache_config.get("residual_length", 128)
        self.prefill_store = prefill_store if prefill_store is not None else PrefillStore()

    def make_cache(self):
        """A fresh, empty cache of this wrapper's method, built as `generate` builds it."""
        return make_cache(self.method, self.cache_config, self.model.config)

    # ------------------------------------------------------------------------------------------------------------
    # generate_until
    @property
    def avg_bits(self) -> float:
        """Stored bits per K/V element of this method's quantized region on this model (`avg_bits`)."""
        kv_heads, head_dim = kv_heads_and_dim(self.model.config)
        return avg_bits(self.method, self.cache_config, head_dim, kv_heads)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        if self.cache_implementation == "tiny-turboquant":
            generation_kwargs.setdefault(CACHE_KWARG, self.make_cache())
        elif self.cache_implementation is not None:
            generation_kwargs.setdefault("cache_implementation", self.cache_implementation)
            generation_kwargs.setdefault("cache_config", dict(self.cache_config))
        return super()._model_generate(context, max_length, stop, **generation_kwargs)

    # ------------------------------------------------------------------------------------------------------------
    # loglikelihood through the cache
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        # One request at a time: contexts are long, and padded batches would put pad tokens into quantization
        # groups. Requests are sorted so that those sharing a context are adjacent and reuse one prefill.
        order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1]), tuple(requests[i][1])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for i in tqdm(order, disable=disable_tqdm or self.rank != 0, desc=f"loglikelihood [{self.method}]"):
            cache_key, context, continuation = requests[i]
            if not 0 < len(continuation) <= self.max_length:
                raise ValueError(f"continuation of {len(continuation)} tokens; max_length is {self.max_length}.")
            # Left-truncate like HFLM: the model sees at most max_length tokens (context + continuation[:-1]).
            tokens = (context + continuation)[-(self.max_length + 1) :]
            logprobs = self._continuation_logprobs(tokens[: -len(continuation)], continuation)
            targets = torch.tensor(continuation, device=logprobs.device)
            answer = (
                float(logprobs.gather(-1, targets[:, None]).sum()),
                bool((logprobs.argmax(-1) == targets).all()),
            )
            results[i] = answer
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, answer)
        return results

    @torch.no_grad()
    def _continuation_logprobs(self, context: list[int], continuation: list[int]) -> torch.Tensor:
        """Log-probs `[len(continuation), vocab]` predicting each continuation token, through a fresh cache."""
        first, cache = self._prefill(context)
        if len(continuation) == 1:
            return first[None]
        inputs = torch.tensor([continuation[:-1]], device=self.device)
        logits = self.model(inputs, **{CACHE_KWARG: cache}).logits[0]
        return torch.cat([first[None], F.log_softmax(logits.float(), dim=-1)])

    def _prefill_key(self, context: list[int]) -> tuple[int, tuple[int, ...]]:
        """The key of `context`'s exact prefill in the store: the positions whose queries it records, and the tokens.
        The query rule reads the queries at the sinks and the positions after them up to its horizon (`KeyRotation`):
        methods whose horizons both cover the context share its prefill."""
        return min(choice_horizon(self.cache_config.get("sink_tokens", 0)), len(context)), tuple(context)

    @torch.no_grad()
    def _prefill(self, context: list[int]) -> tuple[torch.Tensor, object]:
        """Last-position log-probs of `context` and a cache of this method holding it, as a prefill leaves it."""
        key = self._prefill_key(context)
        entry = self.prefill_store.get(key)
        if entry is None:
            exact, moments = DynamicCache(config=self.model.config), {}
            inputs = torch.tensor([context], device=self.device)
            with recording_query_moments(moments, horizon=key[0]):
                logits = self.model(inputs, **{CACHE_KWARG: exact}, logits_to_keep=1).logits[0, -1]
            entry = (F.log_softmax(logits.float(), dim=-1), exact, moments)
            self.prefill_store.put(key, entry)
        first, exact, moments = entry
        cache = self.make_cache()
        for idx, prefilled in enumerate(exact.layers):
            # tiny-turboquant's cache creates its layers in `update`: it has none yet
            if idx < len(cache.layers) and type(cache.layers[idx]) is type(prefilled):
                # Same layer type (e.g. sliding window, or every layer of "bf16"): a copy is what it would hold.
                cache.layers[idx] = copy.deepcopy(prefilled)
                continue
            cache.update(prefilled.keys, prefilled.values, idx)  # what the prefill forward stores
            layer = cache.layers[idx]
            if layer.get_seq_length() != prefilled.get_seq_length():
                raise ValueError(
                    f"layer {idx} of the {self.method!r} cache keeps every token, but the exact prefill's layer is a "
                    f"sliding window that kept only the last {prefilled.keys.shape[-2]} of "
                    f"{prefilled.get_seq_length()} tokens: this method's cache cannot be filled from the shared "
                    "prefill on a model with sliding-window layers."
                )
            if isinstance(layer, OscarLayer) and layer.rotation.wants_queries:  # what its attention hands over
                layer.observe_query_moment(moments[idx])
        if isinstance(cache, OscarCache):
            cache.choose_bits()  # bits="auto": the prompt ends here, as generate's prefill does
        return first, cache

    # ------------------------------------------------------------------------------------------------------------
    # perplexity through the cache
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        results = []
        for request in tqdm(requests, disable=disable_tqdm or self.rank != 0, desc=f"rolling [{self.method}]"):
            (text,) = request.args
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            total = sum(self._chunked_loglikelihood(*make_disjoint_window(w)) for w in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    @torch.no_grad()
    def _chunked_loglikelihood(self, context: list[int], continuation: list[int]) -> float:
        """Sum of log-probs of `continuation` given `context`, fed through one fresh cache `rolling_chunk` tokens
        at a time (each chunk attends to what the cache stores of the earlier ones)."""
        sequence = context + continuation
        inputs = sequence[:-1]
        cache = self.make_cache()
        total = 0.0
        for start in range(0, len(inputs), self.rolling_chunk):
            chunk = inputs[start : start + self.rolling_chunk]
            logits = self.model(torch.tensor([chunk], device=self.device), **{CACHE_KWARG: cache}).logits[0]
            targets = torch.tensor(sequence[start + 1 : start + 1 + len(chunk)], device=logits.device)
            token_logprobs = F.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]
            first_scored = max(len(context) - 1 - start, 0)  # positions predicting context tokens are not scored
            total += float(token_logprobs[first_scored:].sum())
            if start == 0 and isinstance(cache, OscarCache):
                # bits="auto": the first chunk attended to its own exact K/V alone (nothing quantized was read), so
                # choosing the widths from it scores every later token at the chosen widths, as after a prompt of
                # `rolling_chunk` tokens; a window scored chunk by chunk never ends a prompt otherwise
                cache.choose_bits()
        return total
