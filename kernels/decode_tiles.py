"""The Triton split kernel's quantized tiles (kernels/decode_triton.py): codes unpacked in registers, one online-softmax
step per block of quantized tokens, the query operand rotated into the keys' stored domain.

Dequantization in registers: a word holds the codes of tokens j and j + H (H = W / 2) at bits j*b and j*b + 16, so
one shift and one mask turn it into two fp16 `1024 + code` (exact; no int-to-float conversion), and packed fp16
arithmetic subtracts 1024 and applies scale/min two values at a time. The tile's token order is therefore permuted
(column (r * H + j) * 2 + t holds token r * W + t * H + j); softmax is order-free, and norms, V parameters and the
padding mask are read in the same order; key parameters (per channel, per group of G tokens) and value parameters
(per token, per group of G channels) are loaded once per group and broadcast in registers. Dot operands of the
quantized part are fp16 (the default fp16 scales bound every dequantized value; the rotated query is divided by its
max so it cannot overflow), tf32 with fp32 scales; accumulation is fp32.

Keys and values of different widths (2 and 4 bits) permute their tiles differently: the probabilities are permuted from
the keys' column order to the values' (`keys_to_values_order`), a shuffle of the small [M, N] tile rather than of a
[D, N] one; key-side reads (norms, padding mask) follow the key tile's order, value parameters the value tile's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERPRETER, WORD_BITS, add, fwht_rows, maximum


@triton.jit
def unpack_codes_t(words_t, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr):
    """[D, ROWS] int32 words -> [D, ROWS * W] fp16 codes; column (r * H + j) * 2 + t is token r * W + t * H + j."""
    W: tl.constexpr = WORD_BITS // BITS
    H: tl.constexpr = W // 2
    MASK: tl.constexpr = ((1 << BITS) - 1) * 0x10001
    shifts = tl.arange(0, H) * BITS
    if INTERPRETER:
        x = ((words_t[:, :, None] >> shifts[None, None, :]) & MASK) | 0x64006400  # two fp16 (1024 + code)
        lo = x.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:  # the same in PTX (lop3 0xea: (a & b) | c), the register handed out as its two fp16 halves, which saves
        # the 16-bit shuffles Triton emits to split and re-pair them (test_unpack_codes_order checks this path against
        # the storage layout's unpacker on the GPU)
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
def tile_tokens(o_c, W: tl.constexpr):
    """The token (from the tile's first) that column `o_c` of an unpacked tile of W codes a word holds
    (`unpack_codes_t`)."""
    return (o_c // W) * W + (o_c % 2) * (W // 2) + (o_c % W) // 2


@triton.jit
def keys_to_values_order(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[M, N] columns in the token order of a 4-bit tile -> that of a 2-bit tile, or back (the same shuffle: an
    involution). Within 16 tokens, the 4-bit tile's column 8 t + 2 j + a holds token 8 t + 4 a + j (t, a < 2, j < 4)
    and the 2-bit tile's column 8 a + 2 j + t holds it (`tile_tokens`): t and a swap places."""
    p = tl.permute(tl.reshape(p, (BLOCK_M, BLOCK_N // 16, 2, 4, 2)), (0, 1, 4, 3, 2))
    return tl.reshape(p, (BLOCK_M, BLOCK_N))


@triton.jit
def dot(a, b, PRECISION: tl.constexpr):
    if INTERPRETER:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One online-softmax update for base-2 scores s [M, N] (-inf = masked); rows may be fully masked."""
    m_new = tl.maximum(m_i, tl.reduce(s, 1, maximum))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    return p, alpha, m_new, l_i * alpha + tl.reduce(p, 1, add)


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
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One BLOCK_N-token step of the online softmax over quantized tokens, from tile pointers; MASKED: the last,
    partial block (tokens_left < BLOCK_N valid tokens). Key-side pointers and masks (codes, norms, padding mask) are
    in the key tile's column order, value-side ones in the value tile's (`tile_tokens`)."""
    KW: tl.constexpr = WORD_BITS // KEY_BITS
    VW: tl.constexpr = WORD_BITS // VALUE_BITS
    SCALE_DTYPE: tl.constexpr = p_ks.dtype.element_ty
    DOT_DTYPE: tl.constexpr = b_q.dtype
    # fp32 operands (fp32 scales) in three TF32 products: one TF32 product would round them to 10 mantissa bits and
    # leave float32 scales less accurate than float16 ones
    PRECISION: tl.constexpr = "tf32x3" if b_q.dtype == tl.float32 else "tf32"
    o_c = tl.arange(0, BLOCK_N)
    if MASKED:
        m_kw = (tl.arange(0, BLOCK_N // KW) * KW < tokens_left)[None, :]
        m_vw = (tl.arange(0, BLOCK_N // VW) * VW < tokens_left)[None, :]
        m_t = tile_tokens(o_c, KW) < tokens_left
        m_c = (tile_tokens(o_c, VW) < tokens_left)[None, :]
    else:  # constant masks: folded away by the compiler
        m_kw = tl.full([1, BLOCK_N // KW], True, tl.int1)
        m_vw = tl.full([1, BLOCK_N // VW], True, tl.int1)
        m_t = tl.full([BLOCK_N], True, tl.int1)
        m_c = m_t[None, :]

    NKG: tl.constexpr = BLOCK_N // GROUP if BLOCK_N >= GROUP else 1  # key groups per tile
    GK: tl.constexpr = BLOCK_N // NKG  # tile columns per key group
    NVG: tl.constexpr = HEAD_DIM // GROUP  # value groups per token
    m_kg = (tl.arange(0, NKG) * GK < tokens_left)[None, :, None]
    b_ks = tl.load(p_ks, mask=m_kg, other=0.0)
    b_km = tl.load(p_km, mask=m_kg, other=0.0)
    b_kt = unpack_codes_t(tl.load(p_kw, mask=m_kw, other=0), HEAD_DIM, BLOCK_N // KW, KEY_BITS).to(SCALE_DTYPE)
    b_kt = tl.reshape(tl.reshape(b_kt, (HEAD_DIM, NKG, GK)) * b_ks + b_km, (HEAD_DIM, BLOCK_N))
    s = dot(b_q, b_kt.to(DOT_DTYPE), PRECISION) * qk_scale
    if TOKEN_SCALING:
        s *= tl.load(p_kn, mask=m_t, other=1.0)[None, :]
    if HAS_MASK:
        s = tl.where((tl.load(p_mask, mask=m_t, other=0) != 0)[None, :], s, float("-inf"))
    elif MASKED:
        s = tl.where(m_t[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
    if KEY_BITS != VALUE_BITS:
        p = keys_to_values_order(p, BLOCK_M, BLOCK_N)

    b_vs = tl.load(p_vs, mask=m_c[None, :, :], other=0.0)
    b_vm = tl.load(p_vm, mask=m_c[None, :, :], other=0.0)
    b_vt = unpack_codes_t(tl.load(p_vw, mask=m_vw, other=0), HEAD_DIM, BLOCK_N // VW, VALUE_BITS).to(SCALE_DTYPE)
    b_vt = tl.reshape(tl.reshape(b_vt, (NVG, GROUP, BLOCK_N)) * b_vs + b_vm, (HEAD_DIM, BLOCK_N))
    acc = acc * alpha[:, None] + dot(p.to(DOT_DTYPE), tl.trans(b_vt.to(DOT_DTYPE)), PRECISION)
    return acc, m_i, l_i


@triton.jit
def query_operand(
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
        q_rotated = fwht_rows(q, BLOCK_M, HEAD_DIM, LOG2_D)
        q = tl.where(key_rotated, q_rotated, q) if KEY_ROTATION_PER_HEAD else q_rotated
    q_max = tl.reduce(tl.reduce(tl.abs(q), 1, maximum), 0, maximum)
    q_max = tl.where(q_max > 0, q_max, 1.0)
    return (q / q_max).to(DOT_DTYPE), qk_scale * q_max


@triton.jit
def any_masked(mask_ptr, start, end, stride_mt, CHUNK: tl.constexpr):
    """Whether the key padding mask excludes any of tokens [start, end)."""
    found = 0
    for chunk in range(start, end, CHUNK):
        o_t = chunk + tl.arange(0, CHUNK)
        excluded = tl.load(mask_ptr + o_t * stride_mt, mask=o_t < end, other=1) == 0
        found = tl.maximum(found, tl.max(excluded.to(tl.int32), 0))
    return found != 0


@triton.jit
def quantized_blocks(
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
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    HAS_MASK: tl.constexpr,
    PARTIAL_BLOCK: tl.constexpr,
):
    """Online softmax over quantized blocks [block_lo, block_hi) from the query operand `b_q` (`query_operand`);
    returns (acc, m, l), acc in the values' stored (rotated, with ROTATION) domain: the merge kernel un-rotates the sum
    of the splits. HAS_MASK: whether a step applies the key padding mask.
    PARTIAL_BLOCK: whether the last block may be partial (the number of quantized tokens is not a multiple of BLOCK_N).
    The cache's is a multiple of its residual length, so a kernel without the masked step is the usual one: it needs
    fewer registers (and spills none or fewer)."""
    KW: tl.constexpr = WORD_BITS // KEY_BITS
    VW: tl.constexpr = WORD_BITS // VALUE_BITS
    # offsets inside a block (loop-invariant); column c of a key (value) tile holds token tile_tokens(c, KW (VW))
    o_d = tl.arange(0, HEAD_DIM)[:, None]
    o_c = tl.arange(0, BLOCK_N)
    tok = tile_tokens(o_c, KW)
    off_kw = tl.arange(0, BLOCK_N // KW)[None, :] * stride_kcr + o_d * stride_kcd
    off_vw = tl.arange(0, BLOCK_N // VW)[None, :] * stride_vcr + o_d * stride_vcd
    NKG: tl.constexpr = BLOCK_N // GROUP if BLOCK_N >= GROUP else 1  # key groups per tile (columns c // GROUP)
    o_kg = tl.arange(0, NKG)[None, :, None]
    NVG: tl.constexpr = HEAD_DIM // GROUP  # value groups per token
    o_vg = tl.arange(0, NVG)[:, None, None]
    off_ks = o_kg * stride_ksg + o_d[:, :, None] * stride_ksd  # [D, NKG, 1]
    off_km = o_kg * stride_kmg + o_d[:, :, None] * stride_kmd
    # value parameters: [tokens, D / GROUP] contiguous (`_validate`); the constant strides let each thread load a
    # token's groups as one vector, which Triton then pipelines with the codes (cp.async) instead of issuing 16-bit
    # gathers whose latency every step waited for
    off_vparams = tile_tokens(o_c, VW)[None, None, :] * NVG + o_vg  # [D / GROUP, 1, BLOCK_N]
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
            kc_ptr + (t0 // KW) * stride_kcr + off_kw,
            ks_ptr + (t0 // GROUP) * stride_ksg + off_ks,
            km_ptr + (t0 // GROUP) * stride_kmg + off_km,
            kn_ptr + t0 * stride_knt + off_kn,
            vc_ptr + (t0 // VW) * stride_vcr + off_vw,
            vs_ptr + t0 * NVG + off_vparams,
            vm_ptr + t0 * NVG + off_vparams,
            mask_ptr + t0 * stride_mt + off_mask,
            BLOCK_N, HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, HAS_MASK, False,
        )  # fmt: skip
    if PARTIAL_BLOCK and full_hi < block_hi:  # the last block of the cache is partial
        t0 = full_hi * BLOCK_N
        acc, m_i, l_i = _quantized_block(
            acc, m_i, l_i, b_q, qk_scale,
            kc_ptr + (t0 // KW) * stride_kcr + off_kw,
            ks_ptr + (t0 // GROUP) * stride_ksg + off_ks,
            km_ptr + (t0 // GROUP) * stride_kmg + off_km,
            kn_ptr + t0 * stride_knt + off_kn,
            vc_ptr + (t0 // VW) * stride_vcr + off_vw,
            vs_ptr + t0 * NVG + off_vparams,
            vm_ptr + t0 * NVG + off_vparams,
            mask_ptr + t0 * stride_mt + off_mask,
            num_quantized - t0, HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, HAS_MASK, True,
        )  # fmt: skip
    return acc, m_i, l_i
