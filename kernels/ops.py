"""The Triton launchers as PyTorch custom ops, so that `torch.compile` traces a decode step without graph breaks.

    torch.ops.oscar.decode_attention(query, quantized, residual_keys, residual_values, key_padding_mask, scaling,
                                     config, key_rotated, length) -> [B, Hq, Tq, D]
    torch.ops.oscar.flush_residual(residual_keys, residual_values, storage, length, config, padding_mask,
                                   key_rotated) -> None (writes storage)

The ops take plain tensors: `quantized` is the list of `QuantizedKV` fields in order (an empty list for no
quantized region; absent fields, e.g. `key_norms` without token scaling, as None), `storage` the list of the present
fields only (a list the op writes to cannot hold None; `config` says which are present), and `config` is the
`OscarConfig` as JSON (`config_key`). The fake implementations need nothing of the kernels: decode_attention's output
has the query's shape, flush_residual returns nothing.
Both are opaque to the compiler (`custom_op`): Inductor calls them as they are, CUDA graphs capture their launches.

`decode_attention(...)` and `flush_residual(...)` below are the typed Python entry points the cache calls (traceable:
they take the config's key string and look nothing up but a dict filled eagerly).
"""

from __future__ import annotations

import functools
import json

import torch

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout


def config_key(config: OscarConfig) -> str:
    """The op argument standing for `config`: its fields as canonical JSON. Computed eagerly (once per cache layer)
    and passed on as a constant string, so that traced code never serializes anything."""
    key = json.dumps(config.to_dict(), sort_keys=True)
    _PRESENT_FIELDS.setdefault(key, tuple(dtype is not None for dtype in StorageLayout.of(config).dtypes))
    return key


# Which `QuantizedKV` fields a config stores (e.g. no `key_norms` without token scaling), by `config_key`.
_PRESENT_FIELDS: dict[str, tuple[bool, ...]] = {}


@functools.cache
def _config(key: str) -> OscarConfig:
    return OscarConfig.from_dict(json.loads(key))


@torch.library.custom_op("oscar::decode_attention", mutates_args=())
def _decode_attention_op(
    query: torch.Tensor,
    quantized: list[torch.Tensor | None],
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: str,
    key_rotated: torch.Tensor | None,
    length: torch.Tensor | None,
    sinks: int = 0,
) -> torch.Tensor:
    from . import decode_attention_triton

    stored = QuantizedKV(*quantized) if quantized else None
    return decode_attention_triton(
        query, stored, residual_keys, residual_values, key_padding_mask, scaling, _config(config), key_rotated, length,
        sinks=sinks,
    )  # fmt: skip


@_decode_attention_op.register_fake
def _(
    query, quantized, residual_keys, residual_values, key_padding_mask, scaling, config, key_rotated, length, sinks=0
):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op("oscar::flush_residual", mutates_args=("storage",))
def _flush_residual_op(
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    storage: list[torch.Tensor],
    length: torch.Tensor,
    config: str,
    padding_mask: torch.Tensor | None,
    key_rotated: torch.Tensor | None,
) -> None:
    from . import flush_residual_triton

    parts = iter(storage)
    stored = QuantizedKV(*(next(parts) if present else None for present in _PRESENT_FIELDS[config]))
    flush_residual_triton(residual_keys, residual_values, stored, length, _config(config), padding_mask, key_rotated)


@_flush_residual_op.register_fake
def _(residual_keys, residual_values, storage, length, config, padding_mask, key_rotated):
    return None


def decode_attention(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: str,
    key_rotated: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
    sinks: int = 0,
) -> torch.Tensor:
    """`decode_attention_triton` through the `oscar::decode_attention` op (same contract; `config` from
    `config_key`)."""
    fields = [] if quantized is None else list(quantized)
    return torch.ops.oscar.decode_attention(
        query, fields, residual_keys, residual_values, key_padding_mask, float(scaling), config, key_rotated, length,
        sinks,
    )  # fmt: skip


def flush_residual(
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    storage: QuantizedKV,
    length: torch.Tensor,
    config: str,
    padding_mask: torch.Tensor | None = None,
    key_rotated: torch.Tensor | None = None,
) -> None:
    """`flush_residual_triton` through the `oscar::flush_residual` op (same contract; `config` from `config_key`)."""
    fields = [t for t in storage if t is not None]
    torch.ops.oscar.flush_residual(residual_keys, residual_values, fields, length, config, padding_mask, key_rotated)
