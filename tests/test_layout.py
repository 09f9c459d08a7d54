"""The storage layout (oscar_hf.layout): packing bit order, shapes, row views and the check every kernel runs."""

import pytest
import torch

from oscar_hf import OscarConfig
from oscar_hf.layout import QuantizedKV, StorageLayout
from oscar_hf.reference import quantize_kv


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_round_trips_every_code(bits):
    per_word = StorageLayout.codes_per_word(bits)
    every = torch.arange(2**bits, dtype=torch.uint8).repeat(per_word * 2)[: per_word * 2]
    codes = torch.cat(
        [every.view(-1, 1).expand(-1, 5), torch.randint(0, 2**bits, (per_word * 6, 5), dtype=torch.uint8)]
    )
    codes[:per_word, 0] = 2**bits - 1  # all-ones word: the sign bit is set
    words = StorageLayout.pack_codes(codes.view(1, 1, -1, 5), bits)
    assert words.dtype == torch.int32 and words.shape == (1, 1, codes.shape[0] // per_word, 5)
    assert torch.equal(StorageLayout.unpack_codes(words, bits), codes.view(1, 1, -1, 5))
    assert words[0, 0, 0, 0].item() == -1


def test_pack_bit_order_is_token_major_in_low_bits():
    codes = torch.zeros(1, 1, 16, 1, dtype=torch.uint8)
    codes[0, 0, 1, 0] = 3  # token 1 -> bits [2, 4)
    codes[0, 0, 15, 0] = 1  # token 15 -> bit 30
    assert StorageLayout.pack_codes(codes, 2).item() == (3 << 2) | (1 << 30)


def test_three_bit_codes_are_bit_planes_of_32_tokens():
    """Word 3 g + p holds bit p of tokens 32 g .. 32 g + 31, token 32 g + j at bit j; every code round-trips."""
    codes = torch.randint(0, 8, (2, 3, 96, 5), dtype=torch.uint8)
    codes[0, 0, :32, 0] = 7  # all-ones planes: the sign bit is set
    codes[0, 0, 32:64, 0] = 0
    codes[0, 0, 33, 0] = 5  # token 1 of the second group: planes 0 and 2
    words = StorageLayout.pack_codes(codes, 3)
    assert words.dtype == torch.int32 and words.shape == (2, 3, 9, 5)
    assert torch.equal(StorageLayout.unpack_codes(words, 3), codes)
    assert words[0, 0, :3, 0].tolist() == [-1, -1, -1]
    assert words[0, 0, 3:6, 0].tolist() == [1 << 1, 0, 1 << 1]


def test_three_bit_rows_cover_whole_key_groups():
    """A 3-bit layout's shapes and row views: 3 code rows per 32 tokens, whole rows per key group."""
    layout = StorageLayout(3, 2, 32, True, torch.float16)
    shapes = layout.shapes(1, 2, 64, 2, 64, 96)
    assert shapes.key_codes == (1, 2, 9, 64) and shapes.value_codes == (1, 2, 6, 64)
    codes = torch.randint(0, 8, (1, 2, 96, 64), dtype=torch.uint8)
    qkv = layout.empty(1, 2, 64, 2, 64, 96, "cpu")._replace(key_codes=StorageLayout.pack_codes(codes, 3))
    part = layout.rows(qkv, 32, 96)
    assert torch.equal(StorageLayout.unpack_codes(part.key_codes, 3), codes[:, :, 32:96])


@pytest.mark.parametrize(
    "config",
    [
        OscarConfig(bits=2, sink_tokens=0),
        OscarConfig(bits=4, group_size=64, residual_length=128, sink_tokens=0),
        OscarConfig(token_scaling=False, bits=2, sink_tokens=0),
        OscarConfig(key_bits=4, value_bits=2, sink_tokens=0),
        OscarConfig(key_bits=2, value_bits=4, sink_tokens=0),
    ],
    ids=["default", "4bit-G64", "noScale", "K4V2", "K2V4"],
)
def test_quantize_kv_output_follows_the_layout(config):
    """Every field's shape and dtype is the layout's; keys and values are packed at their own bits."""
    layout = StorageLayout.of(config)
    keys, values = torch.randn(2, 3, 192, 128), torch.randn(2, 3, 192, 128)
    qkv = quantize_kv(keys, values, config)
    assert layout.check(qkv, 2, 3, 128, keys.device, "test") == 192
    empty = layout.empty(2, 3, 128, 3, 128, 192, keys.device)
    for name, got, want in zip(QuantizedKV._fields, qkv, empty):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.shape == want.shape and got.dtype == want.dtype, name
    assert qkv.key_codes.shape[2] == 192 * config.key_bits // 32
    assert qkv.value_codes.shape[2] == 192 * config.value_bits // 32


def test_rows_are_views_of_whole_groups():
    config = OscarConfig(bits=2, sink_tokens=0)
    layout = StorageLayout.of(config)
    qkv = quantize_kv(torch.randn(1, 2, 128, 64), torch.randn(1, 2, 128, 64), config)
    part = layout.rows(qkv, 32, 96)
    assert layout.num_tokens(part) == 64
    whole = layout.unpack_codes(qkv.key_codes, config.key_bits)
    assert torch.equal(layout.unpack_codes(part.key_codes, config.key_bits), whole[:, :, 32:96])
    assert torch.equal(part.value_scale, qkv.value_scale[:, :, 32:96])
    assert torch.equal(part.key_scale, qkv.key_scale[:, :, 1:3])
    assert part.key_norms.data_ptr() == qkv.key_norms[:, :, 32:].data_ptr()  # a view, not a copy


def test_check_names_the_wrong_field():
    config = OscarConfig(bits=2, sink_tokens=0)
    layout = StorageLayout.of(config)
    qkv = quantize_kv(torch.randn(1, 2, 64, 64), torch.randn(1, 2, 64, 64), config)
    with pytest.raises(ValueError, match="key_min has shape"):
        layout.check(qkv._replace(key_min=qkv.key_min[:, :, :1]), 1, 2, 64, qkv.key_min.device, "test")
    with pytest.raises(ValueError, match="value_scale is torch.float32"):
        layout.check(qkv._replace(value_scale=qkv.value_scale.float()), 1, 2, 64, qkv.key_min.device, "test")
    with pytest.raises(ValueError, match="key_codes has shape"):
        StorageLayout.of(OscarConfig(bits=4, sink_tokens=0)).check(qkv, 1, 2, 64, qkv.key_min.device, "test")
    with pytest.raises(ValueError, match="value_codes has shape"):
        StorageLayout.of(OscarConfig(value_bits=4, sink_tokens=0)).check(qkv, 1, 2, 64, qkv.key_min.device, "test")
    with pytest.raises(ValueError, match="key_norms has shape None"):
        layout.check(qkv._replace(key_norms=None), 1, 2, 64, qkv.key_min.device, "test")
