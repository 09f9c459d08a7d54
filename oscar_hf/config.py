"""`OscarConfig`: every knob of the OScaR KV cache, validated once, in one place."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

_SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
_METHODS = ("auto", "oscar", "paper")
# bits="auto"'s default budget: the 2-bit cache's memory plus 2-4 % (3.125 at head_dim 128); with 4 sinks it brought
# every model measured within +1.7 % of bf16's perplexity and SmolLM2's 2k retrieval to bf16's (docs/accuracy.md).
DEFAULT_AVG_BITS = 3.2

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class OscarConfig:
    """Configuration of an `OscarCache`.

    Args:
        bits: bits per stored K/V value, 2 (the paper's setting) or 4: the shorthand for `key_bits` and
            `value_bits` both. "auto" (the default when no width is given): each full-attention layer chooses its own
            key and value widths (K2V2, K4V2, K2V4 or K4V4) from the prompt, under the budget `avg_bits`
            (`cache/layer_bits.py`).
        avg_bits: the budget of bits="auto" (refused with fixed widths; given alone it implies bits="auto"): the
            average stored bits per K/V element over the layers, everything counted as `oscar_hf.average_bits` counts
            it (at head_dim 128: all 2-bit 3.125, 4-bit keys 4.125, all 4-bit 5.125). The greedy rule of
            `layer_widths.choose_layer_bits` upgrades the layers whose prompt shows the largest attention error per
            added bit until the budget is spent. None (default): `DEFAULT_AVG_BITS` (3.2, the 2-bit cache's memory
            plus 2-4 %), or the model's all-2-bit cost where its head shape stores more (head_dim 32, or 64 with
            one KV head): `OscarConfig.budget`. A given budget below the all-2-bit cost is an error (the cache says
            the minimum for its model); above the all-4-bit cost every layer stores 4-bit keys and values.
        key_bits, value_bits: bits per stored key and per stored value, each 2 or 4, where they differ (keys are the
            sensitive half: `key_bits=4, value_bits=2` stores 4.1 bits per K/V element at head_dim 128, between
            2 bits' 3.1 and 4 bits' 5.1: `oscar_hf.average_bits`). One given alone fixes the other at 2. Given with
            `bits`, they must equal it (an error otherwise: no silent precedence). After construction: fixed widths
            set all three (`bits` the common width, or None where keys and values differ); bits="auto" leaves
            `key_bits` and `value_bits` None. (Changing a config with `dataclasses.replace`: pass `bits` alone, or
            `key_bits` and `value_bits` with `bits=None`.)
        group_size: tokens per key quantization group (per channel) and channels per value group (per token).
        residual_length: the most recent tokens kept in full precision; a multiple of `group_size`. Tokens are
            quantized in blocks of this many, so attention always sees 1 to `residual_length` exact recent tokens.
        sink_tokens: the first tokens of each sequence kept exact, in the model dtype, never quantized (attention
            sinks: the first tokens draw much of every query's attention). Each row keeps its own first real
            tokens in `sink_tokens` slots, whatever its left padding, once the cache knows the padding
            (`OscarCache.set_padding`; generate tells it); without it, a padded row's first positions are its sinks.
            Default 4 (0 keeps none): on three of the four models measured they cut the 2-bit cache's perplexity
            change by about 70 %, on Qwen2.5-0.5B they cost 0.7 point (docs/accuracy.md). Like the residual window,
            they are exact tokens: `KVMemory` counts them as exact bytes, `average_bits` (the quantized region's bits
            per element) leaves them out.
        rotation: Canalized Rotation (Walsh-Hadamard along head_dim) of keys and values (see `method` for keys).
        token_scaling: Omni-Token Scaling (divide each key token by its norm over all KV heads before quantizing).
            With `rotation=False, token_scaling=False` the cache is plain KIVI-style quantization.
        scale_dtype: dtype of the per-group scales and minimums, "float16" (default, the paper's byte count) or
            "float32". bfloat16 is refused: its 8-bit mantissa biases the zero-point.
        method: how `rotation` treats the keys; values are always rotated. "oscar" (the query rule): each (batch
            row, KV head) of each layer decides whether rotating its keys lowers the attention-logit error of the
            prompt's keys (its first 4096) against the prompt's own queries (`reference.query_rotation_choice`; the
            queries reach the cache through transformers' "sdpa" attention). The choice is made again after each
            multi-token call while the prompt streams in, so a prompt fed in chunks chooses as when fed whole, and
            is final from the first decode step (or beyond 4096 tokens) for the whole generation, eager and compiled
            decoding alike (`cache/key_rotation.py` says exactly when). It avoids the rotation's damage on models
            whose keys carry large near-constant channels (Qwen2's k_proj bias, Gemma 3's k_norm) and keeps it where
            it helps: see docs/accuracy.md. "paper": every key is rotated, the paper's method (arXiv 2605.19660).
            "auto" (default): "oscar" on a model whose attention is "sdpa", "paper" on any other (eager,
            flash_attention_*, flex), whose queries the cache cannot see, with a warning (once) saying so;
            `OscarCache` resolves it (`resolve`), so `cache.oscar_config.method` says which runs. A layer that "oscar"
            never hands queries (an explicit "oscar" on such a model, or a cache filled by hand with `update`)
            chooses from the keys alone, with a warning (once) naming how to get the query rule.
        attention: "auto" (default) decodes with the fused Triton kernels where they apply (CUDA, an sdpa model,
            head_dim 64/128/256) and with the portable path elsewhere; "fused" demands the kernels (an error names
            what prevents them; on CPU they run only under TRITON_INTERPRET=1); "portable" always dequantizes and
            uses the model's own attention, for comparison.
    """

    bits: int | str | None = None
    key_bits: int | None = None
    value_bits: int | None = None
    group_size: int = 32
    residual_length: int = 128
    sink_tokens: int = 4
    rotation: bool = True
    token_scaling: bool = True
    scale_dtype: str = "float16"
    attention: str = "auto"
    method: str = "auto"
    avg_bits: float | None = None

    def __post_init__(self):
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"OscarConfig: {message}")

        check(
            self.bits in (None, 2, 4, "auto"),
            f"bits={self.bits!r} is not supported; use 'auto' (default: layer-wise widths under avg_bits), 2 or 4.",
        )
        for name in ("bits", "key_bits", "value_bits", "group_size", "residual_length", "sink_tokens"):
            value = getattr(self, name)
            if (value is None and name.endswith("bits")) or (name == "bits" and value == "auto"):
                continue
            check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}.")
        for name in ("rotation", "token_scaling"):
            value = getattr(self, name)
            check(isinstance(value, bool), f"{name} must be True or False, got {value!r}.")
        for name in ("key_bits", "value_bits"):
            value = getattr(self, name)
            check(value in (None, 2, 4), f"{name}={value} is not supported; use 2 (default) or 4.")
        if self.bits is None and self.key_bits is None and self.value_bits is None:
            object.__setattr__(self, "bits", "auto")  # no width given: each layer's is chosen under the budget
        if self.bits == "auto":
            self._check_auto(check)
        else:
            check(
                self.avg_bits is None,
                f"avg_bits={self.avg_bits} is the budget of bits='auto' (layer-wise widths); pass bits='auto' with it, "
                "or drop it (otherwise every layer stores key_bits and value_bits).",
            )
            self._resolve_bits(check)
        check(
            self.group_size in (32, 64, 128),
            f"group_size={self.group_size} is not supported; use 32 (default), 64 or 128.",
        )
        check(
            self.residual_length > 0 and self.residual_length % self.group_size == 0,
            f"residual_length={self.residual_length} must be a positive multiple of group_size={self.group_size} "
            f"(e.g. {4 * self.group_size}), because whole blocks of it are quantized at once.",
        )
        check(
            self.sink_tokens >= 0,
            f"sink_tokens={self.sink_tokens} must be 0 (no sinks) or a positive number of first tokens kept exact.",
        )
        check(
            self.scale_dtype in _SCALE_DTYPES,
            f"scale_dtype={self.scale_dtype!r} is not supported; use one of {sorted(_SCALE_DTYPES)}.",
        )
        check(
            self.method in _METHODS,
            f"method={self.method!r} is not supported; use 'auto' (default: 'oscar' where the model's attention is "
            "sdpa, else 'paper'), 'oscar' (a per-head choice of the key rotation from the prompt's queries) or "
            "'paper' (the paper's method, every key rotated).",
        )
        check(
            self.attention in ("auto", "fused", "portable"),
            f"attention={self.attention!r} is not supported; use 'auto' (fused kernels where they apply), 'fused' "
            "or 'portable'.",
        )

    def _check_auto(self, check) -> None:
        """bits="auto": `avg_bits` None (the default budget) or finite; the layers choose `key_bits` and `value_bits`
        (None here)."""
        check(
            self.key_bits is None and self.value_bits is None,
            f"bits='auto' chooses key_bits and value_bits per layer; drop key_bits={self.key_bits} and "
            f"value_bits={self.value_bits}, or pass fixed widths without bits='auto'.",
        )
        value = self.avg_bits
        check(
            value is None
            or (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0),
            f"avg_bits is the average stored bits per K/V element over the layers (e.g. 3.6 or 4.1; at head_dim 128 "
            f"all 2-bit layers cost 3.125 and all 4-bit 5.125), or None for the default ({DEFAULT_AVG_BITS}); got "
            f"avg_bits={value!r}.",
        )

    def budget(self, all_2bit_cost: float) -> float:
        """bits="auto": the average stored bits the layers may spend, on a model whose layers cost `all_2bit_cost`
        at 2 bits everywhere: `avg_bits`, else `DEFAULT_AVG_BITS` or that cost where a head shape stores more."""
        return max(DEFAULT_AVG_BITS, all_2bit_cost) if self.avg_bits is None else self.avg_bits

    @property
    def auto_bits(self) -> bool:
        """Whether each layer chooses its widths (bits="auto")."""
        return self.bits == "auto"

    def require_widths(self, who: str) -> None:
        """Refuse bits="auto" where one layout is needed (`who` names the caller): its widths are per layer."""
        if self.auto_bits:
            raise ValueError(
                f"{who}: bits='auto' (the default) chooses each layer's widths from its prompt, so it has no one "
                "layout; pass a config of fixed widths, e.g. OscarConfig(bits=2) or config.with_widths(2, 2)."
            )

    def with_widths(self, key_bits: int, value_bits: int) -> OscarConfig:
        """This config with fixed widths (a layer's config under bits="auto")."""
        return dataclasses.replace(self, bits=None, avg_bits=None, key_bits=key_bits, value_bits=value_bits)

    def _resolve_bits(self, check) -> None:
        """Set `key_bits` and `value_bits` (from `bits`, else 2 each) and `bits` (their common width, or None)."""
        if self.bits is not None:
            for name in ("key_bits", "value_bits"):
                given = getattr(self, name)
                check(
                    given in (None, self.bits),
                    f"bits={self.bits} contradicts {name}={given}: `bits` sets key_bits and value_bits both. Pass "
                    f"bits alone, or key_bits and value_bits without bits (dataclasses.replace: with bits=None).",
                )
        default = 2 if self.bits is None else self.bits
        key_bits = default if self.key_bits is None else self.key_bits
        value_bits = default if self.value_bits is None else self.value_bits
        object.__setattr__(self, "key_bits", key_bits)  # a frozen dataclass sets its own fields this way
        object.__setattr__(self, "value_bits", value_bits)
        object.__setattr__(self, "bits", key_bits if key_bits == value_bits else None)

    def resolve(self, attn_implementation: str | None) -> OscarConfig:
        """This config as a cache runs it on a model whose attention is `attn_implementation`: method="auto" becomes
        "oscar" where the cache sees the queries (sdpa) and "paper" elsewhere, with a warning (once per
        implementation) naming why and how to get the query rule. An explicit method is kept as it is."""
        if self.method != "auto":
            return self
        if attn_implementation == "sdpa":  # its calls hand the queries over (integrations/fused_attention.py)
            return dataclasses.replace(self, method="oscar")
        if self.rotation:  # without rotation the method changes nothing
            logger.warning_once(
                f"OscarCache: this model's attention is {attn_implementation!r}, not 'sdpa', so the cache cannot see "
                "the queries from which the default key-rotation rule (method='oscar') chooses; it uses "
                "method='paper' (every key rotated, the paper's method), which is worse on some models (see the "
                "README's Accuracy section). For the query rule load the model with attn_implementation='sdpa'; "
                "pass cache_config={'method': 'paper'} to choose the paper's method and silence this warning."
            )
        return dataclasses.replace(self, method="paper")

    @property
    def scale_torch_dtype(self) -> torch.dtype:
        return _SCALE_DTYPES[self.scale_dtype]

    @classmethod
    def from_dict(cls, options: dict[str, Any] | None) -> OscarConfig:
        """Build from a `cache_config` dict (as passed to `generate`); unknown keys are an error, never ignored."""
        options = dict(options or {})
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(valid))
        if unknown:
            raise ValueError(f"Unknown OscarCache option(s) {unknown}; valid options are {valid}.")
        return cls(**options)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
