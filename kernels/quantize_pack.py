"""Fused rotate + token-scale + quantize + pack of post-RoPE keys and values, in the OScaR storage contract.

`quantize_kv_triton(keys, values, config)` computes exactly `oscar_hf.reference.quantize_kv`:

    inputs   keys, values   [B, Hkv, N, D]   bf16 / fp16 / fp32, any strides; N a multiple of G = group_size,
                                             D a power of two that G divides (64, 128, 256)
    outputs  a new contiguous `QuantizedKV` of N tokens in the layout of `oscar_hf.layout.StorageLayout` (its
             `_store_codes` below writes the bits that `StorageLayout.pack_codes` defines), or tokens
             [start, start + N) of a storage's buffers (`out`, `start`): a prefill's blocks go straight to the cache

As in the reference, scale and min are rounded to the scale dtype before the codes are computed, so the codes are
the best ones for the stored parameters; divisions and square roots are IEEE-rounded and the Walsh-Hadamard
butterflies run in the reference's order, so codes differ from the reference only on exact rounding ties of
summation order.

One program per (group of G tokens, batch row) loops over the KV heads twice: first the token norms (a norm
needs every head of the token; under tensor parallelism the caller passes norms over every rank's heads), then,
per head, rotation (fp32 butterflies in registers), scaling, the two kinds of min/max groups, rounding and
packing. The second read of K hits L2 (G * D * Hkv elements per program).
With `finite` (a `[2]` bool device tensor, set by the caller), the kernel clears its first flag where a real token's
K/V are not finite and its second where a stored scale or minimum is not (`oscar_hf.reference.finite_flags`, the
cache's check, which reads them): no extra pass over the K/V, and one flag pair may gather any number of blocks. The
K/V are checked themselves: the min/max skip a NaN (maxNum), which can leave every scale finite.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout
from oscar_hf.reference import check_head_dim

from .common import (
    MODEL_DTYPES,
    add,
    announce_first_launch,
    code_row,
    fwht_rows,
    interpreting,
    maximum,
    minimum,
    on_device,
    word_planes,
    word_tokens,
)


@triton.jit
def _quantize(x, mn, mx, LEVELS: tl.constexpr, SCALE_DTYPE: tl.constexpr):
    """Codes (int32, same shape as x) for groups with min `mn` and max `mx` (broadcast against x).

    Returns (codes, scale, min) with scale/min rounded to SCALE_DTYPE first, as `reference.quantize_groups` does.
    """
    mn = mn.to(SCALE_DTYPE).to(tl.float32)
    scale = tl.div_rn(mx - mn, tl.full(mx.shape, LEVELS, tl.float32)).to(SCALE_DTYPE).to(tl.float32)
    q = tl.where(scale > 0, tl.div_rn(x - mn, tl.where(scale > 0, scale, 1.0)), 0.0)
    q = (q + 12582912.0) - 12582912.0  # round half to even (1.5 * 2**23 trick, exact for |q| < 2**22)
    codes = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.int32)
    return codes, scale.to(SCALE_DTYPE), mn.to(SCALE_DTYPE)


@triton.jit
def _store_codes(codes_ptr, codes, first_token, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Pack [G, D] int32 codes of tokens `first_token ...` (a multiple of G) into the rows of a contiguous [rows, D]
    head at `codes_ptr`, the bits `StorageLayout.pack_codes` defines: with W = `word_tokens(BITS)` tokens a word,
    token r * W + j at bits [j * b, (j + 1) * b) of its plane p (b = BITS, p = 0 where BITS divides the word; else
    b = 1 and p = 0 .. BITS - 1 holds bit p of the code, `word_planes` rows a group)."""
    W: tl.constexpr = word_tokens(BITS)
    PLANES: tl.constexpr = word_planes(BITS)
    B: tl.constexpr = BITS // PLANES  # bits of a token in each word
    grouped = tl.reshape(codes, (G // W, W, D))
    shifts = tl.arange(0, W) * B
    rows = code_row(first_token, BITS) + tl.arange(0, G // W) * PLANES
    o_d = tl.arange(0, D)
    for p in tl.static_range(PLANES):
        plane = (grouped >> p) & ((1 << B) - 1)
        # The shifted codes occupy disjoint bits, so their sum is their bitwise or, without a carry or a signed
        # overflow; a sum, unlike an or, is a reduction that Triton's interpreter runs in numpy.
        tl.store(codes_ptr + (rows + p)[:, None] * D + o_d[None, :], tl.reduce(plane << shifts[None, :, None], 1, add))


@triton.jit
def _all_finite(x):
    """Whether every element of `x` (float32) is finite (NaN != NaN)."""
    return tl.reduce(((x == x) & (tl.abs(x) < float("inf"))).to(tl.int32), None, minimum) > 0


@triton.jit
def _quantize_pack_kernel(
    # pointers
    k_ptr,
    v_ptr,
    key_codes_ptr,
    key_scale_ptr,
    key_min_ptr,
    key_norms_ptr,
    value_codes_ptr,
    value_scale_ptr,
    value_min_ptr,
    length_ptr,
    key_rotated_ptr,
    valid_ptr,
    finite_ptr,
    # sizes
    num_kv_heads,
    valid_len,
    out_start_group,
    # strides of the inputs
    stride_kb,
    stride_kh,
    stride_kt,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vt,
    stride_vd,
    # strides of the (contiguous) outputs, per batch row and per head
    stride_kcodes_b,
    stride_kcodes_h,
    stride_vcodes_b,
    stride_vcodes_h,
    stride_kparam_b,
    stride_kparam_h,
    stride_vparam_b,
    stride_vparam_h,
    stride_norms_b,
    stride_krb,
    stride_krh,
    stride_valid_b,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    LOG2_D: tl.constexpr,
    GROUP: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    ROTATION: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    KEY_ROTATION_PER_HEAD: tl.constexpr,
    NORMS_GIVEN: tl.constexpr,
    HAS_VALID: tl.constexpr,
    FLUSH_WINDOW: tl.constexpr,
    CHECK_FINITE: tl.constexpr,
):
    KEY_LEVELS: tl.constexpr = (1 << KEY_BITS) - 1
    VALUE_LEVELS: tl.constexpr = (1 << VALUE_BITS) - 1
    NUM_VGROUPS: tl.constexpr = HEAD_DIM // GROUP
    SCALE_DTYPE: tl.constexpr = key_scale_ptr.dtype.element_ty

    pid_g = tl.program_id(0).to(tl.int64)
    pid_b = tl.program_id(1).to(tl.int64)
    out_g = pid_g + out_start_group  # the output group: its place in the output (a block, or a storage)
    o_t = pid_g * GROUP + tl.arange(0, GROUP)
    o_t_valid = o_t  # the padding mask's columns: the input's tokens ...
    if FLUSH_WINDOW:
        # Flush: the inputs are a full residual window when the tokens held are a positive multiple of it; they
        # go to tokens [held - FLUSH_WINDOW, held) of the storage. Otherwise there is nothing to do.
        held = tl.load(length_ptr)
        if (held == 0) | (held % FLUSH_WINDOW != 0):
            return
        out_g += (held - FLUSH_WINDOW) // GROUP
        o_t_valid = out_g * GROUP + tl.arange(0, GROUP)  # ... or, flushing, the cache's positions
    o_t_out = out_g * GROUP + tl.arange(0, GROUP)
    o_d = tl.arange(0, HEAD_DIM)
    o_vg = tl.arange(0, NUM_VGROUPS)
    p_k = k_ptr + pid_b * stride_kb + o_t[:, None] * stride_kt + o_d[None, :] * stride_kd
    p_v = v_ptr + pid_b * stride_vb + o_t[:, None] * stride_vt + o_d[None, :] * stride_vd

    # Padding (HAS_VALID): column t of the mask is token t (`o_t_valid`); tokens past its end are real.
    valid = tl.full([GROUP], 1, tl.int1)
    if HAS_VALID:
        valid = tl.load(valid_ptr + pid_b * stride_valid_b + o_t_valid, mask=o_t_valid < valid_len, other=1) != 0
    any_valid = tl.reduce(valid.to(tl.int32), 0, maximum) > 0

    if TOKEN_SCALING:
        if NORMS_GIVEN:  # already in the output (tensor parallel: all-reduced over the ranks' heads)
            norms = tl.load(key_norms_ptr + pid_b * stride_norms_b + o_t_out)
        else:
            sum_sq = tl.full([GROUP], 0.0, tl.float32)
            for h in range(num_kv_heads):
                b_k = tl.load(p_k + h * stride_kh).to(tl.float32)
                sum_sq += tl.reduce(b_k * b_k, 1, add)
            norms = tl.sqrt_rn(sum_sq)
            norms = tl.where(norms > 0, norms, 1.0)  # NaN > 0 is False
        norms = tl.where(valid, norms, 1.0)  # padding stores norm 1, whatever it held
        tl.store(key_norms_ptr + pid_b * stride_norms_b + o_t_out, norms)

    inputs_finite = tl.full([], 1, tl.int1)
    params_finite = tl.full([], 1, tl.int1)
    for h in range(num_kv_heads):
        b_k = tl.load(p_k + h * stride_kh).to(tl.float32)
        b_v = tl.load(p_v + h * stride_vh).to(tl.float32)
        if CHECK_FINITE:  # a real token's K/V (padding may hold anything)
            real = valid[:, None]
            inputs_finite &= _all_finite(tl.where(real, b_k, 0.0)) & _all_finite(tl.where(real, b_v, 0.0))
        if ROTATION:
            if KEY_ROTATION_PER_HEAD:  # method="oscar": this (row, head)'s flag
                rotated = tl.load(key_rotated_ptr + pid_b * stride_krb + h * stride_krh) != 0
                b_k = tl.where(rotated, fwht_rows(b_k, GROUP, HEAD_DIM, LOG2_D), b_k)
            else:
                b_k = fwht_rows(b_k, GROUP, HEAD_DIM, LOG2_D)
            b_v = fwht_rows(b_v, GROUP, HEAD_DIM, LOG2_D)
        if TOKEN_SCALING:
            b_k = tl.div_rn(b_k, norms[:, None])

        # keys: per channel, over the real tokens among the G of this program (none: scale 0, min 0)
        k_min = tl.reduce(tl.where(valid[:, None], b_k, float("inf")), 0, minimum)[None, :]
        k_max = tl.reduce(tl.where(valid[:, None], b_k, float("-inf")), 0, maximum)[None, :]
        codes, scale, mn = _quantize(
            b_k, tl.where(any_valid, k_min, 0.0), tl.where(any_valid, k_max, 0.0), KEY_LEVELS, SCALE_DTYPE
        )
        codes = tl.where(valid[:, None], codes, 0)  # padding may hold anything, NaN included: its code is 0
        p_codes = key_codes_ptr + pid_b * stride_kcodes_b + h * stride_kcodes_h
        _store_codes(p_codes, codes, out_g * GROUP, GROUP, HEAD_DIM, KEY_BITS)
        o_kparam = pid_b * stride_kparam_b + h * stride_kparam_h + out_g * HEAD_DIM + o_d[None, :]
        tl.store(key_scale_ptr + o_kparam, scale)
        tl.store(key_min_ptr + o_kparam, mn)
        if CHECK_FINITE:
            params_finite &= _all_finite(scale.to(tl.float32)) & _all_finite(mn.to(tl.float32))

        # values: per token, over groups of G channels (a padding token reads as zeros: scale 0, min 0, codes 0)
        b_v3 = tl.where(tl.reshape(valid, (GROUP, 1, 1)), tl.reshape(b_v, (GROUP, NUM_VGROUPS, GROUP)), 0.0)
        v_min, v_max = tl.reduce(b_v3, 2, minimum)[:, :, None], tl.reduce(b_v3, 2, maximum)[:, :, None]
        codes, scale, mn = _quantize(b_v3, v_min, v_max, VALUE_LEVELS, SCALE_DTYPE)
        codes = tl.reshape(codes, (GROUP, HEAD_DIM))
        p_codes = value_codes_ptr + pid_b * stride_vcodes_b + h * stride_vcodes_h
        _store_codes(p_codes, codes, out_g * GROUP, GROUP, HEAD_DIM, VALUE_BITS)
        o_vparam = pid_b * stride_vparam_b + h * stride_vparam_h + o_t_out[:, None] * NUM_VGROUPS + o_vg[None, :]
        tl.store(value_scale_ptr + o_vparam, tl.reshape(scale, (GROUP, NUM_VGROUPS)))
        tl.store(value_min_ptr + o_vparam, tl.reshape(mn, (GROUP, NUM_VGROUPS)))
        if CHECK_FINITE:
            params_finite &= _all_finite(scale.to(tl.float32)) & _all_finite(mn.to(tl.float32))

    if CHECK_FINITE:  # only ever cleared: every program writing the same value, no atomics are needed
        tl.store(finite_ptr, 0, mask=inputs_finite == 0)
        tl.store(finite_ptr + 1, 0, mask=params_finite == 0)


def _check_inputs(keys: torch.Tensor, values: torch.Tensor, config: OscarConfig) -> None:
    if keys.dim() != 4 or keys.shape != values.shape:
        raise ValueError(
            f"quantize_kv_triton: keys and values must both be [B, Hkv, N, D], got {tuple(keys.shape)} and "
            f"{tuple(values.shape)}."
        )
    if keys.dtype not in MODEL_DTYPES or values.dtype != keys.dtype:
        raise ValueError(
            f"quantize_kv_triton: keys/values must share one of {MODEL_DTYPES}, got {keys.dtype} and {values.dtype}."
        )
    if keys.device != values.device or (keys.device.type != "cuda" and not interpreting()):
        raise ValueError(
            f"quantize_kv_triton: keys and values must be on one CUDA device (got {keys.device} and "
            f"{values.device}); use oscar_hf.reference.quantize_kv elsewhere."
        )
    head_dim, tokens = keys.shape[-1], keys.shape[-2]
    check_head_dim(head_dim, config)
    if head_dim & (head_dim - 1):
        raise ValueError(
            f"quantize_kv_triton: head_dim={head_dim} is not a power of two; the fused kernels support 64, 128 and "
            "256. Use oscar_hf.reference.quantize_kv for this model."
        )
    if tokens % config.group_size:
        raise ValueError(
            f"quantize_kv_triton: the token count N={tokens} must be a multiple of group_size={config.group_size}."
        )


def quantize_kv_triton(
    keys: torch.Tensor,
    values: torch.Tensor,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    norms: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    *,
    out: QuantizedKV | None = None,
    start: int = 0,
    finite: torch.Tensor | None = None,
) -> QuantizedKV:
    """Rotate, token-scale, quantize and pack post-RoPE keys and values: `reference.quantize_kv` in one kernel.
    `key_rotated`: method="oscar"'s `[B, Hkv]` bool, which heads rotate their keys (None for method="paper").
    `norms`: the token norms `[B, 1, N]` float32 to scale by, instead of the norms over the heads in `keys` (tensor
    parallel: `reference.token_norms(keys, group)` covers the heads of every rank).
    `valid`: `[B, N]` bool, False for the padding of a left-padded batch (as in `reference.quantize_kv`).
    `out`: a storage's buffers (contiguous, as `StorageLayout.empty`) to write tokens `[start, start + N)` of, in
    place (`start` a multiple of group_size); None: a new block. Returns the block written (views into `out`).
    `finite`: `[2]` bool on the K/V's device, cleared where the K/V or the stored parameters are not finite (module
    docstring)."""
    _check_inputs(keys, values, config)
    batch, heads, tokens, head_dim = keys.shape
    who = "quantize_kv_triton"
    check_key_rotated(key_rotated, batch, heads, keys.device, config, who)
    _check_valid(valid, batch, keys.device, who, tokens)
    layout = StorageLayout.of(config)
    if out is None:
        out = layout.empty(batch, heads, head_dim, heads, head_dim, tokens, keys.device)
    else:
        _check_storage(out, layout, keys, start, config, who)
    block = layout.rows(out, start, start + tokens)
    if finite is not None and (finite.shape != (2,) or finite.dtype != torch.bool or finite.device != keys.device):
        raise ValueError(
            f"{who}: finite must be a [2] bool tensor on {keys.device}, got {finite.dtype} {tuple(finite.shape)} on "
            f"{finite.device}."
        )
    if norms is not None:
        if block.key_norms is None:
            raise ValueError(f"{who}: norms were given, but token scaling is off.")
        if norms.shape != block.key_norms.shape or norms.dtype != torch.float32 or norms.device != keys.device:
            raise ValueError(
                f"{who}: norms must be float32 {tuple(block.key_norms.shape)} on {keys.device}, got "
                f"{norms.dtype} {tuple(norms.shape)} on {norms.device}."
            )
        block.key_norms.copy_(norms)  # the kernel reads them from its output
    _launch(keys, values, out, config, None, key_rotated, norms is not None, valid, start, finite)
    return block


def flush_residual_triton(
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    storage: QuantizedKV,
    length: torch.Tensor,
    config: OscarConfig,
    padding_mask: torch.Tensor | None = None,
    key_rotated: torch.Tensor | None = None,
) -> None:
    """A compiled decode step's flush, decided on the device: when `length` (a one-element integer tensor, the
    tokens held) is a positive multiple of the residual window, quantize the full window `residual_keys/values`
    (`[B, Hkv, R, D]`) into tokens `[length - R, length)` of `storage`, as `quantize_kv_triton` would; otherwise
    write nothing. One launch either way and no host synchronisation, so a CUDA graph can replay it every step.
    `padding_mask`: `[B, P]` bool over the cache's first P positions, False for padding (later ones are real).
    `key_rotated`: method="oscar"'s `[B, Hkv]` bool, as for `quantize_kv_triton` (None for method="paper")."""
    _check_inputs(residual_keys, residual_values, config)
    batch, heads, window, head_dim = residual_keys.shape
    if window != config.residual_length:
        raise ValueError(f"flush_residual_triton: got {window} residual tokens, expected {config.residual_length}.")
    _check_storage(storage, StorageLayout.of(config), residual_keys, 0, config, "flush_residual_triton")
    if length.numel() != 1 or length.dtype not in (torch.int32, torch.int64) or length.device != residual_keys.device:
        raise ValueError(
            f"flush_residual_triton: length must be one integer on {residual_keys.device}, got {length.numel()} "
            f"{length.dtype} on {length.device}."
        )
    check_key_rotated(key_rotated, batch, heads, residual_keys.device, config, "flush_residual_triton")
    _check_valid(padding_mask, batch, residual_keys.device, "flush_residual_triton")
    _launch(residual_keys, residual_values, storage, config, length, key_rotated, valid=padding_mask)


def _check_storage(storage: QuantizedKV, layout: StorageLayout, keys: torch.Tensor, start: int, config, who: str):
    """Storage to write tokens `[start, start + N)` of (N: the keys' tokens; a flush's window lands anywhere in it):
    the layout's fields, contiguous, with room for them."""
    batch, heads, tokens, head_dim = keys.shape
    capacity = layout.check(storage, batch, heads, head_dim, keys.device, who)
    if not all(t is None or t.is_contiguous() for t in storage):
        raise ValueError(f"{who}: the storage tensors must be contiguous (as StorageLayout.empty).")
    if start < 0 or start % config.group_size or start + tokens > capacity:
        raise ValueError(
            f"{who}: tokens [{start}, {start + tokens}) do not fit a storage of {capacity} tokens at a multiple of "
            f"group_size={config.group_size}."
        )


def _check_valid(valid, batch: int, device: torch.device, who: str, tokens: int | None = None) -> None:
    """A padding mask must be bool `[B, tokens]` (any number of positions for a flush) on the K/V's device."""
    if valid is None:
        return
    if (
        valid.dtype != torch.bool
        or valid.dim() != 2
        or valid.shape[0] != batch
        or (tokens is not None and valid.shape[1] != tokens)
        or valid.device != device
    ):
        expected = f"[{batch}, {tokens if tokens is not None else 'positions'}]"
        raise ValueError(
            f"{who}: the padding mask must be bool {expected} on {device}, got {valid.dtype} {tuple(valid.shape)} on "
            f"{valid.device}."
        )


def check_key_rotated(key_rotated, batch: int, heads: int, device: torch.device, config: OscarConfig, who: str):
    """method="oscar" (with rotation) needs its per-head flags, `[B, Hkv]` bool on the K/V's device; method="paper"
    takes none, nor does an unresolved "auto" (the cache resolves it; None rotates every key)."""
    if not (config.rotation and config.method == "oscar"):
        if key_rotated is not None:
            raise ValueError(f"{who}: key_rotated is for method='oscar' with rotation on; this config takes None.")
        return
    if key_rotated is None:
        raise ValueError(f"{who}: method='oscar' needs key_rotated, the [B, Hkv] bool of which heads rotate keys.")
    if key_rotated.dtype != torch.bool or tuple(key_rotated.shape) != (batch, heads) or key_rotated.device != device:
        raise ValueError(
            f"{who}: key_rotated must be bool {(batch, heads)} on {device}, got {key_rotated.dtype} "
            f"{tuple(key_rotated.shape)} on {key_rotated.device}."
        )


def _launch(
    keys,
    values,
    out: QuantizedKV,
    config: OscarConfig,
    length: torch.Tensor | None,
    key_rotated: torch.Tensor | None,
    norms_given: bool = False,
    valid: torch.Tensor | None = None,
    start: int = 0,
    finite: torch.Tensor | None = None,
) -> None:
    """The kernel over every group of `keys`/`values`, into `out` (from token `start`, or where `length` says)."""
    batch, heads, tokens, head_dim = keys.shape
    if tokens == 0 or batch == 0:
        return
    device = keys.device
    if device.type == "cuda":
        announce_first_launch()
    with on_device(device):
        _quantize_pack_kernel[(tokens // config.group_size, batch)](
            keys,
            values,
            out.key_codes,
            out.key_scale,
            out.key_min,
            out.key_norms if out.key_norms is not None else out.key_scale,  # unused pointer without token scaling
            out.value_codes,
            out.value_scale,
            out.value_min,
            length if length is not None else out.key_scale,  # unused pointer outside a flush
            key_rotated.view(torch.uint8) if key_rotated is not None else out.key_scale,  # unused for method="paper"
            valid.view(torch.uint8) if valid is not None else out.key_scale,  # unused without padding
            finite.view(torch.uint8) if finite is not None else out.key_scale,  # unused without a finite check
            heads,
            valid.shape[1] if valid is not None else 0,
            start // config.group_size,
            *keys.stride(),
            *values.stride(),
            out.key_codes.stride(0),
            out.key_codes.stride(1),
            out.value_codes.stride(0),
            out.value_codes.stride(1),
            out.key_scale.stride(0),
            out.key_scale.stride(1),
            out.value_scale.stride(0),
            out.value_scale.stride(1),
            out.key_norms.stride(0) if out.key_norms is not None else 0,
            *(key_rotated.stride() if key_rotated is not None else (0, 0)),
            valid.stride(0) if valid is not None else 0,
            HEAD_DIM=head_dim,
            LOG2_D=head_dim.bit_length() - 1,
            GROUP=config.group_size,
            KEY_BITS=config.key_bits,
            VALUE_BITS=config.value_bits,
            ROTATION=config.rotation,
            TOKEN_SCALING=config.token_scaling,
            KEY_ROTATION_PER_HEAD=key_rotated is not None,
            NORMS_GIVEN=norms_given,
            HAS_VALID=valid is not None,
            FLUSH_WINDOW=config.residual_length if length is not None else 0,
            CHECK_FINITE=finite is not None,
            num_warps=8 if head_dim > 128 else 4,  # D = 256: the [G, D] fp32 tiles over twice the threads
        )
