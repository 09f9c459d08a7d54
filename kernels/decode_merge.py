"""The merge kernel of fused decode attention: the split kernels' partials combined by log-sum-exp.

Grid (B * Hkv * g * Tq,): one program per query row merges the quantized partials, un-rotates their sum once (o = o~ H,
exact since H is linear: one transform per row instead of one per split program), and adds the residual partial.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import add, fwht_rows, maximum


@triton.jit(do_not_specialize=["num_parts"])
def merge_kernel(
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
    # memory; BLOCK_S covers all partials up to `DecodeTuning.merge_tile`), weighs it against the running maximum (the
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
        m_new = tl.maximum(m_i, tl.reduce(part_m, 0, maximum))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha, beta = tl.exp2(m_i - m_use), tl.exp2(part_m - m_use)
        l_q = l_q * alpha + tl.reduce(part_l * beta, 0, add)
        acc_q = acc_q * alpha + tl.reduce(part_o * beta[:, None], 0, add)
        m_i = m_new

    if ROTATION:
        acc_q = tl.reshape(fwht_rows(tl.reshape(acc_q, (1, HEAD_DIM)), 1, HEAD_DIM, LOG2_D), (HEAD_DIM,))
    weight_r = tl.exp2(m_r - tl.where(m_i == float("-inf"), 0.0, m_i))
    l_all = l_q + l_r * weight_r
    out = (acc_q + o_r * weight_r) / tl.where(l_all > 0, l_all, 1.0)

    b = bh // num_kv_heads
    head = (bh % num_kv_heads) * GQA + row // TQ
    p_out = out_ptr + b * stride_ob + head * stride_oh + (row % TQ) * stride_ot + o_d * stride_od
    tl.store(p_out, out.to(out_ptr.dtype.element_ty))
