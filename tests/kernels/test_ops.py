"""The custom-op boundary (oscar_hf.kernels.ops): registered correctly (torch.library.opcheck: schema, fake tensors,
autograd registration, AOT dispatch), the same results as the launchers, and traced by dynamo without graph breaks.
On CPU the kernels run in Triton's interpreter."""

import dataclasses

import pytest
import torch
from devices import DEVICE
from oscar_hf.kernels import decode_attention_triton, flush_residual_triton, ops, quantize_kv_triton

from oscar_hf import OscarConfig


def _inputs(config, batch=1, quantized_tokens=32, residual=8):
    keys, values = torch.randn(2, batch, 2, quantized_tokens + residual, 64, device=DEVICE, dtype=torch.bfloat16)
    stored = quantize_kv_triton(keys[:, :, :quantized_tokens], values[:, :, :quantized_tokens], config)
    query = torch.randn(batch, 4, 1, 64, device=DEVICE, dtype=torch.bfloat16)
    mask = torch.rand(batch, quantized_tokens + residual, device=DEVICE) > 0.2
    return query, stored, keys[:, :, quantized_tokens:], values[:, :, quantized_tokens:], mask


def _storage(config, batch=1, tokens=64):
    keys, values = torch.randn(2, batch, 2, tokens, 64, device=DEVICE, dtype=torch.bfloat16)
    # random contents, in the storage layout (which the method does not change)
    return quantize_kv_triton(keys, values, dataclasses.replace(config, method="paper"))


@pytest.mark.parametrize(
    ("token_scaling", "method", "key_bits"),
    [(True, "paper", 2), (False, "paper", 2), (True, "oscar", 2), (True, "oscar", 4)],
)
def test_flush_op_matches_the_launcher_and_passes_opcheck(token_scaling, method, key_bits):
    config = OscarConfig(
        residual_length=32, token_scaling=token_scaling, method=method, key_bits=key_bits, sink_tokens=0
    )
    key_rotated = torch.tensor([[True, False]], device=DEVICE) if method == "oscar" else None
    keys, values = torch.randn(2, 1, 2, 32, 64, device=DEVICE, dtype=torch.bfloat16)
    held = torch.tensor(64, device=DEVICE)
    got, expected = _storage(config), _storage(config)
    for a, b in zip(got, expected):
        if a is not None:
            a.copy_(b)
    ops.flush_residual(keys, values, got, held, ops.config_key(config), None, key_rotated)
    flush_residual_triton(keys, values, expected, held, config, None, key_rotated)
    for name, a, b in zip(got._fields, got, expected):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), name
    fields = [t for t in got if t is not None]
    padding = torch.arange(80, device=DEVICE)[None] >= 40  # 40 padding positions, some inside the flushed window
    op_args = (keys, values, fields, held, ops.config_key(config), padding, key_rotated)
    torch.library.opcheck(torch.ops.oscar.flush_residual.default, op_args)


@pytest.mark.parametrize(
    ("with_history", "method", "key_bits"),
    [(True, "paper", 2), (False, "paper", 2), (True, "oscar", 2), (True, "oscar", 4)],
)
def test_decode_attention_op_matches_the_launcher_and_passes_opcheck(with_history, method, key_bits):
    config = OscarConfig(residual_length=32, method=method, key_bits=key_bits, sink_tokens=0)
    key_rotated = torch.tensor([[True, False]], device=DEVICE) if method == "oscar" else None
    query, stored, residual_keys, residual_values, mask = _inputs(dataclasses.replace(config, method="paper"))
    if not with_history:
        stored, mask = None, mask[:, -residual_keys.shape[2] :]
    args = (query, stored, residual_keys, residual_values, mask, 0.125)
    expected = decode_attention_triton(*args, config, key_rotated)
    assert torch.equal(ops.decode_attention(*args, ops.config_key(config), key_rotated), expected)
    fields = [] if stored is None else list(stored)
    op_args = (query, fields, *args[2:], ops.config_key(config), key_rotated, None)
    torch.library.opcheck(torch.ops.oscar.decode_attention.default, op_args)


def test_decode_attention_op_with_a_device_length():
    """Compiled decode's call: the whole storage and window, the tokens held on the device (8 of the 32 + 8 slots
    past the 32 quantized tokens are the window's; `length` says 40)."""
    config = OscarConfig(residual_length=32, bits=2, sink_tokens=0)
    query, stored, keys, values, _ = _inputs(config, quantized_tokens=64, residual=32)
    length = torch.tensor(40, device=DEVICE)
    mask = torch.rand(1, 96, device=DEVICE) > 0.2
    args = (query, stored, keys, values, mask, 0.125)
    expected = decode_attention_triton(*args, config, None, length)
    assert torch.equal(ops.decode_attention(*args, ops.config_key(config), None, length), expected)
    op_args = (query, list(stored), *args[2:], ops.config_key(config), None, length)
    torch.library.opcheck(torch.ops.oscar.decode_attention.default, op_args)


def test_ops_compile_without_graph_breaks():
    config = OscarConfig(residual_length=32, bits=2, sink_tokens=0)
    query, _, residual_keys, residual_values, mask = _inputs(config)
    key = ops.config_key(config)

    def step(query, keys, values, stored, held, residual_keys, residual_values, mask):
        ops.flush_residual(keys, values, stored, held, key)
        return ops.decode_attention(query, stored, residual_keys, residual_values, mask, 0.125, key)

    keys, values = torch.randn(2, 1, 2, 32, 64, device=DEVICE, dtype=torch.bfloat16)
    stored, expected_stored = _storage(config, tokens=32), _storage(config, tokens=32)
    for a, b in zip(stored, expected_stored):
        if a is not None:
            a.copy_(b)
    held = torch.tensor(32, device=DEVICE)
    args = (query, keys, values, stored, held, residual_keys, residual_values, mask)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    expected = step(query, keys, values, expected_stored, held, residual_keys, residual_values, mask)
    assert torch.equal(out, expected)
    assert all(torch.equal(a, b) for a, b in zip(stored, expected_stored) if a is not None)
