"""Fused decode attention over the OScaR 2/4-bit KV cache (flash-decoding: split-K + log-sum-exp merge).

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
quantized tokens and length - L residual ones, decided on the device, and `key_padding_mask` is [B, W] over positions
(W >= capacity + R: the residual slot j is position L + j), so nothing on the host depends on how much is held.

Query i (0-based, of Tq) sees every quantized token and residual tokens 0 .. R - Tq + i (the queries are the last
Tq residual tokens). Scores: `(q H . deq(u_t)) * n_t * scaling` for quantized tokens, `q . k_t * scaling` for
residual ones. Nothing proportional to the context is materialised: the split kernel reads the packed codes.

Kernel 1, grid (B * Hkv, S + 1): program (bh, s < S) runs an online softmax over its range of quantized blocks for
all g * Tq query rows of KV head bh (each K/V tile is loaded once and used by the g heads), starting from the
rotated query; its accumulator stays in the values' rotated domain. Program (bh, S) does the same over the residual
tokens in the query dtype. Each writes (acc, m, l) in fp32 to a partial buffer [B * Hkv, parts, g * Tq, (D)].
Where `_gluon_splits` allows (a CUDA GPU, D = 128, 2 bits, fp16 scales, g * Tq <= 8: the usual decode step), the
Gluon kernel (kernels/decode_attention_gluon.py, grid (B * Hkv, S_g)) reads the full 128-token blocks into partials
0 .. S_g - 1, launched after kernel 1, whose one quantized program per KV head then reads only what follows them (a
partial block, or nothing) and writes the query operand the Gluon kernel reads.
Kernel 2, grid (B * Hkv * g * Tq,), merges the quantized partials by log-sum-exp, un-rotates their sum once
(o = o~ H, exact since H is linear: one transform per row instead of one per split program), and adds the residual
partial.

Dequantization in registers: a word holds the codes of tokens j and j + H (H = W / 2) at bits j*b and j*b + 16, so
one shift and one mask turn it into two fp16 `1024 + code` (exact; no int-to-float conversion), and packed fp16
arithmetic subtracts 1024 and applies scale/min two values at a time. The tile's token order is therefore permuted
(column (r * H + j) * 2 + t holds token r * W + t * H + j); softmax is order-free, and norms, V parameters and the
padding mask are read in the same order; key parameters (per channel, per group of G tokens) and value parameters
(per token, per group of G channels) are loaded once per group and broadcast in registers. Dot operands of the
quantized part are fp16 (the default fp16 scales bound every dequantized value; the rotated query is divided by its
max so it cannot overflow), tf32 with fp32 scales; the residual part uses the query dtype; accumulation is fp32.
The design, what limits its speed on H100 and H200 GPUs and what did not pay: docs/kernels.md.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout

from . import DECODE_HEAD_DIMS, DECODE_MAX_QUERY_ROWS, DECODE_MAX_QUERY_TOKENS
from .quantize_pack import _add, _fwht_rows, _maximum, check_key_rotated

# Gluon (Triton's layout-explicit dialect, still `experimental`, its API changing between releases) reads the full
# blocks of the usual decode step with the Triton versions it was built and checked with: 3.6 on the GPUs, 3.9 compiled
# on the CPU. With an older Triton the Triton kernel reads every token.
_gluon = None
if tuple(int(part) for part in triton.__version__.split(".")[:2]) >= (3, 6):
    from . import decode_attention_gluon as _gluon

_MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GLUON_BLOCK = 128  # tokens per step of the Gluon kernel: it reads the quantized region's full blocks of this size
_LOG2E = 1.4426950408889634
# Triton's CPU interpreter (the CPU CI): it multiplies raw bf16 bit patterns in tl.dot (3.9), so dot operands are
# upcast there, and it cannot run PTX, so codes are unpacked there with the integer ops the PTX below performs.
_INTERPRETER: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def _unpack_codes_t(words_t, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr):
    """[D, ROWS] int32 words -> [D, ROWS * W] fp16 codes; column (r * H + j) * 2 + t is token r * W + t * H + j."""
    W: tl.constexpr = 32 // BITS
    H: tl.constexpr = W // 2
    MASK: tl.constexpr = ((1 << BITS) - 1) * 0x10001
    shifts = tl.arange(0, H) * BITS
    if _INTERPRETER:
        x = ((words_t[:, :, None] >> shifts[None, None, :]) & MASK) | 0x64006400  # two fp16 (1024 + code)
        lo = x.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:  # the same in PTX (lop3 0xea: (a & b) | c), the register handed out as its two fp16 halves, which saves
        # the 16-bit shuffles Triton emits to split and re-pair them (H200: 2-3 % of the kernel; test_unpack_codes_order
        # checks this path against the storage layout's unpacker on the GPU)
        lo, hi = tl.inline_asm_elementwise(
            f"{{ .reg .b32 t; shr.u32 t, $2, $3; lop3.b32 t, t, {MASK}, 0x64006400, 0xea; mov.b32 {{$0, $1}}, t; }}",
            "=h,=h,r,r",
            [words_t[:, :, None], shifts[None, None, :]],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    return tl.reshape(tl.join(lo, hi), (HEAD_DIM, ROWS * W)) - 1024.0


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    if _INTERPRETER:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _online_softmax_step(s, m_i, l_i):
    """One online-softmax update for base-2 scores s [M, N] (-inf = masked); rows may be fully masked."""
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _maximum))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + tl.reduce(p, 1, _add)


@triton.jit
def _quantized_block(
    acc,
    m_i,
    l_i,
    b_q,
    qk_scale,
    p_kw,
    p_ks,
    p_km,
    p_kn,
    p_vw,
    p_vs,
    p_vm,
    p_mask,
    tokens_left,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One BLOCK_N-token step of the online softmax over quantized tokens, from tile pointers; MASKED: the last,
    partial block (tokens_left < BLOCK_N valid tokens)."""
    W: tl.constexpr = 32 // BITS
    H: tl.constexpr = W // 2
    ROWS: tl.constexpr = BLOCK_N // W
    SCALE_DTYPE: tl.constexpr = p_ks.dtype.element_ty
    DOT_DTYPE: tl.constexpr = b_q.dtype
    o_c = tl.arange(0, BLOCK_N)
    if MASKED:
        m_w = (tl.arange(0, ROWS) * W < tokens_left)[None, :]
        m_t = ((o_c // W) * W + (o_c % 2) * H + (o_c % W) // 2) < tokens_left
    else:  # constant masks: folded away by the compiler
        m_w = tl.full([1, ROWS], True, tl.int1)
        m_t = tl.full([BLOCK_N], True, tl.int1)
    m_c = m_t[None, :]

    NKG: tl.constexpr = BLOCK_N // GROUP if BLOCK_N >= GROUP else 1  # key groups per tile
    GK: tl.constexpr = BLOCK_N // NKG  # tile columns per key group
    NVG: tl.constexpr = HEAD_DIM // GROUP  # value groups per token
    m_kg = (tl.arange(0, NKG) * GK < tokens_left)[None, :, None]
    b_ks = tl.load(p_ks, mask=m_kg, other=0.0)
    b_km = tl.load(p_km, mask=m_kg, other=0.0)
    b_kt = _unpack_codes_t(tl.load(p_kw, mask=m_w, other=0), HEAD_DIM, ROWS, BITS).to(SCALE_DTYPE)
    b_kt = tl.reshape(tl.reshape(b_kt, (HEAD_DIM, NKG, GK)) * b_ks + b_km, (HEAD_DIM, BLOCK_N))
    s = _dot(b_q, b_kt.to(DOT_DTYPE), "tf32") * qk_scale
    if TOKEN_SCALING:
        s *= tl.load(p_kn, mask=m_t, other=1.0)[None, :]
    if HAS_MASK:
        s = tl.where((tl.load(p_mask, mask=m_t, other=0) != 0)[None, :], s, float("-inf"))
    elif MASKED:
        s = tl.where(m_c, s, float("-inf"))
    p, alpha, m_i, l_i = _online_softmax_step(s, m_i, l_i)

    b_vs = tl.load(p_vs, mask=m_c[None, :, :], other=0.0)
    b_vm = tl.load(p_vm, mask=m_c[None, :, :], other=0.0)
    b_vt = _unpack_codes_t(tl.load(p_vw, mask=m_w, other=0), HEAD_DIM, ROWS, BITS).to(SCALE_DTYPE)
    b_vt = tl.reshape(tl.reshape(b_vt, (NVG, GROUP, BLOCK_N)) * b_vs + b_vm, (HEAD_DIM, BLOCK_N))
    acc = acc * alpha[:, None] + _dot(p.to(DOT_DTYPE), tl.trans(b_vt.to(DOT_DTYPE)), "tf32")
    return acc, m_i, l_i


@triton.jit
def _query_operand(
    q,
    key_rotated,
    qk_scale,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_D: tl.constexpr,
    ROTATION: tl.constexpr,
    KEY_ROTATION_PER_HEAD: tl.constexpr,
):
    """The query rows as the quantized blocks' first dot operand, and the score scale that goes with it: rotated into
    the keys' stored domain, divided by their largest magnitude so that fp16 operands cannot overflow.
    `key_rotated`: with KEY_ROTATION_PER_HEAD (method="oscar"), whether this head's keys are stored rotated."""
    q = q.to(tl.float32)
    if ROTATION:  # (q H) . (k H) = q . k: the query meets the keys in their stored domain
        # method="oscar" selects the query per head: one transform in the prologue. (With the masked last-block step
        # compiled in as well, Triton 3.6 duplicated the selected query's operand conversion and re-read it from shared
        # memory every step; that step is compiled only for partial blocks now, `PARTIAL_BLOCK`, and the usual kernel's
        # loop counts as the paper kernel's, `count_sass.py --per-head`.)
        q_rotated = _fwht_rows(q, BLOCK_M, HEAD_DIM, LOG2_D)
        q = tl.where(key_rotated, q_rotated, q) if KEY_ROTATION_PER_HEAD else q_rotated
    q_max = tl.reduce(tl.reduce(tl.abs(q), 1, _maximum), 0, _maximum)
    q_max = tl.where(q_max > 0, q_max, 1.0)
    return (q / q_max).to(DOT_DTYPE), qk_scale * q_max


@triton.jit
def _any_masked(mask_ptr, start, end, stride_mt, CHUNK: tl.constexpr):
    """Whether the key padding mask excludes any of tokens [start, end)."""
    found = 0
    for chunk in range(start, end, CHUNK):
        o_t = chunk + tl.arange(0, CHUNK)
        excluded = tl.load(mask_ptr + o_t * stride_mt, mask=o_t < end, other=1) == 0
        found = tl.maximum(found, tl.max(excluded.to(tl.int32), 0))
    return found != 0


@triton.jit
def _quantized_blocks(
    b_q,
    qk_scale,
    kc_ptr,
    ks_ptr,
    km_ptr,
    kn_ptr,
    vc_ptr,
    vs_ptr,
    vm_ptr,
    mask_ptr,
    block_lo,
    block_hi,
    num_quantized,
    stride_kcr,
    stride_kcd,
    stride_ksg,
    stride_ksd,
    stride_kmg,
    stride_kmd,
    stride_knt,
    stride_vcr,
    stride_vcd,
    stride_mt,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PARTIAL_BLOCK: tl.constexpr,
):
    """Online softmax over quantized blocks [block_lo, block_hi) from the query operand `b_q` (`_query_operand`);
    returns (acc, m, l), acc in the values' stored (rotated, with ROTATION) domain: the merge kernel un-rotates the sum
    of the splits. HAS_MASK: whether a step applies the key padding mask.
    PARTIAL_BLOCK: whether the last block may be partial (the number of quantized tokens is not a multiple of BLOCK_N).
    The cache's is a multiple of its residual length, so a kernel without the masked step is the usual one: it needs
    fewer registers (counted with Triton 3.6 for sm_90, D=128, 4 warps, 128-token steps: 56 bytes of spills per thread
    instead of 272)."""
    W: tl.constexpr = 32 // BITS
    H: tl.constexpr = W // 2
    ROWS: tl.constexpr = BLOCK_N // W
    # offsets inside a block (loop-invariant); column c of a tile holds token (c // W) * W + (c % 2) * H + (c % W) // 2
    o_d = tl.arange(0, HEAD_DIM)[:, None]
    o_c = tl.arange(0, BLOCK_N)
    tok = (o_c // W) * W + (o_c % 2) * H + (o_c % W) // 2
    o_w = tl.arange(0, ROWS)[None, :]
    off_kw = o_w * stride_kcr + o_d * stride_kcd
    off_vw = o_w * stride_vcr + o_d * stride_vcd
    NKG: tl.constexpr = BLOCK_N // GROUP if BLOCK_N >= GROUP else 1  # key groups per tile (columns c // GROUP)
    o_kg = tl.arange(0, NKG)[None, :, None]
    NVG: tl.constexpr = HEAD_DIM // GROUP  # value groups per token
    o_vg = tl.arange(0, NVG)[:, None, None]
    off_ks = o_kg * stride_ksg + o_d[:, :, None] * stride_ksd  # [D, NKG, 1]
    off_km = o_kg * stride_kmg + o_d[:, :, None] * stride_kmd
    # value parameters: [tokens, D / GROUP] contiguous (`_validate`); the constant strides let each thread load a
    # token's groups as one vector, which Triton then pipelines with the codes (cp.async) instead of issuing 16-bit
    # gathers whose latency every step waited for
    off_vparams = tok[None, None, :] * NVG + o_vg  # [D / GROUP, 1, BLOCK_N]
    off_kn = tok * stride_knt
    off_mask = tok * stride_mt

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    # past the full blocks, within [block_lo, block_hi): a split may be empty (with a device length, those past it)
    full_hi = tl.maximum(block_lo, tl.minimum(block_hi, num_quantized // BLOCK_N))
    for block in range(block_lo, full_hi):
        t0 = block * BLOCK_N
        acc, m_i, l_i = _quantized_block(
            acc, m_i, l_i, b_q, qk_scale,
            kc_ptr + (t0 // W) * stride_kcr + off_kw,
            ks_ptr + (t0 // GROUP) * stride_ksg + off_ks,
            km_ptr + (t0 // GROUP) * stride_kmg + off_km,
            kn_ptr + t0 * stride_knt + off_kn,
            vc_ptr + (t0 // W) * stride_vcr + off_vw,
            vs_ptr + t0 * NVG + off_vparams,
            vm_ptr + t0 * NVG + off_vparams,
            mask_ptr + t0 * stride_mt + off_mask,
            BLOCK_N, HEAD_DIM, BITS, GROUP, BLOCK_N, TOKEN_SCALING, HAS_MASK, False,
        )  # fmt: skip
    if PARTIAL_BLOCK and full_hi < block_hi:  # the last block of the cache is partial
        t0 = full_hi * BLOCK_N
        acc, m_i, l_i = _quantized_block(
            acc, m_i, l_i, b_q, qk_scale,
            kc_ptr + (t0 // W) * stride_kcr + off_kw,
            ks_ptr + (t0 // GROUP) * stride_ksg + off_ks,
            km_ptr + (t0 // GROUP) * stride_kmg + off_km,
            kn_ptr + t0 * stride_knt + off_kn,
            vc_ptr + (t0 // W) * stride_vcr + off_vw,
            vs_ptr + t0 * NVG + off_vparams,
            vm_ptr + t0 * NVG + off_vparams,
            mask_ptr + t0 * stride_mt + off_mask,
            num_quantized - t0, HEAD_DIM, BITS, GROUP, BLOCK_N, TOKEN_SCALING, HAS_MASK, True,
        )  # fmt: skip
    return acc, m_i, l_i


@triton.jit
def _residual_part(
    q,
    rk_ptr,
    rv_ptr,
    mask_ptr,
    num_residual,
    qk_scale,
    stride_rkt,
    stride_rkd,
    stride_rvt,
    stride_rvd,
    stride_mt,
    TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    """Online softmax of the query rows over the full-precision residual tokens, causal for the last TQ."""
    PRECISION: tl.constexpr = "ieee" if rk_ptr.dtype.element_ty == tl.float32 else "tf32"
    o_d = tl.arange(0, HEAD_DIM)
    last = num_residual - TQ + tl.arange(0, BLOCK_M) % TQ  # last residual index each row may see
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
    for start in range(0, num_residual, BLOCK_R):
        o_j = start + tl.arange(0, BLOCK_R)
        m_j = o_j < num_residual
        b_k = tl.load(rk_ptr + o_j[:, None] * stride_rkt + o_d[None, :] * stride_rkd, mask=m_j[:, None], other=0.0)
        s = _dot(q, tl.trans(b_k), PRECISION) * qk_scale
        m_s = m_j
        if HAS_MASK:
            m_s &= tl.load(mask_ptr + o_j * stride_mt, mask=m_j, other=0) != 0
        s = tl.where(m_s[None, :] & (o_j[None, :] <= last[:, None]), s, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax_step(s, m_i, l_i)
        b_v = tl.load(rv_ptr + o_j[:, None] * stride_rvt + o_d[None, :] * stride_rvd, mask=m_j[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(b_v.dtype), b_v, PRECISION)
    return acc, m_i, l_i


@triton.jit(
    do_not_specialize=["num_quantized", "num_residual", "blocks_per_split", "num_splits", "first_slot", "num_parts"]
)
def _split_kernel(
    # pointers
    q_ptr,
    kc_ptr,
    ks_ptr,
    km_ptr,
    kn_ptr,
    vc_ptr,
    vs_ptr,
    vm_ptr,
    rk_ptr,
    rv_ptr,
    mask_ptr,
    key_rotated_ptr,
    length_ptr,
    part_o_ptr,
    part_ml_ptr,
    q_op_ptr,
    q_scale_ptr,
    # sizes
    num_kv_heads,
    num_quantized,
    num_residual,
    blocks_per_split,
    num_splits,
    first_slot,
    num_parts,
    qk_scale,
    # strides
    stride_qb,
    stride_qh,
    stride_qt,
    stride_qd,
    stride_kcb,
    stride_kch,
    stride_kcr,
    stride_kcd,
    stride_ksb,
    stride_ksh,
    stride_ksg,
    stride_ksd,
    stride_kmb,
    stride_kmh,
    stride_kmg,
    stride_kmd,
    stride_knb,
    stride_knt,
    stride_vcb,
    stride_vch,
    stride_vcr,
    stride_vcd,
    stride_vsb,
    stride_vsh,
    stride_vmb,
    stride_vmh,
    stride_rkb,
    stride_rkh,
    stride_rkt,
    stride_rkd,
    stride_rvb,
    stride_rvh,
    stride_rvt,
    stride_rvd,
    stride_mb,
    stride_mt,
    stride_krb,
    stride_krh,
    # meta-parameters
    GQA: tl.constexpr,
    TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_D: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROTATION: tl.constexpr,
    KEY_ROTATION_PER_HEAD: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PARTIAL_BLOCK: tl.constexpr,
    DEVICE_LENGTH: tl.constexpr,
    GLUON_BLOCK: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Program (bh, s < num_splits) reads quantized blocks of KV head bh, program (bh, num_splits) its residual
    window; each writes partial slot first_slot + s of num_parts. With GLUON_BLOCK, `_gluon_split_kernel` reads the
    full GLUON_BLOCK-token blocks (slots 0 .. first_slot - 1): the quantized program reads only what follows them (a
    partial block, or nothing) and writes the query operand and score scale that kernel reads. LAUNCH_DEPENDENTS: that
    kernel is a programmatic dependent, launched as this one starts (it waits for this one's output)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    ROWS_USED: tl.constexpr = GQA * TQ
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    h = pid_bh % num_kv_heads
    if DEVICE_LENGTH:  # the storage's capacity and the window R came in; the tokens held decide what is read
        held = tl.load(length_ptr)
        num_quantized = (held - 1) // num_residual * num_residual
        num_residual = held - num_quantized

    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < ROWS_USED
    o_d = tl.arange(0, HEAD_DIM)
    p_q = q_ptr + b * stride_qb + (h * GQA + o_m // TQ) * stride_qh + (o_m % TQ) * stride_qt
    q = tl.load(p_q[:, None] + o_d[None, :] * stride_qd, mask=m_m[:, None], other=0.0)

    if pid_s == num_splits:
        acc, m_i, l_i = _residual_part(
            q,
            rk_ptr + b * stride_rkb + h * stride_rkh,
            rv_ptr + b * stride_rvb + h * stride_rvh,
            mask_ptr + b * stride_mb + num_quantized * stride_mt,
            num_residual,
            qk_scale,
            stride_rkt,
            stride_rkd,
            stride_rvt,
            stride_rvd,
            stride_mt,
            TQ,
            HEAD_DIM,
            BLOCK_M,
            BLOCK_R,
            HAS_MASK,
        )
    else:
        block_lo = pid_s * blocks_per_split
        if GLUON_BLOCK:
            block_lo += num_quantized // GLUON_BLOCK * (GLUON_BLOCK // BLOCK_N)
        block_hi = tl.minimum(block_lo + blocks_per_split, (num_quantized + BLOCK_N - 1) // BLOCK_N)
        key_rotated = False
        if KEY_ROTATION_PER_HEAD:
            key_rotated = tl.load(key_rotated_ptr + b * stride_krb + h * stride_krh) != 0
        b_q, q_scale = _query_operand(
            q, key_rotated, qk_scale, ks_ptr.dtype.element_ty, BLOCK_M, HEAD_DIM, LOG2_D, ROTATION,
            KEY_ROTATION_PER_HEAD,
        )  # fmt: skip
        if GLUON_BLOCK:  # [D, BLOCK_M] per KV head, as the Gluon kernel loads its second MMA operand
            tl.store(q_op_ptr + pid_bh * HEAD_DIM * BLOCK_M + o_d[None, :] * BLOCK_M + o_m[:, None], b_q)
            tl.store(q_scale_ptr + pid_bh, q_scale)
        p_mask = mask_ptr + b * stride_mb
        args = (
            b_q, q_scale, kc_ptr + b * stride_kcb + h * stride_kch, ks_ptr + b * stride_ksb + h * stride_ksh,
            km_ptr + b * stride_kmb + h * stride_kmh, kn_ptr + b * stride_knb, vc_ptr + b * stride_vcb + h * stride_vch,
            vs_ptr + b * stride_vsb + h * stride_vsh, vm_ptr + b * stride_vmb + h * stride_vmh, p_mask, block_lo,
            block_hi, num_quantized, stride_kcr, stride_kcd, stride_ksg, stride_ksd, stride_kmg, stride_kmd, stride_knt,
            stride_vcr, stride_vcd, stride_mt,
        )  # fmt: skip
        masked = False
        if HAS_MASK:
            # Programs whose tokens are all unmasked (all but those over a left-padded prefix, and every one of a
            # compiled step without padding) run the loop without the per-step mask gather (Triton 3.6, D=128: 1300
            # instead of 1332 instructions per step with 8-row query tiles, 1382 instead of 1462 with 16).
            last = tl.minimum(block_hi * BLOCK_N, num_quantized)
            masked = _any_masked(p_mask, block_lo * BLOCK_N, last, stride_mt, 8 * BLOCK_N)
        if masked:
            acc, m_i, l_i = _quantized_blocks(
                *args, HEAD_DIM, BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, True, PARTIAL_BLOCK
            )
        else:
            acc, m_i, l_i = _quantized_blocks(
                *args, HEAD_DIM, BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, False, PARTIAL_BLOCK
            )

    # partials: part_o [B * Hkv, num_parts, GQA * TQ, D], part_ml [B * Hkv, num_parts, GQA * TQ, 2] (m, l), fp32
    o_part = (pid_bh * num_parts + first_slot + pid_s) * ROWS_USED + o_m
    tl.store(part_o_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], acc, mask=m_m[:, None])
    tl.store(part_ml_ptr + o_part * 2, m_i, mask=m_m)
    tl.store(part_ml_ptr + o_part * 2 + 1, l_i, mask=m_m)


@triton.jit(do_not_specialize=["num_parts"])
def _merge_kernel(
    # pointers
    part_o_ptr,
    part_ml_ptr,
    out_ptr,
    # sizes
    num_kv_heads,
    num_parts,
    # strides
    stride_ob,
    stride_oh,
    stride_ot,
    stride_od,
    # meta-parameters
    GQA: tl.constexpr,
    TQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_D: tl.constexpr,
    ROTATION: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WAIT_FOR_PARTIALS: tl.constexpr,
):
    if WAIT_FOR_PARTIALS:  # launched as a programmatic dependent of the kernel that writes the partials
        tl.extra.cuda.gdc_wait()
    ROWS_USED: tl.constexpr = GQA * TQ
    pid = tl.program_id(0).to(tl.int64)  # (b * Hkv + h) * GQA * TQ + row
    bh = pid // ROWS_USED
    row = pid % ROWS_USED
    o_d = tl.arange(0, HEAD_DIM)
    p_ml = part_ml_ptr + (bh * num_parts * ROWS_USED + row) * 2
    num_splits = num_parts - 1  # the quantized partials; the last one is the residual program's
    # the residual program's partial (in the values' original domain), loaded first: its loads travel with the loop's
    m_r = tl.load(p_ml + num_splits * ROWS_USED * 2)
    l_r = tl.load(p_ml + num_splits * ROWS_USED * 2 + 1)
    o_r = tl.load(part_o_ptr + ((bh * num_parts + num_splits) * ROWS_USED + row) * HEAD_DIM + o_d)

    # Online over tiles of BLOCK_S quantized partials: each step loads a tile's m, l and o together (one round trip to
    # memory; BLOCK_S covers all partials up to `_Tuning.merge_tile`), weighs it against the running maximum (the
    # residual's to start with) and adds its weighted sum to one running [D] row, in the values' stored domain.
    # Empty partials (m = -inf, l = 0) add nothing.
    m_i = m_r
    l_q = tl.full([], 0.0, tl.float32)
    acc_q = tl.full([HEAD_DIM], 0.0, tl.float32)
    for start in range(0, num_splits, BLOCK_S):
        o_s = start + tl.arange(0, BLOCK_S)
        valid = o_s < num_splits
        part_m = tl.load(p_ml + o_s * ROWS_USED * 2, mask=valid, other=float("-inf"))
        part_l = tl.load(p_ml + o_s * ROWS_USED * 2 + 1, mask=valid, other=0.0)
        p_o = part_o_ptr + ((bh * num_parts + o_s) * ROWS_USED + row)[:, None] * HEAD_DIM + o_d[None, :]
        part_o = tl.load(p_o, mask=valid[:, None], other=0.0)
        m_new = tl.maximum(m_i, tl.reduce(part_m, 0, _maximum))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m_i - m_use), tl.exp2(part_m - m_use)
        l_q = l_q * alpha + tl.reduce(part_l * beta, 0, _add)
        acc_q = acc_q * alpha + tl.reduce(part_o * beta[:, None], 0, _add)
        m_i = m_new

    if ROTATION:
        acc_q = tl.reshape(_fwht_rows(tl.reshape(acc_q, (1, HEAD_DIM)), 1, HEAD_DIM, LOG2_D), (HEAD_DIM,))
    weight_r = tl.exp2(m_r - tl.where(m_i == float("-inf"), 0.0, m_i))
    l_all = l_q + l_r * weight_r
    out = (acc_q + o_r * weight_r) / tl.where(l_all > 0, l_all, 1.0)

    b = bh // num_kv_heads
    head = (bh % num_kv_heads) * GQA + row // TQ
    p_out = out_ptr + b * stride_ob + head * stride_oh + (row % TQ) * stride_ot + o_d * stride_od
    tl.store(p_out, out.to(out_ptr.dtype.element_ty))


def _interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors through its interpreter (TRITON_INTERPRET=1, the CPU CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _num_sms(device: torch.device) -> int:
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True)
class _Tuning:
    """Launch choices of the split kernel; `_default_tuning` picks them, the benchmark sweeps them."""

    block_n: int  # quantized tokens per inner step (a multiple of 16)
    num_warps: int
    block_m: int  # query rows of a program's tiles, at least (the rows a KV head reads, rounded up to a power of 2)
    programs_per_sm: int  # splits are sized to launch about this many programs per SM ...
    programs_per_sm_few_heads: int  # ... this many when B * Hkv < SMs / 4 (one wave: shorter merge, fewer partials)
    min_blocks_per_split: int = 4  # ... but no split gets fewer blocks than this ...
    min_blocks_per_split_few_heads: int = 1  # ... or than this with few heads (short contexts: one block per program)
    num_stages: int = 3
    max_registers: int | None = None  # ptxas register cap per thread (None: the compiler's choice)
    residual_block: int = 32  # residual tokens per step of the program that reads the residual window
    # The merge kernel reads partial outputs ([partials, D], fp32) in tiles of up to `merge_tile` elements, over one
    # warp per `merge_tile_per_warp`. Its latency after the last partial is the decode's tail: H200, 8b1efdd, B=8 32K
    # (17 partials, one 32-slot tile, one warp) / B=1 32K (133 partials, 128-slot tiles, four warps), us: 78.3 / 17.8,
    # against 80.2 with four warps / 21.0 with two, and 81.9 / 23.2 with a running state per slot (3d4d3de)
    merge_tile: int = 16384
    merge_tile_per_warp: int = 4096
    gluon_programs_per_sm: int = 0  # where `_gluon_splits` allows the Gluon kernel: its programs per SM (0: never)
    gluon_max_registers: int | None = None  # ptxas register cap of the Gluon kernel (None: the compiler's choice)
    # ptxas options of the Gluon kernel. Its most aggressive register-usage level schedules the loop with as many
    # registers as at the default level (232, Triton 3.9) and 11 fewer instructions per step; H200 sweep
    # B=8 32K / B=1 32K / B=8 128K, us: 81.6 / 17.7 / 310.0 against
    # 82.0 / 17.8 / 313.7 with Triton's options (the default level 5)
    gluon_ptxas_options: str | None = "--register-usage-level 10"
    # Hopper and newer: the Gluon and merge kernels are launched as programmatic dependents (they start while the
    # kernel before them runs, and wait for it where they read its output)
    gluon_pdl: bool = True


# Up to this many quantized tokens with few KV heads (`_few_heads`), D=128 keeps the 4-warp programs of 128-token
# steps: H200, B=1 at 4K, 11.6 us against 13.0-13.7 for the 2-warp programs (at 32K they are as fast: 36.2 vs 35.2).
_SHORT_CONTEXT = 8192


def _default_tuning(head_dim: int, rows: int, scale_dtype: torch.dtype, short_few_heads: bool = False) -> _Tuning:
    """Launch choices by head dim, query rows per KV head and scale dtype, measured on an H200 with 4 query rows per KV
    head (`bench_decode_attention.py --sweep [--head-dim] [--variants]`, graph medians, B=8 and B=1 at 32K;
    docs/kernels.md).

    Up to 16 query rows with fp16 scales (the usual decode step): 64-token steps over one warp per 64 channels. The
    kernel is latency-bound at two or three warps per scheduler (its registers allow no more), and the warps of one
    program wait for each other at every cross-warp reduction and layout conversion of a step; programs of fewer warps
    keep as many warps per SM, independent of each other. B=8 at 32K, against the 4- and 8-warp programs before: D=64
    104 vs 154 us (one warp), D=128 228 vs 256 us (two warps), D=256 492 vs 797 us (four warps); B=1 at 32K: 21.1 vs
    23.6, 35.2 vs 36.2 and 72.5 vs 114 us. Splits are sized for 32 / 12 / 8 programs per SM (2x / 1.5x / 1x the warps
    of the earlier 8 programs of 4 warps; D=128 with 16: 236 us), and with few KV heads (B * Hkv < SMs / 4) for 8 / 4
    / 2, where a split may hold a single block (B=1 at 4K: 12.3 vs 16.7 us with at least 4, measured with the 4-warp
    programs). At D=128 a split holds at least 8 blocks otherwise: where the KV heads fill the SMs at short contexts,
    fewer and longer programs fit in fewer waves (B=8 4K 33.0 vs 37.7 us with at least 4, B=8 8K 67.8 vs 77.2, B=16 4K
    67.3 vs 80.8; no change from 32K, where splits hold more than 8 blocks anyway).

    More query rows (speculative steps, wide GQA) or fp32 scales (tf32 operands) keep the choices measured before:
    64-token steps (32 at D=256, and with fp32 scales) over 4 warps (8 at D=256 or above 32 rows). The residual
    program steps over 32 tokens: its tile counts towards the kernel's registers (D=128, 4-warp programs: 254 and no
    spills, 255 and spills with 64; B=8 32K 256 vs 270 us). `short_few_heads`: at most `_SHORT_CONTEXT` quantized
    tokens over few KV heads.

    Query tiles on that path: 8 rows where a KV head reads at most 8 (16 before: Llama's GQA 4 fills 4 of them, and
    the query transform, scores, softmax and accumulator ran on all 16; H200 B=8 32K 176.4 vs 190.7 us, B=1 32K 28.3
    vs 30.3). At D=128 the Gluon kernel reads the full 128-token blocks there (`_gluon_splits`), one wave of 4
    two-warp programs per SM (H200, e16f497, same run, B=8 32K / 128K / B=1 32K / 128K / B=32 32K, us: 84.7 / 319.2
    / 18.5 / 47.6 / 325.7; 8 per SM in two waves 85.9 / 321.2 / 24.4 / 52.9 / 324.5; 3 per SM 108.2 / 394.7 / 22.0 /
    57.6 / 584.3; 5 under a 200-register cap 116.9 / 427.5 / 19.4 / 63.7 / 342.4; without programmatic dependent
    launch 86.5 / 322.4 / 20.6 / 50.4 / 324.0; the Triton kernel alone 178.5 / 742.7 / 28.4 / - / 676.6 at e66e27f)."""
    if rows <= 16 and scale_dtype != torch.float32 and head_dim in DECODE_HEAD_DIMS:
        if short_few_heads and head_dim == 128:
            return _Tuning(block_n=128, num_warps=4, block_m=8, programs_per_sm=8, programs_per_sm_few_heads=2)
        warps = head_dim // 64
        return _Tuning(
            block_n=64,
            num_warps=warps,
            block_m=8,
            programs_per_sm={64: 32, 128: 12, 256: 8}[head_dim],
            programs_per_sm_few_heads=8 // warps,
            min_blocks_per_split=8 if head_dim == 128 else 4,
            gluon_programs_per_sm=4,
        )
    return _Tuning(
        block_n=32 if scale_dtype == torch.float32 or head_dim > 128 else 64,
        num_warps=8 if head_dim > 128 or rows > 32 else 4,
        block_m=16,
        programs_per_sm=8,
        programs_per_sm_few_heads=2,
    )


def _num_splits(batch_heads: int, num_blocks: int, device: torch.device, tuning: _Tuning, few_heads: bool) -> int:
    """Splits of the quantized blocks of each KV head (0 without quantized blocks); `few_heads`: `_few_heads`.

    Under the interpreter: as if there were 4 SMs, one block per split (tests then cross split boundaries).
    """
    if num_blocks == 0:
        return 0
    if device.type != "cuda":  # the interpreter: 4 SMs, one block per split
        return max(1, min(math.ceil(tuning.programs_per_sm * 4 / batch_heads), num_blocks))
    if few_heads:
        per_sm, min_blocks = tuning.programs_per_sm_few_heads, tuning.min_blocks_per_split_few_heads
    else:
        per_sm, min_blocks = tuning.programs_per_sm, tuning.min_blocks_per_split
    return max(1, min(math.ceil(per_sm * _num_sms(device) / batch_heads), num_blocks // min_blocks))


def _gluon_splits(query, quantized, config, rows: int, num_quantized: int, tuning: _Tuning) -> int:
    """Programs per KV head of the Gluon kernel (kernels/decode_attention_gluon.py), 0 where it does not run and the
    Triton kernel reads every quantized token. It is compiled for what the usual decode step has: a CUDA GPU of
    compute capability 8.0 or newer (mma.sync), D = 128, 2 bits in groups of 32, fp16 scales, at most 8 query rows per
    KV head, the storage's channels contiguous, and at least one full 128-token block to read. Splits are sized so
    that all programs run in one wave of `tuning.gluon_programs_per_sm` two-warp programs per SM (its ~212 registers
    allow 4 per SM), at least two blocks each: with a second, partly filled wave the whole second wave's time adds
    (one-warp programs, H200, B=8 128K: 675 us with 17 splits per KV head, 1088 programs for 1056 places, against 434
    us with 16)."""
    full_blocks = num_quantized // _GLUON_BLOCK
    if full_blocks == 0 or _gluon is None or tuning.gluon_programs_per_sm == 0 or query.device.type != "cuda":
        return 0
    codes_and_pairs = (quantized.key_codes, quantized.key_scale, quantized.key_min, quantized.value_codes)
    if (
        _interpreting()
        or torch.cuda.get_device_capability(query.device) < (8, 0)
        or (query.shape[3], config.bits, config.group_size, config.scale_torch_dtype) != (128, 2, 32, torch.float16)
        or max(tuning.block_m, triton.next_power_of_2(rows)) != 8
        or any(t.stride(-1) != 1 or t.storage_offset() % 2 for t in codes_and_pairs)  # int32 views of fp16 pairs
        or (quantized.key_norms is not None and quantized.key_norms.stride(-1) != 1)
    ):
        return 0
    wave = tuning.gluon_programs_per_sm * _num_sms(query.device)
    return max(1, min(wave // (query.shape[0] * quantized.key_codes.shape[1]), full_blocks // 2))


def _few_heads(batch_heads: int, device: torch.device) -> bool:
    """Whether B * Hkv is under a quarter of the SMs (then one wave of programs: `_Tuning`'s few-heads choices)."""
    return device.type == "cuda" and 4 * batch_heads < _num_sms(device)


def _strides(prefix: str, tensor: torch.Tensor, axes: str) -> dict[str, int]:
    """`tensor`'s strides as the split kernel's keyword arguments `stride_<prefix><axis>`, one letter per dim
    (`_` skips a dim the kernel never steps along)."""
    return {f"stride_{prefix}{axis}": stride for axis, stride in zip(axes, tensor.stride(), strict=True) if axis != "_"}


def _validate(query, quantized, residual_keys, residual_values, key_padding_mask, config, length) -> int:
    """Check shapes/dtypes/devices; return the number of quantized tokens (with `length`, the storage's capacity)."""
    if query.dim() != 4:
        raise ValueError(f"decode_attention_triton: query must be [B, Hq, Tq, D], got {tuple(query.shape)}.")
    batch, q_heads, q_len, head_dim = query.shape
    if query.dtype not in _MODEL_DTYPES:
        raise ValueError(f"decode_attention_triton: query dtype {query.dtype} is not one of {_MODEL_DTYPES}.")
    if query.device.type != "cuda" and not _interpreting():
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
) -> torch.Tensor:
    """Attention of the newest Tq queries over quantized + residual tokens (module docstring), fused, [B, Hq, Tq, D].
    `key_rotated`: method="oscar"'s `[B, Hkv]` bool, as given to `quantize_kv_triton` (None for method="paper").
    `length`: None, or the tokens held as a device tensor, over the whole storage and window (module docstring)."""
    return _decode_attention(
        query, quantized, residual_keys, residual_values, key_padding_mask, scaling, config, key_rotated, length
    )


def _decode_attention(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: OscarConfig,
    key_rotated: torch.Tensor | None,
    length: torch.Tensor | None = None,
    tuning: _Tuning | None = None,
) -> torch.Tensor:
    """`decode_attention_triton` with the launch choices given (the benchmark's sweep), else `_default_tuning`'s."""
    num_quantized = _validate(query, quantized, residual_keys, residual_values, key_padding_mask, config, length)
    check_key_rotated(
        key_rotated, query.shape[0], residual_keys.shape[1], query.device, config, "decode_attention_triton"
    )
    if num_quantized == 0:
        quantized = None
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, residual = residual_keys.shape[1], residual_keys.shape[2]
    gqa = q_heads // kv_heads
    rows = gqa * q_len
    few_heads = _few_heads(batch * kv_heads, query.device)
    if tuning is None:
        short_few_heads = few_heads and num_quantized <= _SHORT_CONTEXT
        tuning = _default_tuning(head_dim, rows, config.scale_torch_dtype, short_few_heads)
    block_n = tuning.block_n
    num_blocks = triton.cdiv(num_quantized, block_n)
    gluon_splits = _gluon_splits(query, quantized, config, rows, num_quantized, tuning)
    if gluon_splits:  # the Triton kernel's one quantized program reads what follows the Gluon kernel's full blocks
        num_splits, blocks_per_split = 1, _GLUON_BLOCK // block_n
        gluon_blocks_per_split = triton.cdiv(num_quantized // _GLUON_BLOCK, gluon_splits)
        gluon_splits = triton.cdiv(num_quantized // _GLUON_BLOCK, gluon_blocks_per_split)
    else:
        num_splits = _num_splits(batch * kv_heads, num_blocks, query.device, tuning, few_heads)
        blocks_per_split = triton.cdiv(num_blocks, num_splits) if num_splits else 0
        if num_splits:
            num_splits = triton.cdiv(num_blocks, blocks_per_split)
    gluon_parts = gluon_splits * _gluon.WARPS if gluon_splits else 0  # a partial per warp
    # programmatic dependent launch (griddepcontrol) needs compute capability 9.0 (and a GPU: the CPU tests force
    # `_gluon_splits` to run the launch around a stand-in for the Gluon kernel); asked only where the Gluon kernel runs
    pdl = (
        gluon_splits > 0
        and tuning.gluon_pdl
        and query.device.type == "cuda"
        and torch.cuda.get_device_capability(query.device) >= (9, 0)
    )
    num_parts = gluon_parts + num_splits + 1  # the Gluon kernel's partials, the Triton kernel's, the residual's

    device = query.device
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    part_o = torch.empty((batch * kv_heads, num_parts, rows, head_dim), dtype=torch.float32, device=device)
    part_ml = torch.empty((batch * kv_heads, num_parts, rows, 2), dtype=torch.float32, device=device)
    block_m = max(tuning.block_m, triton.next_power_of_2(rows))
    q_op = torch.empty(
        (batch * kv_heads, head_dim, block_m) if gluon_splits else (0,), dtype=torch.float16, device=device
    )
    q_scale = torch.empty(batch * kv_heads if gluon_splits else 0, dtype=torch.float32, device=device)
    if quantized is None:  # nothing to read: empty tensors of the right dtypes and ranks, never dereferenced
        quantized = StorageLayout.of(config).empty(batch, kv_heads, head_dim, kv_heads, head_dim, 0, device)
    key_norms = quantized.key_norms if quantized.key_norms is not None else torch.empty(0, 0, 0, device=device)
    mask = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else torch.empty(0, 0, device=device)

    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _split_kernel[(batch * kv_heads, num_splits + 1)](
            q_ptr=query,
            kc_ptr=quantized.key_codes,
            ks_ptr=quantized.key_scale,
            km_ptr=quantized.key_min,
            kn_ptr=key_norms,
            vc_ptr=quantized.value_codes,
            vs_ptr=quantized.value_scale,
            vm_ptr=quantized.value_min,
            rk_ptr=residual_keys,
            rv_ptr=residual_values,
            mask_ptr=mask,
            key_rotated_ptr=key_rotated.view(torch.uint8) if key_rotated is not None else mask,  # unused if None
            length_ptr=length if length is not None else mask,  # unused if None
            part_o_ptr=part_o,
            part_ml_ptr=part_ml,
            q_op_ptr=q_op,
            q_scale_ptr=q_scale,
            num_kv_heads=kv_heads,
            num_quantized=num_quantized,
            num_residual=residual,
            blocks_per_split=blocks_per_split,
            num_splits=num_splits,
            first_slot=gluon_parts,
            num_parts=num_parts,
            qk_scale=scaling * _LOG2E,
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
            **_strides("m", mask, "bt"),
            **_strides("kr", key_rotated if key_rotated is not None else mask, "bh"),
            GQA=gqa,
            TQ=q_len,
            HEAD_DIM=head_dim,
            LOG2_D=head_dim.bit_length() - 1,
            BITS=config.bits,
            GROUP=config.group_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_R=tuning.residual_block,
            ROTATION=config.rotation,
            KEY_ROTATION_PER_HEAD=key_rotated is not None,
            TOKEN_SCALING=config.token_scaling,
            HAS_MASK=key_padding_mask is not None,
            # with `length`, the tokens read are a multiple of the window R (`num_quantized` is the capacity)
            PARTIAL_BLOCK=(num_quantized if length is None else residual) % block_n != 0,
            DEVICE_LENGTH=length is not None,
            GLUON_BLOCK=_GLUON_BLOCK if gluon_splits else 0,
            LAUNCH_DEPENDENTS=pdl,
            num_warps=tuning.num_warps,
            num_stages=tuning.num_stages,
            **({"maxnreg": tuning.max_registers} if tuning.max_registers else {}),
        )
        if gluon_splits:
            _gluon.launch(
                (batch * kv_heads, gluon_splits), q_op, q_scale, quantized, key_norms, mask, length, part_o, part_ml,
                num_quantized, residual, gluon_blocks_per_split, num_parts, rows, config.token_scaling,
                key_padding_mask is not None, tuning.gluon_max_registers, tuning.gluon_ptxas_options, pdl,
            )  # fmt: skip
        merge_slots = min(triton.next_power_of_2(max(num_parts - 1, 1)), max(1, tuning.merge_tile // head_dim))
        _merge_kernel[(batch * kv_heads * rows,)](
            part_o,
            part_ml,
            out,
            kv_heads,
            num_parts,
            **_strides("o", out, "bhtd"),
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
    return out
