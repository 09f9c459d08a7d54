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

3-bit codes are bit planes (`oscar_hf.layout`): plane p of 32 tokens holds bit p of token j at bit j, so the same
shift by j and mask 0x10001 takes bit p of tokens j and j + 16 from each plane; shifted by p and summed over the three
planes, they are the two codes, as above with W = 32 tokens a word (`word_tokens`) and H = 16. A 3-bit tile is whole
planes: BLOCK_N a multiple of 32 (the launchers refuse others).

Keys and values of different words (2, 3 and 4 bits: 16, 32 and 8 tokens a word) permute their tiles differently: the
probabilities are permuted from the keys' column order to the values' (`keys_to_values_order`), a shuffle of the small
[M, N] tile rather than of a [D, N] one; key-side reads (norms, padding mask) follow the key tile's order, value
parameters the value tile's. Every launcher finds a tile's code rows through `common.code_row`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import INTERPRETER, add, code_row, fwht_rows, maximum, word_planes, word_tokens


@triton.jit
def _fp16_halves(x):
    """int32 `x` -> its two fp16 halves (low, high): of `x | 0x64006400`, 1024 + the code in each half."""
    if INTERPRETER:
        x |= 0x64006400
        lo = x.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (x >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    else:  # the register handed out as its two fp16 halves (as in `load_codes_t`'s fused form)
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; or.b32 t, $2, 0x64006400; mov.b32 {$0, $1}, t; }",
            "=h,=h,r",
            [x],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    return lo, hi


@triton.jit
def load_codes_t(p_w, m_w, stride_r, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    """The [D, BLOCK_N] fp16 codes of a tile from the pointers `p_w` to its words ([D, BLOCK_N / W], `word_offsets`;
    W = `word_tokens(BITS)`) and their mask `m_w`; column (r * H + j) * 2 + t is token r * W + t * H + j (H = W / 2,
    `tile_tokens`). 2 and 4 bits: each word loaded once; 3 bits: bit plane p of the same tokens p rows
    (`stride_r`) further, each plane's bits of tokens j and j + 16 shifted into place, the three summed."""
    W: tl.constexpr = word_tokens(BITS)
    PLANES: tl.constexpr = word_planes(BITS)
    B: tl.constexpr = BITS // PLANES  # bits of a token in each word
    MASK: tl.constexpr = ((1 << B) - 1) * 0x10001
    shifts = tl.arange(0, W // 2) * B
    if PLANES == 1 and not INTERPRETER:
        # shift, mask and 1024's exponent bits in PTX (lop3 0xea: (a & b) | c), the register handed out as its two fp16
        # halves, which saves the 16-bit shuffles Triton emits to split and re-pair them (test_unpack_codes_order checks
        # this path against the storage layout's unpacker on the GPU)
        lo, hi = tl.inline_asm_elementwise(
            f"{{ .reg .b32 t; shr.u32 t, $2, $3; lop3.b32 t, t, {MASK}, 0x64006400, 0xea; mov.b32 {{$0, $1}}, t; }}",
            "=h,=h,r,r",
            [tl.load(p_w, mask=m_w, other=0)[:, :, None], shifts[None, None, :]],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=1,
        )
    else:
        x = (tl.load(p_w, mask=m_w, other=0)[:, :, None] >> shifts[None, None, :]) & MASK  # two codes, bits 0 and 16
        for p in tl.static_range(1, PLANES):
            x |= ((tl.load(p_w + p * stride_r, mask=m_w, other=0)[:, :, None] >> shifts[None, None, :]) & MASK) << p
        lo, hi = _fp16_halves(x)
    return tl.reshape(tl.join(lo, hi), (HEAD_DIM, BLOCK_N)) - 1024.0


@triton.jit
def word_offsets(stride_r, stride_d, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    """[D, BLOCK_N / W] offsets of a tile's words from its first row (`code_row` of its first token): a word of each
    W = `word_tokens(BITS)` tokens, `word_planes(BITS)` rows apart (the first plane's; `load_codes_t` reads the
    others)."""
    words = tl.arange(0, BLOCK_N // word_tokens(BITS)) * word_planes(BITS)
    return words[None, :] * stride_r + tl.arange(0, HEAD_DIM)[:, None] * stride_d


def check_block_n(block_n: int, config, who: str) -> None:
    """A tile step reads whole words of both widths (`word_tokens`: 16 tokens at 2 bits, 8 at 4, the 32 of 3-bit
    planes): refuse a tuning's `block_n` that splits one, naming the step that would."""
    tokens = max(word_tokens(config.key_bits), word_tokens(config.value_bits))
    if block_n % tokens:
        raise ValueError(
            f"{who}: block_n={block_n} splits the code words of {config.key_bits}-bit keys / {config.value_bits}-bit "
            f"values ({tokens} tokens a word; 3-bit codes are bit planes of 32 tokens); pass a tuning whose block_n "
            f"is a multiple of {tokens}."
        )


@triton.jit
def tile_tokens(o_c, W: tl.constexpr):
    """The token (from the tile's first) that column `o_c` of an unpacked tile of W = `word_tokens(bits)` tokens a
    word holds (`load_codes_t`)."""
    return (o_c // W) * W + (o_c % 2) * (W // 2) + (o_c % W) // 2


@triton.constexpr_function
def _shuffle(block_m, block_n, from_w, to_w):
    """`keys_to_values_order`'s reshape and permutation, from tiles of `from_w` tokens a word to `to_w` (8, 16, 32).
    Within a word of W = 2^w tokens, column bit 0 holds token bit w - 1 and column bits 1 .. w - 1 token bits
    0 .. w - 2 (`tile_tokens`); higher bits are the same. The columns of each max(from_w, to_w) tokens are split into
    one axis per bit, every axis of the result takes the axis holding its token bit, and axes that stay neighbours
    in order are merged (2 and 4 bits: the (2, 4, 2) axes whose outer two swap)."""
    bits = max(from_w, to_w).bit_length() - 1

    def token_bit(i, w):
        return w - 1 if i == 0 else i - 1 if i < w else i

    column = {token_bit(i, from_w.bit_length() - 1): i for i in range(bits)}
    wanted = [column[token_bit(i, to_w.bit_length() - 1)] for i in reversed(range(bits))]  # most significant first
    runs = []
    for bit in wanted:
        if runs and runs[-1][-1] == bit + 1:
            runs[-1].append(bit)
        else:
            runs.append([bit])
    source = sorted(runs, key=lambda run: -run[0])
    shape = (block_m, block_n >> bits, *(1 << len(run) for run in source))
    return shape, (0, 1, *(2 + source.index(run) for run in runs))


@triton.jit
def keys_to_values_order(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr):
    """[M, N] columns in the token order of a key tile of KW tokens a word -> that of a value tile of VW
    (`tile_tokens`): a shuffle of the small [M, N] tile rather than of a [D, N] one. 4 and 2 bits: within 16 tokens,
    the 4-bit tile's column 8 t + 2 j + a holds token 8 t + 4 a + j (t, a < 2, j < 4) and the 2-bit tile's column
    8 a + 2 j + t holds it: t and a swap places (an involution)."""
    SHUFFLE: tl.constexpr = _shuffle(BLOCK_M, BLOCK_N, KW, VW)
    return tl.reshape(tl.permute(tl.reshape(p, SHUFFLE[0]), SHUFFLE[1]), (BLOCK_M, BLOCK_N))


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
    stride_kcr,
    stride_vcr,
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
    in the key tile's column order, value-side ones in the value tile's (`tile_tokens`); `stride_kcr`, `stride_vcr`:
    the code rows' strides (3-bit planes are rows apart)."""
    KW: tl.constexpr = word_tokens(KEY_BITS)
    VW: tl.constexpr = word_tokens(VALUE_BITS)
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
    b_kt = load_codes_t(p_kw, m_kw, stride_kcr, HEAD_DIM, BLOCK_N, KEY_BITS).to(SCALE_DTYPE)
    b_kt = tl.reshape(tl.reshape(b_kt, (HEAD_DIM, NKG, GK)) * b_ks + b_km, (HEAD_DIM, BLOCK_N))
    s = dot(b_q, b_kt.to(DOT_DTYPE), PRECISION) * qk_scale
    if TOKEN_SCALING:
        s *= tl.load(p_kn, mask=m_t, other=1.0)[None, :]
    if HAS_MASK:
        s = tl.where((tl.load(p_mask, mask=m_t, other=0) != 0)[None, :], s, float("-inf"))
    elif MASKED:
        s = tl.where(m_t[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
    if KW != VW:
        p = keys_to_values_order(p, BLOCK_M, BLOCK_N, KW, VW)

    b_vs = tl.load(p_vs, mask=m_c[None, :, :], other=0.0)
    b_vm = tl.load(p_vm, mask=m_c[None, :, :], other=0.0)
    b_vt = load_codes_t(p_vw, m_vw, stride_vcr, HEAD_DIM, BLOCK_N, VALUE_BITS).to(SCALE_DTYPE)
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
    KW: tl.constexpr = word_tokens(KEY_BITS)
    VW: tl.constexpr = word_tokens(VALUE_BITS)
    # offsets inside a block (loop-invariant); column c of a key (value) tile holds token tile_tokens(c, KW (VW))
    o_d = tl.arange(0, HEAD_DIM)[:, None]
    o_c = tl.arange(0, BLOCK_N)
    tok = tile_tokens(o_c, KW)
    off_kw = word_offsets(stride_kcr, stride_kcd, HEAD_DIM, BLOCK_N, KEY_BITS)
    off_vw = word_offsets(stride_vcr, stride_vcd, HEAD_DIM, BLOCK_N, VALUE_BITS)
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
            kc_ptr + code_row(t0, KEY_BITS) * stride_kcr + off_kw,
            ks_ptr + (t0 // GROUP) * stride_ksg + off_ks,
            km_ptr + (t0 // GROUP) * stride_kmg + off_km,
            kn_ptr + t0 * stride_knt + off_kn,
            vc_ptr + code_row(t0, VALUE_BITS) * stride_vcr + off_vw,
            vs_ptr + t0 * NVG + off_vparams,
            vm_ptr + t0 * NVG + off_vparams,
            mask_ptr + t0 * stride_mt + off_mask,
            BLOCK_N, stride_kcr, stride_vcr,
            HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, HAS_MASK, False,
        )  # fmt: skip
    if PARTIAL_BLOCK and full_hi < block_hi:  # the last block of the cache is partial
        t0 = full_hi * BLOCK_N
        acc, m_i, l_i = _quantized_block(
            acc, m_i, l_i, b_q, qk_scale,
            kc_ptr + code_row(t0, KEY_BITS) * stride_kcr + off_kw,
            ks_ptr + (t0 // GROUP) * stride_ksg + off_ks,
            km_ptr + (t0 // GROUP) * stride_kmg + off_km,
            kn_ptr + t0 * stride_knt + off_kn,
            vc_ptr + code_row(t0, VALUE_BITS) * stride_vcr + off_vw,
            vs_ptr + t0 * NVG + off_vparams,
            vm_ptr + t0 * NVG + off_vparams,
            mask_ptr + t0 * stride_mt + off_mask,
            num_quantized - t0, stride_kcr, stride_vcr,
            HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, HAS_MASK, True,
        )  # fmt: skip
    return acc, m_i, l_i
