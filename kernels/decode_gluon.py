"""The quantized tokens of a decode step in Gluon: codes unpacked straight into tensor-core fragments.

`decode_attention_triton` (kernels/decode_attention.py) launches `_gluon_split_kernel` where `supports` allows it
(CUDA, D = 128, keys and values of 2 or 4 bits each, groups of 32, fp16 scales, at most 8 query rows per KV head):
it reads every full 128-token block of the quantized region and writes one partial (o in the values' stored domain,
m, l in base 2) per warp into the same partial buffer as the Triton split kernel, whose programs then read only the
partial last block and the residual window (and write the query operand this kernel reads), and whose merge kernel
combines them all.

Why Gluon: Triton chooses the register layouts of `tl.dot`'s operands, and its split kernel spends ~5 instructions
per code, half of them moving the unpacked tiles and the query through shared memory and registers into those
layouts (docs/kernels.md). Here the layouts are ours: each lane reads the storage words whose codes it
holds in the MMA's fragments, so a pair of codes becomes an operand register with a `lop3` and a `sub.f16x2` (keys:
and an `fma.f16x2`), about 2.4 instructions per code in all (`benchmarks/count_sass.py --gluon`).

The storage is the cache's (`oscar_hf.layout`): word [row, d] holds the codes of tokens 16 row + j at bits 2j.
Programs of two warps step over 128-token blocks (8 word rows); up to 8 query rows per KV head are the MMA's N.
4-bit keys or values (word [row, d]: tokens 8 row + j at bits 4 j, 16 word rows a block) keep every lane's logical
tokens, so that only the unpacking differs (last item below).

- Loads: each block's words and parameters are copied into shared memory one step ahead (cp.async, two stages,
  25 KB per program at 2 bits, 42 KB at 4; no registers held while they travel), in swizzles that make the fragment
  loads conflict-free.
- Warps: warp h takes word rows 4 h .. 4 h + 3 of each step (its stored tokens 64 h .. 64 h + 63): its own online
  softmax over them, as a batched MMA whose batch is the warp, and its own partial. A 16-bit half of a word holds 8
  tokens of a channel; with the word and the word shifted right by 8 (`_code_pairs`), token 4 s + m of each half lies
  at bits 2 m of both halves, m < 4.
- Codes to fp16 (`_code_bits`): with the code at bits 2 m of the mantissa of E = 2^(8 - 2 m), the `lop3`
  (p & mask) | E reads E + c / 4 exactly, and less E it is c / 4. Keys: k = (c / 4) (4 s) + m, one `fma.f16x2`
  rounded once, as the Triton kernel's `c s + m` (docs/kernels.md: why E is not folded into the minimum). A lane's
  tokens lie in one 32-token key group.
- Scores as S^T = K Q^T (m16n8k16: the tokens are the MMA's M): lane (g, i) holds rows g + 8 r1 of m-tile mt, the
  stored token 16 (4 h + g // 2) + 8 (g % 2) + mt + 4 r1 (`stored_token`), and channel pairs (2 c, 2 c + 1). Their
  codes are in two words (one per channel) of word row 4 h + g // 2; one `prmt` joins half g % 2 of both, so that
  one `lop3` then gives a channel pair of one token.
- Values as O^T = V^T P^T (channels as M), tokens in the same logical order: lane (g, i) holds k = e + 2 i + 8 s +
  16 kt, the stored token 16 (4 h + i) + 8 e + kt + 4 s: tokens kt + 4 s of both halves of one word of row 4 h + i,
  so that one `lop3` gives a k-pair of the operand, and a lane reads one word per channel. Value parameters are per
  token and 32-channel group: P^T is scaled per group (s), the codes are c / 4 (the sums are multiplied by 4 once, at
  the end), and the minima go in through a fifth MMA whose A rows are the groups' minima.
- Online softmax (base 2) over the query rows, the key padding mask per step where a program's range has padding.
- 4 bits: logical row R's 8-token halves are word rows 2 R and 2 R + 1, and a 16-bit half holds 4 tokens, so one
  `prmt` takes the same 16-bit half of two words (keys: of one word row's two channels, the lane reading its own
  row 2 R + g % 2; values: of rows 2 R and 2 R + 1, the two halves of a k-pair) and the shift by 8 leaves token
  2 s + m at bits 4 m, m < 2; with E = 2^(8 - 4 m) the codes read c / 4 as at 2 bits, so the rest is shared.
- Hopper: launched as a programmatic dependent of the Triton split kernel (PDL): the programs start and copy their
  first block while that kernel runs, then wait for the query operand it writes.

The same kernel reads the serving pool's pages (`launch_paged`, `PAGED`: a page is one 128-token block, copied from
where the request's row of the block table says; `kernels/decode_paged.py`).

Gluon has no CPU interpreter: the CPU CI runs the Triton kernel and the launch around this one (a float64 stand-in);
tests/kernels/test_decode_attention.py checks this one against the float64 reference on the GPU, and
benchmarks/fuzz_kernels.py on random cases. Measured: docs/kernels.md.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

from .common import interpreting
from .decode_gluon_layouts import (
    A_OP,
    B_OP,
    BIAS_BY_GROUP,
    BLOCK,
    HALF,
    K4_CODES,
    K4_WORDS,
    K_CODES,
    K_GROUP_PAIRS,
    K_PAIRS,
    K_PAIRS_BY_GROUP,
    K_PARAMS_COPY,
    K_PARAMS_SMEM,
    K_WORDS,
    K_WORDS_SMEM,
    MMA,
    NORMS_COPY,
    NORMS_SMEM,
    ROWS,
    V4_CODES,
    V4_WORDS,
    V4_WORDS_SMEM,
    V_CODES,
    V_PARAMS,
    V_PARAMS_COPY,
    V_PARAMS_SMEM,
    V_WORDS,
    V_WORDS_SMEM,
    WORDS_COPY,
    D,
    column,
    expand,
    tokens,
)
from .decode_workspace import nothing
from .launching import BoundKernel

# Gluon names that changed after Triton 3.6 (the GPU image's): the cp.async copy and the CTA barrier
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

WARPS = 2  # per program: one partial each


@gluon.jit
def _code_pairs(w, CODES: gl.constexpr, M_LAYOUT: gl.constexpr, BITS: gl.constexpr):
    """Value words, or the words that a `prmt` made of a key channel pair's halves, w [...] -> p [..., 2 s, 1] int32
    in CODES, and `_code_bits`' mask and E for m < 8 / BITS ([1, ..., 1, 8 / BITS]; M_LAYOUT: CODES sliced down to its
    last dim): p holds w and w >> 8, so that the code of token (8 / BITS) s + m of each 16-bit half lies at bits
    BITS m of that half (the mask drops the bits above)."""
    n: gl.constexpr = w.type.shape.__len__() + 1  # the new dim s; m follows it
    p = gl.convert_layout(gl.join(w, w >> 8), gl.SliceLayout(n, CODES), assert_trivial=True)
    mask, base = _code_bits(expand(gl.arange(0, 8 // BITS, layout=M_LAYOUT), n, True), BITS)
    return gl.expand_dims(p, n), mask, base


@gluon.jit
def _code_bits(m, BITS: gl.constexpr):
    """The mask of the BITS-bit codes at bits BITS m of both halves, and E = 2^(8 - BITS m) as an fp16 pair: with the
    code there, E's mantissa bits read E + c / 4 (exact: the code ends at bit 7 of the 10), so that less E is c / 4."""
    return ((1 << BITS) - 1) * 0x00010001 << (BITS * m), 0x5C005C00 - BITS * m * 0x04000400


@gluon.jit
def _halves(w_even, w_odd, half):
    """One `prmt`: 16-bit half `half` (0 or 1) of both words, w_even's in the low half, w_odd's in the high one."""
    return gl.inline_asm_elementwise(
        "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [w_even, w_odd, 0x5410 + 0x2222 * half], dtype=gl.int32,
        is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _grid_dependency(instruction: gl.constexpr):
    """`griddepcontrol.launch_dependents` or `.wait` (programmatic dependent launch, sm_90)."""
    gl.inline_asm_elementwise(instruction + " // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _copy_block(
    smem, src, pages, block, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr, TOKEN_SCALING: gl.constexpr,
    PAGED: gl.constexpr,
):  # fmt: skip
    """Start copying block `block`'s codes and parameters into shared-memory stage block % 2 (cp.async by both warps,
    no registers held while they travel: the step that reads them waits for them). PAGED: the block is the page that
    the request's row of the block table names (`pages`: that row, and each field's page stride)."""
    kw_s, vw_s, ks_s, km_s, vs_s, vm_s, kn_s = smem
    kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, stride_kcr, stride_ksg, stride_kmg, stride_vcr = src
    stage = block % 2
    first = block  # the block's place in the storage the pointers address
    if PAGED:  # a page holds one block: its own rows start at the page's origin
        table_ptr, stride_kcp, stride_ksp, stride_kmp, stride_knp, stride_vcp, stride_vsp, stride_vmp = pages
        page = gl.load(table_ptr + block).to(gl.int64)
        kc_ptr += page * stride_kcp
        ks_ptr += page * stride_ksp
        km_ptr += page * stride_kmp
        kn_ptr += page * stride_knp
        vc_ptr += page * stride_vcp
        vs_ptr += page * stride_vsp
        vm_ptr += page * stride_vmp
        first = 0
    o_rk = first * (4 * KEY_BITS) + gl.arange(0, 4 * KEY_BITS, layout=gl.SliceLayout(1, WORDS_COPY))  # word rows
    o_rv = first * (4 * VALUE_BITS) + gl.arange(0, 4 * VALUE_BITS, layout=gl.SliceLayout(1, WORDS_COPY))
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, WORDS_COPY))
    _async_load(kw_s.index(stage), kc_ptr + o_rk[:, None] * stride_kcr + o_d[None, :])
    _async_load(vw_s.index(stage), vc_ptr + o_rv[:, None] * stride_vcr + o_d[None, :])
    o_grp = first * 4 + gl.arange(0, 4, layout=gl.SliceLayout(1, K_PARAMS_COPY))
    o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, K_PARAMS_COPY))
    _async_load(ks_s.index(stage), ks_ptr + o_grp[:, None] * stride_ksg + o_c[None, :])
    _async_load(km_s.index(stage), km_ptr + o_grp[:, None] * stride_kmg + o_c[None, :])
    # value parameters and key norms in each warp's logical token order (the order its MMA fragments hold them in)
    o_k = first * BLOCK + tokens(gl.SliceLayout(2, V_PARAMS_COPY))
    o_vg = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_PARAMS_COPY)))
    _async_load(vs_s.index(stage), vs_ptr + o_k[:, :, None] * 4 + o_vg[None, None, :])
    _async_load(vm_s.index(stage), vm_ptr + o_k[:, :, None] * 4 + o_vg[None, None, :])
    if TOKEN_SCALING:
        _async_load(kn_s.index(stage), kn_ptr + first * BLOCK + tokens(NORMS_COPY))


@gluon.jit
def _key_operand(words, scale, minimum, KEY_BITS: gl.constexpr):
    """The warp's K tile [2 h, 64 logical tokens, D] as the first MMA operand, dequantized (fp16), from the step's
    words [4 KEY_BITS word rows, D] (K_WORDS, K4_WORDS) and scale/min pairs [4 groups, 64 channel pairs] (int32): c / 4
    (`_code_bits`) times 4 s plus m, one `fma.f16x2` rounded once, as the Triton kernel's c s + m."""
    w_even, w_odd = gl.split(gl.reshape(words, [4 * KEY_BITS, 64, 2]))  # channels 2 c, 2 c + 1 of each word row
    s4 = gl.inline_asm_elementwise(  # 4 s (exact)
        "{ .reg .b32 c4; mov.b32 c4, 0x44004400; mul.rn.f16x2 $0, $1, c4; }", "=r,r", [scale], dtype=gl.int32,
        is_pure=True, pack=1,
    )  # fmt: skip
    s4 = _by_word_row(s4)  # [8 R, 64 c]
    minimum = _by_word_row(minimum)
    if KEY_BITS == 2:  # lanes g and g + 1 read the same words of row R and keep half g0 of each
        rcg: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, K_CODES))  # [R, c, g0]
        w_even = gl.convert_layout(w_even, gl.SliceLayout(2, rcg), assert_trivial=True)[:, :, None]
        w_odd = gl.convert_layout(w_odd, gl.SliceLayout(2, rcg), assert_trivial=True)[:, :, None]
        o_g0 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, rcg)))
        w = _halves(w_even, w_odd, o_g0[None, None, :])
        m_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, K_CODES))))
        p, mask, base = _code_pairs(w, K_CODES, m_layout, 2)  # [R, c, g0, r1, 1]
        s4 = expand(gl.convert_layout(s4, gl.SliceLayout(2, rcg), assert_trivial=True), 3, False)
        minimum = expand(gl.convert_layout(minimum, gl.SliceLayout(2, rcg), assert_trivial=True), 3, False)
    else:  # 8 tokens a word: each lane reads its own word row 2 R + g0 and takes half r1 of each
        rcgr: gl.constexpr = gl.SliceLayout(4, gl.SliceLayout(5, K4_CODES))  # [R, c, g0, r1]
        rcg: gl.constexpr = gl.SliceLayout(3, rcgr)
        w_even = gl.permute(gl.reshape(w_even, [8, 2, 64]), [0, 2, 1])  # word row 2 R + g0 -> [R, c, g0]
        w_odd = gl.permute(gl.reshape(w_odd, [8, 2, 64]), [0, 2, 1])
        w_even = gl.convert_layout(w_even, rcg, assert_trivial=True)[:, :, :, None]
        w_odd = gl.convert_layout(w_odd, rcg, assert_trivial=True)[:, :, :, None]
        o_r1 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, rcgr))))
        w = _halves(w_even, w_odd, o_r1[None, None, None, :])
        m_layout: gl.constexpr = gl.SliceLayout(
            0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, K4_CODES))))
        )
        p, mask, base = _code_pairs(w, K4_CODES, m_layout, 4)  # [R, c, g0, r1, s, 1]: mt = 2 s + m
        s4 = expand(gl.convert_layout(s4, gl.SliceLayout(2, rcg), assert_trivial=True), 4, False)
        minimum = expand(gl.convert_layout(minimum, gl.SliceLayout(2, rcg), assert_trivial=True), 4, False)
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0xea; sub.rn.f16x2 t, t, $4; fma.rn.f16x2 t, t, $5, $6;"
        " mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r,r,r", [p, mask, base, s4, minimum], dtype=(gl.float16, gl.float16), is_pure=True, pack=1,
    )  # fmt: skip
    k = gl.reshape(gl.join(lo, hi), [2, 4, 64, 2, 2, 4, 2])  # [h, gh, c, g0, r1, mt, e]
    k = gl.reshape(gl.permute(k, [0, 5, 4, 1, 3, 2, 6]), [2, HALF, D])  # [h | mt, r1, gh, g0 | c, e]
    return gl.convert_layout(k, A_OP, assert_trivial=True)


@gluon.jit
def _by_word_row(x):
    """Key parameters [4 groups, 64 pairs] (loaded in K_GROUP_PAIRS' slice) -> [8 word rows, 64 pairs] (K_PAIRS): word
    rows 2 j, 2 j + 1 (tokens 32 j .. 32 j + 31) belong to group j; the lanes of both rows read the same words."""
    x, _ = gl.broadcast(gl.expand_dims(x, 1), gl.zeros([4, 2, 64], gl.int32, layout=K_PAIRS_BY_GROUP))
    return gl.convert_layout(gl.reshape(x, [8, 64]), K_PAIRS, assert_trivial=True)


@gluon.jit
def _value_operand(words, VALUE_BITS: gl.constexpr):
    """Words of 32 channels [4 VALUE_BITS word rows, 32 channels] (V_WORDS, V4_WORDS) -> the warp's [2 h, 32, 64
    logical tokens] as the first MMA operand: fp16 c / 4 (`_code_bits`)."""
    if VALUE_BITS == 2:  # a k-pair's halves e are the two halves of one word
        m_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, V_CODES)))
        p, mask, base = _code_pairs(words, V_CODES, m_layout, 2)  # [R, ch, s, 1]
    else:  # 8 tokens a word: a k-pair's halves e are word rows 2 R + e; half s of both
        rcs: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, V4_CODES))  # [R, ch, s]
        w_e0, w_e1 = gl.split(gl.permute(gl.reshape(words, [8, 2, 32]), [0, 2, 1]))  # [R, ch] each
        w_e0 = gl.convert_layout(w_e0, gl.SliceLayout(2, rcs), assert_trivial=True)[:, :, None]
        w_e1 = gl.convert_layout(w_e1, gl.SliceLayout(2, rcs), assert_trivial=True)[:, :, None]
        o_s = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, rcs)))
        w = _halves(w_e0, w_e1, o_s[None, None, :])
        m_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, V4_CODES))))
        p, mask, base = _code_pairs(w, V4_CODES, m_layout, 4)  # [R, ch, s, s2, 1]: kt = 2 s2 + m
    lo, hi = gl.inline_asm_elementwise(
        "{ .reg .b32 t; lop3.b32 t, $2, $3, $4, 0xea; sub.rn.f16x2 t, t, $4; mov.b32 {$0, $1}, t; }",
        "=h,=h,r,r,r", [p, mask, base], dtype=(gl.float16, gl.float16), is_pure=True, pack=1,
    )  # fmt: skip
    v = gl.reshape(gl.join(lo, hi), [2, 4, 32, 2, 4, 2])  # [h, i, ch, s, kt, e]
    v = gl.reshape(gl.permute(v, [0, 2, 4, 3, 1, 5]), [2, 32, HALF])  # [h | ch | kt, s, i, e]
    return gl.convert_layout(v, A_OP, assert_trivial=True)


@gluon.jit
def _step(
    acc0, acc1, acc2, acc3, bias, m_i, l_i, q, q_scale, smem, src, pages, mask_ptr, block, block_hi, stride_mt,
    KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr, TOKEN_SCALING: gl.constexpr, MASKED: gl.constexpr,
    PAGED: gl.constexpr,
):  # fmt: skip
    """One 128-token step of both warps' online softmax: scores, softmax update, P^T V with the value parameters
    folded. Its data is in shared memory (`_copy_block` started it one step earlier); it starts the next block's copy
    first."""
    kw_s, vw_s, ks_s, km_s, vs_s, vm_s, kn_s = smem
    stage = block % 2
    async_copy.wait_group(0)  # this block's copies (the only ones in flight) have landed ...
    _barrier()  # ... for every thread, and every thread is done reading the other stage
    if block + 1 < block_hi:
        _copy_block(smem, src, pages, block + 1, KEY_BITS, VALUE_BITS, TOKEN_SCALING, PAGED)
    async_copy.commit_group()

    k_op = _key_operand(
        kw_s.index(stage).load(K_WORDS if KEY_BITS == 2 else K4_WORDS), ks_s.index(stage).load(K_GROUP_PAIRS),
        km_s.index(stage).load(K_GROUP_PAIRS), KEY_BITS,
    )  # fmt: skip
    s = mma_v2(k_op, q, gl.zeros([2, HALF, ROWS], gl.float32, layout=MMA))  # S^T [h, logical tokens, rows]
    scale = gl.full([2, HALF], 1.0, gl.float32, layout=gl.SliceLayout(2, MMA)) * q_scale
    if TOKEN_SCALING:
        scale = kn_s.index(stage).load(gl.SliceLayout(2, MMA)) * q_scale
    s = s * scale[:, :, None]
    if MASKED:
        tok = block * BLOCK + tokens(gl.SliceLayout(2, MMA))
        s = gl.where((gl.load(mask_ptr + tok * stride_mt) != 0)[:, :, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing to attend to yet
    p = gl.exp2(s - m_use[:, None, :])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)

    p_op = gl.convert_layout(p.to(gl.float16), B_OP)  # P^T [h, logical tokens, rows]
    # value parameters [h, 64 x, 4 groups]: the scale folded into P^T per group (the codes read c / 4: the sums are
    # multiplied by 4 once, at the end) ...
    s_even, s_odd = gl.split(gl.reshape(vs_s.index(stage).load(V_PARAMS), [2, HALF, 2, 2]))  # groups 0, 2 and 1, 3
    s0, s2 = gl.split(s_even)
    s1, s3 = gl.split(s_odd)
    # ... and the minima through the bias MMA: A rows 4 r + j are group j's minima over the logical tokens (rows 0-3
    # are read at the end, the copies in rows 4-15 cost nothing: the operand's registers repeat)
    vb = gl.expand_dims(vm_s.index(stage).permute([0, 2, 1]).load(gl.SliceLayout(1, BIAS_BY_GROUP)), 1)
    vb, _ = gl.broadcast(vb, gl.zeros([2, 4, 4, HALF], gl.float16, layout=BIAS_BY_GROUP))
    vb = gl.convert_layout(gl.reshape(vb, [2, 16, HALF]), A_OP, assert_trivial=True)
    # Each step's products are summed from zero and added to the running sums in fp32: chaining the MMAs onto the
    # running accumulator (mma(a, b, acc * alpha)) rounds every tensor-core accumulation of the long sum, and the
    # value sums (codes times scales) and their minima's sum cancel where the output is small: the relative error then
    # grows with the steps per program (docs/kernels.md).
    alpha_c = alpha[:, None, :]
    zero = gl.zeros([2, 32, ROWS], gl.float32, layout=MMA)
    bias = bias * alpha_c + mma_v2(vb, p_op, gl.zeros([2, 16, ROWS], gl.float32, layout=MMA))
    v_s = vw_s.index(stage)
    v_words: gl.constexpr = V_WORDS if VALUE_BITS == 2 else V4_WORDS
    acc0 = acc0 * alpha_c + mma_v2(
        _value_operand(v_s.slice(0, 32, dim=1).load(v_words), VALUE_BITS), p_op * column(s0), zero
    )
    acc1 = acc1 * alpha_c + mma_v2(
        _value_operand(v_s.slice(32, 32, dim=1).load(v_words), VALUE_BITS), p_op * column(s1), zero
    )
    acc2 = acc2 * alpha_c + mma_v2(
        _value_operand(v_s.slice(64, 32, dim=1).load(v_words), VALUE_BITS), p_op * column(s2), zero
    )
    acc3 = acc3 * alpha_c + mma_v2(
        _value_operand(v_s.slice(96, 32, dim=1).load(v_words), VALUE_BITS), p_op * column(s3), zero
    )
    return acc0, acc1, acc2, acc3, bias, m_new, l_i


@gluon.jit
def _any_masked(mask_ptr, start, end, stride_mt):
    """Whether the key padding mask excludes any of tokens [start, end)."""
    found = 0
    for chunk in range(start, end, 1024):
        o_t = chunk + gl.arange(0, 1024, layout=gl.BlockedLayout([4], [32], [2], [0]))
        excluded = gl.load(mask_ptr + o_t * stride_mt, mask=o_t < end, other=1) == 0
        found = gl.maximum(found, gl.max(excluded.to(gl.int32), axis=0))
    return found != 0


# Each field's stride from one page to the next (PAGED: the serving pool's pages, `launch_paged`).
PAGE_STRIDES = ("stride_kcp", "stride_ksp", "stride_kmp", "stride_knp", "stride_vcp", "stride_vsp", "stride_vmp")
_NOT_SPECIALISED = (
    "num_quantized", "num_residual", "num_sinks", "blocks_per_split", "num_parts", "stride_mb", "stride_table",
)  # fmt: skip


@gluon.jit(do_not_specialize=_NOT_SPECIALISED)
def _gluon_split_kernel(
    q_op_ptr, q_scale_ptr, kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, mask_ptr, length_ptr,
    table_ptr, count_ptr, part_o_ptr, part_ml_ptr,
    num_kv_heads, num_quantized, num_residual, num_sinks, blocks_per_split, num_parts,
    stride_kcb, stride_kch, stride_kcr, stride_ksb, stride_ksh, stride_ksg, stride_kmb, stride_kmh, stride_kmg,
    stride_knb, stride_vcb, stride_vch, stride_vcr, stride_vsb, stride_vsh, stride_vmb, stride_vmh, stride_mb,
    stride_mt, stride_table, stride_kcp, stride_ksp, stride_kmp, stride_knp, stride_vcp, stride_vsp, stride_vmp,
    ROWS_USED: gl.constexpr, KEY_BITS: gl.constexpr, VALUE_BITS: gl.constexpr, TOKEN_SCALING: gl.constexpr,
    HAS_MASK: gl.constexpr, DEVICE_LENGTH: gl.constexpr, PDL: gl.constexpr, PAGED: gl.constexpr,
):  # fmt: skip
    """Program (bh, s) runs the online softmax over full blocks [s * blocks_per_split, ...) of KV head bh, each warp
    over its half of every block, and writes partial slots 2 s (warp 0) and 2 s + 1 (warp 1). `q_op_ptr`
    [B * Hkv, D, 8] fp16 and `q_scale_ptr` [B * Hkv] fp32: the query operand and its score scale (base 2), as the
    Triton split kernel's `query_operand` makes them. The key and value codes' channels and the key scale/min pairs
    (int32 views) are contiguous, the value parameters [tokens, 4] and norms [tokens] too. PDL (launched as a
    programmatic dependent of the Triton split kernel, which writes the query operand): the programs start while that
    kernel runs and copy their first block (the cache was written before it started) before they wait for it; the
    merge kernel is launched the same way, at once.
    PAGED (the serving pool's pages, `decode_paged.py`): request b's blocks are the `count_ptr[b]` pages its row of
    `table_ptr` names, spread over the splits as the Triton paged kernel spreads them (the batch strides are 0, each
    field's page stride is `stride_*p`); no padding mask, no device length."""
    if PDL:
        _grid_dependency("griddepcontrol.launch_dependents;")
    bh = gl.program_id(0).to(gl.int64)
    split = gl.program_id(1)
    b = bh // num_kv_heads
    h = bh % num_kv_heads
    if DEVICE_LENGTH:  # as the Triton kernel: the tokens held decide what is read
        held = gl.load(length_ptr)
        window = num_residual - num_sinks
        num_quantized = (gl.maximum(held - num_sinks - 1, 0) // window * window).to(gl.int32)
    if PAGED:
        count = gl.load(count_ptr + b)
        num_quantized = count * BLOCK
        blocks_per_split = (count + gl.num_programs(1) - 1) // gl.num_programs(1)
        table_ptr += b * stride_table
    kc_ptr += b * stride_kcb + h * stride_kch
    ks_ptr += b * stride_ksb + h * stride_ksh
    km_ptr += b * stride_kmb + h * stride_kmh
    kn_ptr += b * stride_knb
    vc_ptr += b * stride_vcb + h * stride_vch
    vs_ptr += b * stride_vsb + h * stride_vsh
    vm_ptr += b * stride_vmb + h * stride_vmh
    mask_ptr += b * stride_mb
    m_i = gl.full([2, ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, MMA))
    l_i = gl.zeros([2, ROWS], gl.float32, layout=gl.SliceLayout(1, MMA))
    acc0 = gl.zeros([2, 32, ROWS], gl.float32, layout=MMA)  # O^T of value group 0: [h, channels 0-31, rows]
    acc1 = gl.zeros([2, 32, ROWS], gl.float32, layout=MMA)
    acc2 = gl.zeros([2, 32, ROWS], gl.float32, layout=MMA)
    acc3 = gl.zeros([2, 32, ROWS], gl.float32, layout=MMA)
    bias = gl.zeros([2, 16, ROWS], gl.float32, layout=MMA)  # rows 0-3: sum_t p_t m_t per value group

    block_lo = split * blocks_per_split
    block_hi = gl.maximum(block_lo, gl.minimum(block_lo + blocks_per_split, num_quantized // BLOCK))
    smem = (
        gl.allocate_shared_memory(gl.int32, [2, 4 * KEY_BITS, D], K_WORDS_SMEM),
        gl.allocate_shared_memory(gl.int32, [2, 4 * VALUE_BITS, D], V_WORDS_SMEM if VALUE_BITS == 2 else V4_WORDS_SMEM),
        gl.allocate_shared_memory(gl.int32, [2, 4, 64], K_PARAMS_SMEM),
        gl.allocate_shared_memory(gl.int32, [2, 4, 64], K_PARAMS_SMEM),
        gl.allocate_shared_memory(gl.float16, [2, 2, HALF, 4], V_PARAMS_SMEM),
        gl.allocate_shared_memory(gl.float16, [2, 2, HALF, 4], V_PARAMS_SMEM),
        gl.allocate_shared_memory(gl.float32, [2, 2, HALF if TOKEN_SCALING else 1], NORMS_SMEM),
    )
    src = (kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, stride_kcr, stride_ksg, stride_kmg, stride_vcr)
    pages = (table_ptr, stride_kcp, stride_ksp, stride_kmp, stride_knp, stride_vcp, stride_vsp, stride_vmp)
    if block_lo < block_hi:
        _copy_block(smem, src, pages, block_lo, KEY_BITS, VALUE_BITS, TOKEN_SCALING, PAGED)
    async_copy.commit_group()
    if PDL:
        _grid_dependency("griddepcontrol.wait;")
    o_dq = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(2, B_OP)))
    o_rq = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, B_OP)))
    q = gl.load(q_op_ptr + bh * D * ROWS + o_dq[None, :, None] * ROWS + o_rq[None, None, :])  # [1, D, rows] fp16
    q, _ = gl.broadcast(q, gl.zeros([2, D, ROWS], gl.float16, layout=B_OP))  # both warps
    q_scale = gl.load(q_scale_ptr + bh)
    # Two copies of the loop, the step compiled with and without the mask (as the Triton kernel's `_any_masked`
    # dispatch): moving the loop into a helper called twice with the arguments as a tuple makes Triton 3.6 (the GPU
    # image's) fail an assertion while lowering the kernel without token scaling (3.9 compiles it).
    if HAS_MASK and _any_masked(mask_ptr, block_lo * BLOCK, block_hi * BLOCK, stride_mt):
        for block in range(block_lo, block_hi):
            acc0, acc1, acc2, acc3, bias, m_i, l_i = _step(
                acc0, acc1, acc2, acc3, bias, m_i, l_i, q, q_scale, smem, src, pages, mask_ptr, block, block_hi,
                stride_mt, KEY_BITS, VALUE_BITS, TOKEN_SCALING, True, PAGED,
            )  # fmt: skip
    else:
        for block in range(block_lo, block_hi):
            acc0, acc1, acc2, acc3, bias, m_i, l_i = _step(
                acc0, acc1, acc2, acc3, bias, m_i, l_i, q, q_scale, smem, src, pages, mask_ptr, block, block_hi,
                stride_mt, KEY_BITS, VALUE_BITS, TOKEN_SCALING, False, PAGED,
            )  # fmt: skip

    # partials as the Triton kernel's: part_o [B * Hkv, parts, rows, D], part_ml [..., rows, 2] (m, l), fp32; warp h
    # writes slot 2 split + h
    o_h = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(2, MMA)))[:, None, None]
    o_g = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))[None, :, None]
    o_c = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, MMA)))[None, :, None]
    o_r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))[None, None, :]
    slot = (bh * num_parts + 2 * split + o_h) * ROWS_USED
    p_o = part_o_ptr + (slot + o_r) * D + o_c
    m_o = o_r < ROWS_USED
    gl.store(p_o, 4.0 * acc0 + gl.sum(gl.where(o_g == 0, bias, 0.0), axis=1)[:, None, :], mask=m_o)
    gl.store(p_o + 32, 4.0 * acc1 + gl.sum(gl.where(o_g == 1, bias, 0.0), axis=1)[:, None, :], mask=m_o)
    gl.store(p_o + 64, 4.0 * acc2 + gl.sum(gl.where(o_g == 2, bias, 0.0), axis=1)[:, None, :], mask=m_o)
    gl.store(p_o + 96, 4.0 * acc3 + gl.sum(gl.where(o_g == 3, bias, 0.0), axis=1)[:, None, :], mask=m_o)
    o_hs = gl.arange(0, 2, layout=gl.SliceLayout(1, gl.SliceLayout(1, MMA)))[:, None]
    o_rs = gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, MMA)))[None, :]
    p_ml = part_ml_ptr + ((bh * num_parts + 2 * split + o_hs) * ROWS_USED + o_rs) * 2
    gl.store(p_ml, m_i, mask=o_rs < ROWS_USED)
    gl.store(p_ml + 1, l_i, mask=o_rs < ROWS_USED)


def supports(query, quantized, config, block_m: int) -> tuple[bool, str]:
    """Whether this kernel can read the full blocks of these inputs, and why not: it is compiled for what the usual
    decode step has, a CUDA GPU of compute capability 8.0 or newer (mma.sync), D = 128, keys and values whose codes fill
    whole bytes (2 or 4 bits) in groups of 32, fp16 scales, query tiles of 8 rows per KV head, the storage's channels
    contiguous. The widths are checked first, so that the reason for 3-bit codes is the same on any device."""
    if any(8 % bits for bits in (config.key_bits, config.value_bits)):  # its unpacking reads codes byte by byte
        return (
            False,
            f"compiled for codes that fill whole bytes (2 or 4 bits; 3-bit codes are bit planes, whose fragments it "
            f"does not unpack); got {config.key_bits}-bit keys, {config.value_bits}-bit values",
        )
    if query.device.type != "cuda" or interpreting():
        return False, "Gluon kernels run on CUDA GPUs only (Triton's interpreter cannot run them)"
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return False, f"{torch.cuda.get_device_name(query.device)} predates compute capability 8.0 (mma.sync)"
    got = (query.shape[3], config.group_size, config.scale_torch_dtype)
    if got != (D.value, 32, torch.float16):
        return (
            False,
            f"compiled for head_dim 128, groups of 32, fp16 scales; got (head_dim, group_size, scale dtype) = {got}",
        )
    if block_m != ROWS.value:
        return False, f"compiled for query tiles of {ROWS.value} rows per KV head; these need {block_m}"
    codes_and_pairs = (quantized.key_codes, quantized.key_scale, quantized.key_min, quantized.value_codes)
    if any(t.stride(-1) != 1 or t.storage_offset() % 2 for t in codes_and_pairs):  # int32 views of fp16 pairs
        return False, "the codes' and key parameters' channels must be contiguous, the parameters at even offsets"
    if quantized.key_norms is not None and quantized.key_norms.stride(-1) != 1:
        return False, "the key norms must be contiguous over tokens"
    return True, ""


# what `launch` passes per call: the tensors, then the sizes a decode changes every step (the residual tokens held, the
# padding mask's row stride: the attention mask grows by a token per step), which the kernel does not specialise on
_PER_CALL = ("q_op_ptr", "q_scale_ptr", "kc_ptr", "ks_ptr", "km_ptr", "kn_ptr", "vc_ptr", "vs_ptr", "vm_ptr",
             "mask_ptr", "length_ptr", "part_o_ptr", "part_ml_ptr", "num_residual", "stride_mb")  # fmt: skip


def bind(
    grid, quantized, key_norms, mask, length, num_quantized, blocks_per_split, num_parts, rows, key_bits, value_bits,
    token_scaling, has_mask, max_registers, ptxas_options, pdl, num_sinks=0,
) -> BoundKernel:  # fmt: skip
    """`_gluon_split_kernel` over `grid` = (B * Hkv, splits) with these inputs' strides and the launch's sizes (`mask`
    and `key_norms` may be empty placeholders; `length` None or the device count), compiled with `ptxas_options` (a
    string, or None for Triton's); `launch` gives it the tensors and sizes of each call (`_PER_CALL`). `num_sinks`:
    with `length`, the exact tokens before the window (the quantized ones start after them)."""
    kc, vc, vs, vm = quantized.key_codes, quantized.value_codes, quantized.value_scale, quantized.value_min
    ks, km = quantized.key_scale.view(torch.int32), quantized.key_min.view(torch.int32)  # channel pairs
    strides = dict(
        zip(("stride_kcb", "stride_kch", "stride_kcr"), kc.stride()[:3]),
        **dict(zip(("stride_ksb", "stride_ksh", "stride_ksg"), ks.stride()[:3])),
        **dict(zip(("stride_kmb", "stride_kmh", "stride_kmg"), km.stride()[:3])),
        stride_knb=key_norms.stride(0),
        **dict(zip(("stride_vcb", "stride_vch", "stride_vcr"), vc.stride()[:3])),
        **dict(zip(("stride_vsb", "stride_vsh"), vs.stride()[:2])),
        **dict(zip(("stride_vmb", "stride_vmh"), vm.stride()[:2])),
        stride_mt=mask.stride(1),
    )
    unpaged = nothing(kc.device, 1)  # no block table, and no page strides: read only with PAGED
    constants = dict(
        table_ptr=unpaged, count_ptr=unpaged, stride_table=0, **dict.fromkeys(PAGE_STRIDES, 0),
        num_kv_heads=kc.shape[1], num_quantized=num_quantized, num_sinks=num_sinks,
        blocks_per_split=blocks_per_split, num_parts=num_parts, **strides,
        ROWS_USED=rows, KEY_BITS=key_bits, VALUE_BITS=value_bits, TOKEN_SCALING=token_scaling, HAS_MASK=has_mask,
        DEVICE_LENGTH=length is not None, PDL=pdl, PAGED=False,
        num_warps=WARPS, launch_pdl=pdl,
        **({"maxnreg": max_registers} if max_registers else {}),
        **({"ptx_options": ptxas_options} if ptxas_options else {}),
    )  # fmt: skip
    return BoundKernel(_gluon_split_kernel, grid, constants, _PER_CALL)


def launch_paged(grid, q_op, q_scale, pages, block_table, page_counts, part_o, part_ml, config, pdl) -> None:
    """`_gluon_split_kernel` over the serving pool's pages (`decode_paged.paged_decode_attention`, which checked
    `supports` and wrote the query operand): program (bh, s) reads its share of request b's pages, each page one
    block, and writes partial slots 2 s and 2 s + 1 of `part_o`'s; `pdl`: launched as a programmatic dependent of the
    Triton kernel that writes the query operand. Launched through `kernel[grid]`: a pool's batch, table and split
    count change from step to step (its decode steps run under CUDA graphs)."""
    kc, vc, vs, vm = pages.key_codes, pages.value_codes, pages.value_scale, pages.value_min
    ks, km = pages.key_scale.view(torch.int32), pages.key_min.view(torch.int32)  # channel pairs
    norms = pages.key_norms if config.token_scaling else kc  # a placeholder pointer without scaling
    unused = nothing(kc.device, 1)  # no padding mask, no device length
    batch_strides = dict.fromkeys(("stride_kcb", "stride_ksb", "stride_kmb", "stride_knb", "stride_vcb"), 0)
    batch_strides.update(stride_vsb=0, stride_vmb=0)  # each page's place comes from the table
    _gluon_split_kernel[grid](
        q_op, q_scale, kc, ks, km, norms, vc, vs, vm, unused, unused, block_table, page_counts, part_o, part_ml,
        num_kv_heads=kc.shape[1], num_quantized=0, num_residual=0, num_sinks=0, blocks_per_split=0,
        num_parts=part_o.shape[1], **batch_strides,
        stride_kch=kc.stride(1), stride_kcr=kc.stride(2), stride_ksh=ks.stride(1), stride_ksg=ks.stride(2),
        stride_kmh=km.stride(1), stride_kmg=km.stride(2), stride_vch=vc.stride(1), stride_vcr=vc.stride(2),
        stride_vsh=vs.stride(1), stride_vmh=vm.stride(1), stride_mb=0, stride_mt=0,
        stride_table=block_table.stride(0), stride_kcp=kc.stride(0), stride_ksp=ks.stride(0), stride_kmp=km.stride(0),
        stride_knp=norms.stride(0) if config.token_scaling else 0, stride_vcp=vc.stride(0), stride_vsp=vs.stride(0),
        stride_vmp=vm.stride(0),
        ROWS_USED=part_o.shape[2], KEY_BITS=config.key_bits, VALUE_BITS=config.value_bits,
        TOKEN_SCALING=config.token_scaling, HAS_MASK=False, DEVICE_LENGTH=False, PDL=pdl, PAGED=True,
        num_warps=WARPS, launch_pdl=pdl,
    )  # fmt: skip


def launch(
    bound: BoundKernel, stream, q_op, q_scale, quantized, key_norms, mask, length, part_o, part_ml, num_residual
) -> None:  # fmt: skip
    """Launch `bound` (`bind`) on this call's tensors, on `stream` (`BoundKernel.__call__`)."""
    bound(
        stream, q_op, q_scale, quantized.key_codes, quantized.key_scale.view(torch.int32),
        quantized.key_min.view(torch.int32), key_norms, quantized.value_codes, quantized.value_scale,
        quantized.value_min, mask, length if length is not None else mask, part_o, part_ml, num_residual,
        mask.stride(0),
    )  # fmt: skip
