"""The reference math (oscar_hf.reference) against first principles and an independent float64 oracle."""

import math

import pytest
import torch

from oscar_hf import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout
from oscar_hf.reference import (
    dequantize_groups,
    dequantize_kv,
    hadamard_transform,
    quantize_groups,
    quantize_kv,
    query_moment,
    query_rotation_choice,
    token_norms,
)


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_hadamard_is_symmetric_orthogonal_and_sylvester(head_dim):
    eye = torch.eye(head_dim, dtype=torch.float64)
    h = hadamard_transform(eye)  # rows of I H = H
    assert torch.allclose(h, h.T, atol=0)
    assert torch.allclose(h @ h.T, eye, atol=1e-12)
    assert torch.allclose(h.abs(), torch.full_like(h, head_dim**-0.5), atol=1e-15)
    # Sylvester ordering: H[i, j] = (-1)^popcount(i & j) / sqrt(D)
    parity = torch.tensor([[bin(i & j).count("1") % 2 for j in range(head_dim)] for i in range(head_dim)])
    assert torch.equal(torch.sign(h), (1 - 2 * parity).to(h.dtype))


def test_hadamard_preserves_dot_products_and_inverts():
    q, k = torch.randn(3, 5, 7, 128, dtype=torch.float64), torch.randn(3, 5, 11, 128, dtype=torch.float64)
    qr, kr = hadamard_transform(q), hadamard_transform(k)
    torch.testing.assert_close(qr @ kr.transpose(-1, -2), q @ k.transpose(-1, -2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard_transform(qr), q, rtol=1e-12, atol=1e-12)


def test_hadamard_block_rotation_for_non_power_of_two_head_dim():
    x = torch.randn(4, 96, dtype=torch.float64)  # 96 = 3 blocks of 32
    y = hadamard_transform(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    torch.testing.assert_close(y[:, 32:64], hadamard_transform(x[:, 32:64]), rtol=0, atol=1e-15)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("dim", [-2, -1])
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.float32])
def test_quantization_error_within_half_a_step(bits, dim, scale_dtype):
    x = torch.randn(2, 3, 64, 96, dtype=torch.float64) * torch.rand(2, 3, 64, 1, dtype=torch.float64) * 5
    codes, scale, mn = quantize_groups(x, bits, 32, dim, scale_dtype)
    assert codes.dtype == torch.uint8 and codes.max() <= 2**bits - 1 and codes.shape == x.shape
    assert scale.dtype == scale_dtype and scale.shape[dim] == x.shape[dim] // 32
    x_hat = dequantize_groups(codes, scale, mn, 32, dim, torch.float64)
    step = scale.double().repeat_interleave(32, dim=dim)
    # Half a step, plus the rounding of the stored scale/min to scale_dtype (relative eps of the range).
    eps = torch.finfo(scale_dtype).eps
    slack = eps * (x.abs().amax() + step * 2**bits)
    assert ((x_hat - x).abs() <= step / 2 + slack).all()


def test_quantization_zero_range_decodes_to_the_minimum():
    x = torch.randn(1, 1, 32, 32, dtype=torch.float64)
    x[..., 0] = 0.75  # a constant channel, exactly representable in the scale dtype: its key group has no range
    codes, scale, mn = quantize_groups(x, 2, 32, -2, torch.float16)
    assert (scale[..., 0] == 0).all() and (codes[..., 0] == 0).all() and (scale[..., 1:] > 0).all()
    assert torch.equal(dequantize_groups(codes, scale, mn, 32, -2, torch.float64)[..., 0], x[..., 0])


def test_token_norms_over_all_heads_with_guard():
    k = torch.randn(2, 4, 6, 32)
    k[0, :, 2] = 0  # an all-zero token
    k[1, 1, 3, 5] = float("nan")  # a broken token
    n = token_norms(k)
    assert n.shape == (2, 1, 6) and n.dtype == torch.float32
    torch.testing.assert_close(n[0, 0, 0], k[0, :, 0].pow(2).sum().sqrt())
    assert n[0, 0, 2] == 1 and n[1, 0, 3] == 1


def test_token_norms_fp32_from_bf16():
    k = (torch.randn(1, 2, 4, 64) * 300).to(torch.bfloat16)
    torch.testing.assert_close(
        token_norms(k)[:, 0], k.double().pow(2).sum(dim=(1, 3)).sqrt().float(), rtol=1e-6, atol=0
    )


def _keys_of_both_kinds(tokens=96, head_dim=64, norm_spread=1e4):
    """Keys whose heads want opposite treatments: in batch row 0, head 0 has quiet channels with a large constant
    offset (like Qwen2's k_proj bias: per-channel steps stay tiny there unless a rotation mixes in the other
    channels' error); in row 1, head 1 has rare large values in every channel (heavy tails that inflate each
    channel's range; the rotation spreads them out). (Separate rows because token norms are shared by the heads of
    a row: a loud head would make the scaled offset vary.)"""
    gen = torch.Generator().manual_seed(tokens)
    k = torch.randn(2, 3, tokens, head_dim, dtype=torch.float64, generator=gen)
    k[0, 0, :, :4] = 0.01 * k[0, 0, :, :4] + 30
    spikes = torch.rand(tokens, head_dim, generator=gen) < 0.03
    k[1, 1] = torch.where(spikes, 30 * k[1, 1], k[1, 1])
    return k * torch.logspace(0, math.log10(norm_spread), tokens, dtype=torch.float64)[:, None]  # token norms vary


def _queries_weighing_the_offsets(tokens=16):
    """Random queries `[2, 6, tokens, 64]` (two per KV head of `_keys_of_both_kinds`) whose row 0, KV head 0 queries
    weigh the offset channels 20x, as Qwen2.5-0.5B's layer 0 does."""
    q = torch.randn(2, 6, tokens, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(tokens))
    q[0, :2, :, :4] *= 20
    return q


@pytest.mark.parametrize("method", ["oscar", "paper"])
@pytest.mark.parametrize("rotation", [True, False])
@pytest.mark.parametrize("token_scaling", [True, False])
@pytest.mark.parametrize("key_bits,value_bits", [(2, 2), (4, 4), (4, 2), (2, 4)], ids=["K2V2", "K4V4", "K4V2", "K2V4"])
def test_quantize_kv_matches_independent_oracle(oracle, method, rotation, token_scaling, key_bits, value_bits):
    config = OscarConfig(
        key_bits=key_bits,
        value_bits=value_bits,
        rotation=rotation,
        token_scaling=token_scaling,
        scale_dtype="float32",
        method=method,
        sink_tokens=0,
    )
    k = _keys_of_both_kinds()
    v = torch.randn(2, 3, 96, 64, dtype=torch.float64)
    q = _queries_weighing_the_offsets()
    key_rotated = query_rotation_choice(k, query_moment(q, 3), config) if method == "oscar" else None
    if method == "oscar" and rotation and token_scaling and key_bits == 2:  # the choice depends on both (see docstring)
        assert not key_rotated[0, 0] and key_rotated[1, 1], key_rotated  # both kinds occur
    k_hat, v_hat = dequantize_kv(quantize_kv(k, v, config, key_rotated), config, torch.float64, key_rotated)
    k_ref, v_ref = oracle(k, v, config, queries=q)
    # Scales/mins are rounded to float32 from float64 values that differ in their last bits between the butterflies
    # and the oracle's dense matrix, so they may land one float32 ulp apart: allow one ulp of the magnitude. A wrong
    # code would be off by a whole step (a third of the group's range), far beyond this.
    for got, want in ((k_hat, k_ref), (v_hat, v_ref)):
        torch.testing.assert_close(
            got, want, rtol=0, atol=2 * torch.finfo(torch.float32).eps * want.abs().amax().item()
        )


@pytest.mark.parametrize("key_bits,value_bits", [(4, 2), (2, 4)], ids=["K4V2", "K2V4"])
def test_keys_and_values_are_quantized_at_their_own_bits(key_bits, value_bits):
    """A mixed config stores the keys of the uniform config at `key_bits` and the values of the one at `value_bits`,
    field for field (the key-rotation choice is made at the keys' bits); dequantized likewise."""
    config = OscarConfig(key_bits=key_bits, value_bits=value_bits, method="oscar", sink_tokens=0)
    of_keys, of_values = (
        OscarConfig(bits=key_bits, method="oscar", sink_tokens=0),
        OscarConfig(bits=value_bits, method="oscar", sink_tokens=0),
    )
    k, v, q = _keys_of_both_kinds(tokens=128).float(), torch.randn(2, 3, 128, 64), _queries_weighing_the_offsets()
    rotated = query_rotation_choice(k, query_moment(q, 3), config)
    assert torch.equal(rotated, query_rotation_choice(k, query_moment(q, 3), of_keys))
    mixed, keys_alike, values_alike = (quantize_kv(k, v, c, rotated) for c in (config, of_keys, of_values))
    for name in QuantizedKV._fields:
        want = (keys_alike if name.startswith("key_") else values_alike)._asdict()[name]
        assert torch.equal(getattr(mixed, name), want), name
    k_hat, v_hat = dequantize_kv(mixed, config, torch.float32, rotated)
    assert torch.equal(k_hat, dequantize_kv(keys_alike, of_keys, torch.float32, rotated)[0])
    assert torch.equal(v_hat, dequantize_kv(values_alike, of_values, torch.float32, rotated)[1])


def test_oscar_method_cuts_the_logit_error_where_the_rotation_hurts():
    """The reason for method="oscar": queries that weigh a quiet, offset key channel (head 0 above) see a much larger
    logit error when the keys are rotated; the per-head choice keeps that head unrotated and the others rotated."""
    k = _keys_of_both_kinds(tokens=128, norm_spread=1)
    v = torch.randn_like(k)
    q = torch.randn(2, 3, 16, 64, dtype=torch.float64)
    q[0, 0, :, :4] *= 20  # queries weigh the offset channels, as in Qwen2.5-0.5B's layer 0
    errors = {}
    for method in ("oscar", "paper"):
        config = OscarConfig(scale_dtype="float32", method=method, bits=2, sink_tokens=0)
        key_rotated = query_rotation_choice(k, query_moment(q, 3), config) if method == "oscar" else None
        k_hat, _ = dequantize_kv(quantize_kv(k, v, config, key_rotated), config, torch.float64, key_rotated)
        error = q @ (k_hat - k).transpose(-1, -2)
        errors[method] = (error - error.mean(-1, keepdim=True)).square().mean((2, 3)).sqrt()  # per row and head
    assert errors["oscar"][0, 0] < errors["paper"][0, 0] / 3, errors
    torch.testing.assert_close(errors["oscar"][1, 1], errors["paper"][1, 1])  # the outlier head still rotates


def test_token_scaling_removes_token_norm_imbalance():
    """The point of the method: a 100x-norm token in a key group ruins per-channel quantization of its neighbours
    unless keys are scaled per token first."""
    k = torch.randn(1, 2, 128, 64, dtype=torch.float64)
    k[:, :, 5] *= 100
    v = torch.randn_like(k)
    errors = {}
    for scaling in (True, False):
        config = OscarConfig(token_scaling=scaling, scale_dtype="float32", bits=2, sink_tokens=0)
        k_hat, _ = dequantize_kv(quantize_kv(k, v, config), config, torch.float64)
        others = torch.ones(128, dtype=torch.bool)
        others[5] = False
        errors[scaling] = ((k_hat - k)[:, :, others].norm() / k[:, :, others].norm()).item()
    assert errors[True] < errors[False] / 2, errors


def _left_pad(real_rows, paddings, gen):
    """A left-padded batch `[B, H, width, D]` of each row's real tokens after its padding, and its `[B, width]` mask.
    Padding holds loud keys/values (1000x), an inf and a NaN: what it holds must never reach a real token."""
    width = max(p + r.shape[1] for p, r in zip(paddings, real_rows))
    heads, dim = real_rows[0].shape[0], real_rows[0].shape[-1]
    batch = 1000 * torch.randn(len(real_rows), heads, width, dim, dtype=torch.float64, generator=gen)
    batch[:, 0, 0, 0], batch[:, -1, 0, -1] = float("inf"), float("nan")
    valid = torch.zeros(len(real_rows), width, dtype=torch.bool)
    for row, (p, real) in enumerate(zip(paddings, real_rows)):
        batch[row, :, p:] = real
        valid[row, p:] = True
    return batch, valid


@pytest.mark.parametrize("method", ["oscar", "paper"])
@pytest.mark.parametrize("rotation", [True, False])
@pytest.mark.parametrize("token_scaling", [True, False])
def test_padding_in_whole_groups_leaves_each_rows_storage_as_alone(method, rotation, token_scaling):
    """With padding in whole key groups (a multiple of group_size), a padded row stores exactly the codes, scales,
    mins and token norms of the same row quantized alone, and its key-rotation choice; the padding decodes to zeros."""
    config = OscarConfig(
        rotation=rotation, token_scaling=token_scaling, scale_dtype="float32", method=method, bits=2, sink_tokens=0
    )
    gen = torch.Generator().manual_seed(9)
    real = _keys_of_both_kinds(tokens=160)
    real_values = torch.randn(real.shape, dtype=torch.float64, generator=gen)
    alone = [(real[0:1, :, :128], real_values[0:1, :, :128]), (real[1:2], real_values[1:2])]  # 128 and 160 tokens
    paddings = [64, 32]
    keys, valid = _left_pad([k[0] for k, _ in alone], paddings, gen)
    values, _ = _left_pad([v[0] for _, v in alone], paddings, gen)
    layout = StorageLayout.of(config)

    queries = _queries_weighing_the_offsets()
    moment = query_moment(queries, 3)

    def stored(k, v, ok, rows):
        rotated = query_rotation_choice(k, moment[rows], config, ok) if method == "oscar" else None
        qkv = quantize_kv(k, v, config, rotated, valid=ok)
        codes = layout.unpack_codes(qkv.key_codes, 2), layout.unpack_codes(qkv.value_codes, 2)
        return rotated, qkv, codes

    rotated, qkv, codes = stored(keys, values, valid, slice(None))
    g = config.group_size
    for row, ((k, v), p) in enumerate(zip(alone, paddings)):
        rotated_alone, qkv_alone, codes_alone = stored(k, v, None, slice(row, row + 1))
        if method == "oscar":
            assert torch.equal(rotated[row], rotated_alone[0])
        for got, want in zip(codes, codes_alone):
            assert torch.equal(got[row, :, p:], want[0])
        params = ["key_scale", "key_min", "value_scale", "value_min"] + ["key_norms"] * token_scaling
        for name in params:
            first = p // g if name.startswith("key_") and name != "key_norms" else p  # key params: one per g tokens
            assert torch.equal(getattr(qkv, name)[row, :, first:], getattr(qkv_alone, name)[0]), (row, name)
    # Padding decodes to zeros, finite although it held inf and NaN.
    k_hat, v_hat = dequantize_kv(qkv, config, torch.float64, rotated)
    for t in (k_hat, v_hat):
        padding = t.transpose(1, 2)[~valid]
        assert torch.equal(padding, torch.zeros_like(padding))


@pytest.mark.parametrize("method", ["oscar", "paper"])
@pytest.mark.parametrize("rotation", [True, False])
@pytest.mark.parametrize("token_scaling", [True, False])
def test_padding_within_a_group_matches_the_oracle(oracle, method, rotation, token_scaling):
    """Padding that shares key groups with real tokens (40 and 7 padding tokens, groups of 32): the float64 oracle's
    masked quantization, and (method="paper", no per-row choice) exactly the storage of the same batch with each
    padding key replaced by a copy of a real key of its group."""
    config = OscarConfig(
        rotation=rotation, token_scaling=token_scaling, scale_dtype="float32", method=method, bits=2, sink_tokens=0
    )
    gen = torch.Generator().manual_seed(40)
    real = _keys_of_both_kinds(tokens=128)
    paddings = [40, 7]
    keys, valid = _left_pad([real[0, :, :88], real[1, :, :121]], paddings, gen)  # 128 tokens wide
    values, _ = _left_pad([torch.randn(3, n, 64, generator=gen, dtype=torch.float64) for n in (88, 121)], paddings, gen)
    queries = _queries_weighing_the_offsets()
    rotated = query_rotation_choice(keys, query_moment(queries, 3), config, valid) if method == "oscar" else None
    qkv = quantize_kv(keys, values, config, rotated, valid=valid)
    k_hat, v_hat = dequantize_kv(qkv, config, torch.float64, rotated)
    k_ref, v_ref = oracle(keys, values, config, valid=valid, queries=queries)
    for got, want in ((k_hat, k_ref), (v_hat, v_ref)):
        assert torch.isfinite(got).all()
        atol = 2 * torch.finfo(torch.float32).eps * want.abs().amax().item()  # as in the oracle test above
        torch.testing.assert_close(got, want, rtol=0, atol=atol)
    if method == "paper":
        copies = keys.clone()
        for row, p in enumerate(paddings):
            copies[row, :, :p] = keys[row, :, p : p + 1]  # padding of group 0 (and 1): copies of a real token there
            copies[row, :, 32:p] = keys[row, :, p : p + 1]
        twin = quantize_kv(copies, values.nan_to_num(), config)
        layout = StorageLayout.of(config)
        got, want = layout.unpack_codes(qkv.key_codes, 2), layout.unpack_codes(twin.key_codes, 2)
        for row, p in enumerate(paddings):  # the groups holding real tokens (row 0's first group is all padding)
            assert torch.equal(got[row, :, p:], want[row, :, p:])
            for name in ("key_scale", "key_min"):
                assert torch.equal(getattr(qkv, name)[row, :, p // 32 :], getattr(twin, name)[row, :, p // 32 :])
        # The test can fail: without the mask, the loud padding takes over the min/max of the groups it shares.
        blind = layout.unpack_codes(quantize_kv(keys.nan_to_num(), values.nan_to_num(), config).key_codes, 2)
        assert not torch.equal(blind[0, :, 40:64], got[0, :, 40:64])


def test_query_moment_reads_long_prompts_in_slices(monkeypatch):
    """The second moment over query positions, summed slice by slice (a long prefill's float32 copies stay small),
    equals the float64 sum over every position of each KV head's group, padding left out; bf16 queries in float32."""
    from oscar_hf import reference

    monkeypatch.setattr(reference, "QUERY_MOMENT_CHUNK", 7)
    query = torch.randn(2, 6, 30, 16, dtype=torch.float64)  # 3 query heads per KV head, 30 positions: 5 slices
    valid = torch.rand(2, 30) > 0.3
    grouped = (query * valid[:, None, :, None]).view(2, 2, 3, 30, 16)  # [B, Hkv, group, Tq, D]
    want = torch.einsum("bkgtd,bkgte->bkde", grouped, grouped)
    got = query_moment(query, 2, valid)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    low = query_moment(query.bfloat16(), 2, valid)
    assert low.dtype == torch.float32
    torch.testing.assert_close(low.double(), query_moment(query.bfloat16().double(), 2, valid), rtol=1e-5, atol=1e-5)
