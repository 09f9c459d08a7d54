"""The Triton split kernel of fused decode attention (kernels/decode_attention.py launches it).

Grid (B * Hkv, S + 1): program (bh, s < S) runs an online softmax over its range of quantized blocks for all g * Tq
query rows of KV head bh (each K/V tile is loaded once and used by the g heads), starting from the rotated query; its
accumulator stays in the values' rotated domain. Program (bh, S) does the same over the residual tokens in the query
dtype. Each writes (acc, m, l) in fp32 to a partial buffer [B * Hkv, parts, g * Tq, (D)]. Where the Gluon kernel
(kernels/decode_gluon.py) reads the full 128-token blocks, the one quantized program per KV head reads only what
follows them (a partial block, or nothing) and writes the query operand that kernel reads.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .decode_tiles import any_masked, dot, online_softmax_step, quantized_blocks, query_operand


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
        s = dot(q, tl.trans(b_k), PRECISION) * qk_scale
        m_s = m_j
        if HAS_MASK:
            m_s &= tl.load(mask_ptr + o_j * stride_mt, mask=m_j, other=0) != 0
        s = tl.where(m_s[None, :] & (o_j[None, :] <= last[:, None]), s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        b_v = tl.load(rv_ptr + o_j[:, None] * stride_rvt + o_d[None, :] * stride_rvd, mask=m_j[:, None], other=0.0)
        acc = acc * alpha[:, None] + dot(p.to(b_v.dtype), b_v, PRECISION)
    return acc, m_i, l_i


_NOT_SPECIALISED = ("num_quantized", "num_residual", "num_sinks", "blocks_per_split", "num_splits", "first_slot",
                    "num_parts", "stride_mb")  # fmt: skip


@triton.jit(do_not_specialize=_NOT_SPECIALISED)
def split_kernel(
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
    num_sinks,
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
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
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
    if DEVICE_LENGTH:  # the storage's capacity and the sinks + window R came in; the tokens held decide what is read
        held = tl.load(length_ptr)
        window = num_residual - num_sinks
        num_quantized = tl.maximum(held - num_sinks - 1, 0) // window * window
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
        b_q, q_scale = query_operand(
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
            # compiled step without padding) run the loop without the per-step mask gather.
            last = tl.minimum(block_hi * BLOCK_N, num_quantized)
            masked = any_masked(p_mask, block_lo * BLOCK_N, last, stride_mt, 8 * BLOCK_N)
        if masked:
            acc, m_i, l_i = quantized_blocks(
                *args, HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, True, PARTIAL_BLOCK
            )
        else:
            acc, m_i, l_i = quantized_blocks(
                *args, HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, False, PARTIAL_BLOCK
            )

    # partials: part_o [B * Hkv, num_parts, GQA * TQ, D], part_ml [B * Hkv, num_parts, GQA * TQ, 2] (m, l), fp32
    o_part = (pid_bh * num_parts + first_slot + pid_s) * ROWS_USED + o_m
    tl.store(part_o_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], acc, mask=m_m[:, None])
    tl.store(part_ml_ptr + o_part * 2, m_i, mask=m_m)
    tl.store(part_ml_ptr + o_part * 2 + 1, l_i, mask=m_m)
