"""`OscarConfig`: every knob of the OScaR KV cache, validated once, in one place."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

# The bits a stored key or value may have, narrowest first: the one list the config, the storage layout, bits="auto"'s
# layer widths and the kernels read (a new width is added here, then in the kernels' unpacking). 2 and 4 bits pack
# whole codes into a word; 3 bits are stored as bit planes (`oscar_hf.layout`).
SUPPORTED_WIDTHS = (2, 3, 4)
_SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
_METHODS = ("auto", "oscar", "paper")
# bits="auto"'s default budget: a little above the 2-bit cache's memory (3.125 at head_dim 128); with 4 sinks it is the
# default docs/accuracy.md measures.
DEFAULT_AVG_BITS = 3.2
# The widths bits="auto" chooses among unless `auto_widths` says otherwise. Not 3: 3-bit codes are read by the Triton
# split kernel only (the Gluon kernel reads whole-byte codes), at 2.5x K4V4's time per byte on an H100, and with it
# the default's choices at 3.2 bits were within a standard error of these (docs/accuracy.md: "3-bit keys").
DEFAULT_AUTO_WIDTHS = (2, 4)

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class OscarConfig:
    """Configuration of an `OscarCache` (every field is also a key of generate's `cache_config` dict).

    Args:
        bits (`int` or `str`, *optional*, defaults to `"auto"`):
            Bits per stored K/V value, one of `SUPPORTED_WIDTHS` (2, 3, 4; 2 is the paper's setting): the shorthand for
            `key_bits` and `value_bits` both. "auto" (the default when no width is given): each full-attention layer
            chooses its own key and value widths from the prompt, under the budget `avg_bits` (`cache/layer_bits.py`).
        avg_bits (`float`, *optional*):
            The budget of bits="auto" (refused with fixed widths; given alone it implies bits="auto"): the average
            stored bits per K/V element over the layers, counted as `oscar_hf.average_bits` counts them (at head_dim
            128: all 2-bit 3.125, 4-bit keys 4.125, all 4-bit 5.125). Every layer starts at the widest fixed config
            of the chain of `auto_widths` the budget affords (K2V2, K4V2, K4V4 by default), then layers whose prompt
            shows the largest attention error per added bit are upgraded until it is spent
            (`layer_widths.choose_layer_bits`). None: `DEFAULT_AVG_BITS`, or the model's all-2-bit cost where its head
            shape stores more (`budget`). A budget below the all-2-bit cost is an error naming the minimum; above the
            all-4-bit cost every layer is 4-bit.
        auto_widths (`tuple[int, ...]`, *optional*):
            The widths bits="auto" chooses among, narrowest first, from `SUPPORTED_WIDTHS` (refused with fixed widths).
            None: `DEFAULT_AUTO_WIDTHS` (2, 4). `(2, 3, 4)` adds 3-bit keys and values: the start chain becomes K2V2,
            K3V2, K3V3, K4V3, K4V4 (keys one step ahead of values).
        key_bits (`int`, *optional*), value_bits (`int`, *optional*):
            Bits per stored key and per stored value where they differ (keys are the sensitive half: `key_bits=3,
            value_bits=2` or `key_bits=4, value_bits=2`). One given alone fixes the other at 2; given with `bits`, they
            must equal it (no silent precedence). After construction fixed widths set all three (`bits` the common
            width, or None where keys and values differ); bits="auto" leaves `key_bits` and `value_bits` None. (With
            `dataclasses.replace`, pass `bits` alone, or `key_bits` and `value_bits` with `bits=None`.)
        group_size (`int`, *optional*, defaults to 32):
            Tokens per key quantization group (per channel) and channels per value group (per token): 32, 64 or 128.
        residual_length (`int`, *optional*, defaults to 128):
            The most recent tokens kept exact, a multiple of `group_size`. Tokens are quantized in blocks of this many,
            so attention always sees 1 to `residual_length` exact recent tokens.
        sink_tokens (`int`, *optional*, defaults to 4):
            The first tokens of each sequence kept exact, never quantized (attention sinks); 0 keeps none. Each row
            keeps its own first real tokens whatever its left padding, once the cache knows the padding
            (`OscarCache.set_padding`; generate tells it). Counted as exact bytes by `KVMemory`, left out of
            `average_bits`.
        rotation (`bool`, *optional*, defaults to `True`):
            Canalized Rotation (Walsh-Hadamard along head_dim) of values, and of keys as `method` says.
        token_scaling (`bool`, *optional*, defaults to `True`):
            Omni-Token Scaling: each key token divided by its norm over all KV heads before quantizing. With
            `rotation=False, token_scaling=False` the cache is plain KIVI-style quantization.
        scale_dtype (`str`, *optional*, defaults to `"float16"`):
            Dtype of the per-group scales and minimums, "float16" (the paper's byte count) or "float32" (for K/V
            beyond float16's range). bfloat16 is refused: its 8-bit mantissa biases the zero-point.
        method (`str`, *optional*, defaults to `"auto"`):
            How `rotation` treats the keys. "oscar" (the query rule): each (batch row, KV head) of each layer rotates
            its keys where that lowers the attention-logit error against the prompt's own queries
            (`reference.query_rotation_choice`; the queries reach the cache through transformers' "sdpa" attention),
            chosen while the prompt streams in and final from the first decode step (`cache/key_rotation.py`).
            "paper": every key rotated, the paper's method (arXiv 2605.19660). "auto": "oscar" on an "sdpa" model,
            else "paper" with a warning (once); `OscarCache` resolves it (`resolve`).
        attention (`str`, *optional*, defaults to `"auto"`):
            "auto": the Triton kernels where they apply (CUDA, an sdpa model, head_dim 64/128/256), the portable
            reference elsewhere (`cache/backends.py`); "fused": demand the kernels (an error names what prevents
            them; on CPU they run only under TRITON_INTERPRET=1); "portable": always the reference.
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
    auto_widths: tuple[int, ...] | None = None

    def __post_init__(self):
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(f"OscarConfig: {message}")

        widths = ", ".join(map(str, SUPPORTED_WIDTHS[:-1])) + f" or {SUPPORTED_WIDTHS[-1]}"
        check(
            self.bits in (None, "auto", *SUPPORTED_WIDTHS),
            f"bits={self.bits!r} is not supported; use 'auto' (default: layer-wise widths under avg_bits), {widths}.",
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
            check(
                value in (None, *SUPPORTED_WIDTHS),
                f"{name}={value} is not supported; use {widths} (default 2).",
            )
        if self.bits is None and self.key_bits is None and self.value_bits is None:
            object.__setattr__(self, "bits", "auto")  # no width given: each layer's is chosen under the budget
        if self.bits == "auto":
            self._check_auto(check)
        else:
            for name in ("avg_bits", "auto_widths"):
                check(
                    getattr(self, name) is None,
                    f"{name}={getattr(self, name)} belongs to bits='auto' (layer-wise widths); pass bits='auto' with "
                    "it, or drop it (otherwise every layer stores key_bits and value_bits).",
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
        widths = self.auto_widths
        if widths is not None:
            check(
                isinstance(widths, (tuple, list))
                and len(widths) > 0
                and list(widths) == sorted(set(widths))
                and set(widths) <= set(SUPPORTED_WIDTHS),
                f"auto_widths={widths!r} must list widths of {SUPPORTED_WIDTHS}, narrowest first, each once "
                f"(e.g. (2, 3, 4)), or be None for {DEFAULT_AUTO_WIDTHS}.",
            )
            object.__setattr__(self, "auto_widths", tuple(widths))  # a tuple: configs are hashed (a list is not)

    def budget(self, all_2bit_cost: float) -> float:
        """bits="auto": the average stored bits the layers may spend, on a model whose layers cost `all_2bit_cost`
        at 2 bits everywhere: `avg_bits`, else `DEFAULT_AVG_BITS` or that cost where a head shape stores more."""
        return max(DEFAULT_AVG_BITS, all_2bit_cost) if self.avg_bits is None else self.avg_bits

    @property
    def chooser_widths(self) -> tuple[int, ...]:
        """The widths bits="auto" chooses among: `auto_widths`, else `DEFAULT_AUTO_WIDTHS`."""
        return DEFAULT_AUTO_WIDTHS if self.auto_widths is None else self.auto_widths

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
        return dataclasses.replace(
            self, bits=None, avg_bits=None, auto_widths=None, key_bits=key_bits, value_bits=value_bits
        )

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
        if attn_implementation == "sdpa":  # its calls hand the queries over (the sdpa entry oscar_hf registers)
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
