"""Fused decode attention vs the float64 reference (dequantize + plain softmax attention).

The quantized inputs come from `oscar_hf.reference.quantize_kv`, so these tests check the attention kernel alone.
Small shapes run everywhere (CPU CI: Triton's interpreter); `gpu`-marked ones need CUDA.
"""

from __future__ import annotations

import random
from dataclasses import replace

import gluon_stand_in
import pytest
import torch
import triton
import triton.language as tl
from devices import DEVICE, slow_on_cpu
from oscar_hf.kernels import decode_attention as launcher
from oscar_hf.kernels import decode_attention_triton, decode_workspace
from oscar_hf.kernels.common import word_tokens
from oscar_hf.kernels.decode_attention import decode_plan
from oscar_hf.kernels.decode_tiles import keys_to_values_order, load_codes_t, word_offsets
from oscar_hf.kernels.decode_tuning import DecodeTuning, default_tuning, few_heads, num_splits

from oscar_hf.layout import QuantizedKV, StorageLayout
from oscar_hf.reference import decode_attention as decode_attention_reference
from oscar_hf.reference import quantize_kv
from oscar_hf.testing import Case, assert_close_to_reference, check_decode_case, decode_inputs, random_decode_case

BASE = Case()
CASES = [
    # every head_dim in both 16-bit dtypes (on a CPU, each head_dim in one of them in the default run)
    *(
        replace(BASE, head_dim=d, dtype=dt) if dt == default else slow_on_cpu(replace(BASE, head_dim=d, dtype=dt))
        for d, default in ((64, torch.float16), (128, torch.bfloat16), (256, torch.float16))
        for dt in (torch.bfloat16, torch.float16)
    ),
    # GQA ratios 1 / 4 / 8 and an odd head count
    replace(BASE, gqa=1),
    replace(BASE, gqa=8, batch=1),
    replace(BASE, kv_heads=3, gqa=3, batch=1),
    # bits and the two method switches
    replace(BASE, key_bits=4, value_bits=4, head_dim=128),
    replace(BASE, rotation=False, token_scaling=False),
    replace(BASE, rotation=True, token_scaling=False),
    replace(BASE, rotation=False, token_scaling=True, key_bits=4, value_bits=4),
    # keys and values at different widths (their tiles' token orders differ): a partial last block, padding across a
    # block, GQA 8 and speculative queries, fp32 scales (32-token steps), per-head key rotation
    replace(BASE, key_bits=4, value_bits=2, head_dim=128),
    replace(BASE, key_bits=2, value_bits=4, quantized=320, left_pad=77),
    replace(BASE, key_bits=4, value_bits=2, q_len=3, residual=7, gqa=8, batch=1, quantized=160),
    replace(BASE, key_bits=2, value_bits=4, scale_dtype="float32"),
    replace(BASE, key_bits=4, value_bits=2, method="oscar", kv_heads=3, gqa=2, left_pad=5),
    # 3-bit bit planes (32 tokens a word group): K3V2 (a partial last block), alone and against 2 and 4 bits, with
    # padding across a block, speculative queries at D=256, per-head key rotation, fp32 scales, 64-token groups
    replace(BASE, key_bits=3, value_bits=2, head_dim=128),
    slow_on_cpu(replace(BASE, key_bits=3, value_bits=3, quantized=320, left_pad=77)),
    replace(BASE, key_bits=2, value_bits=3, q_len=3, residual=7, head_dim=256, batch=1),
    replace(BASE, key_bits=4, value_bits=3, method="oscar", kv_heads=3, gqa=2, left_pad=5),
    slow_on_cpu(replace(BASE, key_bits=3, value_bits=4, scale_dtype="float32", dtype=torch.float32)),
    slow_on_cpu(replace(BASE, key_bits=3, value_bits=2, group_size=64, quantized=192, head_dim=128, views=True)),
    # residual lengths 1 .. residual_length
    *(replace(BASE, residual=r, batch=1) for r in (1, 127, 128)),
    # quantized lengths: none, one group, two blocks, across block and split boundaries
    *(replace(BASE, quantized=n, batch=1) for n in (0, 32, 128, 320)),
    replace(BASE, quantized=544, batch=1, kv_heads=1, dtype=torch.float16),
    # left padding (masking a prefix that crosses a block), speculative queries (causal residual)
    replace(BASE, quantized=320, left_pad=77),
    replace(BASE, q_len=3, residual=7, left_pad=5),
    replace(BASE, q_len=8, residual=9, gqa=8, batch=1, quantized=64),
    # token-norm imbalance: one key token 100x smaller, one 100x larger
    replace(BASE, extreme_norms=True, quantized=128),
    replace(BASE, extreme_norms=True, quantized=128, token_scaling=False),
    # strided views of capacity buffers (as the cache stores them) and an HF-layout query
    replace(BASE, views=True, quantized=160, q_len=2, residual=4),
    # other storage options and model dtypes
    replace(BASE, group_size=64, quantized=192, head_dim=128),
    replace(BASE, scale_dtype="float32"),
    replace(BASE, dtype=torch.float32),
    # method="oscar": keys rotated or not per (row, KV head); with GQA, speculative queries and padding
    replace(BASE, method="oscar", quantized=128, kv_heads=3, gqa=2),
    replace(BASE, method="oscar", q_len=3, residual=7, left_pad=5, head_dim=128),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_decode_attention_matches_reference(case: Case):
    inputs = decode_inputs(case)
    out = decode_attention_triton(*inputs)
    assert out.shape == inputs[0].shape and out.dtype == case.dtype
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, case.dtype, case.id)


@triton.jit
def _unpack_kernel(words_ptr, out_ptr, D: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    offsets = word_offsets(D, 1, D, BLOCK_N, BITS)  # words [rows, D], as the storage's rows
    codes = load_codes_t(words_ptr + offsets, offsets >= 0, D, D, BLOCK_N, BITS)
    tl.store(out_ptr + tl.arange(0, D)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :], codes)


def _token_of_column(columns: int, per_word: int) -> torch.Tensor:
    """Column c of a tile of `per_word` tokens a word holds token (c // W) W + (c % 2) W / 2 + (c % W) // 2."""
    col = torch.arange(columns)
    return (col // per_word) * per_word + (col % 2) * (per_word // 2) + (col % per_word) // 2


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_unpack_codes_order(bits: int):
    """The code tile decoding of the kernel's inner loop, alone: column (r * H + j) * 2 + t of the [D, BLOCK_N] tile
    holds token r * W + t * H + j (W = `word_tokens`: codes per word, or 32 for 3-bit planes; H = W / 2), on random
    words with every bit pattern, read from the storage's rows (3 bits: planes 3 g + p)."""
    block_n, dim = 64, 32
    rows = block_n * bits // 32
    words = torch.randint(-(2**31), 2**31, (rows, dim), dtype=torch.int64).to(torch.int32).to(DEVICE)
    tokens = StorageLayout.unpack_codes(words, bits).T  # [D, tokens]
    out = torch.empty(dim, block_n, dtype=torch.float16, device=DEVICE)
    _unpack_kernel[(1,)](words, out, dim, block_n, bits)
    want = tokens[:, _token_of_column(block_n, word_tokens(bits))]
    torch.testing.assert_close(out.float().cpu(), want.float().cpu(), rtol=0, atol=0)


@triton.jit
def _shuffle_kernel(p_ptr, out_ptr, M: tl.constexpr, N: tl.constexpr, KW: tl.constexpr, VW: tl.constexpr):
    offsets = tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + offsets, keys_to_values_order(tl.load(p_ptr + offsets), M, N, KW, VW))


@pytest.mark.parametrize(("key_bits", "value_bits"), [(k, v) for k in (2, 3, 4) for v in (2, 3, 4) if k != v])
def test_keys_to_values_order(key_bits: int, value_bits: int):
    """The probabilities' shuffle from the key tile's token order to the value tile's, for every pair of widths:
    a tile whose column c holds the token of column c in the key order holds, shuffled, the value order's."""
    m, n = 4, 64
    kw, vw = word_tokens(key_bits), word_tokens(value_bits)
    p = _token_of_column(n, kw).float().expand(m, n).contiguous().to(DEVICE)
    out = torch.empty_like(p)
    _shuffle_kernel[(1,)](p, out, m, n, kw, vw)
    assert torch.equal(out.cpu(), _token_of_column(n, vw).float().expand(m, n))


def test_merge_over_several_steps():
    """The merge kernel's per-slot running (m, l, acc) across steps: a merge tile of 4 partials over this case's 9
    splits + the residual program (a partial last step), with the first splits fully masked (m = -inf, l = 0)."""
    case = replace(BASE, quantized=544, batch=1, kv_heads=1, left_pad=200)
    inputs = decode_inputs(case)
    tuning = replace(default_tuning(case.head_dim, case.gqa, torch.float16), merge_tile=4 * case.head_dim)
    blocks = triton.cdiv(case.quantized, tuning.block_n)
    assert num_splits(1, blocks, DEVICE, tuning, few_heads(1, DEVICE)) + 1 > 8  # three steps of 4 partials
    out = decode_attention_triton(*inputs, tuning=tuning)
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, case.dtype, case.id)


@pytest.mark.parametrize(
    ("case", "sinks", "held_quantized", "held_exact"),
    [
        (replace(BASE, quantized=160, residual=32), 0, 96, 5),  # a 32-token window: partial 64-token blocks
        (replace(BASE, quantized=160, residual=32, left_pad=40), 0, 96, 32),  # a full window, padding over positions
        (replace(BASE, quantized=128, residual=64, batch=1), 0, 0, 17),  # storage reserved, nothing quantized yet
        (replace(BASE, quantized=192, residual=64, q_len=3, head_dim=128, dtype=torch.float16), 0, 128, 7),
        (replace(BASE, quantized=128, residual=32, method="oscar", kv_heads=3, gqa=2, left_pad=9), 0, 64, 12),
        (replace(BASE, quantized=160, residual=32, key_bits=4, value_bits=2, left_pad=40), 0, 96, 32),
        (replace(BASE, quantized=160, residual=36, key_bits=3, value_bits=2, left_pad=9), 4, 96, 4 + 12),
        # sinks: the residual holds `sinks` sink slots, then the window
        (replace(BASE, quantized=128, residual=36, left_pad=9), 4, 64, 4 + 12),  # 4 sinks, a 32-token window
        (replace(BASE, quantized=128, residual=36, batch=1), 4, 0, 3),  # the sinks still filling: 3 held
        (replace(BASE, quantized=128, residual=36, batch=1), 4, 0, 4 + 32),  # a full window, nothing quantized
        # sinks without rotation, and with speculative queries (causal over the window only: the sinks precede them)
        (replace(BASE, quantized=128, residual=36, rotation=False, token_scaling=False, left_pad=9), 4, 64, 4 + 20),
        (replace(BASE, quantized=128, residual=36, q_len=3, gqa=2, method="oscar"), 4, 64, 4 + 7),
        # the Gluon kernel's full blocks on a GPU (D=128, 2-bit values, fp16 scales): held 384 of 640, a partial block
        # (on a CPU, where the Triton kernel reads them all, sinks and 4-bit values in the default run)
        slow_on_cpu(
            replace(BASE, quantized=640, residual=64, head_dim=128, dtype=torch.float16, row_major=True), 0, 384, 17
        ),
        slow_on_cpu(replace(BASE, quantized=640, residual=32, head_dim=128, left_pad=300, row_major=True), 0, 416, 32),
        (replace(BASE, quantized=640, residual=80, head_dim=128, dtype=torch.float16, row_major=True), 16, 384, 33),
        slow_on_cpu(replace(BASE, quantized=640, residual=80, head_dim=128, row_major=True, key_bits=4), 16, 384, 33),
        (replace(BASE, quantized=640, residual=64, head_dim=128, row_major=True, value_bits=4, left_pad=90), 0, 384, 9),
    ],
    ids=lambda v: v.id if isinstance(v, Case) else str(v),
)
def test_device_length_reads_only_what_is_held(case: Case, sinks: int, held_quantized: int, held_exact: int):
    """Compiled decode's launch: the whole storage (`case.quantized` tokens of capacity) and the exact slots
    (`case.residual`: `sinks` sink slots, then a window of R = residual - sinks), the tokens held (sinks included) in a
    device tensor: the kernel reads L = max(length - sinks - 1, 0) // R * R quantized tokens and the first length - L
    exact slots (mask columns [0, L), then L + j for slot j). Everything past them holds random codes and values (and
    the mask past them attends), so reading any of it would change the output; the expectation is the reference over
    the held tokens alone."""
    query, quantized, residual_keys, residual_values, mask, scaling, config, key_rotated = decode_inputs(case)
    window = case.residual - sinks
    assert held_quantized % window == 0 and 1 <= held_exact <= case.residual  # how the cache holds tokens
    assert held_quantized == 0 or held_exact > sinks  # the window holds 1..R once anything is quantized
    length = torch.tensor(held_quantized + held_exact, device=DEVICE)
    out = decode_attention_triton(
        query, quantized, residual_keys, residual_values, mask, scaling, config, key_rotated, length, sinks=sinks
    )
    held = StorageLayout.of(config).rows(quantized, 0, held_quantized) if held_quantized else None
    held_mask = None if mask is None else mask[:, : held_quantized + held_exact]
    ref = decode_attention_reference(
        query,
        held,
        residual_keys[:, :, :held_exact],
        residual_values[:, :, :held_exact],
        held_mask,
        scaling,
        config,
        key_rotated,
        compute_dtype=torch.float64,
        out_dtype=torch.float64,
    )
    assert_close_to_reference(out, ref, case.dtype, case.id)


def test_quantized_none_equals_zero_tokens():
    query, quantized, rk, rv, mask, scaling, config, _ = decode_inputs(replace(BASE, quantized=32, batch=1))
    empty = QuantizedKV(*(None if t is None else t[..., :0, :] if t.dim() == 4 else t[..., :0] for t in quantized))
    a = decode_attention_triton(query, None, rk, rv, None, scaling, config)
    b = decode_attention_triton(query, empty, rk, rv, None, scaling, config)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rejects_bad_inputs():
    query, quantized, rk, rv, mask, scaling, config, _ = decode_inputs(replace(BASE, quantized=32, batch=1))
    with pytest.raises(ValueError, match="Tq"):
        decode_attention_triton(query.expand(-1, -1, 6, -1), quantized, rk, rv, None, scaling, config)
    with pytest.raises(ValueError, match="key_padding_mask"):
        decode_attention_triton(query, quantized, rk, rv, torch.ones(1, 3, dtype=torch.bool), scaling, config)
    with pytest.raises(ValueError, match="head_dim"):
        decode_attention_triton(query[..., :48], None, rk[..., :48], rv[..., :48], None, scaling, config)
    with pytest.raises(ValueError, match="key_codes"):
        decode_attention_triton(query, quantized, rk, rv, None, scaling, replace(config, bits=None, key_bits=4))
    with pytest.raises(ValueError, match="value_codes"):
        decode_attention_triton(query, quantized, rk, rv, None, scaling, replace(config, bits=None, value_bits=4))
    with pytest.raises(ValueError, match="needs key_rotated"):
        decode_attention_triton(query, quantized, rk, rv, None, scaling, replace(config, method="oscar"))
    with pytest.raises(ValueError, match="this config takes None"):
        decode_attention_triton(query, quantized, rk, rv, None, scaling, config, torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="`length` must be a one-element int64 tensor"):
        decode_attention_triton(query, quantized, rk, rv, None, scaling, config, None, torch.tensor([3, 4]))
    with pytest.raises(ValueError, match=r"key_padding_mask must be bool \[B, W >= capacity \+ R"):
        short = torch.ones(1, 32, dtype=torch.bool, device=DEVICE)  # covers the storage, not the window after it
        decode_attention_triton(query, quantized, rk, rv, short, scaling, config, None, torch.tensor(33, device=DEVICE))
    three_bits = decode_inputs(replace(BASE, quantized=32, batch=1, key_bits=3))
    halves = replace(default_tuning(BASE.head_dim, BASE.gqa, torch.float16), block_n=16)
    with pytest.raises(ValueError, match="block_n=16 splits the code words of 3-bit keys"):
        decode_attention_triton(*three_bits, tuning=halves)
    groups_major = quantized.value_min.transpose(2, 3).contiguous().transpose(2, 3)  # same values, other strides
    with pytest.raises(ValueError, match=r"value_min must be contiguous over its last two dims"):
        decode_attention_triton(query, quantized._replace(value_min=groups_major), rk, rv, None, scaling, config)


GPU_CASES = [
    Case(batch=4, kv_heads=8, gqa=4, head_dim=128, quantized=8192, residual=77),
    Case(batch=2, kv_heads=8, gqa=4, head_dim=128, quantized=8192 + 96, residual=128, left_pad=1000),
    Case(batch=2, kv_heads=4, gqa=8, head_dim=128, quantized=4096, residual=100, key_bits=4, value_bits=4),
    Case(batch=4, kv_heads=8, gqa=4, head_dim=128, quantized=8192, residual=77, key_bits=4, value_bits=2),
    Case(batch=2, kv_heads=2, gqa=8, head_dim=256, quantized=4096 + 32, residual=9, key_bits=2, value_bits=4),
    Case(batch=1, kv_heads=2, gqa=4, head_dim=256, quantized=4096, residual=31, q_len=4),
    Case(batch=3, kv_heads=8, gqa=1, head_dim=64, quantized=2048, residual=64, views=True),
    Case(batch=4, kv_heads=8, gqa=4, head_dim=128, quantized=8192, residual=50, method="oscar"),
    Case(batch=4, kv_heads=8, gqa=4, head_dim=128, quantized=8192, residual=77, key_bits=3, value_bits=2),
    Case(batch=2, kv_heads=2, gqa=8, head_dim=256, quantized=4096 + 32, residual=9, key_bits=2, value_bits=3),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_decode_attention_large(case: Case):
    inputs = decode_inputs(case, seed=1)
    out = decode_attention_triton(*inputs)
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(out, ref, case.dtype, case.id)


GLUON = replace(BASE, head_dim=128, quantized=384, residual=9, batch=2, kv_heads=2, dtype=torch.float16, row_major=True)
GLUON_CASES = [
    GLUON,
    # query rows 1 .. 8 per KV head (the MMA's N): GQA 1 / 2 / 8, speculative rows, a GQA of 3 (odd rows)
    *(replace(GLUON, gqa=g) for g in (1, 2, 8)),
    replace(GLUON, gqa=4, q_len=2, residual=5),
    replace(GLUON, gqa=3, kv_heads=3, batch=1),
    # a partial last block after the full ones (read by the Triton kernel), one block, many splits
    replace(GLUON, quantized=256 + 32),
    replace(GLUON, quantized=512 + 96, dtype=torch.bfloat16),
    replace(GLUON, quantized=128, batch=1),
    replace(GLUON, quantized=4096, batch=1, kv_heads=1),
    # padding masking whole blocks and part of one; the method switches; capacity views; norms 100x apart
    replace(GLUON, left_pad=200),
    replace(GLUON, method="oscar", kv_heads=3, left_pad=70, quantized=640),
    replace(GLUON, token_scaling=False),
    replace(GLUON, rotation=False, token_scaling=False),
    replace(GLUON, views=True, q_len=2, residual=4),
    replace(GLUON, extreme_norms=True),
    # 4-bit keys or values (16 word rows a block): a partial block, padding, the method switches, no token scaling
    # or rotation, GQA 8, capacity views with norms 100x apart
    replace(GLUON, key_bits=4, quantized=512 + 96),
    replace(GLUON, key_bits=4, method="oscar", kv_heads=3, left_pad=70, quantized=640),
    replace(GLUON, key_bits=4, token_scaling=False, gqa=8, dtype=torch.bfloat16),
    replace(GLUON, key_bits=4, views=True, q_len=2, residual=4, extreme_norms=True),
    replace(GLUON, value_bits=4, quantized=512 + 96, left_pad=70),
    replace(GLUON, value_bits=4, method="oscar", kv_heads=3, gqa=3, rotation=False, token_scaling=False),
    replace(GLUON, key_bits=4, value_bits=4, quantized=640, left_pad=200, dtype=torch.bfloat16),
    replace(GLUON, key_bits=4, value_bits=4, views=True, gqa=8, extreme_norms=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: c.id)
def test_gluon_full_blocks(case: Case):
    """The Gluon kernel reads every full 128-token block of these (kernels/decode_gluon.py; with a device
    length: `test_device_length_reads_only_what_is_held`); the whole step must match the float64 reference."""
    inputs = decode_inputs(case, seed=2)
    query, quantized, rk, rv, mask, scaling, config, key_rotated = inputs
    tuning = _gluon_tuning(case)
    plan = decode_plan(query, quantized, rk, rv, mask, config, key_rotated, tuning=tuning)
    assert plan.gluon is not None, plan.why_not_gluon
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(decode_attention_triton(*inputs, tuning=tuning), ref, case.dtype, case.id)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case", [replace(GLUON, scale_dtype="float32"), replace(GLUON, group_size=64)], ids=lambda c: c.id
)
def test_what_the_gluon_kernel_is_not_compiled_for_decodes_with_the_triton_kernel(case: Case):
    """The Gluon kernel is compiled for fp16 scales in groups of 32: it declines others, naming why (asked to run: the
    default tuning for fp32 scales runs none), and the Triton kernel reads every quantized token instead."""
    inputs = decode_inputs(case, seed=2)
    tuning = replace(_gluon_tuning(case), gluon_programs_per_sm=_gluon_tuning(GLUON).gluon_programs_per_sm)
    plan = decode_plan(*inputs[:5], inputs[6], inputs[7], tuning=tuning)
    assert plan.gluon is None and "groups of 32, fp16 scales" in plan.why_not_gluon, plan.why_not_gluon
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(decode_attention_triton(*inputs, tuning=tuning), ref, case.dtype, case.id)


def test_three_bit_blocks_are_read_by_the_triton_kernel():
    """The Gluon kernel unpacks codes that fill whole bytes: it declines 3-bit planes, naming the widths, on any
    device (the reason comes first), and the Triton kernel reads every block of a K3V2 step the Gluon kernel would
    otherwise take (D=128, fp16 scales, full 128-token blocks)."""
    case = replace(GLUON, key_bits=3, value_bits=2, quantized=256, batch=1)
    inputs = decode_inputs(case, seed=2)
    plan = decode_plan(*inputs[:5], inputs[6], inputs[7], tuning=_gluon_tuning(GLUON))
    assert plan.gluon is None and "got 3-bit keys, 2-bit values" in plan.why_not_gluon, plan.why_not_gluon
    ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
    assert_close_to_reference(decode_attention_triton(*inputs, tuning=_gluon_tuning(GLUON)), ref, case.dtype, case.id)


def _gluon_tuning(case: Case) -> DecodeTuning:
    """The launch choices that run the Gluon kernel for `case`: the long-context ones (these cases are short, and
    over few KV heads `default_tuning` picks the Triton kernel's 128-token steps for them, running no Gluon kernel)."""
    return default_tuning(case.head_dim, case.gqa * case.q_len, getattr(torch, case.scale_dtype))


@pytest.mark.parametrize(
    "case, held",
    [
        (replace(GLUON, quantized=256 + 32, batch=1), None),
        (replace(GLUON, quantized=384, method="oscar", left_pad=150, q_len=2, residual=5), None),
        (replace(GLUON, quantized=512, residual=64, left_pad=20), (256, 9)),
        (replace(GLUON, quantized=384 + 32, key_bits=4, left_pad=50), None),
        (replace(GLUON, quantized=384 + 64, key_bits=4, value_bits=4, batch=1), None),
    ],
    ids=lambda v: v.id if isinstance(v, Case) else str(v),
)
def test_gluon_partial_slots(case: Case, held, monkeypatch):
    """The launch around the Gluon kernel, on any device (CPU: Triton's interpreter): a float64 stand-in for the
    Gluon kernel fills the first partial slots from the query operand the Triton kernel writes, whose one quantized
    program per KV head reads what follows the full blocks (a partial block here), and the merge combines them all.
    The step must match the reference; a wrong query operand, slot or block offset would not."""
    query, quantized, rk, rv, mask, scaling, config, key_rotated = decode_inputs(case, seed=3)
    monkeypatch.setattr(launcher, "_PLANS", {})  # plans made here (with the stand-in) are not kept for other tests
    monkeypatch.setattr(launcher, "gluon_splits_for", lambda *args: (2, ""))
    monkeypatch.setattr(launcher.decode_gluon, "launch", gluon_stand_in.contiguous_launch)
    length = None if held is None else torch.tensor(sum(held), device=DEVICE)
    out = decode_attention_triton(query, quantized, rk, rv, mask, scaling, config, key_rotated, length)
    if held is not None:  # the reference over the tokens held (`test_device_length_reads_only_what_is_held`)
        quantized = StorageLayout.of(config).rows(quantized, 0, held[0])
        rk, rv, mask = rk[:, :, : held[1]], rv[:, :, : held[1]], mask[:, : sum(held)]
    ref = decode_attention_reference(
        query, quantized, rk, rv, mask, scaling, config, key_rotated, compute_dtype=torch.float64,
        out_dtype=torch.float64,
    )  # fmt: skip
    assert_close_to_reference(out, ref, case.dtype, case.id)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_float32_scales_are_as_accurate_as_float16_scales(dtype):
    """float32 scales make the quantized dots' operands float32; one TF32 product truncated them on GPUs (fuzz case
    907: 2.1e-3 relative RMSE against 4e-4 with float16 scales, where the fp16 tolerance is 2e-3). Each against the
    float64 reference of its own stored codes, float32 scales must not be the less accurate (x 1.5: the two stores
    round differently)."""
    case = Case(batch=2, kv_heads=3, gqa=2, head_dim=64, quantized=512, residual=40, dtype=dtype, value_bits=4)
    scale_dtypes = ("float16", "float32")
    errors = {scales: check_decode_case(replace(case, scale_dtype=scales), seed=907) for scales in scale_dtypes}
    assert errors["float32"] <= 1.5 * errors["float16"], errors


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_slice(seed: int):
    """A seeded slice of the GPU fuzzer, at interpreter-friendly sizes."""
    check_decode_case(random_decode_case(random.Random(seed), max_tokens=640, max_batch=2, max_kv_heads=2), seed)


def _bad_inputs(inputs, kind: str):
    """`inputs` with one thing a cached plan must not let through."""
    query, quantized, rk, rv, mask, scaling, config, key_rotated = inputs
    if kind == "query dtype":
        query = query.to(torch.float32 if query.dtype != torch.float32 else torch.float16)
    elif kind == "storage of another layout":  # 4-bit storage handed over with the 2-bit config
        keys, values = (
            torch.randn(rk.shape[0], rk.shape[1], quantized.key_codes.shape[2] * 16, rk.shape[3]) for _ in "kv"
        )
        four_bits = replace(config, bits=4, key_bits=4, value_bits=4)
        quantized = quantize_kv(keys.to(DEVICE), values.to(DEVICE), four_bits, key_rotated)
    elif kind == "non-contiguous value parameters":
        quantized = quantized._replace(
            value_scale=quantized.value_scale.transpose(-1, -2).contiguous().transpose(-1, -2)
        )
    elif kind == "padding mask width":
        mask = torch.ones(rk.shape[0], mask.shape[1] + 1, dtype=torch.bool, device=DEVICE)
    return query, quantized, rk, rv, mask, scaling, config, key_rotated


BAD_INPUTS = {  # what the error names
    "query dtype": "dtype",
    "storage of another layout": "quantized.key_codes",
    "non-contiguous value parameters": "value_scale must be contiguous",
    "padding mask width": "key_padding_mask must be bool",
}


def _fresh(seed: int, case: Case):
    """The inputs of another step of the same shapes: other tensors (other addresses), the same launch facts."""
    return decode_inputs(case, seed=seed)


def _check_plan_reuse_and_refusals(case: Case, monkeypatch, tuning: DecodeTuning | None = None) -> launcher.DecodePlan:
    monkeypatch.setattr(launcher, "_PLANS", {})
    made = []
    make_plan = launcher._make_plan
    monkeypatch.setattr(launcher, "_make_plan", lambda *args: made.append(1) or make_plan(*args))
    for seed in range(3):  # one plan; each step's own tensors read (a stale pointer would match another step's data)
        inputs = _fresh(seed, case)
        ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
        out = decode_attention_triton(*inputs, tuning=tuning)
        assert_close_to_reference(out, ref, case.dtype, f"{case.id} step {seed}")
    assert len(made) == 1
    for kind, message in BAD_INPUTS.items():
        with pytest.raises(ValueError, match=message):
            decode_attention_triton(*_bad_inputs(inputs, kind), tuning=tuning)
    query, *rest = inputs  # a changed but valid input (a query in a wider buffer): a plan of its own, the right result
    query = torch.cat((query, torch.randn_like(query)), dim=-1)[..., : query.shape[-1]]
    ref = decode_attention_reference(query, *rest, compute_dtype=torch.float64, out_dtype=torch.float64)
    out = decode_attention_triton(query, *rest, tuning=tuning)
    assert_close_to_reference(out, ref, case.dtype, f"{case.id} strided query")
    assert len(made) == 2 + len(BAD_INPUTS)  # the refused inputs' plans were begun, never kept
    return decode_plan(*inputs[:5], inputs[6], inputs[7], tuning=tuning)


def test_a_cached_plan_is_reused_and_bad_inputs_are_still_refused(monkeypatch):
    """A plan (validation included) is made once per set of launch facts; a step with other tensors of the same facts
    reuses it and reads its own tensors, and an input that breaks the contract after a plan is cached still gets the
    clear error."""
    _check_plan_reuse_and_refusals(replace(BASE, left_pad=7), monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [replace(GLUON, left_pad=70), replace(BASE, left_pad=7)], ids=lambda c: c.id)
def test_a_bound_launch_reads_each_steps_tensors_and_refuses_bad_inputs(case: Case, monkeypatch):
    """On the GPU the plan's kernels launch through their compiled launchers after the first step (`BoundKernel`): the
    later steps must still read their own tensors, and bad inputs must still be refused."""
    plan = _check_plan_reuse_and_refusals(case, monkeypatch, _gluon_tuning(case) if case.head_dim == 128 else None)
    assert plan.split._compiled and plan.merge._compiled, "the compiled kernels' own launchers are not used"
    if case.head_dim == 128:
        assert plan.gluon is not None and plan.gluon._compiled, plan.why_not_gluon


def test_the_steps_that_fill_a_residual_window_share_a_plan(monkeypatch):
    """An eager decode step adds a token to the residual window and to the attention mask: the plan (made once for
    the window's views and the mask's dtype, batch and alignment) takes the tokens held and the mask's width and row
    stride per call, each step reading exactly its own; a window the plan cannot read is still refused."""
    case = replace(BASE, views=True, quantized=160, q_len=2, residual=9, left_pad=7)
    query, quantized, rk, rv, mask, scaling, config, key_rotated = decode_inputs(case, seed=5)
    monkeypatch.setattr(launcher, "_PLANS", {})
    made = []
    make_plan = launcher._make_plan
    monkeypatch.setattr(launcher, "_make_plan", lambda *args: made.append(1) or make_plan(*args))
    for held in (2, 9, 3):
        step_mask = mask[:, : case.quantized + held].clone()  # a new mask per step: width and row stride change
        step = (query, quantized, rk[:, :, :held], rv[:, :, :held], step_mask, scaling, config, key_rotated)
        ref = decode_attention_reference(*step, compute_dtype=torch.float64, out_dtype=torch.float64)
        assert_close_to_reference(decode_attention_triton(*step), ref, case.dtype, f"{case.id} held {held}")
    assert len(made) == 1
    refused = {  # what the error names
        "Tq=2 must be in 1..min\\(R=1": (rk[:, :, :1], rv[:, :, :1], mask[:, : case.quantized + 1]),
        "residual keys/values must both be": (rk[:, :, :4], rv[:, :, :3], mask[:, : case.quantized + 4]),
        "key_padding_mask must be bool": (rk[:, :, :4], rv[:, :, :4], mask[:, : case.quantized + 5]),
    }
    for message, (keys, values, step_mask) in refused.items():
        with pytest.raises(ValueError, match=message):
            decode_attention_triton(query, quantized, keys, values, step_mask, scaling, config, key_rotated)


@pytest.mark.gpu
def test_the_workspace_is_per_stream_and_captured_graphs_have_their_own(monkeypatch):
    """Calls reuse their stream's partial buffers (`decode_workspace.workspace`): calls queued on two streams at once
    and a CUDA graph replayed between eager calls each get their own right answer, and capturing the graph takes none
    of the eager calls' buffers."""
    case = replace(GLUON, left_pad=70)
    tuning = _gluon_tuning(case)
    steps = [decode_inputs(case, seed=seed) for seed in range(3)]
    refs = [decode_attention_reference(*step, compute_dtype=torch.float64, out_dtype=torch.float64) for step in steps]
    monkeypatch.setattr(decode_workspace, "WORKSPACES", {})
    decode_attention_triton(*steps[0], tuning=tuning)  # compiles and binds the plan's kernels
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    on_main, on_side = [], []
    for _ in range(8):  # queued without waiting: a shared buffer would be overwritten by the other stream's kernels
        on_main.append(decode_attention_triton(*steps[0], tuning=tuning))
        with torch.cuda.stream(side):
            on_side.append(decode_attention_triton(*steps[1], tuning=tuning))
    main.wait_stream(side)
    torch.cuda.synchronize()
    for out in on_main:
        assert_close_to_reference(out, refs[0], case.dtype, "main stream")
    for out in on_side:
        assert_close_to_reference(out, refs[1], case.dtype, "side stream")
    assert len(decode_workspace.WORKSPACES) == 2, "one workspace per stream"
    eager_buffers = dict(decode_workspace.WORKSPACES)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_attention_triton(*steps[2], tuning=tuning)
    assert {key: [id(t) for t in buffers] for key, buffers in decode_workspace.WORKSPACES.items()} == {
        key: [id(t) for t in buffers] for key, buffers in eager_buffers.items()
    }, "the capture took or replaced a workspace"
    for _ in range(4):
        graph.replay()
        eager = decode_attention_triton(*steps[0], tuning=tuning)
    torch.cuda.synchronize()
    assert_close_to_reference(captured, refs[2], case.dtype, "graph replay")
    assert_close_to_reference(eager, refs[0], case.dtype, "eager between replays")


def test_eager_calls_share_a_workspace_and_compiled_ones_do_not(monkeypatch):
    """Eager calls of one plan reuse their stream's partial buffers; calls with a device length (compiled decode's
    op, whose CUDA-graph warm-ups allocate from a pool torch rewinds) allocate their own, and stay right."""
    case = replace(BASE, quantized=128, residual=8, left_pad=7)  # a device length reads (length - 1) // R * R tokens
    monkeypatch.setattr(decode_workspace, "WORKSPACES", {})
    for seed in range(2):
        inputs = decode_inputs(case, seed=seed)
        ref = decode_attention_reference(*inputs, compute_dtype=torch.float64, out_dtype=torch.float64)
        assert_close_to_reference(decode_attention_triton(*inputs), ref, case.dtype, f"{case.id} eager {seed}")
    (buffers,) = decode_workspace.WORKSPACES.values()
    length = torch.tensor(case.quantized + case.residual, device=DEVICE)
    out = decode_attention_triton(*inputs, length)
    assert_close_to_reference(out, ref, case.dtype, f"{case.id} device length")
    assert list(decode_workspace.WORKSPACES.values()) == [buffers], "a call with a device length took a kept workspace"
