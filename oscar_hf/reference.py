"""The OScaR method as plain PyTorch: the executable specification that the cache and every kernel follow.

Shapes: keys/values `[B, Hkv, N, D]` (batch, KV heads, tokens, head_dim). All math runs in float32 (or float64
when the input is float64), whatever the model dtype.

The storage (what `quantize_kv` returns and `dequantize_kv` reads) is `oscar_hf.layout`'s `QuantizedKV`, in the
layout `StorageLayout` defines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .config import OscarConfig
from .layout import QuantizedKV, StorageLayout


def rotation_block_size(head_dim: int) -> int:
    """Size of the Walsh-Hadamard blocks along head_dim: head_dim itself when it is a power of two, otherwise the
    largest power of two dividing it (a block-diagonal Hadamard, still symmetric and orthogonal)."""
    return head_dim & -head_dim


def check_head_dim(head_dim: int, config: OscarConfig) -> None:
    """Refuse head dims the storage cannot represent, naming the problem and the fix."""
    if head_dim % config.group_size != 0:
        fits = [g for g in (32, 64, 128) if head_dim % g == 0]
        fix = f"use group_size={fits[0]}" if fits else "keep this model on its default cache"
        raise ValueError(
            f"OscarCache cannot quantize head_dim={head_dim}: values are grouped along head_dim in groups of "
            f"group_size={config.group_size}, which must divide it; {fix}."
        )


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Normalized fast Walsh-Hadamard transform along the last dim (x H, with H = H^T = H^-1), O(D log D).

    Iterative butterflies: at stride h, pairs (i, i + h) inside each 2h-block become (a + b, a - b).
    """
    head_dim = x.shape[-1]
    block = rotation_block_size(head_dim)
    y = x.unflatten(-1, (head_dim // block, block))
    h = 1
    while h < block:
        y = y.unflatten(-1, (block // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * block**-0.5).flatten(-2)


def token_norms(keys: torch.Tensor, group=None) -> torch.Tensor:
    """Omni-Token Scaling factor n_t: the L2 norm of a key token over all KV heads and channels, `[B, 1, N]`.

    Computed in float32 (float64 stays float64); a zero or NaN norm (an all-zero or broken token) becomes 1 so
    that dividing by it is always safe. With `group`, a torch.distributed process group over which the layer's KV
    heads are sharded (tensor parallel), `keys` holds this rank's heads and the norm still covers every head: one
    all-reduce of the squared norms.
    """
    k = keys.float() if keys.dtype != torch.float64 else keys
    # Channels first, then heads: the same float sum whatever the memory layout of `keys` (a prefill's keys are
    # token-major, a cache's window head-major; one reduction over both dims sums in a layout-dependent order), so a
    # token's norm, and so its codes, do not depend on where the token was held when its block was quantized.
    squares = k.square().sum(-1).sum(1)
    if group is not None:
        torch.distributed.all_reduce(squares, group=group)
    norms = squares.sqrt().unsqueeze(1)
    return torch.where(norms > 0, norms, torch.ones_like(norms))  # NaN > 0 is False


def quantize_groups(
    x: torch.Tensor,
    bits: int,
    group_size: int,
    dim: int,
    scale_dtype: torch.dtype,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization in groups of `group_size` consecutive elements along `dim`.

    Returns (codes uint8 shaped like x, scale, min) with `dim` reduced by group_size in scale/min. Scale and min
    are rounded to `scale_dtype` *before* computing the codes, so the codes are the best ones for the stored
    parameters and dequantization is within half a step.

    `valid` (bool, broadcastable to x; None: all valid) marks the elements that count: the others (padding of a
    left-padded batch) take no part in their group's min/max and get code 0, so a group's parameters and its valid
    elements' codes are what they would be with the padding replaced by copies of valid elements of the same group.
    A group with no valid element stores scale 0 and min 0: it decodes to zeros, finite whatever the padding held.
    """
    levels = 2**bits - 1
    compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32

    def grouped(t: torch.Tensor) -> torch.Tensor:
        t = t.movedim(dim, -1)
        return t.unflatten(-1, (t.shape[-1] // group_size, group_size))

    g = grouped(x.to(compute_dtype))
    if valid is None:
        mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    else:
        valid = grouped(valid.expand(x.shape))
        empty = ~valid.any(-1, keepdim=True)
        mn = torch.where(valid, g, torch.inf).amin(-1, keepdim=True).masked_fill(empty, 0)
        mx = torch.where(valid, g, -torch.inf).amax(-1, keepdim=True).masked_fill(empty, 0)
    mn = mn.to(scale_dtype).to(compute_dtype)
    scale = ((mx - mn) / levels).to(scale_dtype).to(compute_dtype)
    codes = torch.where(scale > 0, (g - mn) / scale, 0.0).round_().clamp_(0, levels)
    if valid is not None:
        codes = codes.masked_fill(~valid, 0)  # padding may hold anything, NaN included: its code is defined
    codes = codes.to(torch.uint8).flatten(-2).movedim(-1, dim)
    scale, mn = (t.squeeze(-1).movedim(-1, dim).to(scale_dtype) for t in (scale, mn))
    return codes, scale, mn


def dequantize_groups(
    codes: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, group_size: int, dim: int, dtype=torch.float32
) -> torch.Tensor:
    """Inverse of `quantize_groups`: `code * scale + min`, with scale/min broadcast over each group."""
    scale = scale.to(dtype).repeat_interleave(group_size, dim=dim)
    mn = mn.to(dtype).repeat_interleave(group_size, dim=dim)
    return codes.to(dtype) * scale + mn


def fake_quantize_keys(
    keys: torch.Tensor, rotated: bool, config: OscarConfig, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """The keys' round trip (token scaling and per-channel groups of `config`, with or without the rotation), back in
    the model's domain, unpacked: what `query_rotation_choice` compares. `valid`: as in `quantize_kv`."""
    norms = token_norms(keys).unsqueeze(-1) if config.token_scaling else 1.0
    u = (hadamard_transform(keys) if rotated else keys) / norms
    codes, scale, mn = quantize_groups(
        u, config.key_bits, config.group_size, -2, config.scale_torch_dtype, _key_valid(valid)
    )
    u_hat = dequantize_groups(codes, scale, mn, config.group_size, -2, keys.dtype) * norms
    return hadamard_transform(u_hat) if rotated else u_hat


def _key_valid(valid: torch.Tensor | None) -> torch.Tensor | None:
    """A `[B, N]` token mask as K/V tensors `[B, Hkv, N, D]` broadcast it."""
    return None if valid is None else valid[:, None, :, None]


# Query positions per slice in `query_moment`: a long prompt's queries are read a slice at a time, so that the
# prefill's transient stays small (a whole float32 copy and its regrouped copy would be 4x the bf16 queries).
QUERY_MOMENT_CHUNK = 2048


def query_moment(query: torch.Tensor, kv_heads: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The second moment of the queries each KV head serves, `[B, Hkv, D, D]`: sum over the query heads of its GQA
    group and over the query positions of q q^T (post-RoPE queries `[B, Hq, Tq, D]`, in float32, float64 kept).
    `valid` (`[B, Tq]` bool): only those positions count (padding queries are whatever the model left there).

    On CUDA, 16-bit queries enter the tensor cores as they are, accumulating in float32 (`out_dtype`): a product of
    two 16-bit values is exact in float32, so this is the float32 sum (up to its order) in a small part of the time
    of a float32 matmul, which runs on the CUDA cores unless the user allows TF32."""
    batch, heads, length, dim = query.shape
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    tensor_cores = query.is_cuda and query.dtype in (torch.float16, torch.bfloat16)
    moment = query.new_zeros(batch * kv_heads, dim, dim, dtype=dtype)
    for start in range(0, length, QUERY_MOMENT_CHUNK):
        q = query[:, :, start : start + QUERY_MOMENT_CHUNK]
        q = q if tensor_cores else q.to(dtype)
        if valid is not None:
            q = q.masked_fill(~valid[:, None, start : start + QUERY_MOMENT_CHUNK, None], 0)
        q = q.reshape(batch * kv_heads, -1, dim)
        moment += torch.bmm(q.mT, q, out_dtype=dtype) if tensor_cores else q.mT @ q
    return moment.view(batch, kv_heads, dim, dim)


def query_rotation_choice(
    keys: torch.Tensor,
    moment: torch.Tensor,
    config: OscarConfig,
    valid: torch.Tensor | None = None,
    round_trip: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """method="oscar": whether each (batch row, KV head) rotates its keys, `[B, Hkv]` bool, decided from the keys and
    the queries that read them.

    What quantization costs attention is the logit error q_i.(k^_t - k_t), less its mean over the keys t (a shift of
    all of a query's logits leaves the softmax unchanged). Summed over the queries i (through their second moment
    M = sum_i q_i q_i^T, `query_moment`) and the keys, it is tr(E_c^T E_c M) with E_c the key error centred over the
    tokens (`query_weighted_key_error`). Both round trips of these keys (`fake_quantize_keys`: the prompt's keys, in key
    groups of `config.group_size` tokens from the first) are costed and the cheaper one kept. The rotation helps heads
    whose keys have rare large values in the channels the queries read, and hurts heads whose queries weigh quiet,
    near-constant channels (Qwen2's k_proj-bias channels, Gemma 3's k_norm-scaled keys): the rotation hands those
    channels a share of every channel's error.

    `valid` (`[B, N]` bool, None: all tokens): padding keys enter neither the quantization groups nor the cost. N need
    not be a multiple of the group size (a prompt shorter than a block): the last group is quantized from the tokens it
    has, as if padded. A row without a valid token costs nothing either way and keeps its keys unrotated.
    `round_trip`: `fake_quantize_keys` (None) or an implementation of it (the fused path's Triton kernels).
    """
    k, valid = whole_key_groups(keys, valid, config.group_size)
    moment = moment.to(k.dtype)
    costs = [
        query_weighted_key_error(*key_error_sums(k, rotated, config, valid, round_trip), moment)
        for rotated in (True, False)
    ]
    return costs[0] < costs[1]


def whole_key_groups(keys: torch.Tensor, valid: torch.Tensor | None, group_size: int):
    """`keys` in float32 (float64 kept), padded with invalid zero tokens to whole key groups, and their `[B, N]` mask
    (None: all valid); whatever padding holds (NaN included) is zeroed, so that it weighs 0 in any sum."""
    k = keys.float() if keys.dtype != torch.float64 else keys
    partial = -k.shape[-2] % group_size
    if partial:
        if valid is None:
            valid = torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool, device=k.device)
        k = torch.cat([k, k.new_zeros(*k.shape[:2], partial, k.shape[-1])], dim=-2)
        valid = torch.cat([valid, valid.new_zeros(valid.shape[0], partial)], dim=1)
    if valid is not None:
        k = k.masked_fill(~_key_valid(valid), 0)
    return k, valid


def key_error_sums(
    keys: torch.Tensor,
    rotated: bool,
    config: OscarConfig,
    valid: torch.Tensor | None = None,
    round_trip: Callable[..., torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over the valid tokens of the error e_t of the keys' round trip (`round_trip`, None: `fake_quantize_keys`,
    at `config.key_bits`): `(sum_t e_t e_t^T [B, Hkv, D, D], sum_t e_t [B, Hkv, D], tokens [B, 1, 1])`. Additive over
    chunks of a prompt. `keys`: whole key groups (`whole_key_groups`)."""
    return error_sums((round_trip or fake_quantize_keys)(keys, rotated, config, valid) - keys, valid)


def error_sums(
    error: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`key_error_sums` of a round trip's error `[B, Hkv, N, D]` (invalid tokens left out, whatever they hold)."""
    if valid is not None:
        error = error.masked_fill(~_key_valid(valid), 0)
    count = error.new_full((error.shape[0], 1, 1), error.shape[-2]) if valid is None else valid.sum(-1)[:, None, None]
    return error.transpose(-1, -2) @ error, error.sum(-2), count.to(error.dtype)


def query_weighted_key_error(
    gram: torch.Tensor, total: torch.Tensor, tokens: torch.Tensor, moment: torch.Tensor
) -> torch.Tensor:
    """tr(E_c^T E_c M) per (row, KV head), `[B, Hkv]`: the squared logit error of the keys (centred over the tokens)
    summed over the queries of second moment M (`query_moment`), from `key_error_sums`' sums."""
    centred = gram - total.unsqueeze(-1) * total.unsqueeze(-2) / tokens.clamp_min(1).unsqueeze(-1)
    return (centred * moment).sum((-2, -1))


def rotate_keys(keys: torch.Tensor, key_rotated: torch.Tensor | None) -> torch.Tensor:
    """`keys H` for the heads that rotate (all of them when `key_rotated` is None: method="paper")."""
    if key_rotated is None:
        return hadamard_transform(keys)
    return torch.where(key_rotated[:, :, None, None], hadamard_transform(keys), keys)


def quantize_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    norms: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> QuantizedKV:
    """Rotate, token-scale, quantize and pack post-RoPE keys and values of N tokens (N a multiple of group_size).

    `key_rotated` (`[B, Hkv]` bool, method="oscar"): which heads' keys are rotated; None rotates all (method="paper").
    Values are always rotated when `config.rotation` is on. Ignored when it is off. `norms` overrides the token norms
    computed from `keys` (tensor parallel: `token_norms(keys, group)` covers the KV heads of every rank).

    `valid` (`[B, N]` bool, None: all tokens) marks the real tokens of a padded batch: padding takes no part in the
    key groups' per-channel min/max (`quantize_groups`), so a row's real tokens are quantized as if each padding key
    were a copy of a real key of its group; with whole groups of padding (a padding length that is a multiple of
    group_size) the real tokens' codes, scales, mins and norms are exactly those of the same row without its padding.
    Token norms and value groups (along channels) are per token: padding cannot reach the real tokens there. Padding
    stores code 0, norm 1 and value groups of scale 0 and min 0, so whatever the model left in it (even inf or NaN)
    it decodes to finite numbers: zeros, but for keys in a group shared with real tokens (the group's minimums)."""
    config.require_widths("reference.quantize_kv")
    k = keys.float() if keys.dtype != torch.float64 else keys
    v = values.float() if values.dtype != torch.float64 else values
    if not config.token_scaling:
        norms = None
    elif norms is None:
        norms = token_norms(k)
    if config.rotation:
        k, v = rotate_keys(k, key_rotated), hadamard_transform(v)
    if norms is not None:
        if valid is not None:
            norms = norms.masked_fill(~valid[:, None], 1)
        k = k / norms.unsqueeze(-1)
    key_codes, key_scale, key_min = quantize_groups(
        k, config.key_bits, config.group_size, -2, config.scale_torch_dtype, _key_valid(valid)
    )
    value_codes, value_scale, value_min = quantize_groups(
        v, config.value_bits, config.group_size, -1, config.scale_torch_dtype, _key_valid(valid)
    )
    return QuantizedKV(
        StorageLayout.pack_codes(key_codes, config.key_bits),
        key_scale,
        key_min,
        norms,
        StorageLayout.pack_codes(value_codes, config.value_bits),
        value_scale,
        value_min,
    )


def finite_flags(
    qkv: QuantizedKV, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """`[2]` bool on the block's device, computed without a host synchronisation: whether the model's `keys`/`values`
    are finite, and whether the block's scales/mins are (an overflow of the scale dtype decodes to inf/NaN silently).
    The K/V are checked themselves: the Triton quantizer's min/max skip NaN (IEEE maxNum, as Triton's maximum does on
    a GPU), so a NaN can leave every scale finite. `valid` (`[B, N]` bool, None: all tokens): padding may hold
    anything. `raise_unless_finite` reads them."""
    inputs = torch.isfinite(keys) & torch.isfinite(values)
    if valid is not None:
        inputs |= ~valid[:, None, :, None]
    params = (qkv.key_scale, qkv.key_min, qkv.value_scale, qkv.value_min)
    return torch.stack([inputs.all(), torch.stack([torch.isfinite(p).all() for p in params]).all()])


def raise_unless_finite(flags: torch.Tensor, config: OscarConfig) -> None:
    """Refuse a block whose `finite_flags` are not all set, saying whether the model's K/V were not finite or the scale
    dtype overflowed (reading device flags synchronises the host)."""
    inputs_finite, params_finite = flags.tolist()
    if not inputs_finite:
        raise ValueError(
            "OscarCache: the model produced non-finite keys or values (NaN or inf) for this block; no cache setting "
            "fixes that. Check the model's activations (dtype overflow, e.g. float16 for a bfloat16-trained model)."
        )
    if not params_finite:
        raise ValueError(
            f"OscarCache: a quantization scale or minimum overflowed {config.scale_dtype} (the K/V values are finite "
            "but too large for it). Use scale_dtype='float32'."
        )


def dequantize_kv(
    qkv: QuantizedKV, config: OscarConfig, dtype: torch.dtype = torch.float32, key_rotated: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values the storage represents, back in the model's (un-rotated, un-scaled) domain; `key_rotated`
    as given to `quantize_kv`."""
    g, unpack = config.group_size, StorageLayout.unpack_codes
    k = dequantize_groups(unpack(qkv.key_codes, config.key_bits), qkv.key_scale, qkv.key_min, g, -2, dtype)
    v = dequantize_groups(unpack(qkv.value_codes, config.value_bits), qkv.value_scale, qkv.value_min, g, -1, dtype)
    if qkv.key_norms is not None:
        k = k * qkv.key_norms.to(dtype).unsqueeze(-1)
    if config.rotation:
        k, v = rotate_keys(k, key_rotated), hadamard_transform(v)
    return k, v


def fake_quantize_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_rotated: torch.Tensor,
    config: OscarConfig,
    valid: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What the storage of these K/V represents (`quantize_kv`, then `dequantize_kv` in their dtype), with the keys of
    each (row, KV head) rotated as `key_rotated` (`[B, Hkv]` bool, read where `config.rotation` is on) says: what
    bits="auto" costs each width with (`layer_widths.bit_cost_sums`; `kernels.fake_quantize_kv_triton` is its fused
    path's). `keys`, `values`: whole key groups; `valid` as in `quantize_kv`."""
    config, key_rotated = per_head_rotation(config, key_rotated)
    return dequantize_kv(quantize_kv(keys, values, config, key_rotated, valid=valid), config, keys.dtype, key_rotated)


def per_head_rotation(config: OscarConfig, key_rotated: torch.Tensor) -> tuple[OscarConfig, torch.Tensor | None]:
    """The config and flags that store keys rotated per (row, KV head) as `key_rotated` says: method="oscar" where the
    rotation is on; no flags where it is off (nothing rotates)."""
    if config.rotation:
        return dataclasses.replace(config, method="oscar"), key_rotated
    return config, None


def round_trip_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    config: OscarConfig,
    dtype: torch.dtype = torch.float32,
    moment: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize then dequantize, as a fresh cache whose prompt these keys are; method="oscar" chooses from them and the
    second moment of the queries that read them (`query_moment`), which it needs. method="auto" depends on the model's
    attention: resolve it first (`config.resolve(attn_implementation)`)."""
    if config.method == "auto":
        raise ValueError(
            "round_trip_kv: method='auto' means 'oscar' or 'paper' depending on the model's attention; pass "
            "config.resolve(model.config._attn_implementation) or name the method."
        )
    key_rotated = None
    if config.rotation and config.method == "oscar":
        if moment is None:
            raise ValueError("round_trip_kv: method='oscar' chooses the key rotation from the queries; pass `moment`.")
        key_rotated = query_rotation_choice(keys, moment, config)
    return dequantize_kv(quantize_kv(keys, values, config, key_rotated), config, dtype, key_rotated)


def decode_attention(
    query: torch.Tensor,
    quantized: QuantizedKV | None,
    residual_keys: torch.Tensor,
    residual_values: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    scaling: float,
    config: OscarConfig,
    key_rotated: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of the newest Tq queries over quantized + residual tokens, by dequantization + plain softmax
    attention in `compute_dtype`: the contract of the fused `oscar_hf.kernels.decode_attention_triton`.

    Materialises the whole dequantized cache: the executable definition the fused kernel is tested against.
    The result is cast to `out_dtype` (default: the query dtype); `key_rotated` as given to `quantize_kv`.
    """
    q_heads, q_len, kv_heads = query.shape[1], query.shape[2], residual_keys.shape[1]
    keys, values = residual_keys.to(compute_dtype), residual_values.to(compute_dtype)
    if quantized is not None and quantized.value_scale.shape[2] > 0:
        k_q, v_q = dequantize_kv(quantized, config, compute_dtype, key_rotated)
        keys, values = torch.cat((k_q, keys), dim=2), torch.cat((v_q, values), dim=2)
    total = keys.shape[2]
    keys = keys.repeat_interleave(q_heads // kv_heads, dim=1)
    values = values.repeat_interleave(q_heads // kv_heads, dim=1)
    scores = torch.matmul(query.to(compute_dtype), keys.transpose(-1, -2)) * scaling
    # query i is kv position total - q_len + i: it sees positions 0 .. total - q_len + i
    positions = torch.arange(total, device=query.device)
    allowed = (positions[None, :] <= positions[total - q_len :, None])[None, None]
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, None, :].to(query.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).to(out_dtype or query.dtype)
