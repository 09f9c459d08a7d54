"""How an OScaR layer quantizes, reads back and attends: one backend object per layer, chosen once at its first update
(`choose_backend`), each "no" with its reason, as fla's backend verifiers.

* `PortableBackend`: the reference (`oscar_hf.reference`), on any device. `update` returns the dense history (the
  quantized region dequantized, then the exact tokens), which the model's own attention reads.
* `TritonBackend`: the Triton/Gluon kernels (`oscar_hf.kernels`) quantize blocks into the storage in place; decode steps
  of up to `query_tokens` tokens and prompt chunks arriving with history attend over the packed storage in place: the
  layer's `update` returns the new tokens only, carrying the step (`step.FusedStep`), which the sdpa entry answers
  with `decode_attention` / `chunk_attention`. Its single-token steps may run compiled (`compiled_steps`: CUDA graphs
  over the custom ops of `kernels/ops.py`, `compiled.CompiledDecode`).

Both backends read and write the one storage contract (`oscar_hf.layout`), so a layer's results do not depend on the
backend beyond rounding. A backend holds no layer state: everything a call needs is its arguments.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from .. import kernels
from ..config import OscarConfig
from ..kernels import DECODE_HEAD_DIMS, DECODE_MAX_QUERY_ROWS, DECODE_MAX_QUERY_TOKENS
from ..layout import QuantizedKV
from ..reference import dequantize_kv, fake_quantize_keys, fake_quantize_kv, finite_flags, quantize_kv
from .finite import FiniteCheck
from .history import ChunkHistory, DecodeHistory

if TYPE_CHECKING:
    from .padding import Padding
    from .storage import KVStorage

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Attention features the fused kernel does not implement; a call using them attends over the dense history instead.
UNSUPPORTED_ATTENTION_KWARGS = ("softcap", "sliding_window", "s_aux", "sinks")


class PortableBackend:
    """The reference in PyTorch, on any device: blocks quantized and dequantized in float32 (float64 for a float64
    model); the model's own attention reads the dense history (`history` is None)."""

    name = "portable"
    compiled_steps = False  # whether single-token steps may run inside torch.compile / CUDA graphs
    query_tokens = 0  # the most query tokens a decode step attends in place

    def quantize(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        config: OscarConfig,
        key_rotated: torch.Tensor | None,
        norms: torch.Tensor | None,
        valid: torch.Tensor | None,
        finite: FiniteCheck,
        into: tuple[KVStorage, int] | None = None,
    ) -> QuantizedKV:
        """Quantize a block of K/V `[B, Hkv, N, D]` (`reference.quantize_kv`; `valid` `[B, N]`: False at padding,
        left out; `norms`: the token norms over every rank's heads, tensor parallel), checked finite by `finite`.
        `into`: (storage, quantized token): the block is written there; None: a new block. Returns the block."""
        block = quantize_kv(keys, values, config, key_rotated, norms=norms, valid=valid)
        finite.check(finite_flags(block, keys, values, valid))
        if into is not None:
            into[0].write(into[1], block)
        return block

    def dequantize(
        self,
        rows: QuantizedKV,
        config: OscarConfig,
        key_rotated: torch.Tensor | None,
        dtype: torch.dtype,
        out: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V of the quantized `rows` in `dtype` (computed in float32, float64 for float64), written into `out`
        when given."""
        math_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        keys, values = dequantize_kv(rows, config, math_dtype, key_rotated)
        if out is None:
            return keys.to(dtype), values.to(dtype)
        out[0].copy_(keys)
        out[1].copy_(values)
        return out

    def fake_quantize_kv(self, keys, values, key_rotated, config, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The round trip bits="auto" costs each width with (`reference.fake_quantize_kv`)."""
        return fake_quantize_kv(keys, values, key_rotated, config, valid)

    def fake_quantize_keys(self, keys, rotated, config, valid=None) -> torch.Tensor:
        """The keys' round trip method="oscar"'s choice costs each rotation with (`reference.fake_quantize_keys`)."""
        return fake_quantize_keys(keys, rotated, config, valid)

    def decode_step(self, held: int, new: int, window: int) -> bool:
        """Whether `new` tokens arriving at a window holding `held` of `window` attend in place as a decode step."""
        return False

    def chunk_step(self, total: int, held: int, new: int, window: int) -> bool:
        """Whether `new` tokens arriving at a layer holding `total`, `held` of them in its window of `window` (flushed
        first when full), attend in place as a chunk: a history, and more than a decode step takes."""
        return False

    def history(
        self,
        storage: KVStorage,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        config: OscarConfig,
        key_rotated: torch.Tensor | None,
        padding: Padding | None,
    ) -> DecodeHistory | ChunkHistory | None:
        """What an update bringing these K/V attends to in place, taken before they are stored (a chunk reads the
        history as its update found it); None: the model's attention reads the dense history."""
        return None


class TritonBackend(PortableBackend):
    """The Triton/Gluon kernels (CUDA, or CPU tensors under Triton's interpreter): the same storage, written and read in
    place; decode steps of up to `query_tokens` query tokens and chunks arriving with history attend in place."""

    name = "triton"
    compiled_steps = True

    def __init__(self, query_tokens: int):
        self.query_tokens = query_tokens

    def quantize(self, keys, values, config, key_rotated, norms, valid, finite, into=None) -> QuantizedKV:
        """As the reference's, by the quantizer kernel: written in place into the storage's buffers, checked finite on
        the way (on CUDA without waiting: `FiniteCheck`)."""
        storage, start = into or (None, 0)
        flags = finite.flags(keys.device)
        block = kernels.quantize_kv_triton(
            keys, values, config, key_rotated, norms, valid,
            out=None if storage is None else storage.buffers, start=start, finite=flags,
        )  # fmt: skip
        finite.check(flags)
        return block

    def dequantize(self, rows, config, key_rotated, dtype, out=None) -> tuple[torch.Tensor, torch.Tensor]:
        """As the reference's, by the dequantizer kernel, straight from the packed codes to `dtype`."""
        return kernels.dequantize_kv_triton(rows, config, key_rotated, out, dtype)

    def fake_quantize_kv(self, keys, values, key_rotated, config, valid=None) -> tuple[torch.Tensor, torch.Tensor]:
        return kernels.fake_quantize_kv_triton(keys, values, key_rotated, config, valid)

    def fake_quantize_keys(self, keys, rotated, config, valid=None) -> torch.Tensor:
        return kernels.fake_quantize_keys_triton(keys, rotated, config, valid)

    def decode_step(self, held: int, new: int, window: int) -> bool:
        return new <= self.query_tokens and held + new <= window

    def chunk_step(self, total: int, held: int, new: int, window: int) -> bool:
        return total > 0 and not self.decode_step(0 if held == window else held, new, window)

    def history(self, storage, key_states, value_states, config, key_rotated, padding):
        new = key_states.shape[-2]
        if not self.chunk_step(storage.total, storage.held, new, storage.window):
            return DecodeHistory(self, storage, config, key_rotated, padding)
        exact = storage.exact(key_states, value_states)
        return ChunkHistory(
            self, storage, config, key_rotated, padding, storage.sinks_held, storage.length, *exact, new
        )

    @staticmethod
    def decode_attention(query, quantized, exact_keys, exact_values, key_padding_mask, scaling, config, key_rotated):
        """A decode step's attention `[B, Hq, Tq, D]` over the packed storage read in place
        (`kernels.decode_attention_triton`)."""
        return kernels.decode_attention_triton(
            query, quantized, exact_keys, exact_values, key_padding_mask, scaling, config, key_rotated
        )

    @staticmethod
    def chunk_attention(
        query, quantized, exact_keys, exact_values, key_padding_mask, scaling, config, key_rotated, prefer_flash=False
    ):
        """A chunk's attention `[B, Hq, T, D]`: the faster of the fused kernel over the packed history and flash
        attention over it dequantized piece by piece (`kernels.chunk_attention.chunk_attention`, `prefer_flash`
        its)."""
        from ..kernels.chunk_attention import chunk_attention

        return chunk_attention(
            query,
            quantized,
            exact_keys,
            exact_values,
            key_padding_mask,
            scaling,
            config,
            key_rotated,
            prefer_flash=prefer_flash,
        )


def _failed(*checks: tuple[bool, str]) -> list[str]:
    return [reason for failed, reason in checks if failed]


def _implementation(text_config: PretrainedConfig) -> str | None:
    return getattr(text_config, "_attn_implementation", None)


def query_tokens(text_config: PretrainedConfig, kv_heads: int) -> int:
    """The most query tokens a decode step attends with the kernel: its limit on query rows per KV head over the
    model's GQA group (the same on every tensor-parallel shard)."""
    kv_heads = getattr(text_config, "num_key_value_heads", None) or kv_heads
    group = getattr(text_config, "num_attention_heads", kv_heads) // kv_heads
    return min(DECODE_MAX_QUERY_TOKENS, DECODE_MAX_QUERY_ROWS // max(group, 1))


def fused_blockers(
    oscar_config: OscarConfig,
    text_config: PretrainedConfig,
    offloading: bool,
    device: torch.device,
    head_dims: tuple[int, int],
) -> list[str]:
    """Why K/V on `device` with these (key, value) head dims cannot use the Triton backend (empty: they can).
    attention='portable' is not a reason: it is a choice (`choose_backend`)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's interpreter runs kernels on CPU tensors
    implementation = _implementation(text_config)
    return _failed(
        (offloading, "cache offloading is on"),
        (implementation != "sdpa", f"the model's attn_implementation is {implementation!r}, not 'sdpa'"),
        (
            not (device.type == "cuda" or (oscar_config.attention == "fused" and interpreting)),
            f"K/V are on {device} (CUDA needed; CPU only under TRITON_INTERPRET=1)",
        ),
        (
            not head_dims[0] == head_dims[1] in DECODE_HEAD_DIMS,
            f"head dims {head_dims[0]}/{head_dims[1]} are not one of {DECODE_HEAD_DIMS}",
        ),
        (not HAS_TRITON, "triton is not installed"),
    )


def choose_backend(
    oscar_config: OscarConfig,
    text_config: PretrainedConfig,
    offloading: bool,
    device: torch.device,
    head_dims: tuple[int, int],
    kv_heads: int,
) -> PortableBackend:
    """The backend of a layer storing K/V of `kv_heads` heads and these (key, value) head dims on `device` (the cache
    chooses at a layer's first update, the serving pool at its creation). With attention="auto" the portable one runs
    where the kernels do not apply (same storage, same results up to rounding); attention="fused" demands them."""
    if oscar_config.attention == "portable":
        return PortableBackend()
    reasons = fused_blockers(oscar_config, text_config, offloading, device, head_dims)
    if reasons and oscar_config.attention == "fused":
        raise ValueError(
            f"OscarConfig(attention='fused') cannot use the Triton kernels: {'; '.join(reasons)}. "
            "Use attention='auto' (kernels where they apply) or 'portable'."
        )
    return PortableBackend() if reasons else TritonBackend(query_tokens(text_config, kv_heads))


def config_compile_blockers(
    oscar_config: OscarConfig, text_config: PretrainedConfig, *, offloading: bool, tensor_parallel: bool
) -> list[str]:
    """Why compiled decode cannot run with this model's config and this cache's settings, before any layer is
    initialized (empty: it can, if the layers allow it, `compile_blockers`): the Triton backend by the model's config
    (sdpa, head dims the kernel supports), KV sharing only as transformers >= 5.24 represents it, no offloading or
    tensor parallelism."""
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
    backends: list[PortableBackend],
    reserved: bool,
) -> list[str]:
    """Why compiled decode cannot run (empty: it can): `config_compile_blockers`, the cache's other layers
    (`uncompileable_layers`: the class names of those that cannot run compiled), the backends of the initialized OScaR
    layers and the maximum length reserved."""
    other_layers = ", ".join(sorted(set(uncompileable_layers)))
    return config_compile_blockers(
        oscar_config, text_config, offloading=offloading, tensor_parallel=tensor_parallel
    ) + _failed(
        (bool(uncompileable_layers), f"the model has layers that cannot run compiled ({other_layers})"),
        (
            not all(backend.compiled_steps for backend in backends),
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
