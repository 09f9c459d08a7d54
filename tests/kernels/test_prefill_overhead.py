"""What a prefill adds to the model's forward, kept cheap without changing a result: the query moment on the tensor
cores (CUDA), the finite check of a long prompt's blocks once per update (on CUDA without waiting), the round trips of
the key rotation choice and of bits="auto" through the Triton kernels. Runs on CUDA when there is a GPU, on CPU
tensors (Triton's interpreter for the kernels) otherwise."""

import pytest
import torch
from devices import DEVICE, slow_on_cpu
from oscar_hf.kernels import fake_quantize_keys_triton, fake_quantize_kv_triton, quantize_kv_triton

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.cache import finite, storage
from oscar_hf.layer_widths import bit_cost_sums, layer_bit_costs
from oscar_hf.reference import (
    QUERY_MOMENT_CHUNK,
    dequantize_kv,
    key_error_sums,
    query_moment,
    query_rotation_choice,
    query_weighted_key_error,
    whole_key_groups,
)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_query_moment_is_the_float64_sum_of_its_queries(dtype):
    """Over several slices of `QUERY_MOMENT_CHUNK` positions, GQA 3:1, an outlier channel and left padding; the
    16-bit queries' products are exact in float32, so only the float32 accumulation of ~7,000 terms per entry errs:
    about sqrt(7e3) x 2^-24 ~ 5e-6 relative, bounded here by 2e-5 of the largest entry."""
    torch.manual_seed(0)
    batch, heads, kv_heads, length, dim = 2, 6, 2, QUERY_MOMENT_CHUNK + 300, 64
    query = torch.randn(batch, heads, length, dim, device=DEVICE)
    query[..., 5] *= 30  # the outlier channel of real keys' queries
    query = query.to(dtype)
    valid = torch.ones(batch, length, dtype=torch.bool, device=DEVICE)
    valid[1, :37] = False  # row 1 is left-padded: its first queries are whatever the model left there
    query[1, :, :37] = float("nan")

    got = query_moment(query, kv_heads, valid)

    q = query.double().masked_fill(~valid[:, None, :, None], 0).reshape(batch, kv_heads, -1, dim)
    want = q.mT @ q
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * want.abs().max().item())


# The interpreter's min/max (numpy's nanmin/nanmax) warn about the groups that the rotation has made all NaN.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("attention", ["portable", "fused"])
@pytest.mark.parametrize("rotation", [True, False], ids=["query-rule", "unrotated"])
def test_a_long_prompt_is_checked_finite_once(monkeypatch, attention, rotation, one_layer_config):
    """A prompt of five quantized blocks (quantized in slices of 128 tokens here, of QUANTIZE_CHUNK_TOKENS in use)
    reads its finite flags once, and a NaN in its last block is refused, named as such: at once on CPU tensors; on
    CUDA, whose flags travel to the host behind the kernels (no synchronisation), by the layer's next update."""
    monkeypatch.setattr(storage, "QUANTIZE_CHUNK_TOKENS", 128)
    reads = []
    read = finite.raise_unless_finite
    monkeypatch.setattr(finite, "raise_unless_finite", lambda flags, config: reads.append(flags) or read(flags, config))
    options = OscarConfig(attention=attention, rotation=rotation, method="oscar", bits=2, sink_tokens=0)
    torch.manual_seed(0)

    def prefill_and_step(keys: torch.Tensor, values: torch.Tensor) -> None:
        cache = OscarCache(one_layer_config, options)
        returned, _ = cache.update(keys, values, 0)
        cache.layers[0].observe_queries(torch.randn(1, 2, keys.shape[-2], 64, device=DEVICE), returned)
        assert cache.layers[0].quantized_length == 640
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()  # as generate does after every token: the flags have arrived
        cache.update(keys[:, :, -1:], values[:, :, -1:], 0)  # a decode step (it quantizes nothing)

    keys, values = (torch.randn(1, 1, 700, 64, device=DEVICE) for _ in range(2))
    prefill_and_step(keys, values)
    assert len(reads) == 1

    keys[0, 0, 600, 3] = float("nan")  # in the fifth block
    with pytest.raises(ValueError, match="non-finite keys or values"):
        prefill_and_step(keys, values)


@pytest.mark.parametrize(
    "rotated, head_dim",  # on a CPU, each rotation at one head dim in the default run
    [(True, 128), (False, 64), slow_on_cpu(True, 64), slow_on_cpu(False, 128)],
    ids=["rotated-128", "unrotated-64", "rotated-64", "unrotated-128"],
)
def test_the_fused_key_round_trip_is_the_references(rotated, head_dim):
    """`fake_quantize_keys_triton` (the fused path's key rotation choice) on float32 keys with outlier channels and
    left padding holding NaN, at 2 and 4 key bits:

    * it is the float64 reference's dequantization of the codes the quantizer stores, up to float32 rounding (a few
      roundings per value: 1e-6 of the largest);
    * those codes are the reference's up to rounding ties and one unit in the last place of an fp16 scale or minimum
      (test_quantize_pack.py). A group whose scale differs moves every value of its group, which the rotation spreads
      over all channels, so the round trips are compared through what the choice reads: the query-weighted error of
      each head is the float64 reference's within 5e-3 (9.4e-4 at most over 320 draws), and the choices agree."""
    torch.manual_seed(0)
    batch, heads, tokens = 2, 3, 4 * 32
    keys = torch.randn(batch, heads, tokens, head_dim, device=DEVICE)
    keys[..., :4] = keys[..., :4] * 20 + 3  # outlier channels with an offset, as real keys have
    valid = torch.ones(batch, tokens, dtype=torch.bool, device=DEVICE)
    valid[1, :45] = False
    keys[1, :, :45] = float("nan")
    moment = query_moment(torch.randn(batch, 2 * heads, 64, head_dim, device=DEVICE), heads)
    for config in (
        OscarConfig(method="oscar", bits=2, sink_tokens=0),
        OscarConfig(method="oscar", key_bits=4, value_bits=2, bits=None, sink_tokens=0),
    ):
        k, mask = whole_key_groups(keys, valid, config.group_size)
        got = fake_quantize_keys_triton(k, rotated, config, mask).double()
        key_rotated = torch.full((batch, heads), rotated, device=DEVICE)
        stored = quantize_kv_triton(k, k, config, key_rotated, valid=mask)
        want = dequantize_kv(stored, config, torch.float64, key_rotated)[0]
        real = mask[:, None, :, None].expand_as(want)
        torch.testing.assert_close(got[real], want[real], rtol=1e-6, atol=1e-6 * want[real].abs().max().item())

        fused = key_error_sums(k, rotated, config, mask, fake_quantize_keys_triton)
        reference = key_error_sums(k.double(), rotated, config, mask)
        torch.testing.assert_close(
            query_weighted_key_error(*(t.double() for t in fused), moment.double()),
            query_weighted_key_error(*reference, moment.double()),
            rtol=5e-3,
            atol=0,
        )
        assert torch.equal(
            query_rotation_choice(keys, moment, config, valid, fake_quantize_keys_triton),
            query_rotation_choice(keys.double(), moment.double(), config, valid),
        )


@pytest.mark.parametrize("rotation", [True, False], ids=["query-rule", "unrotated"])
def test_the_fused_width_costs_are_the_references(rotation):
    """bits="auto"'s cost sums through `fake_quantize_kv_triton` (the fused path's) on float32 K/V with outlier key
    channels and left padding holding NaN, a prompt of 2.5 key groups:

    * its K/V are the dequantization of the codes the quantizer stores, up to float32 rounding (heads of both
      rotations in one call);
    * what the choice reads, each width's key and value cost (`layer_bit_costs`), is the float64 reference's within
      5e-3 (codes equal up to rounding ties, as for the keys' round trip above), and each head's rotation agrees."""
    torch.manual_seed(1)
    batch, heads, tokens, head_dim = 2, 3, 80, 64
    keys, values = (torch.randn(batch, heads, tokens, head_dim, device=DEVICE) for _ in range(2))
    keys[..., :4] = keys[..., :4] * 20 + 3
    valid = torch.ones(batch, tokens, dtype=torch.bool, device=DEVICE)
    valid[1, :45] = False
    keys[1, :, :45] = values[1, :, :45] = float("nan")
    moment = query_moment(torch.randn(batch, 2 * heads, 64, head_dim, device=DEVICE), heads) / 128
    config = OscarConfig(method="oscar", rotation=rotation, bits=2, sink_tokens=0)
    rotations = (True, False) if rotation else (False,)

    k, mask = whole_key_groups(keys, valid, config.group_size)
    v, _ = whole_key_groups(values, valid, config.group_size)
    key_rotated = torch.rand(batch, heads, device=DEVICE) < 0.5  # heads of both kinds
    for bits in (2, 4):
        width = config.with_widths(bits, bits)
        flags = key_rotated if rotation else None
        got = fake_quantize_kv_triton(k, v, key_rotated, width, mask)
        want = dequantize_kv(quantize_kv_triton(k, v, width, flags, valid=mask), width, torch.float64, flags)
        real = mask[:, None, :, None].expand_as(want[0])
        for got_half, want_half in zip(got, want):
            scale = want_half[real].abs().max().item()
            torch.testing.assert_close(got_half.double()[real], want_half[real], rtol=1e-6, atol=1e-6 * scale)

    fused = bit_cost_sums(keys, values, config, rotations, valid, fake_quantize_kv_triton)
    reference = bit_cost_sums(keys.double(), values.double(), config, rotations, valid)
    costs = [layer_bit_costs(sums, moment.double(), rotations, head_dim**-0.5) for sums in (fused, reference)]
    for got, want in zip(costs[0][:2], costs[1][:2]):
        torch.testing.assert_close(got.double(), want, rtol=5e-3, atol=0)
    assert torch.equal(costs[0][2], costs[1][2])
