"""Decode attention over the 2-bit pool's pages in place, through a block table (`oscar_hf.serving.history`: the
decode steps of a continuous-batching forward).

`paged_decode_attention(query, pages, tail_keys, tail_values, block_table, page_counts, tail_blocks, exact_tokens,
scaling, config)`, one decode token per request:

    query          [B, Hq, 1, D]                   bf16 / fp16 / fp32, Hq = g * Hkv
    pages          QuantizedKV of [blocks, ...]    one layer's page of every page block (`PageLayout.views`): fields
                                                    [blocks, Hkv, R / W, D] codes, [blocks, Hkv, R / G, D] key
                                                    parameters, [blocks, 1, R] norms, [blocks, Hkv, R, D / G] value
                                                    parameters (the last two axes contiguous), any block stride
    tail_keys      [tail blocks, S + R, Hkv, D]    the same layer's exact tokens (`TailLayout.views`), model dtype
    tail_values    [tail blocks, S + R, Hkv, D]
    block_table    [B, max pages] int32            request b's page blocks, in position order; page_counts [B] int32
    tail_blocks    [B] int32, exact_tokens [B] int32: request b's tail block, and its exact tokens (slots
                   0 .. exact_tokens - 1: the sinks, then the window, the query's own token last)
    returns        [B, Hq, 1, D]                   query dtype

Grid (B * Hkv, splits + 1): program (bh, s < splits) runs the online softmax of the g query rows of KV head bh over
pages [s * P, (s + 1) * P) of its request (P = ceil(its pages / splits): every request's pages spread over the splits,
so the grid depends on the batch and the table's width only, not on the page counts, and a CUDA graph of it serves any
count; by default as many splits as the cache's decode kernel makes for the table's width,
`decode_tuning.num_splits`, so that the partials stay a few programs per SM), each page's tiles read from the block the
table names, with the split kernel's tile step (`decode_tiles._quantized_block`: codes unpacked in registers, the
rotated query, token norms on the scores); program (bh, splits) runs it over the tail's exact tokens
(`decode_triton._residual_part`). The
merge kernel (decode_merge.py) then combines the partials by log-sum-exp and un-rotates the quantized sum, as for the
cache's own decode. A page is R tokens of a complete block, so no tile step is partial and no padding mask applies.
Every key is rotated (the pool's method="paper"; `rotation=False`: none).

Where the cache's decode runs its Gluon kernel over full 128-token blocks (`decode_gluon.supports`: a CUDA GPU,
D = 128, groups of 32, fp16 scales; and here R = 128, so that a page is one of its blocks), that kernel reads the pages
(`decode_gluon.launch_paged`: each block's words and parameters copied from the page the table names) with two
partials per program, and this kernel runs the tails only, its tail programs writing the query operand the Gluon
kernel reads; as for the cache, the Triton kernel reads everything elsewhere. On an H100 the Gluon kernel reads a
B = 8, 32K batch's pages at 80 % of the copy bandwidth (1.08x the cache's own call on the same blocks), the Triton
kernel at 32 % (`bench_decode_attention.py --paged`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV

from .common import code_row, on_device, word_tokens
from .decode_attention import decode_gluon, gluon_pdl, gluon_splits_for
from .decode_merge import merge_kernel
from .decode_tiles import _quantized_block, query_operand, tile_tokens, word_offsets
from .decode_triton import _residual_part
from .decode_tuning import DecodeTuning, default_tuning, few_heads, num_splits

_LOG2E = 1.4426950408889634
# A pool's forwards bring new batch sizes, table widths and split counts at nearly every step (the decode rows of steps
# with prompt chunks have their own table): nothing of them may pick a compiled variant, or a serving run would compile
# one for each new combination while requests wait. So the split count and the table's stride are not specialised,
# the tables' sections start 16-byte aligned (`history.PagedBatch`), and the merge reads the partials in tiles of one of
# two fixed counts (looping over more): the narrow one where the partials fit it, the wide one where they do not (the
# Gluon kernel's one wave makes ~130 partials a KV head at B = 1 on an H100: one or two steps of the merge's loop,
# each a round trip to memory, where the narrow tile would take nine).
MERGE_SLOTS = (16, 128)
# Whether the Gluon kernel reads the pages where it applies, by default (a call's own `tuning` decides otherwise: the
# tests pass `default_tuning`'s); bench_serving.py's `oscar-triton` row turns it off, the A/B of the two kernels.
GLUON_PAGES = True


@triton.jit(do_not_specialize=["num_splits", "num_parts", "stride_table"])
def paged_split_kernel(
    # pointers
    q_ptr,
    kc_ptr,
    ks_ptr,
    km_ptr,
    kn_ptr,
    vc_ptr,
    vs_ptr,
    vm_ptr,
    tk_ptr,
    tv_ptr,
    table_ptr,
    count_ptr,
    tail_ptr,
    exact_ptr,
    part_o_ptr,
    part_ml_ptr,
    q_op_ptr,
    q_scale_ptr,
    # sizes
    num_kv_heads,
    num_splits,
    num_parts,
    qk_scale,
    # strides
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kcp,
    stride_kch,
    stride_kcr,
    stride_kcd,
    stride_ksp,
    stride_ksh,
    stride_ksg,
    stride_ksd,
    stride_kmp,
    stride_kmh,
    stride_kmg,
    stride_kmd,
    stride_knp,
    stride_knt,
    stride_vcp,
    stride_vch,
    stride_vcr,
    stride_vcd,
    stride_vsp,
    stride_vsh,
    stride_vmp,
    stride_vmh,
    stride_tkp,
    stride_tks,
    stride_tkh,
    stride_tkd,
    stride_tvp,
    stride_tvs,
    stride_tvh,
    stride_tvd,
    stride_table,
    # meta-parameters
    GQA: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    LOG2_D: tl.constexpr,
    KEY_BITS: tl.constexpr,
    VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROTATION: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    GLUON: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr,
):
    """Program (bh, s < num_splits) reads request b's share of its pages, program (bh, num_splits) its tail; each
    writes partial slot first + s of num_parts, first = num_parts - num_splits - 1. GLUON: `_gluon_split_kernel`
    reads every page (slots 0 .. first - 1, num_splits = 0), and the tail's program writes the query operand and
    score scale that kernel reads. LAUNCH_DEPENDENTS: that kernel is a programmatic dependent, launched as this one
    starts (it copies its first page, then waits for this one's output)."""
    if LAUNCH_DEPENDENTS:
        tl.extra.cuda.gdc_launch_dependents()
    pid_bh = tl.program_id(0).to(tl.int64)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    h = pid_bh % num_kv_heads
    o_m = tl.arange(0, BLOCK_M)
    m_m = o_m < GQA
    o_d = tl.arange(0, HEAD_DIM)
    p_q = q_ptr + b * stride_qb + (h * GQA + o_m) * stride_qh
    q = tl.load(p_q[:, None] + o_d[None, :] * stride_qd, mask=m_m[:, None], other=0.0)

    if pid_s == num_splits:  # the tail: sinks, window and the query's own token, one contiguous run of slots
        if GLUON:  # [D, BLOCK_M] per KV head, as the Gluon kernel loads its second MMA operand
            b_q, q_scale = query_operand(
                q, False, qk_scale, ks_ptr.dtype.element_ty, BLOCK_M, HEAD_DIM, LOG2_D, ROTATION, False
            )
            tl.store(q_op_ptr + pid_bh * HEAD_DIM * BLOCK_M + o_d[None, :] * BLOCK_M + o_m[:, None], b_q)
            tl.store(q_scale_ptr + pid_bh, q_scale)
        tail = tl.load(tail_ptr + b).to(tl.int64)
        acc, m_i, l_i = _residual_part(
            q,
            tk_ptr + tail * stride_tkp + h * stride_tkh,
            tv_ptr + tail * stride_tvp + h * stride_tvh,
            tk_ptr,  # no padding mask
            tl.load(exact_ptr + b),
            qk_scale,
            stride_tks,
            stride_tkd,
            stride_tvs,
            stride_tvd,
            0,
            1,
            HEAD_DIM,
            BLOCK_M,
            BLOCK_R,
            False,
        )
    else:
        KW: tl.constexpr = word_tokens(KEY_BITS)
        VW: tl.constexpr = word_tokens(VALUE_BITS)
        NKG: tl.constexpr = BLOCK_N // GROUP if BLOCK_N >= GROUP else 1
        NVG: tl.constexpr = HEAD_DIM // GROUP
        b_q, q_scale = query_operand(
            q, False, qk_scale, ks_ptr.dtype.element_ty, BLOCK_M, HEAD_DIM, LOG2_D, ROTATION, False
        )
        # offsets inside a tile, as `decode_tiles.quantized_blocks` lays them out
        o_dc = tl.arange(0, HEAD_DIM)[:, None]
        o_c = tl.arange(0, BLOCK_N)
        off_kw = word_offsets(stride_kcr, stride_kcd, HEAD_DIM, BLOCK_N, KEY_BITS)
        off_vw = word_offsets(stride_vcr, stride_vcd, HEAD_DIM, BLOCK_N, VALUE_BITS)
        o_kg = tl.arange(0, NKG)[None, :, None]
        off_ks = o_kg * stride_ksg + o_dc[:, :, None] * stride_ksd
        off_km = o_kg * stride_kmg + o_dc[:, :, None] * stride_kmd
        off_vparams = tile_tokens(o_c, VW)[None, None, :] * NVG + tl.arange(0, NVG)[:, None, None]
        off_kn = tile_tokens(o_c, KW) * stride_knt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, tl.float32)
        acc = tl.full([BLOCK_M, HEAD_DIM], 0.0, tl.float32)
        count = tl.load(count_ptr + b)
        pages_per_split = tl.cdiv(count, num_splits)  # this request's pages spread over every split
        page_lo = pid_s * pages_per_split
        page_hi = tl.minimum(page_lo + pages_per_split, count)
        for page in range(page_lo, page_hi):
            block = tl.load(table_ptr + b * stride_table + page).to(tl.int64)
            kc = kc_ptr + block * stride_kcp + h * stride_kch
            ks = ks_ptr + block * stride_ksp + h * stride_ksh
            km = km_ptr + block * stride_kmp + h * stride_kmh
            kn = kn_ptr + block * stride_knp
            vc = vc_ptr + block * stride_vcp + h * stride_vch
            vs = vs_ptr + block * stride_vsp + h * stride_vsh
            vm = vm_ptr + block * stride_vmp + h * stride_vmh
            for t0 in tl.static_range(0, PAGE, BLOCK_N):
                acc, m_i, l_i = _quantized_block(
                    acc, m_i, l_i, b_q, q_scale,
                    kc + code_row(t0, KEY_BITS) * stride_kcr + off_kw,
                    ks + (t0 // GROUP) * stride_ksg + off_ks,
                    km + (t0 // GROUP) * stride_kmg + off_km,
                    kn + t0 * stride_knt + off_kn,
                    vc + code_row(t0, VALUE_BITS) * stride_vcr + off_vw,
                    vs + t0 * NVG + off_vparams,
                    vm + t0 * NVG + off_vparams,
                    kn,  # no padding mask
                    BLOCK_N, stride_kcr, stride_vcr,
                    HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, False, False,
                )  # fmt: skip

    # partials: part_o [B * Hkv, num_parts, GQA, D], part_ml [..., 2] (m, l), fp32
    o_part = (pid_bh * num_parts + num_parts - num_splits - 1 + pid_s) * GQA + o_m
    tl.store(part_o_ptr + o_part[:, None] * HEAD_DIM + o_d[None, :], acc, mask=m_m[:, None])
    tl.store(part_ml_ptr + o_part * 2, m_i, mask=m_m)
    tl.store(part_ml_ptr + o_part * 2 + 1, l_i, mask=m_m)


def paged_decode_attention(
    query: torch.Tensor,
    pages: QuantizedKV,
    tail_keys: torch.Tensor,
    tail_values: torch.Tensor,
    block_table: torch.Tensor,
    page_counts: torch.Tensor,
    tail_blocks: torch.Tensor,
    exact_tokens: torch.Tensor,
    scaling: float,
    config: OscarConfig,
    splits: int | None = None,
    tuning: DecodeTuning | None = None,
) -> torch.Tensor:
    """Attention of each request's decode query over its pages and its tail (see the module docstring); `splits`:
    the Triton kernel's programs over each request's pages, else chosen from the batch, the table's width and the
    device; `tuning`: `default_tuning`'s for these shapes unless given (`gluon_programs_per_sm=0`: no Gluon kernel;
    without `GLUON_PAGES` the default runs none)."""
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = pages.key_codes.shape[1]
    if q_len != 1 or q_heads % kv_heads:
        raise ValueError(f"paged_decode_attention: one query token per request, heads a multiple of {kv_heads}")
    if config.method == "oscar" and config.rotation:
        raise ValueError("paged_decode_attention: every key is rotated in the pool (method='paper')")
    for name in ("value_scale", "value_min"):
        tensor = getattr(pages, name)
        if tensor.stride()[-2:] != (head_dim // config.group_size, 1):
            raise ValueError(f"paged_decode_attention: pages.{name} must be contiguous over its last two axes")
    gqa = q_heads // kv_heads
    if tuning is None:
        tuning = default_tuning(head_dim, gqa, config.scale_torch_dtype)
        if not GLUON_PAGES:
            tuning = replace(tuning, gluon_programs_per_sm=0)
    block_n = tuning.block_n
    if config.residual_length % block_n:
        block_n = config.group_size  # a divisor of the page (residual_length is a multiple of group_size)
    block_m = max(tuning.block_m, triton.next_power_of_2(gqa))
    max_pages = block_table.shape[1]
    heads = batch * kv_heads
    gluon_splits = 0
    if decode_gluon is not None and config.residual_length == decode_gluon.BLOCK.value:  # a page is one block
        gluon_splits, _ = gluon_splits_for(query, pages, config, block_m, max_pages * config.residual_length, tuning)
    if gluon_splits:
        splits = 0  # the Triton kernel runs the tails only
    else:
        if splits is None:  # as many splits as the cache's decode would make for the table's width
            tiles = max_pages * (config.residual_length // block_n)
            splits = num_splits(heads, tiles, query.device, tuning, few_heads(heads, query.device))
        splits = max(1, min(splits, max_pages))  # at most one a page
    gluon_parts = gluon_splits * decode_gluon.WARPS if gluon_splits else 0  # a partial per warp
    num_parts = gluon_parts + splits + 1
    pdl = gluon_pdl(gluon_splits, tuning, query.device)  # the three launches overlap as the cache's call's do
    part_o = query.new_empty(heads, num_parts, gqa, head_dim, dtype=torch.float32)
    part_ml = query.new_empty(heads, num_parts, gqa, 2, dtype=torch.float32)
    q_op = query.new_empty((heads, head_dim, block_m) if gluon_splits else (0,), dtype=torch.float16)
    q_scale = query.new_empty(heads if gluon_splits else 0, dtype=torch.float32)
    strides = {}
    for prefix, tensor, axes in (
        ("q", query[:, :, 0], "bhd"),
        ("kc", pages.key_codes, "phrd"),
        ("ks", pages.key_scale, "phgd"),
        ("km", pages.key_min, "phgd"),
        ("vc", pages.value_codes, "phrd"),
        ("tk", tail_keys, "pshd"),
        ("tv", tail_values, "pshd"),
    ):
        strides.update({f"stride_{prefix}{axis}": stride for axis, stride in zip(axes, tensor.stride())})
    norms = pages.key_norms if config.token_scaling else pages.key_codes  # a placeholder pointer without scaling
    strides.update(
        stride_knp=norms.stride(0),
        stride_knt=norms.stride(-1) if config.token_scaling else 0,
        stride_vsp=pages.value_scale.stride(0),
        stride_vsh=pages.value_scale.stride(1),
        stride_vmp=pages.value_min.stride(0),
        stride_vmh=pages.value_min.stride(1),
        stride_table=block_table.stride(0),
    )
    out = torch.empty_like(query)
    merge_slots = MERGE_SLOTS[0] if num_parts - 1 <= MERGE_SLOTS[0] else MERGE_SLOTS[1]
    with on_device(query.device):  # Triton launches on the current device
        paged_split_kernel[(batch * kv_heads, splits + 1)](
            query,
            pages.key_codes,
            pages.key_scale,
            pages.key_min,
            norms,
            pages.value_codes,
            pages.value_scale,
            pages.value_min,
            tail_keys,
            tail_values,
            block_table,
            page_counts,
            tail_blocks,
            exact_tokens,
            part_o,
            part_ml,
            q_op,
            q_scale,
            kv_heads,
            splits,
            num_parts,
            scaling * _LOG2E,
            **strides,
            GQA=gqa,
            HEAD_DIM=head_dim,
            LOG2_D=head_dim.bit_length() - 1,
            KEY_BITS=config.key_bits,
            VALUE_BITS=config.value_bits,
            GROUP=config.group_size,
            PAGE=config.residual_length,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_R=tuning.residual_block,
            ROTATION=config.rotation,
            TOKEN_SCALING=config.token_scaling,
            GLUON=gluon_splits > 0,
            LAUNCH_DEPENDENTS=pdl,
            num_warps=tuning.num_warps,
        )
        if gluon_splits:
            decode_gluon.launch_paged(
                (heads, gluon_splits), q_op, q_scale, pages, block_table, page_counts, part_o, part_ml, config, pdl
            )
        merge_kernel[(batch * kv_heads * gqa,)](
            part_o,
            part_ml,
            out,
            kv_heads,
            num_parts,
            *out[:, :, 0].stride()[:2],
            0,
            out.stride(-1),
            GQA=gqa,
            TQ=1,
            HEAD_DIM=head_dim,
            LOG2_D=head_dim.bit_length() - 1,
            ROTATION=config.rotation,
            BLOCK_S=merge_slots,
            WAIT_FOR_PARTIALS=pdl,
            num_warps=triton.cdiv(merge_slots * head_dim, tuning.merge_tile_per_warp),
            launch_pdl=pdl,
        )
    return out
