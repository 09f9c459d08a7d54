"""How an OScaR layer's steps attend, decided in one place: portable, fused or compiled, each "no" with its reason.

* portable: `update` returns dense K/V (the dequantized history, then the exact tokens) to the model's attention;
* fused: decode steps of up to `DecodePath.query_tokens` tokens attend with the Triton kernel, which reads the packed
  storage in place (`integrations/fused_attention.py`), and so do longer chunks arriving with history, with the chunk
  kernel (`cache/history.py`); blocks are quantized by the Triton kernel;
* compiled: fused single-token steps inside `torch.compile` / CUDA graphs, from a device counter over storage
  reserved up front (`cache/compiled.py`).

Each check returns the reasons it fails (empty: it applies), like fla's backend verifiers, so that an error or
`OscarCache.compile_blockers()` names every one. `OscarCache` makes the decision at a layer's first update
(`decide`) and hands the layer the resulting `DecodePath`.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from .config import OscarConfig
from .kernels import DECODE_HEAD_DIMS, DECODE_MAX_QUERY_ROWS, DECODE_MAX_QUERY_TOKENS

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Attention features the fused kernel does not implement; a call using them attends over the dense history instead.
UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")


@dataclass(frozen=True)
class DecodePath:
    """What a layer's steps may use, decided at its first update.

    fused: blocks are quantized by the Triton kernel, decode steps of up to `query_tokens` tokens attend with the
        fused kernel and longer chunks arriving with history with the chunk kernel.
    query_tokens: the kernel's limit on query rows per KV head divided by the model's GQA group.
    head_group: under tensor parallelism, the torch.distributed group over which this process holds a shard of the
        layer's KV heads: the Omni-Token norm (over all heads) is all-reduced over it (eager code only).
    """

    fused: bool = False
    query_tokens: int = 0
    head_group: object = None

    def fused_step(self, held: int, new: int, window: int) -> bool:
        """Whether `new` tokens arriving at a residual window holding `held` of `window` take the fused kernel."""
        return self.fused and new <= self.query_tokens and held + new <= window

    def chunk_step(self, total: int, held: int, new: int, window: int) -> bool:
        """Whether `new` tokens arriving at a layer holding `total`, `held` of them in its residual window of `window`
        (flushed first when full), take the chunk kernel: a history, and more than a fused decode step takes."""
        return self.fused and total > 0 and not self.fused_step(0 if held == window else held, new, window)


def _failed(*checks: tuple[bool, str]) -> list[str]:
    return [reason for failed, reason in checks if failed]


def _implementation(text_config: PretrainedConfig) -> str | None:
    return getattr(text_config, "_attn_implementation", None)


def fused_blockers(
    oscar_config: OscarConfig,
    text_config: PretrainedConfig,
    offloading: bool,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
) -> list[str]:
    """Why a layer seeing these K/V cannot use the Triton kernels (empty: it can). attention='portable' is not a
    reason: it is a choice (`decide`)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs kernels on CPU tensors
    implementation = _implementation(text_config)
    return _failed(
        (offloading, "cache offloading is on"),
        (implementation != "sdpa", f"the model's attn_implementation is {implementation!r}, not 'sdpa'"),
        (
            not (key_states.is_cuda or (oscar_config.attention == "fused" and interpreting)),
            f"K/V are on {key_states.device} (CUDA needed; CPU only under TRITON_INTERPRET=1)",
        ),
        (
            not key_states.shape[-1] == value_states.shape[-1] in DECODE_HEAD_DIMS,
            f"head dims {key_states.shape[-1]}/{value_states.shape[-1]} are not one of {DECODE_HEAD_DIMS}",
        ),
        (not HAS_TRITON, "triton is not installed"),
    )


def decide(
    oscar_config: OscarConfig,
    text_config: PretrainedConfig,
    offloading: bool,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    head_group=None,
) -> DecodePath:
    """The path of a layer whose first update brings these K/V. With attention="auto" the portable path runs where
    the kernels do not apply (same storage, same results up to rounding); attention="fused" demands them."""
    kv_heads = getattr(text_config, "num_key_value_heads", None) or key_states.shape[1]
    group = getattr(text_config, "num_attention_heads", kv_heads) // kv_heads  # the same on every shard
    query_tokens = min(DECODE_MAX_QUERY_TOKENS, DECODE_MAX_QUERY_ROWS // max(group, 1))
    if oscar_config.attention == "portable":
        return DecodePath(False, query_tokens, head_group)
    reasons = fused_blockers(oscar_config, text_config, offloading, key_states, value_states)
    if reasons and oscar_config.attention == "fused":
        raise ValueError(
            f"OscarConfig(attention='fused') cannot use the Triton kernels: {'; '.join(reasons)}. "
            "Use attention='auto' (kernels where they apply) or 'portable'."
        )
    return DecodePath(not reasons, query_tokens, head_group)


def config_compile_blockers(
    oscar_config: OscarConfig, text_config: PretrainedConfig, *, offloading: bool, tensor_parallel: bool
) -> list[str]:
    """Why compiled decode cannot run with this model's config and this cache's settings, before any layer is
    initialized (empty: it can, if the layers allow it, `compile_blockers`): the fused path by the model's config (sdpa,
    head dims the kernel supports), KV sharing only as transformers >= 5.24 represents it, no offloading or tensor
    parallelism."""
    heads = getattr(text_config, "num_attention_heads", None) or 1
    head_dim = getattr(text_config, "head_dim", None) or getattr(text_config, "hidden_size", 0) // heads
    group = heads // (getattr(text_config, "num_key_value_heads", None) or heads)
    implementation = _implementation(text_config)
    return _failed(
        (oscar_config.attention == "portable", "attention='portable'"),
        (not HAS_TRITON, "triton is not installed"),
        (implementation != "sdpa", f"the model's attn_implementation is {implementation!r}, not 'sdpa'"),
        (head_dim not in DECODE_HEAD_DIMS, f"head_dim {head_dim} is not one of {DECODE_HEAD_DIMS}"),
        (group > DECODE_MAX_QUERY_ROWS, f"{group} query heads per KV head exceed {DECODE_MAX_QUERY_ROWS}"),
        (
            _kv_sharing_before_5_24(text_config),
            "KV-sharing layers (num_kv_shared_layers) before transformers 5.24: upgrade it to decode them compiled",
        ),
        (offloading, "cache offloading is on"),
        (tensor_parallel, "tensor parallel: the token norms' all-reduce over the ranks' KV heads runs in eager code"),
    )


def _kv_sharing_before_5_24(text_config: PretrainedConfig) -> bool:
    """Whether some layers reuse another layer's K/V as transformers up to 5.23 represents it: Gemma 3n's
    `num_kv_shared_layers`, the sharing layers left out of the cache and the producer's K/V moved with `.to(device)` on
    their way to attention, a copy that could lose the fused step the keys carry inside a traced forward. From 5.24
    (`kv_sharing_modes`) each sharing layer has a `DummyLayer` and attends with the very K/V the producer's update
    returned, step included (tests/kernels/test_compiled_decode.py compiles Gemma 3n)."""
    shared = getattr(text_config, "num_kv_shared_layers", 0)
    return bool(shared) and getattr(text_config, "kv_sharing_modes", None) is None


def compile_blockers(
    oscar_config: OscarConfig,
    text_config: PretrainedConfig,
    *,
    uncompileable_layers: list[str],
    offloading: bool,
    tensor_parallel: bool,
    paths: list[DecodePath | None],
    reserved: bool,
) -> list[str]:
    """Why compiled decode cannot run (empty: it can): `config_compile_blockers`, the cache's other layers
    (`uncompileable_layers`: the class names of those that cannot run compiled), every initialized OScaR layer on the
    fused path (`paths`: None for a layer not initialized yet) and the maximum length reserved."""
    other_layers = ", ".join(sorted(set(uncompileable_layers)))
    return config_compile_blockers(
        oscar_config, text_config, offloading=offloading, tensor_parallel=tensor_parallel
    ) + _failed(
        (bool(uncompileable_layers), f"the model has layers that cannot run compiled ({other_layers})"),
        (
            any(path is not None and not path.fused for path in paths),
            "the fused kernels do not apply to the K/V this cache holds (see OscarConfig.attention)",
        ),
        (not reserved, "no maximum length is reserved"),
    )


def attention_blockers(dropout: float, kwargs: dict) -> list[str]:
    """Why an attention call on a fused step's K/V cannot be answered by the fused kernel (empty: it can)."""
    return _failed(
        (bool(dropout), "dropout"),
        *((kwargs.get(name) is not None, name) for name in UNSUPPORTED_ATTENTION_KWARGS),
    )
