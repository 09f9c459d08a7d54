"""Prototype: the quantized part of a 2-bit decode step in Gluon, codes unpacked straight into tensor-core fragments.

    python benchmarks/proto_decode_gluon.py --count      # CPU: compile for sm_90, count the loop's SASS
    python benchmarks/proto_decode_gluon.py              # GPU: check against float32, time, write a record

Why Gluon: the Triton kernel (`oscar_hf.kernels.decode_attention`) spends ~5 instructions per code, half of them on
moving the unpacked tiles and the query operand through shared memory and registers into the layouts Triton picks for
`tl.dot` (NOTES_kernels.md). In Gluon the layouts are ours: each lane loads the storage words whose codes it holds in
the MMA's fragments, so the codes go from the loaded word to an operand register with a shift, a `lop3` and (keys
only) one `fma.f16x2`, and nothing goes through shared memory but P.

Same storage as the cache (`oscar_hf.layout`): word [row, d] holds the codes of tokens 16 row + j at bits 2j. One warp
per program, 128-token steps (8 word rows), D = 128, up to 8 query rows per KV head (GQA <= 8, one query token).

- Scores as S^T = K Q^T (m16n8k16: the tokens are the MMA's M, the 8 query rows its N). Lane (g, i) holds rows
  g + 8 r1 + 16 mt of every K tile, which this kernel maps to the stored token 16 g + mt + 8 r1: the whole word row g.
  For channels d, d + 1 one `prmt` joins the low (high) 16-bit halves of the two words, so `(p >> 2 mt)` has the codes
  of (token, d) and (token, d + 1) at bits 0 and 16: an fp16 pair with the codes at mantissa bits 8-9 is `1 + c / 4`
  (exact), and k = s c + m = (4 s) (1 + c / 4) + (m - 4 s) is one `fma.f16x2` (one rounding, as `c s + m`). A lane's
  tokens lie in one 32-token key group, so its scales are 16 pairs per step.
- Values as O^T = V^T P^T (channels as M). The logical token order is the same (k = 2 i + e + 8 r2 + 16 kt is stored
  token 16 (2 i + e) + kt + 8 r2), so lane (g, i) holds word rows 2 i and 2 i + 1: again whole words. Value parameters
  are per token and 32-channel group: P^T is scaled per group (4 s), the codes stay `1 + c / 4`, and the minimum goes
  in through a fifth MMA tile whose rows are the groups' m - 4 s.
- Base-2 online softmax over the 8 columns; partials (o in the values' stored domain, m, l) as the Triton kernel's.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

_LOG2E = 1.4426950408889634
HEAD_DIM, QUERY_ROWS, STEP = 128, 8, 128  # head dim, query rows per KV head (the MMA's N), tokens per step
D, ROWS, BLOCK = gl.constexpr(HEAD_DIM), gl.constexpr(QUERY_ROWS), gl.constexpr(STEP)

MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2))
B_OP = gl.constexpr(gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2))

# key words [8 word rows g, 128 channels d]: lane (g, i) holds d = e + 2 i + 8 r2 + 16 ks
K_WORDS = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 1], [0, 8], [0, 16], [0, 32], [0, 64]], [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]], [], [], [8, 128]
    )
)
K_PAIRS = gl.constexpr(  # [8 g, 64 channel pairs c]
    gl.DistributedLinearLayout([[0, 4], [0, 8], [0, 16], [0, 32]], [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]], [], [], [8, 64])
)
K_CODES = gl.constexpr(  # [g, c, r1, h, m2]; the token's m-tile mt = 4 h + m2
    gl.DistributedLinearLayout(
        [[0, 0, 1, 0, 0], [0, 4, 0, 0, 0], [0, 8, 0, 0, 0], [0, 16, 0, 0, 0], [0, 32, 0, 0, 0], [0, 0, 0, 0, 1],
         [0, 0, 0, 0, 2], [0, 0, 0, 1, 0]],
        [[0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]], [], [], [8, 64, 2, 2, 4],
    )
)  # fmt: skip
# value words of one 32-channel group [8 word rows R = 2 i + e, 32 channels]: lane (g, i) holds channel g + 8 r1 + 16 mt
V_WORDS = gl.constexpr(
    gl.DistributedLinearLayout([[1, 0], [0, 8], [0, 16]], [[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]], [], [], [8, 32])
)
V_PAIRS = gl.constexpr(  # [4 i, 32 channels]
    gl.DistributedLinearLayout([[0, 8], [0, 16]], [[1, 0], [2, 0], [0, 1], [0, 2], [0, 4]], [], [], [4, 32])
)
V_CODES = gl.constexpr(  # [i, ch, r2, h, m2]; the token's k-tile kt = 4 h + m2
    gl.DistributedLinearLayout(
        [[0, 0, 1, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 0, 0, 1, 0], [0, 8, 0, 0, 0], [0, 16, 0, 0, 0]],
        [[1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [0, 1, 0, 0, 0], [0, 2, 0, 0, 0], [0, 4, 0, 0, 0]], [], [], [4, 32, 2, 2, 4],
    )
)  # fmt: skip
# value parameters [128 logical tokens k, 4 groups] as the P^T operand holds k (lanes over query rows: broadcast)
V_PARAMS = gl.constexpr(
    gl.DistributedLinearLayout(
        [[0, 1], [0, 2], [1, 0], [8, 0], [16, 0], [32, 0], [64, 0]], [[2, 0], [4, 0], [0, 0], [0, 0], [0, 0]], [], [],
        [128, 4],
    )
)

LANES = gl.constexpr(gl.BlockedLayout([1], [32], [1], [0]))


@gluon.jit
def _prefetch_step(kc, ks, km, kn, vc, vs, vm, block):
    """Ask L2 for a step's storage (seven contiguous regions, one per lane): `cp.async.bulk.prefetch` (sm_90)."""
    lane = gl.arange(0, 32, layout=LANES)
    t0 = block * BLOCK
    zero = gl.zeros([32], gl.int64, layout=LANES)
    addr = gl.where(lane == 0, (kc + t0 // 16 * D).to(gl.int64, bitcast=True) + zero, zero)  # rows of D words
    addr = gl.where(lane == 1, (ks + t0 // 32 * (D // 2)).to(gl.int64, bitcast=True) + zero, addr)
    addr = gl.where(lane == 2, (km + t0 // 32 * (D // 2)).to(gl.int64, bitcast=True) + zero, addr)
    addr = gl.where(lane == 3, (kn + t0).to(gl.int64, bitcast=True) + zero, addr)
    addr = gl.where(lane == 4, (vc + t0 // 16 * D).to(gl.int64, bitcast=True) + zero, addr)
    addr = gl.where(lane == 5, (vs + t0 * 4).to(gl.int64, bitcast=True) + zero, addr)
    addr = gl.where(lane == 6, (vm + t0 * 4).to(gl.int64, bitcast=True) + zero, addr)
    size = gl.where(lane == 0, 8 * D * 4, 0)
    size = gl.where((lane == 1) | (lane == 2) | (lane == 5) | (lane == 6), 4 * D * 2, size)
    size = gl.where(lane == 3, BLOCK * 4, size)
    size = gl.where(lane == 4, 8 * D * 4, size)
    gl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r", [addr, size], dtype=gl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@gluon.jit
def _stored_token(m):
    """Logical token index (MMA row of S^T, k of P^T) -> stored token within the 128-token step."""
    return 16 * (m % 8) + m // 16 + 8 * ((m // 8) % 2)


@gluon.jit
def _column(x):
    return gl.convert_layout(x, gl.SliceLayout(1, B_OP), assert_trivial=True)[:, None]


@gluon.jit
def _expand_last(x, n: gl.constexpr):
    for _ in gl.static_range(n):
        x = gl.expand_dims(x, x.type.shape.__len__())
    return x


@gluon.jit
def _key_operand(kc_ptr, ks_ptr, km_ptr, row0, group0, stride_kcr, stride_ksg):
    """The step's K tile [128 logical tokens, D] as the first MMA operand, dequantized (fp16)."""
    o_g = gl.arange(0, 8, layout=gl.SliceLayout(1, K_WORDS))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, K_WORDS))
    w = gl.load(kc_ptr + (row0 + o_g[:, None]) * stride_kcr + o_d[None, :])
    w_even, w_odd = gl.split(gl.reshape(w, [8, 64, 2]))
    w_even = gl.convert_layout(w_even, K_PAIRS, assert_trivial=True)
    w_odd = gl.convert_layout(w_odd, K_PAIRS, assert_trivial=True)
    lo16, hi16 = gl.inline_asm_elementwise(  # tokens j < 8 (r1 = 0) and j >= 8 (r1 = 1) of channels (2c, 2c + 1)
        "prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;", "=r,=r,r,r", [w_even, w_odd],
        dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    # scale / min pairs (channels 2c, 2c + 1) of the lane's key group, as int32
    o_g2 = gl.arange(0, 8, layout=gl.SliceLayout(1, K_PAIRS))
    o_c2 = gl.arange(0, 64, layout=gl.SliceLayout(0, K_PAIRS))
    off = (group0 + o_g2[:, None] // 2) * stride_ksg + o_c2[None, :]
    s4, m4 = gl.inline_asm_elementwise(  # 4 s and m - 4 s
        "{ .reg .b32 c4, cm4; mov.b32 c4, 0x44004400; mov.b32 cm4, 0xC400C400; mul.rn.f16x2 $0, $2, c4;"
        " fma.rn.f16x2 $1, $2, cm4, $3; }",
        "=r,=r,r,r", [gl.load(ks_ptr + off), gl.load(km_ptr + off)], dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    p = gl.join(lo16, hi16)  # [g, c, r1]
    # codes of m-tiles 0..3 sit below bit 8 (shift p << 8 right by 2 m2), of 4..7 above (shift p right by 2 m2)
    p = gl.convert_layout(gl.join(p << 8, p), gl.SliceLayout(4, K_CODES), assert_trivial=True)
    o_m2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, K_CODES)))))
    shift = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(o_m2 * 2, 0), 0), 0), 0)
    pair_layout: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, K_CODES)))
    s4 = _expand_last(gl.convert_layout(s4, pair_layout, assert_trivial=True), 3)
    m4 = _expand_last(gl.convert_layout(m4, pair_layout, assert_trivial=True), 3)
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.b32 t, $2, $3; lop3.b32 t, t, 0x03000300, 0x3C003C00, 0xea; fma.rn.f16x2 t, t, $4, $5;"
        " mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r,r", [gl.expand_dims(p, 4), shift, s4, m4], dtype=(gl.float16, gl.float16), is_pure=True, pack=1,
    )  # fmt: skip
    k = gl.reshape(gl.permute(gl.join(lo, hi), [3, 4, 2, 0, 1, 5]), [BLOCK, D])  # [h, m2, r1, g | c, e]
    return gl.convert_layout(k, A_OP, assert_trivial=True)


@gluon.jit
def _value_operand(vc_ptr, row0, ch0, stride_vcr):
    """Codes of 32 channels from ch0, [32, 128 logical tokens] as the first MMA operand: fp16 1 + c / 4."""
    o_r = gl.arange(0, 8, layout=gl.SliceLayout(1, V_WORDS))
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(0, V_WORDS))
    w = gl.load(vc_ptr + (row0 + o_r[:, None]) * stride_vcr + ch0 + o_c[None, :])
    w_even, w_odd = gl.split(gl.permute(gl.reshape(w, [4, 2, 32]), [0, 2, 1]))
    w_even = gl.convert_layout(w_even, V_PAIRS, assert_trivial=True)
    w_odd = gl.convert_layout(w_odd, V_PAIRS, assert_trivial=True)
    lo16, hi16 = gl.inline_asm_elementwise(  # tokens j < 8 (r2 = 0), j >= 8 (r2 = 1) of word rows 2i, 2i + 1
        "prmt.b32 $0, $2, $3, 0x5410; prmt.b32 $1, $2, $3, 0x7632;", "=r,=r,r,r", [w_even, w_odd],
        dtype=(gl.int32, gl.int32), is_pure=True, pack=1,
    )  # fmt: skip
    p = gl.join(lo16, hi16)  # [i, ch, r2]
    p = gl.convert_layout(gl.join(p << 8, p), gl.SliceLayout(4, V_CODES), assert_trivial=True)
    o_m2 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, V_CODES)))))
    shift = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(o_m2 * 2, 0), 0), 0), 0)
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b32 t; shr.b32 t, $2, $3; lop3.b32 t, t, 0x03000300, 0x3C003C00, 0xea; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r", [gl.expand_dims(p, 4), shift], dtype=(gl.float16, gl.float16), is_pure=True, pack=1,
    )  # fmt: skip
    v = gl.reshape(gl.permute(gl.join(lo, hi), [1, 3, 4, 2, 0, 5]), [32, BLOCK])  # [ch | h, m2, r2, i, e]
    return gl.convert_layout(v, A_OP, assert_trivial=True)


@gluon.jit
def _split_kernel(
    qt_ptr, qk_scale_ptr, kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, o_ptr, ml_ptr,
    num_blocks, blocks_per_split, num_splits,
    stride_kcb, stride_kch, stride_kcr, stride_ksb, stride_ksh, stride_ksg, stride_knb,
    stride_vcb, stride_vch, stride_vcr, stride_vsb, stride_vsh,
    HKV: gl.constexpr,
    PREFETCH: gl.constexpr,
):  # fmt: skip
    bh = gl.program_id(0)
    split = gl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    kc_ptr += b * stride_kcb + h * stride_kch
    ks_ptr += b * stride_ksb + h * stride_ksh  # int32 pairs: strides in pairs
    km_ptr += b * stride_ksb + h * stride_ksh
    kn_ptr += b * stride_knb
    vc_ptr += b * stride_vcb + h * stride_vch
    vs_ptr += b * stride_vsb + h * stride_vsh
    vm_ptr += b * stride_vsb + h * stride_vsh

    o_dq = gl.arange(0, D, layout=gl.SliceLayout(1, B_OP))
    o_rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, B_OP))
    q = gl.load(qt_ptr + bh * D * ROWS + o_dq[:, None] * ROWS + o_rq[None, :])  # [D, rows] fp16
    qk_scale = gl.load(qk_scale_ptr + bh)

    o_m = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, MMA))
    tok_m = _stored_token(o_m)
    o_k = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, V_PARAMS))
    o_grp = gl.arange(0, 4, layout=gl.SliceLayout(0, V_PARAMS))
    off_vp = _stored_token(o_k)[:, None] * 4 + o_grp[None, :]
    o_gb = gl.arange(0, 16, layout=gl.SliceLayout(1, A_OP))
    o_kb = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, A_OP))
    off_vb = _stored_token(o_kb)[None, :] * 4 + o_gb[:, None]
    m_vb = (o_gb < 4)[:, None]

    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, MMA))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(0, MMA))
    acc0 = gl.zeros([32, ROWS], gl.float32, layout=MMA)
    acc1 = gl.zeros([32, ROWS], gl.float32, layout=MMA)
    acc2 = gl.zeros([32, ROWS], gl.float32, layout=MMA)
    acc3 = gl.zeros([32, ROWS], gl.float32, layout=MMA)
    bias = gl.zeros([16, ROWS], gl.float32, layout=MMA)

    block_lo = split * blocks_per_split
    block_hi = gl.minimum(block_lo + blocks_per_split, num_blocks)
    for block in range(block_lo, gl.minimum(block_lo + PREFETCH, block_hi)):
        _prefetch_step(kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, block)
    for block in range(block_lo, block_hi):
        t0 = block * BLOCK
        if PREFETCH > 0:
            if block + PREFETCH < block_hi:
                _prefetch_step(kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, block + PREFETCH)
        k_op = _key_operand(kc_ptr, ks_ptr, km_ptr, block * 8, block * 4, stride_kcr, stride_ksg)
        s = mma_v2(k_op, q, gl.zeros([BLOCK, ROWS], gl.float32, layout=MMA))
        norms = gl.load(kn_ptr + t0 + tok_m)
        s = s * (norms * qk_scale)[:, None]
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        p = gl.exp2(s - m_new[None, :])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=0)
        m_i = m_new
        p_op = gl.convert_layout(p.to(gl.float16), B_OP)  # [128 k, rows]
        vs = gl.load(vs_ptr + t0 * 4 + off_vp) * 4.0  # [128 k, 4 groups] fp16
        s_even, s_odd = gl.split(gl.reshape(vs, [BLOCK, 2, 2]))  # groups 0, 2 and 1, 3
        s0, s2 = gl.split(s_even)
        s1, s3 = gl.split(s_odd)
        vb = gl.load(vm_ptr + t0 * 4 + off_vb, mask=m_vb, other=0.0) - 4.0 * gl.load(
            vs_ptr + t0 * 4 + off_vb, mask=m_vb, other=0.0
        )  # [16 groups (4 used), 128 k]: m - 4 s
        alpha_c = alpha[None, :]
        bias = mma_v2(vb, p_op, bias * alpha_c)
        row0 = block * 8
        acc0 = mma_v2(_value_operand(vc_ptr, row0, 0, stride_vcr), p_op * _column(s0), acc0 * alpha_c)
        acc1 = mma_v2(_value_operand(vc_ptr, row0, 32, stride_vcr), p_op * _column(s1), acc1 * alpha_c)
        acc2 = mma_v2(_value_operand(vc_ptr, row0, 64, stride_vcr), p_op * _column(s2), acc2 * alpha_c)
        acc3 = mma_v2(_value_operand(vc_ptr, row0, 96, stride_vcr), p_op * _column(s3), acc3 * alpha_c)

    # partials: o [rows, D] (values' stored domain), m, l
    o_g = gl.arange(0, 16, layout=gl.SliceLayout(1, MMA))[:, None]
    base = o_ptr + (bh * num_splits + split) * ROWS * D
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(1, MMA))[:, None]
    o_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))[None, :]
    gl.store(base + o_r * D + o_c, acc0 + gl.sum(gl.where(o_g == 0, bias, 0.0), axis=0)[None, :])
    gl.store(base + o_r * D + 32 + o_c, acc1 + gl.sum(gl.where(o_g == 1, bias, 0.0), axis=0)[None, :])
    gl.store(base + o_r * D + 64 + o_c, acc2 + gl.sum(gl.where(o_g == 2, bias, 0.0), axis=0)[None, :])
    gl.store(base + o_r * D + 96 + o_c, acc3 + gl.sum(gl.where(o_g == 3, bias, 0.0), axis=0)[None, :])
    o_r1 = gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    ml = ml_ptr + (bh * num_splits + split) * 2 * ROWS
    gl.store(ml + o_r1, m_i)
    gl.store(ml + ROWS + o_r1, l_i)


def make_inputs(batch: int, kv_heads: int, context: int, rows: int, gen: torch.Generator, device) -> dict:
    """Random storage of `context` quantized tokens (any words are valid codes) and a query in the stored domain."""
    def rand(*shape, lo=0.0, hi=1.0, dtype=torch.float16):
        return (torch.rand(*shape, generator=gen) * (hi - lo) + lo).to(dtype).to(device)

    words = lambda: torch.randint(-(2**31), 2**31, (batch, kv_heads, context // 16, HEAD_DIM), generator=gen, dtype=torch.int64).to(torch.int32).to(device)  # noqa: E731
    groups = context // 32
    return {
        "q": torch.randn(batch, kv_heads, rows, HEAD_DIM, generator=gen).to(device),
        "key_codes": words(),
        "key_scale": rand(batch, kv_heads, groups, HEAD_DIM, lo=0.05, hi=0.5),
        "key_min": rand(batch, kv_heads, groups, HEAD_DIM, lo=-1.0, hi=0.0),
        "key_norms": rand(batch, 1, context, lo=0.5, hi=2.0, dtype=torch.float32),
        "value_codes": words(),
        "value_scale": rand(batch, kv_heads, context, HEAD_DIM // 32, lo=0.05, hi=0.5),
        "value_min": rand(batch, kv_heads, context, HEAD_DIM // 32, lo=-1.0, hi=0.0),
    }


def unpack(words: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(16, device=words.device, dtype=torch.int32).mul_(2).view(16, 1)
    return ((words.unsqueeze(-2) >> shifts) & 3).flatten(-3, -2).float()


def reference(x: dict, scaling: float) -> torch.Tensor:
    """float32 attention of the query rows over the dequantized tokens: [B, Hkv, rows, HEAD_DIM] in the stored domain."""
    k = unpack(x["key_codes"]) * x["key_scale"].float().repeat_interleave(32, 2) + x["key_min"].float().repeat_interleave(32, 2)
    k = k * x["key_norms"].transpose(1, 2).unsqueeze(1)
    v = unpack(x["value_codes"]) * x["value_scale"].float().repeat_interleave(32, 3) + x["value_min"].float().repeat_interleave(32, 3)
    scores = torch.matmul(x["q"].float(), k.transpose(-1, -2)) * scaling
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def prepare(x: dict, scaling: float, num_splits: int, maxnreg: int | None = None, prefetch: int = 0) -> dict:
    """The kernel's query operand (rotated domain as given, / max |q|, transposed, fp16), scales and outputs."""
    batch, kv_heads, rows, _ = x["q"].shape
    num_blocks = x["value_scale"].shape[2] // STEP
    per_split = math.ceil(num_blocks / num_splits)
    num_splits = math.ceil(num_blocks / per_split)
    q = x["q"].float()
    q_max = q.abs().amax(dim=(2, 3)).clamp_min(1e-30)
    qt = torch.zeros(batch * kv_heads, HEAD_DIM, QUERY_ROWS, dtype=torch.float16, device=q.device)
    qt[:, :, :rows] = (q / q_max[..., None, None]).reshape(batch * kv_heads, rows, HEAD_DIM).transpose(1, 2).half()
    kc, ks, km = x["key_codes"], x["key_scale"].view(torch.int32), x["key_min"].view(torch.int32)
    vc, vs, vm = x["value_codes"], x["value_scale"], x["value_min"]
    return {
        "grid": (batch * kv_heads, num_splits),
        "args": (
            qt, (q_max * scaling * _LOG2E).reshape(-1).contiguous(), kc, ks, km, x["key_norms"], vc, vs, vm,
            torch.empty(batch * kv_heads, num_splits, QUERY_ROWS, HEAD_DIM, device=q.device),
            torch.empty(batch * kv_heads, num_splits, 2, QUERY_ROWS, device=q.device),
            num_blocks, per_split, num_splits,
            kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2), x["key_norms"].stride(0),
            vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1),
        ),
        "kv_heads": kv_heads,
        "prefetch": prefetch,
        "options": {"num_warps": 1} | ({"maxnreg": maxnreg} if maxnreg else {}),
    }  # fmt: skip


def launch(prep: dict):
    """Run the split kernel; returns (o [BH, S, rows, HEAD_DIM], m, l [BH, S, rows]) (base 2)."""
    _split_kernel[prep["grid"]](*prep["args"], HKV=prep["kv_heads"], PREFETCH=prep["prefetch"], **prep["options"])
    o, ml = prep["args"][9], prep["args"][10]
    return o, ml[:, :, 0], ml[:, :, 1]


def merge(o, m, l, batch, kv_heads, rows):
    m_all = m.amax(dim=1, keepdim=True)
    w = torch.exp2(m - m_all)
    out = (o * w[..., None]).sum(1) / (l * w).sum(1)[..., None]
    return out[:, :rows].reshape(batch, kv_heads, rows, HEAD_DIM)


def count() -> None:
    from count_sass import loop_report
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {n: "*i32" for n in ("qt_ptr", "qk_scale_ptr", "kc_ptr", "ks_ptr", "km_ptr", "kn_ptr", "vc_ptr", "vs_ptr", "vm_ptr", "o_ptr", "ml_ptr")}
    sig.update({"qt_ptr": "*fp16", "qk_scale_ptr": "*fp32", "kn_ptr": "*fp32", "vs_ptr": "*fp16", "vm_ptr": "*fp16", "o_ptr": "*fp32", "ml_ptr": "*fp32"})
    for n in ("num_blocks", "blocks_per_split", "num_splits", "stride_kcb", "stride_kch", "stride_kcr", "stride_ksb", "stride_ksh", "stride_ksg", "stride_knb", "stride_vcb", "stride_vch", "stride_vcr", "stride_vsb", "stride_vsh"):
        sig[n] = "i32"
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(sig))}
    kernel = triton.compile(GluonASTSource(_split_kernel, sig, {"HKV": 8, "PREFETCH": int(os.environ.get("PREFETCH", 1))}, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, **({"maxnreg": int(os.environ["MAXNREG"])} if "MAXNREG" in os.environ else {})})
    loop, ops, usage = loop_report(kernel)
    print(usage)
    print(f"loop: {len(loop)} instructions per 128-token step = {len(loop) * 32 / (128 * 128 * 2):.2f} per K or V code")
    print("most frequent:", ", ".join(f"{k} {v}" for k, v in ops.most_common(20)))


def check(gen: torch.Generator) -> list[dict]:
    """The merged partials against the float32 reference on fresh random storage, several shapes and splits."""
    results = []
    for batch, kv_heads, context, rows, splits in [(2, 2, 4096, 4, 3), (1, 3, 1024, 8, 1), (2, 8, 8192, 4, 5), (1, 1, 32768, 1, 7)]:
        x = make_inputs(batch, kv_heads, context, rows, gen, "cuda")
        scaling = HEAD_DIM**-0.5
        out = merge(*launch(prepare(x, scaling, splits, prefetch=2)), batch, kv_heads, rows)
        ref = reference(x, scaling)
        err = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        results.append({"batch": batch, "kv_heads": kv_heads, "context": context, "rows": rows, "splits": splits, "rel_err": err})
        print(results[-1], flush=True)
    return results


def timings(gen: torch.Generator, shapes, split_choices) -> list[dict]:
    """Graph medians at the benchmark's shapes: SDPA bf16 and the landed fused kernel (whole decode step) from
    bench_decode_attention, the Gluon split kernel alone (no residual, no merge) on the same quantized storage."""
    from bench_decode_attention import make_sets, sdpa_folded, sdpa_gqa, fused, timed
    from oscar_hf.config import OscarConfig

    config = OscarConfig()
    rows = []
    for batch, context in shapes:
        st = make_sets(batch, context, config, 1, gen)[0]
        scale = HEAD_DIM**-0.5
        row = {"batch": batch, "context": context}
        row["sdpa_bf16_us"] = min(timed(lambda: f(st["q"], st["k"], st["v"], scale), 1)["us_graph"] for f in (sdpa_gqa, sdpa_folded))
        row["fused_us"] = timed(lambda: fused(st, config, scale), 1)["us_graph"]
        qz = st["quantized"]
        x = {"q": st["q"].view(batch, 8, 4, HEAD_DIM).float(), "key_codes": qz.key_codes, "key_scale": qz.key_scale, "key_min": qz.key_min,
             "key_norms": qz.key_norms, "value_codes": qz.value_codes, "value_scale": qz.value_scale, "value_min": qz.value_min}
        for splits in split_choices:
            for prefetch in (0, 1, 2, 4):
                prep = prepare(x, scale, splits, prefetch=prefetch)
                row[f"gluon_split_us_s{splits}_pf{prefetch}"] = timed(lambda: launch(prep), 1)["us_graph"]
        best = min(v for k, v in row.items() if k.startswith("gluon_split"))
        row["gluon_vs_sdpa"] = row["sdpa_bf16_us"] / best
        row["fused_vs_sdpa"] = row["sdpa_bf16_us"] / row["fused_us"]
        print(row, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", action="store_true", help="CPU: compile for sm_90 and count the loop")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--profile", action="store_true", help="GPU: launch the B=8 32K kernel 3 times (for ncu)")
    parser.add_argument("--splits", type=int, default=16)
    parser.add_argument("--maxnreg", type=int)
    args = parser.parse_args()
    if args.count:
        count()
        return
    if args.profile:
        x = make_inputs(8, 8, 32768, 4, torch.Generator().manual_seed(0), "cuda")
        prep = prepare(x, HEAD_DIM**-0.5, args.splits, args.maxnreg)
        for _ in range(3):
            launch(prep)
        torch.cuda.synchronize()
        return
    gen = torch.Generator(device="cuda").manual_seed(0)
    record = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__}
    record["check"] = check(torch.Generator().manual_seed(0))
    record["timings"] = timings(gen, [(8, 32768), (8, 131072), (1, 32768)], [8, 16, 32, 64])
    name = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    path = Path(args.out) / f"proto_decode_gluon_{name}.json"
    path.write_text(json.dumps(record, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
