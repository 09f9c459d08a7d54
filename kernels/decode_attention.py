"""Fused decode attention over the OScaR 2/4-bit KV cache (flash-decoding: split-K + log-sum-exp merge): the launcher.

`decode_attention_triton(query, quantized, residual_keys, residual_values, key_padding_mask, scaling, config)`:

    query             [B, Hq, Tq, D]      bf16 / fp16 / fp32; Hq = g * Hkv (GQA), 1 <= Tq <= R (speculative decoding)
    quantized         QuantizedKV or None, L quantized tokens (layout: `oscar_hf.layout.StorageLayout`; tensors may be
                      views of larger capacity buffers, any strides but the value parameters' last two, which must be
                      the layout's (D / G, 1)), L a multiple of group_size
    residual_keys     [B, Hkv, R, D]      raw post-RoPE keys, query dtype (not rotated, not scaled), 1 <= R
    residual_values   [B, Hkv, R, D]
    key_padding_mask  None or bool [B, L + R] (True = attend)
    returns           [B, Hq, Tq, D]      query dtype

With `length` (compiled decode: a one-element int64 device tensor, the tokens held, the new ones included), `quantized`
and the residual tensors are the whole reserved storage and window instead: the kernel reads L = (length - 1) // R * R
quantized tokens and length - L residual ones, decided on the device, and `key_padding_mask` is [B, W] (W >= capacity
+ R: the residual slot j is column L + j), so nothing on the host depends on how much is held. With `sinks` S (exact
sink tokens held before the window, in the first S residual slots: the residual tensors hold S + R tokens), L =
max(length - S - 1, 0) // R * R.

Query i (0-based, of Tq) sees every quantized token and residual tokens 0 .. R - Tq + i (the queries are the last
Tq residual tokens). Scores: `(q H . deq(u_t)) * n_t * scaling` for quantized tokens, `q . k_t * scaling` for
residual ones. Nothing proportional to the context is materialised: the split kernels read the packed codes.

One call is three launches, which `DecodePlan` names:
- the Triton split kernel (kernels/decode_triton.py): the residual window, and the quantized tokens the Gluon kernel
  does not read (all of them where it does not run, else what follows its full blocks: a partial block, or nothing);
- the Gluon kernel (kernels/decode_gluon.py) where `decode_gluon.supports` allows it (the usual decode step): the full
  128-token blocks of the quantized region;
- the merge kernel (kernels/decode_merge.py): every partial, by log-sum-exp.
A plan is made (and the inputs validated) once per set of launch facts (shapes, strides, dtypes, devices, config,
tuning) but for the two a decode changes every step, the residual tokens held and the padding mask's width (checked
per call, passed per call to kernels that do not specialise on them): the layers of a step and the steps that add to
the same residual window (an eager decode makes a plan every R steps), every compiled step, reuse it.

Host cost of a call with a cached plan: the lookup, the output's allocation and three launches through the compiled
kernels' own launchers (`launching.BoundKernel`); the partial outputs and the query operand, consumed within the
call, live in a workspace per (device, stream) (`decode_workspace.workspace`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout

from . import DECODE_HEAD_DIMS, DECODE_MAX_QUERY_ROWS, DECODE_MAX_QUERY_TOKENS, launching
from .common import MODEL_DTYPES, announce_first_launch, interpreting, on_device
from .decode_merge import merge_kernel
from .decode_tiles import check_block_n
from .decode_triton import split_kernel
from .decode_tuning import SHORT_CONTEXT, DecodeTuning, default_tuning, few_heads, gluon_programs_per_head, num_splits
from .decode_workspace import no_storage, nothing, workspace
from .launching import BoundKernel
from .quantize_pack import check_key_rotated

# Gluon (Triton's layout-explicit dialect, still `experimental`, its API changing between releases) reads the full
# blocks of the usual decode step with the Triton versions it was built and checked with: 3.6 on the GPUs, 3.9 compiled
# on the CPU. With an older Triton the Triton kernel reads every token.
decode_gluon = None
if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 6):
    from . import decode_gluon

_LOG2E = 1.4426950408889634
_MAX_PLANS = 256  # plans kept (oldest dropped first): an eager decode makes one per R steps, a compiled one one


@dataclass(frozen=True)
class DecodePlan:
    """What one set of launch facts launches: the three kernels with their grids, sizes, constants and strides bound."""

    num_quantized: int  # quantized tokens (with a device length: the storage's capacity); 0: none
    device_length: bool  # the tokens held are a device tensor (`length`): the mask may be wider than what is read
    tuning: DecodeTuning
    split: BoundKernel  # the Triton split kernel: the residual window, the quantized tokens the Gluon one leaves
    gluon: BoundKernel | None  # the Gluon kernel over the full 128-token blocks; None: the split kernel reads all ...
    why_not_gluon: str  # ... for this reason
    merge: BoundKernel
    part_shape: tuple[int, int, int, int]  # partial outputs [B * Hkv, partials, g * Tq, D]
    q_op_shape: tuple[int, ...]  # the query operand the Gluon kernel reads ((0,) without it)


def decode_attention_triton(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
    *,
    sinks: int = 0,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:
    """Attention of the newest Tq queries over quantized + residual tokens (module docstring), fused, [B, Hq, Tq, D].
    `key_rotated`: method="oscar"'s `[B, Hkv]` bool, as given to `quantize_kv_triton` (None for method="paper").
    `length`: None, or the tokens held as a device tensor, over the whole storage and window (module docstring), of
    which the first `sinks` residual slots are sinks. `tuning`: launch choices (`bench_decode_attention.py --sweep`),
    else `default_tuning`'s."""
    plan = decode_plan(query, quantized, residual_keys, residual_values, key_padding_mask, config, key_rotated, length,
                       tuning, sinks)  # fmt: skip
    device = query.device
    if not plan.num_quantized:  # nothing to read: empty tensors of the right dtypes and ranks, never dereferenced
        quantized = no_storage(query, residual_keys, config)
    inputs = _inputs(query, quantized, residual_keys, residual_values, key_padding_mask, key_rotated, length)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    with on_device(device):
        _launch(plan, inputs, quantized, length, scaling, out)
    return out


def _launch(plan: DecodePlan, inputs: tuple, quantized: QuantizedKV, length, scaling: float, out: torch.Tensor):
    """The plan's three launches on the current stream of `out`'s device, the current device."""
    stream = launching.current_stream(out.device)
    part_o, part_ml, q_op, q_scale = workspace(plan, out.device, stream, length is not None)
    direct = None if launching.hooks_set() else stream  # with launch hooks (a profiler's), through Triton's launch
    residual, mask = inputs[8].shape[2], inputs[10]
    plan.split(direct, *inputs, part_o, part_ml, q_op, q_scale, residual, scaling * _LOG2E, mask.stride(0))
    if plan.gluon:
        decode_gluon.launch(
            plan.gluon, direct, q_op, q_scale, quantized, inputs[4], mask, length, part_o, part_ml, residual
        )
    plan.merge(direct, part_o, part_ml, out)


def decode_plan(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    length: torch.Tensor | None = None,
    tuning: DecodeTuning | None = None,
    sinks: int = 0,
) -> DecodePlan:
    """The launch plan of these inputs: made (the inputs validated: a ValueError names what is wrong) the first time
    their launch facts are seen, then looked up (the residual tokens and the mask's width checked against it)."""
    facts = (
        config, tuning, sinks, quantized is None, _facts(query), _window_facts(residual_keys),
        _window_facts(residual_values),
        None if key_padding_mask is None else _mask_facts(key_padding_mask),
        *(None if t is None else _facts(t) for t in (key_rotated, length, *(quantized or ()))),
    )  # fmt: skip
    plan = _PLANS.get(facts)
    if plan is None or not _fits(plan, query, residual_keys, residual_values, key_padding_mask):
        # new facts, or a residual window or mask width the cached plan cannot read: made again (which refuses
        # inputs that break the contract, naming the problem)
        plan = _make_plan(
            query, quantized, residual_keys, residual_values, key_padding_mask, config, key_rotated, length, tuning,
            sinks,
        )  # fmt: skip
        if len(_PLANS) >= _MAX_PLANS:
            del _PLANS[next(iter(_PLANS))]
        _PLANS[facts] = plan
    return plan


_PLANS: dict[tuple, DecodePlan] = {}


def _facts(tensor: torch.Tensor) -> tuple:
    """What validation and a plan read of a tensor: shape, strides, dtype, device (`get_device`: the index, -1 for
    the CPU; cheaper than `.device`), and its address modulo 16 (Triton compiles a kernel for its pointers' alignment,
    which a plan's `BoundKernel`s keep; the Gluon kernel reads fp16 parameter pairs as int32, at even offsets)."""
    return tensor.shape, tensor.stride(), tensor.dtype, tensor.get_device(), tensor.data_ptr() & 15


def _window_facts(tensor: torch.Tensor) -> tuple:
    """`_facts` of residual keys or values [B, Hkv, R, D] but their tokens R, which a plan takes per call (`_fits`)."""
    shape = tensor.shape
    if len(shape) != 4:  # never planned: validation refuses it
        return _facts(tensor)
    return shape[0], shape[1], shape[3], tensor.stride(), tensor.dtype, tensor.get_device(), tensor.data_ptr() & 15


def _mask_facts(mask: torch.Tensor) -> tuple:
    """`_facts` of a key padding mask [B, W] but its width and row stride, which a plan takes per call (`_fits`)."""
    if mask.dim() != 2:  # never planned: validation refuses it
        return _facts(mask)
    return mask.shape[0], mask.stride(1), mask.dtype, mask.get_device(), mask.data_ptr() & 15


def _fits(plan: DecodePlan, query, residual_keys, residual_values, key_padding_mask) -> bool:
    """Whether a plan found by facts that leave out the residual tokens and the mask's width reads these: what
    `_validate` requires of them (1 <= Tq <= R, as many values as keys, a mask over what is read)."""
    residual = residual_keys.shape[2]
    if residual_values.shape[2] != residual or residual < query.shape[2]:
        return False
    if key_padding_mask is None:
        return True
    width, slots = key_padding_mask.shape[1], plan.num_quantized + residual
    return width >= slots if plan.device_length else width == slots


# the split kernel's tensor arguments, in `_inputs`' order, then its buffers, the residual tokens, the score scale and
# the padding mask's row stride of each call (the sizes a decode changes every step: not specialised on)
_SPLIT_INPUTS = ("q_ptr", "kc_ptr", "ks_ptr", "km_ptr", "kn_ptr", "vc_ptr", "vs_ptr", "vm_ptr", "rk_ptr", "rv_ptr",
                 "mask_ptr", "key_rotated_ptr", "length_ptr")  # fmt: skip
_SPLIT_PER_CALL = (*_SPLIT_INPUTS, "part_o_ptr", "part_ml_ptr", "q_op_ptr", "q_scale_ptr", "num_residual", "qk_scale",
                   "stride_mb")  # fmt: skip
_MERGE_PER_CALL = ("part_o_ptr", "part_ml_ptr", "out_ptr")


def _inputs(query, quantized, residual_keys, residual_values, key_padding_mask, key_rotated, length) -> tuple:
    """The split kernel's input tensors (`_SPLIT_INPUTS`; an absent one: an empty stand-in the kernel never reads)."""
    device = query.device
    key_norms = quantized.key_norms if quantized.key_norms is not None else nothing(device, 3)
    mask = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else nothing(device, 2)
    return (
        query, quantized.key_codes, quantized.key_scale, quantized.key_min, key_norms, quantized.value_codes,
        quantized.value_scale, quantized.value_min, residual_keys, residual_values, mask,
        key_rotated.view(torch.uint8) if key_rotated is not None else mask, length if length is not None else mask,
    )  # fmt: skip


def _strides(prefix: str, tensor: torch.Tensor, axes: str) -> dict[str, int]:
    """`tensor`'s strides as the split kernel's keyword arguments `stride_<prefix><axis>`, one letter per dim
    (`_` skips a dim the kernel never steps along)."""
    return {f"stride_{prefix}{axis}": stride for axis, stride in zip(axes, tensor.stride(), strict=True) if axis != "_"}


def _make_plan(
    query, quantized, residual_keys, residual_values, key_padding_mask, config, key_rotated, length, tuning, sinks
) -> DecodePlan:
    num_quantized = _validate(query, quantized, residual_keys, residual_values, key_padding_mask, config, length)
    if sinks and (length is None or not 0 < sinks < residual_keys.shape[2]):
        raise ValueError(
            f"decode_attention_triton: sinks={sinks} apply with a device `length` only, and must leave a window in "
            f"the {residual_keys.shape[2]} residual slots; without `length`, pass the sinks as residual tokens."
        )
    check_key_rotated(
        key_rotated, query.shape[0], residual_keys.shape[1], query.device, config, "decode_attention_triton"
    )
    device = query.device
    if device.type == "cuda":
        announce_first_launch()
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, residual = residual_keys.shape[1], residual_keys.shape[2]
    gqa = q_heads // kv_heads
    rows = gqa * q_len
    few = few_heads(batch * kv_heads, device)
    if tuning is None:
        tuning = default_tuning(head_dim, rows, config.scale_torch_dtype, few and num_quantized <= SHORT_CONTEXT)
    if num_quantized == 0:
        quantized = no_storage(query, residual_keys, config)
    block_n = tuning.block_n
    check_block_n(block_n, config, "decode_attention_triton")
    block_m = max(tuning.block_m, triton.next_power_of_2(rows))
    num_blocks = triton.cdiv(num_quantized, block_n)
    gluon_splits, why_not_gluon = gluon_splits_for(query, quantized, config, block_m, num_quantized, tuning)
    gluon_blocks_per_split = 0
    if gluon_splits:  # the Triton kernel's one quantized program reads what follows the Gluon kernel's full blocks
        gluon_block = decode_gluon.BLOCK.value
        splits, blocks_per_split = 1, gluon_block // block_n
        gluon_blocks_per_split = triton.cdiv(num_quantized // gluon_block, gluon_splits)
        gluon_splits = triton.cdiv(num_quantized // gluon_block, gluon_blocks_per_split)
    else:
        gluon_block = 0
        splits = num_splits(batch * kv_heads, num_blocks, device, tuning, few)
        blocks_per_split = triton.cdiv(num_blocks, splits) if splits else 0
        if splits:
            splits = triton.cdiv(num_blocks, blocks_per_split)
    gluon_parts = gluon_splits * decode_gluon.WARPS if gluon_splits else 0  # a partial per warp
    pdl = gluon_pdl(gluon_splits, tuning, device)
    num_parts = gluon_parts + splits + 1  # the Gluon kernel's partials, the Triton kernel's, the residual's
    inputs = _inputs(query, quantized, residual_keys, residual_values, key_padding_mask, key_rotated, length)
    key_norms, mask, key_rotated_or_mask = inputs[4], inputs[10], inputs[11]
    split_args = dict(
        num_kv_heads=kv_heads,
        num_quantized=num_quantized,
        num_sinks=sinks,
        blocks_per_split=blocks_per_split,
        num_splits=splits,
        first_slot=gluon_parts,
        num_parts=num_parts,
        **_strides("q", query, "bhtd"),
        **_strides("kc", quantized.key_codes, "bhrd"),
        **_strides("ks", quantized.key_scale, "bhgd"),
        **_strides("km", quantized.key_min, "bhgd"),
        **_strides("kn", key_norms, "b_t"),
        **_strides("vc", quantized.value_codes, "bhrd"),
        **_strides("vs", quantized.value_scale, "bh__"),
        **_strides("vm", quantized.value_min, "bh__"),
        **_strides("rk", residual_keys, "bhtd"),
        **_strides("rv", residual_values, "bhtd"),
        **_strides("m", mask, "_t"),  # stride_mb per call
        **_strides("kr", key_rotated_or_mask, "bh"),
        GQA=gqa,
        TQ=q_len,
        HEAD_DIM=head_dim,
        LOG2_D=head_dim.bit_length() - 1,
        KEY_BITS=config.key_bits,
        VALUE_BITS=config.value_bits,
        GROUP=config.group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=tuning.residual_block,
        ROTATION=config.rotation,
        KEY_ROTATION_PER_HEAD=key_rotated is not None,
        TOKEN_SCALING=config.token_scaling,
        HAS_MASK=key_padding_mask is not None,
        # with `length`, the tokens read are a multiple of the window R (`num_quantized` is the capacity)
        PARTIAL_BLOCK=(num_quantized if length is None else residual - sinks) % block_n != 0,
        DEVICE_LENGTH=length is not None,
        GLUON_BLOCK=gluon_block,
        LAUNCH_DEPENDENTS=pdl,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        **({"maxnreg": tuning.max_registers} if tuning.max_registers else {}),
    )
    gluon = None
    if gluon_splits:
        gluon = decode_gluon.bind(
            (batch * kv_heads, gluon_splits), quantized, key_norms, mask, length, num_quantized,
            gluon_blocks_per_split, num_parts, rows, config.key_bits, config.value_bits, config.token_scaling,
            key_padding_mask is not None, tuning.gluon_max_registers, tuning.gluon_ptxas_options, pdl, sinks,
        )  # fmt: skip
    merge_slots = min(triton.next_power_of_2(max(num_parts - 1, 1)), max(1, tuning.merge_tile // head_dim))
    merge_args = dict(
        num_kv_heads=kv_heads,
        num_parts=num_parts,
        # the output is a new contiguous [B, Hq, Tq, D]
        stride_ob=q_heads * q_len * head_dim,
        stride_oh=q_len * head_dim,
        stride_ot=head_dim,
        stride_od=1,
        GQA=gqa,
        TQ=q_len,
        HEAD_DIM=head_dim,
        LOG2_D=head_dim.bit_length() - 1,
        ROTATION=config.rotation,
        BLOCK_S=merge_slots,
        WAIT_FOR_PARTIALS=pdl,
        num_warps=triton.cdiv(merge_slots * head_dim, tuning.merge_tile_per_warp),
        launch_pdl=pdl,
    )
    return DecodePlan(
        num_quantized=num_quantized,
        device_length=length is not None,
        tuning=tuning,
        split=BoundKernel(split_kernel, (batch * kv_heads, splits + 1), split_args, _SPLIT_PER_CALL),
        gluon=gluon,
        why_not_gluon=why_not_gluon,
        merge=BoundKernel(merge_kernel, (batch * kv_heads * rows,), merge_args, _MERGE_PER_CALL),
        part_shape=(batch * kv_heads, num_parts, rows, head_dim),
        q_op_shape=(batch * kv_heads, head_dim, block_m) if gluon_splits else (0,),
    )


def gluon_splits_for(
    query, quantized, config, block_m: int, num_quantized: int, tuning: DecodeTuning
) -> tuple[int, str]:
    """Programs per KV head of the Gluon kernel, and why it does not run where that is 0 (the Triton kernel then reads
    every quantized token)."""
    if decode_gluon is None:
        return 0, f"Triton {triton.__version__} predates the Gluon kernel's (3.6)"
    if tuning.gluon_programs_per_sm == 0:
        return 0, "the tuning runs no Gluon kernel (gluon_programs_per_sm=0)"
    full_blocks = num_quantized // decode_gluon.BLOCK.value
    if full_blocks == 0:
        return 0, f"no full {decode_gluon.BLOCK.value}-token block of quantized tokens"
    ok, reason = decode_gluon.supports(query, quantized, config, block_m)
    if not ok:
        return 0, reason
    return gluon_programs_per_head(query.shape[0] * quantized.key_codes.shape[1], full_blocks, tuning, query.device), ""


def gluon_pdl(gluon_splits: int, tuning: DecodeTuning, device: torch.device) -> bool:
    """Whether the Gluon kernel and the merge launch as programmatic dependents of the kernel before them: asked
    only where the Gluon kernel runs; griddepcontrol needs compute capability 9.0 (and a GPU: the CPU tests stand in
    for the Gluon kernel)."""
    return (
        gluon_splits > 0
        and tuning.gluon_pdl
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


def _validate(query, quantized, residual_keys, residual_values, key_padding_mask, config, length) -> int:
    """Check shapes/dtypes/devices; return the number of quantized tokens (with `length`, the storage's capacity)."""
    if query.dim() != 4:
        raise ValueError(f"decode_attention_triton: query must be [B, Hq, Tq, D], got {tuple(query.shape)}.")
    batch, q_heads, q_len, head_dim = query.shape
    if query.dtype not in MODEL_DTYPES:
        raise ValueError(f"decode_attention_triton: query dtype {query.dtype} is not one of {MODEL_DTYPES}.")
    if query.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"decode_attention_triton: tensors must be on a CUDA device, got {query.device}; use "
            "oscar_hf.reference.decode_attention (or the portable path) elsewhere."
        )
    if head_dim not in DECODE_HEAD_DIMS or head_dim % config.group_size:
        raise ValueError(
            f"decode_attention_triton: head_dim={head_dim} is not supported (64, 128 or 256, a multiple of "
            f"group_size={config.group_size}); use the portable attention path for this model."
        )
    if residual_keys.dim() != 4 or residual_keys.shape != residual_values.shape:
        raise ValueError(
            "decode_attention_triton: residual keys/values must both be [B, Hkv, R, D], got "
            f"{tuple(residual_keys.shape)} and {tuple(residual_values.shape)}."
        )
    _, kv_heads, residual, _ = residual_keys.shape
    if residual_keys.shape[0] != batch or residual_keys.shape[3] != head_dim or kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"decode_attention_triton: residual K/V {tuple(residual_keys.shape)} do not match query "
            f"{tuple(query.shape)} (same B and D, Hq a multiple of Hkv)."
        )
    if residual_keys.dtype != query.dtype or residual_values.dtype != query.dtype:
        raise ValueError(
            f"decode_attention_triton: residual K/V dtype ({residual_keys.dtype}, {residual_values.dtype}) must be "
            f"the query dtype {query.dtype}."
        )
    if not 1 <= q_len <= min(residual, DECODE_MAX_QUERY_TOKENS) or q_heads // kv_heads * q_len > DECODE_MAX_QUERY_ROWS:
        raise ValueError(
            f"decode_attention_triton: Tq={q_len} must be in 1..min(R={residual}, {DECODE_MAX_QUERY_TOKENS}) (the "
            f"queries are the last residual tokens) with (Hq / Hkv) * Tq <= {DECODE_MAX_QUERY_ROWS}."
        )
    num_quantized = 0
    if quantized is not None:
        num_quantized = StorageLayout.of(config).check(
            quantized, batch, kv_heads, head_dim, query.device, "decode_attention_triton"
        )
        groups = head_dim // config.group_size  # the kernel reads the value parameters with these constant strides
        for name in ("value_scale", "value_min"):
            if getattr(quantized, name).stride()[2:] != (groups, 1):
                raise ValueError(
                    f"decode_attention_triton: quantized.{name} must be contiguous over its last two dims [L, D / G] "
                    f"(strides ({groups}, 1), as the storage layout allocates them and its token views keep), got "
                    f"{getattr(quantized, name).stride()[2:]}; pass `.contiguous()` storage."
                )
    if length is not None and (length.dtype != torch.int64 or length.numel() != 1 or length.device != query.device):
        raise ValueError(
            "decode_attention_triton: `length` must be a one-element int64 tensor on the query's device (the tokens "
            f"held, this step's included), got {length.dtype} {tuple(length.shape)} on {length.device}."
        )
    if key_padding_mask is not None:
        slots = num_quantized + residual
        # with `length`, over positions: the window's slots follow the tokens quantized so far, up to the capacity
        width_ok = key_padding_mask.shape[-1] == slots if length is None else key_padding_mask.shape[-1] >= slots
        expected = f"[B, L + R] = {(batch, slots)}" if length is None else f"[B, W >= capacity + R = {slots}]"
        if key_padding_mask.dtype != torch.bool or key_padding_mask.dim() != 2 or not width_ok:
            raise ValueError(
                f"decode_attention_triton: key_padding_mask must be bool {expected}, got {key_padding_mask.dtype} "
                f"{tuple(key_padding_mask.shape)}."
            )
        if key_padding_mask.shape[0] != batch:
            raise ValueError(
                f"decode_attention_triton: key_padding_mask has batch {key_padding_mask.shape[0]}, not {batch}."
            )
    return num_quantized
