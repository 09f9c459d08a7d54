"""What a prefill adds to the model's forward, kept cheap without changing a result: the query moment on the tensor
cores (CUDA), the finite check of a long prompt's blocks with one host synchronisation per update, the key rotation
choice's round trips through the Triton kernels. Runs on CUDA when there is a GPU, on CPU tensors (Triton's
interpreter for the kernels) otherwise."""

import pytest
import torch
from oscar_hf.kernels import fake_quantize_keys_triton
from transformers import LlamaConfig

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.cache import finite, storage
from oscar_hf.reference import (
    QUERY_MOMENT_CHUNK,
    fake_quantize_keys,
    query_moment,
    query_rotation_choice,
    whole_key_groups,
)

from .conftest import DEVICE


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


def _layer_config() -> LlamaConfig:
    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=64, hidden_size=128
    )
    config._attn_implementation = "sdpa"
    return config


# The interpreter's min/max (numpy's nanmin/nanmax) warn about the groups that the rotation has made all NaN.
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning:triton.runtime.interpreter")
@pytest.mark.parametrize("attention", ["portable", "fused"])
@pytest.mark.parametrize("rotation", [True, False], ids=["query-rule", "unrotated"])
def test_a_long_prompt_is_checked_finite_with_one_synchronisation(monkeypatch, attention, rotation):
    """A prompt of five quantized blocks (quantized in slices of 128 tokens here, of QUANTIZE_CHUNK_TOKENS in use)
    reads its finite flags once (each read synchronises the host with the GPU), and a NaN in its last block is still
    refused, named as such, in the same call."""
    monkeypatch.setattr(storage, "QUANTIZE_CHUNK_TOKENS", 128)
    reads = []
    read = finite.raise_unless_finite
    monkeypatch.setattr(finite, "raise_unless_finite", lambda flags, config: reads.append(flags) or read(flags, config))
    options = OscarConfig(attention=attention, rotation=rotation, method="oscar")
    torch.manual_seed(0)

    def prefill(keys: torch.Tensor, values: torch.Tensor) -> None:
        cache = OscarCache(_layer_config(), options)
        returned, _ = cache.update(keys, values, 0)
        cache.layers[0].observe_queries(torch.randn(1, 2, keys.shape[-2], 64, device=DEVICE), returned)
        assert cache.layers[0].quantized_length == 640

    keys, values = (torch.randn(1, 1, 700, 64, device=DEVICE) for _ in range(2))
    prefill(keys, values)
    assert len(reads) == 1

    keys[0, 0, 600, 3] = float("nan")  # in the fifth block
    with pytest.raises(ValueError, match="non-finite keys or values"):
        prefill(keys, values)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rotated", [True, False], ids=["rotated", "unrotated"])
def test_the_fused_key_round_trip_is_the_references(head_dim, rotated):
    """`fake_quantize_keys_triton` (the fused path's key rotation choice) against `reference.fake_quantize_keys` in
    float64 on the same float32 keys (outlier channels, left padding holding NaN, 2 and 4 bits): equal up to float32
    rounding, except where a value sits on a rounding tie (at most 0.1 % of the elements, each by one step). The
    choices both make from a query moment agree."""
    torch.manual_seed(0)
    batch, heads, tokens = 2, 3, 4 * 32
    keys = torch.randn(batch, heads, tokens, head_dim, device=DEVICE)
    keys[..., :4] = keys[..., :4] * 20 + 3  # outlier channels with an offset, as real keys have
    valid = torch.ones(batch, tokens, dtype=torch.bool, device=DEVICE)
    valid[1, :45] = False
    keys[1, :, :45] = float("nan")
    for config in (OscarConfig(method="oscar"), OscarConfig(method="oscar", key_bits=4, value_bits=2, bits=None)):
        k, mask = whole_key_groups(keys, valid, config.group_size)
        got = fake_quantize_keys_triton(k, rotated, config, mask).double()
        want = fake_quantize_keys(k.double(), rotated, config, mask)
        real = mask[:, None, :, None].expand_as(want)
        step = (want - k.double()).abs().amax()  # at most one quantization step of any group
        off = ((got - want).abs() > 1e-5 * step) & real
        assert off.float().mean() <= 1e-3
        torch.testing.assert_close(got[real & ~off], want[real & ~off], rtol=1e-5, atol=1e-5 * step.item())
        assert ((got - want).abs()[off] <= 1.01 * step).all()

        moment = query_moment(torch.randn(batch, 2 * heads, 64, head_dim, device=DEVICE), heads)
        assert torch.equal(
            query_rotation_choice(keys, moment, config, valid, fake_quantize_keys_triton),
            query_rotation_choice(keys.double(), moment.double(), config, valid),
        )
