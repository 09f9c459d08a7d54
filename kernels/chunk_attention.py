"""Fused attention of a prefill chunk over the OScaR cache: many query tokens over the packed history, read in place.

`chunk_attention_triton(query, quantized, exact_keys, exact_values, key_padding_mask, scaling, config)`:

    query             [B, Hq, T, D]      bf16 / fp16 / fp32; Hq = g * Hkv (GQA), any strides
    quantized         QuantizedKV or None, L quantized tokens (`oscar_hf.layout`; views of capacity buffers allowed,
                      the value parameters contiguous over [L, D / G] as the layout allocates them)
    exact_keys        [B, Hkv, E, D]     the exact tokens that follow them, query dtype, E >= T: the residual window,
    exact_values      [B, Hkv, E, D]     then the chunk's own T tokens (post-RoPE, neither rotated nor scaled)
    key_padding_mask  None or bool [B, L + E] (True = attend)
    returns           [B, Hq, T, D]      query dtype (a view of a [B, T, Hq, D] tensor: the layout sdpa returns)

Query i (of T) sees every quantized token and exact tokens 0 .. E - T + i: causal within the chunk. This is
`oscar_hf.reference.decode_attention` for any number of queries; nothing proportional to L is materialised.

One program per (tile of BLOCK_M query rows, batch row x KV head). A tile's rows are token-major, `row = t * g + j`
(query token t, head j of the KV head's GQA group), so every K/V tile a program loads serves all g heads, and the
tensor cores see M = BLOCK_M rows (tokens x group). The program runs one online softmax over

1. the quantized blocks, with the decode kernel's tiles (kernels/decode_tiles.py: codes unpacked and dequantized in
   registers tile by tile, the query rotated into the keys' stored domain, fp16 dot operands, token norms, padding),
   accumulating in the values' rotated domain, then un-rotated once (o = o~ H is linear);
2. the exact tokens in the model dtype, blocks wholly left of the tile's causal diagonal without the causal mask,
   the blocks on it with it, and none past it.

Both parts share the running max and sum (base-2 scores, `scaling * log2(e)`), so the log-sum-exp merge of the two is
the online softmax itself and one write of the normalised output ends the program.

`chunk_attention_flash(...)` computes the same attention (no padding) through torch's FlashAttention-style kernels
(cuDNN's where torch can use it, 1.6-1.8x FlashAttention-2's speed on an H200, else FlashAttention-2; on the CPU tensors
of Triton's interpreter torch's CPU flash kernel, so that CI runs the same code): the chunk's T queries over their own T
tokens (causal, square), then over the history piece by piece, each piece of the quantized region dequantized into one
reused buffer pair in the model dtype (`dequantize_kv_triton`), the last piece followed by the exact tokens before the
chunk (sinks, window), each part folded into the first part's output by their log-sum-exp (`merge_partial`). Its
transients are the buffer pair (pieces of 2 T tokens by default, and the exact prefix) and two outputs: at GQA 4 about
three times the chunk's output, never anything of the history's size. Where a chunk is long it is the faster of the two:
the fused kernel dequantizes every history tile once per query tile (T * g / BLOCK_M times) and runs Triton's
tensor-core code, torch's attention reads tiles dequantized once (`chunk_attention_<gpu>.json`: `flash_pieces` against
`fused_chunk`). A short chunk is memory-bound, and the fused kernel reads 2-bit codes where the other path reads bf16
written just before. `chunk_attention` picks between them (`FLASH_MIN_QUERIES`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from oscar_hf.config import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout

from . import DECODE_HEAD_DIMS
from .common import MODEL_DTYPES, announce_first_launch, fwht_rows, interpreting, on_device
from .decode_tiles import any_masked, check_block_n, dot, online_softmax_step, quantized_blocks, query_operand
from .decode_workspace import no_storage, nothing
from .dequantize import dequantize_kv_triton
from .quantize_pack import check_key_rotated

_LOG2E = 1.4426950408889634
# Chunks of at least this many queries take `chunk_attention_flash` where they can (no padding, a torch backend that
# takes them): where `bench_chunk_attention.py --chunks` finds the two paths cross (docs/benchmarks.md).
FLASH_MIN_QUERIES = 1024


@dataclass(frozen=True)
class ChunkTuning:
    """Launch choices of the chunk kernel (`bench_chunk_attention.py --sweep` compares them)."""

    block_m: int = 128  # query rows (tokens x GQA group) per program, at most
    block_n: int = 128  # tokens per inner step (a multiple of 16), quantized and exact
    num_warps: int = 8
    num_stages: int = 2


def default_chunk_tuning(head_dim: int) -> ChunkTuning:
    """128-row tiles of 128-token steps up to D=128 (the fastest in `bench_chunk_attention.py --sweep` on an H100);
    at D=256 half the rows and half the steps, so the fp32 accumulator and the tiles fit registers."""
    return ChunkTuning() if head_dim <= 128 else ChunkTuning(block_m=64, block_n=64)


@triton.jit
def _exact_block(
    acc, m_i, l_i, q, ek_ptr, ev_ptr, mask_ptr, start, num_exact, last, qk_scale,
    stride_ekt, stride_ekd, stride_evt, stride_evd, stride_mt,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
):  # fmt: skip
    """One BLOCK_N-token step of the online softmax over exact tokens from `start`; CAUSAL: the block crosses the
    tile's diagonal or the end of the tokens (`last`: the last exact index each row may see)."""
    PRECISION: tl.constexpr = "ieee" if ek_ptr.dtype.element_ty == tl.float32 else "tf32"
    o_d = tl.arange(0, HEAD_DIM)
    o_j = start + tl.arange(0, BLOCK_N)
    m_j = o_j < num_exact
    b_k = tl.load(ek_ptr + o_j[:, None] * stride_ekt + o_d[None, :] * stride_ekd, mask=m_j[:, None], other=0.0)
    s = dot(q, tl.trans(b_k), PRECISION) * qk_scale
    if CAUSAL:
        s = tl.where(m_j[None, :] & (o_j[None, :] <= last[:, None]), s, float("-inf"))
    if HAS_MASK:
        s = tl.where((tl.load(mask_ptr + o_j * stride_mt, mask=m_j, other=0) != 0)[None, :], s, float("-inf"))
    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
    b_v = tl.load(ev_ptr + o_j[:, None] * stride_evt + o_d[None, :] * stride_evd, mask=m_j[:, None], other=0.0)
    acc = acc * alpha[:, None] + dot(p.to(b_v.dtype), b_v, PRECISION)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["num_quantized", "num_exact", "num_queries"])
def _chunk_attention_kernel(
    q_ptr, kc_ptr, ks_ptr, km_ptr, kn_ptr, vc_ptr, vs_ptr, vm_ptr, ek_ptr, ev_ptr, mask_ptr, key_rotated_ptr, out_ptr,
    num_kv_heads, num_quantized, num_exact, num_queries, qk_scale,
    stride_qb, stride_qh, stride_qt, stride_qd,
    stride_kcb, stride_kch, stride_kcr, stride_kcd,
    stride_ksb, stride_ksh, stride_ksg, stride_ksd,
    stride_kmb, stride_kmh, stride_kmg, stride_kmd,
    stride_knb, stride_knt,
    stride_vcb, stride_vch, stride_vcr, stride_vcd,
    stride_vsb, stride_vsh, stride_vmb, stride_vmh,
    stride_ekb, stride_ekh, stride_ekt, stride_ekd,
    stride_evb, stride_evh, stride_evt, stride_evd,
    stride_mb, stride_mt,
    stride_krb, stride_krh,
    stride_ob, stride_oh, stride_ot, stride_od,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, LOG2_D: tl.constexpr, KEY_BITS: tl.constexpr, VALUE_BITS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROTATION: tl.constexpr, KEY_ROTATION_PER_HEAD: tl.constexpr,
    TOKEN_SCALING: tl.constexpr, HAS_MASK: tl.constexpr, PARTIAL_BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1).to(tl.int64)
    b = pid_bh // num_kv_heads
    h = pid_bh % num_kv_heads
    first_row = pid_m * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)
    t = rows // GQA  # row = t * GQA + j: query token t, query head h * GQA + j
    head = h * GQA + rows % GQA
    m_rows = t < num_queries
    o_d = tl.arange(0, HEAD_DIM)
    p_q = q_ptr + b * stride_qb + head * stride_qh + t * stride_qt
    q = tl.load(p_q[:, None] + o_d[None, :] * stride_qd, mask=m_rows[:, None], other=0.0)

    # 1. the quantized region (every query sees all of it)
    key_rotated = False
    if KEY_ROTATION_PER_HEAD:
        key_rotated = tl.load(key_rotated_ptr + b * stride_krb + h * stride_krh) != 0
    b_q, q_scale = query_operand(
        q, key_rotated, qk_scale, ks_ptr.dtype.element_ty, BLOCK_M, HEAD_DIM, LOG2_D, ROTATION, KEY_ROTATION_PER_HEAD
    )
    p_mask = mask_ptr + b * stride_mb
    args = (
        b_q, q_scale, kc_ptr + b * stride_kcb + h * stride_kch, ks_ptr + b * stride_ksb + h * stride_ksh,
        km_ptr + b * stride_kmb + h * stride_kmh, kn_ptr + b * stride_knb, vc_ptr + b * stride_vcb + h * stride_vch,
        vs_ptr + b * stride_vsb + h * stride_vsh, vm_ptr + b * stride_vmb + h * stride_vmh, p_mask, 0,
        tl.cdiv(num_quantized, BLOCK_N), num_quantized, stride_kcr, stride_kcd, stride_ksg, stride_ksd, stride_kmg,
        stride_kmd, stride_knt, stride_vcr, stride_vcd, stride_mt,
    )  # fmt: skip
    masked = False
    if HAS_MASK:  # rows without padding in the quantized region run the loop without the per-step mask gather
        masked = any_masked(p_mask, 0, num_quantized, stride_mt, 8 * BLOCK_N)
    if masked:
        acc, m_i, l_i = quantized_blocks(
            *args, HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, True, PARTIAL_BLOCK
        )
    else:
        acc, m_i, l_i = quantized_blocks(
            *args, HEAD_DIM, KEY_BITS, VALUE_BITS, GROUP, BLOCK_M, BLOCK_N, TOKEN_SCALING, False, PARTIAL_BLOCK
        )
    if ROTATION:  # the values' stored domain back to the model's: (sum p v~) H = sum p v
        acc = fwht_rows(acc, BLOCK_M, HEAD_DIM, LOG2_D)

    # 2. the exact tokens, causal: query t sees exact tokens 0 .. num_exact - num_queries + t
    offset = num_exact - num_queries
    last = offset + t
    first_last = offset + first_row // GQA  # the tile's first row sees the fewest
    end = tl.minimum(num_exact, offset + tl.minimum(first_row + BLOCK_M - 1, GQA * num_queries - 1) // GQA + 1)
    full_end = tl.minimum((first_last + 1) // BLOCK_N * BLOCK_N, end)  # blocks every row of the tile sees whole
    ek = ek_ptr + b * stride_ekb + h * stride_ekh
    ev = ev_ptr + b * stride_evb + h * stride_evh
    p_mask_exact = p_mask + num_quantized * stride_mt
    for start in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _exact_block(
            acc, m_i, l_i, q, ek, ev, p_mask_exact, start, num_exact, last, qk_scale,
            stride_ekt, stride_ekd, stride_evt, stride_evd, stride_mt, HEAD_DIM, BLOCK_N, HAS_MASK, False,
        )  # fmt: skip
    for start in range(full_end, end, BLOCK_N):
        acc, m_i, l_i = _exact_block(
            acc, m_i, l_i, q, ek, ev, p_mask_exact, start, num_exact, last, qk_scale,
            stride_ekt, stride_ekd, stride_evt, stride_evd, stride_mt, HEAD_DIM, BLOCK_N, HAS_MASK, True,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that sees nothing (all padding) writes zeros
    p_out = out_ptr + b * stride_ob + head * stride_oh + t * stride_ot
    tl.store(p_out[:, None] + o_d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=m_rows[:, None])


def chunk_attention_triton(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    *,
    tuning: ChunkTuning | None = None,
) -> torch.Tensor:
    """Attention of T chunk queries over quantized + exact tokens (module docstring), fused: `[B, Hq, T, D]`.
    `key_rotated`: method="oscar"'s `[B, Hkv]` bool (None for method="paper"); `tuning`: launch choices, else
    `default_chunk_tuning`'s."""
    num_quantized = _validate(query, quantized, exact_keys, exact_values, key_padding_mask, config)
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads, num_exact = exact_keys.shape[1], exact_keys.shape[2]
    check_key_rotated(key_rotated, batch, kv_heads, query.device, config, "chunk_attention_triton")
    device = query.device
    if device.type == "cuda":
        announce_first_launch()
    gqa = q_heads // kv_heads
    tuning = tuning or default_chunk_tuning(head_dim)
    check_block_n(tuning.block_n, config, "chunk_attention_triton")
    block_m = max(16, min(tuning.block_m, triton.next_power_of_2(gqa * q_len)))  # tl.dot: at least 16 rows
    if quantized is None or num_quantized == 0:  # nothing to read: empty stand-ins, never dereferenced
        quantized = no_storage(query, exact_keys, config)
    norms = quantized.key_norms
    mask = key_padding_mask.view(torch.uint8) if key_padding_mask is not None else nothing(device, 2)
    flags = key_rotated.view(torch.uint8) if key_rotated is not None else nothing(device, 2)
    out = torch.empty(batch, q_len, q_heads, head_dim, dtype=query.dtype, device=device).transpose(1, 2)
    grid = (triton.cdiv(gqa * q_len, block_m), batch * kv_heads)
    with on_device(device):
        _chunk_attention_kernel[grid](
            query, quantized.key_codes, quantized.key_scale, quantized.key_min,
            norms if norms is not None else nothing(device, 3), quantized.value_codes, quantized.value_scale,
            quantized.value_min, exact_keys, exact_values, mask, flags, out,
            kv_heads, num_quantized, num_exact, q_len, scaling * _LOG2E,
            *query.stride(), *quantized.key_codes.stride(), *quantized.key_scale.stride(),
            *quantized.key_min.stride(), *((norms.stride(0), norms.stride(2)) if norms is not None else (0, 0)),
            *quantized.value_codes.stride(), *quantized.value_scale.stride()[:2], *quantized.value_min.stride()[:2],
            *exact_keys.stride(), *exact_values.stride(), *mask.stride(), *flags.stride(), *out.stride(),
            GQA=gqa, HEAD_DIM=head_dim, LOG2_D=head_dim.bit_length() - 1, KEY_BITS=config.key_bits,
            VALUE_BITS=config.value_bits,
            GROUP=config.group_size, BLOCK_M=block_m, BLOCK_N=tuning.block_n, ROTATION=config.rotation,
            KEY_ROTATION_PER_HEAD=key_rotated is not None, TOKEN_SCALING=norms is not None,
            HAS_MASK=key_padding_mask is not None, PARTIAL_BLOCK=num_quantized % tuning.block_n != 0,
            num_warps=tuning.num_warps, num_stages=tuning.num_stages,
        )  # fmt: skip
    return out


def chunk_attention(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    *,
    prefer_flash: bool = False,
) -> torch.Tensor:
    """`chunk_attention_triton`'s attention by the faster path for this call: `chunk_attention_flash` for a chunk of
    at least `FLASH_MIN_QUERIES` queries without padding where torch's fused attention (cuDNN or flash) takes its
    tensors, else the fused kernel; a chunk without history (its own tokens only: plain causal attention) by torch's
    at any length. `prefer_flash`: see `chunk_attention_flash`."""
    args = (query, quantized, exact_keys, exact_values)
    own_only = quantized is None and exact_keys.shape[-2] == query.shape[-2]
    torch_pays = key_padding_mask is None and (query.shape[-2] >= FLASH_MIN_QUERIES or own_only)
    if torch_pays and _torch_attention_backend(query, exact_keys):
        return chunk_attention_flash(*args, scaling, config, key_rotated, prefer_flash=prefer_flash)
    return chunk_attention_triton(*args, key_padding_mask, scaling, config, key_rotated)


def chunk_attention_flash(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    scaling: float,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    *,
    piece_tokens: int | None = None,
    prefer_flash: bool = False,
) -> torch.Tensor:
    """`chunk_attention_triton`'s attention without padding, by torch's fused attention over the chunk's own tokens
    and over the history dequantized piece by piece (module docstring): `[B, Hq, T, D]`, a view of a `[B, T, Hq, D]`
    tensor. `piece_tokens`: quantized tokens per piece (rounded up to the group size), else 2 T. `prefer_flash`:
    torch's flash kernel before cuDNN, for callers whose shapes are new at nearly every call (a serving step's
    chunks): cuDNN builds an execution plan for each new shape (cached per thread by shape), ~1.5 ms of host time per
    call in a serving step on an H100 (`serving_h100-80gb-hbm3.json`, the prompt profile), more than its faster kernel
    saves there."""
    who = "chunk_attention_flash"
    num_quantized = _validate(query, quantized, exact_keys, exact_values, None, config, who)
    check_key_rotated(key_rotated, query.shape[0], exact_keys.shape[1], query.device, config, who)
    backend = _torch_attention_backend(query, exact_keys, prefer_flash)
    if backend is None:
        raise ValueError(
            "chunk_attention_flash: torch's fused attention (cuDNN or flash) does not take these tensors here (on CUDA "
            "it needs bf16 or fp16, a supported head_dim, and the backend enabled); use chunk_attention_triton."
        )
    num_exact, num_queries = exact_keys.shape[2], query.shape[2]
    prefix = num_exact - num_queries  # the exact tokens before the chunk's own (sinks, window): every query sees them
    own = (exact_keys[:, :, prefix:], exact_values[:, :, prefix:])
    out, lse = _attend(backend, query, *own, scaling, causal=True)  # square: either backend's causal alignment
    if not num_quantized and not prefix:
        return out

    def history():
        """(keys, values) over everything before the chunk's own tokens, in pieces; the last piece is followed by
        the exact prefix in the same buffers (one call)."""
        if not num_quantized:
            yield exact_keys[:, :, :prefix], exact_values[:, :, :prefix]
            return
        group = config.group_size
        piece = min(num_quantized, -(-(piece_tokens or 2 * num_queries) // group) * group)
        shape = (*exact_keys.shape[:2], piece + prefix, exact_keys.shape[3])
        buffers = [exact_keys.new_empty(shape) for _ in range(2)]
        layout = StorageLayout.of(config)
        for start in range(0, num_quantized, piece):
            end = min(start + piece, num_quantized)
            n = end - start
            rows = layout.rows(quantized, start, end)
            dequantize_kv_triton(rows, config, key_rotated, out=tuple(b[:, :, :n] for b in buffers))
            extra = prefix if end == num_quantized else 0
            for buffer, exact in zip(buffers, (exact_keys, exact_values)):
                buffer[:, :, n : n + extra] = exact[:, :, :extra]
            yield tuple(buffer[:, :, : n + extra] for buffer in buffers)

    for keys, values in history():
        merge_partial(out, lse, *_attend(backend, query, keys, values, scaling, causal=False))
    return out


def merge_partial(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold attention over new keys into attention over others, in place: `out` `[..., T, D]` and `lse` `[..., T]`
    (float32: the natural log-sum-exp of the scores) over the keys so far, `part` and `part_lse` over the new ones.
    The softmax over all keys weighs each normalised part by its share of the total exp-sum: out + w (part - out) with
    w = exp(part_lse - lse_total), one pass in `out`'s dtype (w rounded to it: a relative error of the dtype's
    rounding, as the output's own)."""
    total = torch.logaddexp(lse, part_lse)
    out.lerp_(part, (part_lse - total).exp_().unsqueeze(-1).to(out.dtype))
    lse.copy_(total)


def _attend(backend: str, query, keys, values, scaling: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's fused attention with its log-sum-exp `[B, Hq, T]` (float32), GQA without expanding K/V. `causal` only
    where S = T: cuDNN aligns the diagonal top-left, flash bottom-right, and the two agree there."""
    if backend == "cudnn":  # 1.6-1.8x flash's speed on an H200 (bf16, D = 128)
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            query, keys, values, None, True, 0.0, causal, False, scale=scaling
        )[:2]
        return out, lse.squeeze(-1)  # [B, Hq, T, 1]
    if backend == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, keys, values, 0.0, causal, scale=scaling
        )
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        query, keys, values, 0.0, causal, False, scale=scaling
    )[:2]
    return out, lse


def _torch_attention_backend(query: torch.Tensor, keys: torch.Tensor, prefer_flash: bool = False) -> str | None:
    """The torch attention backend that takes these tensors: on CUDA "cudnn" or "flash" (device, dtype, head_dim,
    GQA, enabled by the user; cuDNN first, flash first with `prefer_flash`), on CPU (Triton's interpreter) "cpu",
    torch's CPU flash kernel, where flash is enabled; None if none does."""
    if query.device.type == "cpu":
        return "cpu" if torch.backends.cuda.flash_sdp_enabled() else None
    if query.device.type != "cuda":
        return None
    from torch.backends.cuda import SDPAParams, can_use_cudnn_attention, can_use_flash_attention

    params = SDPAParams(query, keys, keys, None, 0.0, False, True)
    takes = {"cudnn": can_use_cudnn_attention, "flash": can_use_flash_attention}
    order = ("flash", "cudnn") if prefer_flash else ("cudnn", "flash")
    return next((backend for backend in order if takes[backend](params)), None)


def _validate(
    query, quantized, exact_keys, exact_values, key_padding_mask, config, who="chunk_attention_triton"
) -> int:
    """Check shapes/dtypes/devices (a ValueError names `who` and what is wrong); return the number of quantized
    tokens."""
    if query.dim() != 4 or exact_keys.dim() != 4 or exact_keys.shape != exact_values.shape:
        raise ValueError(
            f"{who}: query must be [B, Hq, T, D] and exact keys/values both [B, Hkv, E, D], got "
            f"{tuple(query.shape)}, {tuple(exact_keys.shape)} and {tuple(exact_values.shape)}."
        )
    batch, q_heads, q_len, head_dim = query.shape
    _, kv_heads, num_exact, _ = exact_keys.shape
    if query.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{who}: tensors must be on a CUDA device, got {query.device}; use oscar_hf.reference.decode_attention "
            "(or the portable path) elsewhere."
        )
    if query.dtype not in MODEL_DTYPES or exact_keys.dtype != query.dtype or exact_values.dtype != query.dtype:
        raise ValueError(
            f"{who}: query and exact K/V must share one of {MODEL_DTYPES}, got {query.dtype}, {exact_keys.dtype} and "
            f"{exact_values.dtype}."
        )
    if head_dim not in DECODE_HEAD_DIMS or head_dim % config.group_size:
        raise ValueError(
            f"{who}: head_dim={head_dim} is not supported (one of {DECODE_HEAD_DIMS}, a multiple of "
            f"group_size={config.group_size}); use the portable attention path for this model."
        )
    if exact_keys.shape[0] != batch or exact_keys.shape[3] != head_dim or kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(
            f"{who}: exact K/V {tuple(exact_keys.shape)} do not match query {tuple(query.shape)} (same B and D, Hq a "
            "multiple of Hkv)."
        )
    if not 1 <= q_len <= num_exact:
        raise ValueError(
            f"{who}: T={q_len} queries must be 1 .. E={num_exact} (the queries are the last exact tokens)."
        )
    if exact_keys.device != query.device or exact_values.device != query.device:
        raise ValueError(
            f"{who}: exact K/V are on {exact_keys.device}/{exact_values.device}, the query on {query.device}."
        )
    num_quantized = 0
    if quantized is not None:
        num_quantized = StorageLayout.of(config).check(quantized, batch, kv_heads, head_dim, query.device, who)
        groups = head_dim // config.group_size  # the tiles read the value parameters with these constant strides
        for name in ("value_scale", "value_min"):
            if getattr(quantized, name).stride()[2:] != (groups, 1):
                raise ValueError(
                    f"{who}: quantized.{name} must be contiguous over its last two dims [L, D / G] (strides "
                    f"({groups}, 1) as the storage layout allocates them), got {getattr(quantized, name).stride()[2:]}"
                )
    if key_padding_mask is not None and (
        key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (batch, num_quantized + num_exact)
    ):
        raise ValueError(
            f"{who}: key_padding_mask must be bool [B, L + E] = {(batch, num_quantized + num_exact)}, got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}."
        )
    if key_padding_mask is not None and key_padding_mask.device != query.device:
        raise ValueError(f"{who}: key_padding_mask is on {key_padding_mask.device}, the query on {query.device}.")
    return num_quantized
