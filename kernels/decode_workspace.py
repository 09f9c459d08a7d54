"""The tensors a fused decode call uses besides its inputs: the buffers it consumes within itself (partial outputs,
their (m, l), the Gluon kernel's query operand and scale), kept per (device, stream) from call to call (`workspace`),
and the empty stand-ins of absent inputs (`no_storage`, `nothing`)."""

from __future__ import annotations

import functools

import torch

from oscar_hf.layout import QuantizedKV, StorageLayout

MAX_WORKSPACES = 8  # workspaces kept (oldest dropped first): one per stream and plan size in use


def workspace(plan, device: torch.device, stream: int | None, compiled: bool) -> tuple[torch.Tensor, ...]:
    """The partial outputs, their (m, l) and the Gluon kernel's query operand and scale of one call of `plan`
    (`decode_attention.DecodePlan`) on `stream`:
    kept from call to call for eager calls, new for a `compiled` one (a device length: the custom op under
    torch.compile) or one a CUDA graph captures.

    Why eager calls can share them: the split and Gluon kernels write them and the merge kernel reads them within one
    call, all three on `stream`; the next call that takes the same buffers is on the same stream (the key), so CUDA
    runs its kernels after this call's merge. Calls on other streams or devices take other buffers. A dropped
    workspace goes back to the caching allocator, which reuses its memory only for work ordered after it on the stream
    it was allocated on.
    Why the others get new ones (as every call did before): a captured graph's replays may run on any stream,
    unordered with eager calls, so its buffers are its own (from the graph's memory pool); and CUDA-graph trees
    (torch.compile's "reduce-overhead") run a compiled step's warm-up calls with the allocator routed to their pool,
    whose state they later rewind, which could hand a buffer kept here to another tensor."""
    if compiled or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return _allocate(plan, device)
    key = (device.index, stream, plan.part_shape, plan.q_op_shape)
    buffers = WORKSPACES.get(key)
    if buffers is None:
        if len(WORKSPACES) >= MAX_WORKSPACES:
            del WORKSPACES[next(iter(WORKSPACES))]
        buffers = WORKSPACES[key] = _allocate(plan, device)
    return buffers


WORKSPACES: dict[tuple, tuple[torch.Tensor, ...]] = {}


def _allocate(plan, device: torch.device) -> tuple[torch.Tensor, ...]:
    part_o = torch.empty(plan.part_shape, dtype=torch.float32, device=device)
    part_ml = torch.empty((*plan.part_shape[:3], 2), dtype=torch.float32, device=device)
    q_op = torch.empty(plan.q_op_shape, dtype=torch.float16, device=device)
    q_scale = torch.empty(plan.q_op_shape[0] if plan.gluon else 0, dtype=torch.float32, device=device)
    return part_o, part_ml, q_op, q_scale


def no_storage(query, residual_keys, config) -> QuantizedKV:
    """The storage of a call that reads no quantized token: empty tensors of the right dtypes and ranks."""
    batch, kv_heads, _, head_dim = residual_keys.shape
    return _empty_storage(StorageLayout.of(config), batch, kv_heads, head_dim, query.device)


@functools.lru_cache(maxsize=16)
def _empty_storage(layout: StorageLayout, batch: int, kv_heads: int, head_dim: int, device) -> QuantizedKV:
    """A storage of no tokens (no element: shared by every call, never written)."""
    return layout.empty(batch, kv_heads, head_dim, kv_heads, head_dim, 0, device)


@functools.cache
def nothing(device: torch.device, dims: int) -> torch.Tensor:
    """An empty float32 tensor of `dims` dims on `device`: a stand-in for an absent input (no element: shared)."""
    return torch.empty((0,) * dims, device=device)
