"""Fused rotate/scale/quantize/pack kernel vs `oscar_hf.reference.quantize_kv`.

Codes may differ from the reference only where a value sits on a rounding tie whose side depends on summation order
(the token norm, the butterflies): at most 0.1% of codes, each by one level. Scales and minimums are rounded to
the scale dtype from the same min/max, so they match to one unit in the last place of that dtype.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from devices import DEVICE
from oscar_hf.kernels import flush_residual_triton, quantize_kv_triton

from oscar_hf.config import OscarConfig
from oscar_hf.layout import StorageLayout
from oscar_hf.reference import finite_flags, quantize_kv, token_norms
from oscar_hf.testing import Case

BLOCK = Case(batch=1, quantized=64)  # the K/V of 64 tokens to quantize


CASES = [
    *(replace(BLOCK, head_dim=d, key_bits=b, value_bits=b) for d in (64, 128, 256) for b in (2, 3, 4)),
    replace(BLOCK, head_dim=128, key_bits=4, value_bits=2, batch=2, kv_heads=3, quantized=96),
    replace(BLOCK, head_dim=128, key_bits=3, value_bits=2, batch=2, kv_heads=3, quantized=96),
    replace(BLOCK, key_bits=4, value_bits=3, group_size=64, quantized=128),
    replace(BLOCK, key_bits=2, value_bits=3, group_size=128, head_dim=128, quantized=128),
    replace(BLOCK, key_bits=2, value_bits=4, dtype=torch.float16, quantized=96),
    replace(BLOCK, dtype=torch.float16, batch=2, kv_heads=3),
    replace(BLOCK, dtype=torch.float32),
    replace(BLOCK, rotation=False, token_scaling=False),
    replace(BLOCK, rotation=True, token_scaling=False, key_bits=4, value_bits=4),
    replace(BLOCK, rotation=False, token_scaling=True),
    replace(BLOCK, group_size=64, head_dim=128, quantized=128),
    replace(BLOCK, scale_dtype="float32"),
    replace(BLOCK, extreme_norms=True, quantized=96),
    replace(BLOCK, extreme_norms=True, quantized=96, token_scaling=False, rotation=False),
    replace(BLOCK, views=True, kv_heads=3, quantized=32),
]


def make_inputs(case: Case, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    shape = (case.batch, case.quantized, case.kv_heads, case.head_dim) if case.views else None
    if case.views:  # HF's [B, T, H, D] layout seen as [B, H, T, D]
        keys, values = (torch.randn(*shape, generator=gen).transpose(1, 2) for _ in range(2))
    else:
        keys, values = (
            torch.randn(case.batch, case.kv_heads, case.quantized, case.head_dim, generator=gen) for _ in range(2)
        )
    if case.extreme_norms:
        keys[:, :, 5] *= 0.01
        keys[:, :, case.quantized - 7] *= 100.0
    return keys.to(DEVICE, case.dtype), values.to(DEVICE, case.dtype), case.config()


def assert_matches_reference(out, ref, config: OscarConfig, label: str) -> None:
    for name, bits in (("key_codes", config.key_bits), ("value_codes", config.value_bits)):
        got, want = getattr(out, name), getattr(ref, name)
        assert got.shape == want.shape and got.dtype == torch.int32, f"{label}: {name} {got.shape} {got.dtype}"
        codes, codes_ref = StorageLayout.unpack_codes(got, bits).int(), StorageLayout.unpack_codes(want, bits).int()
        diff = (codes - codes_ref).abs()
        where = torch.nonzero(diff)[:8].tolist()
        assert (diff == 0).float().mean().item() >= 0.999 and diff.max().item() <= 1, (
            f"{label}: {name}: {(diff != 0).sum().item()} of {diff.numel()} codes differ, max {diff.max().item()}; "
            f"first [b, h, token, d]: {where}"
        )
    # one unit in the last place of the scale dtype (fp16: 2^-10 relative), plus subnormal-sized absolute slack
    rtol = 2**-10 if config.scale_dtype == "float16" else 2**-22
    for name in ("key_scale", "key_min", "value_scale", "value_min", "key_norms"):
        got, want = getattr(out, name), getattr(ref, name)
        if want is None:
            assert got is None, f"{label}: {name} should be None without token scaling"
            continue
        assert got.shape == want.shape and got.dtype == want.dtype, f"{label}: {name} {got.shape} {got.dtype}"
        torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6, msg=lambda m, n=name: f"{label}: {n}: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_quantize_matches_reference(case: Case):
    keys, values, config = make_inputs(case)
    out = quantize_kv_triton(keys, values, config)
    ref = quantize_kv(keys, values, config)
    assert_matches_reference(out, ref, config, case.id)


@pytest.mark.parametrize("bits", [(3, 3), (3, 2), (2, 4)], ids=["K3V3", "K3V2", "K2V4"])
def test_words_are_the_layouts_packing(bits):
    """Without the rotation and the token norm no summation order can move a rounding tie, so the kernel's words are
    bit for bit `StorageLayout.pack_codes` of the reference's codes: 3-bit planes in rows 3 g + p (the layout's)."""
    case = replace(BLOCK, key_bits=bits[0], value_bits=bits[1], rotation=False, token_scaling=False, quantized=96)
    keys, values, config = make_inputs(replace(case, dtype=torch.float32), seed=5)
    out, ref = quantize_kv_triton(keys, values, config), quantize_kv(keys, values, config)
    assert torch.equal(out.key_codes, ref.key_codes) and torch.equal(out.value_codes, ref.value_codes)
    assert StorageLayout.unpack_codes(out.key_codes, bits[0]).max() == 2 ** bits[0] - 1  # every bit plane written


def test_rejects_bad_inputs():
    keys, values, config = make_inputs(BLOCK)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_kv_triton(keys[:, :, :40], values[:, :, :40], config)
    with pytest.raises(ValueError, match="power of two"):
        quantize_kv_triton(keys[..., :48].repeat(1, 1, 1, 2), values[..., :48].repeat(1, 1, 1, 2), config)
    with pytest.raises(ValueError, match="share one of"):
        quantize_kv_triton(keys, values.half(), config)


@pytest.mark.parametrize(
    "case", [replace(BLOCK, batch=2, kv_heads=3), replace(BLOCK, head_dim=128, dtype=torch.float16)], ids=lambda c: c.id
)
def test_per_head_key_rotation_matches_reference(case: Case):
    """method="oscar": each (row, KV head) rotates its keys or not, as its flag says; values always rotate."""
    keys, values, _ = make_inputs(case)
    config = OscarConfig(method="oscar", bits=2, sink_tokens=0)
    key_rotated = torch.arange(case.batch * case.kv_heads, device=DEVICE).view(case.batch, case.kv_heads) % 2 == 1
    out = quantize_kv_triton(keys, values, config, key_rotated)
    assert_matches_reference(out, quantize_kv(keys, values, config, key_rotated), config, case.id)
    with pytest.raises(ValueError, match="needs key_rotated"):
        quantize_kv_triton(keys, values, config)
    with pytest.raises(ValueError, match="must be bool"):
        quantize_kv_triton(keys, values, config, key_rotated.int())


def test_given_norms_replace_the_norms_over_the_heads_seen():
    """Tensor parallel: each rank sees its KV heads but scales by the norm over all of them, passed in."""
    keys, values, config = make_inputs(replace(BLOCK, batch=2))
    norms = token_norms(keys) * (1 + torch.rand(2, 1, 64, device=DEVICE))  # as if other ranks' heads added energy
    out = quantize_kv_triton(keys, values, config, norms=norms)
    assert_matches_reference(out, quantize_kv(keys, values, config, norms=norms), config, "given norms")
    assert torch.equal(out.key_norms, norms)
    with pytest.raises(ValueError, match="norms must be float32"):
        quantize_kv_triton(keys, values, config, norms=norms.double())
    with pytest.raises(ValueError, match="token scaling is off"):
        quantize_kv_triton(keys, values, OscarConfig(token_scaling=False, bits=2, sink_tokens=0), norms=norms)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter meets the NaN
def test_padding_matches_reference():
    """A left-padded batch: padding (here NaN and inf, as a model may leave there) enters no key group and stores
    code 0, norm 1 and value parameters 0, exactly as `reference.quantize_kv(..., valid=...)`."""
    keys, values, config = make_inputs(Case(batch=3, kv_heads=2, quantized=96))
    valid = torch.arange(96, device=DEVICE)[None] >= torch.tensor([[40], [64], [0]], device=DEVICE)
    keys[0, :, 3], values[1, :, 10] = float("nan"), float("inf")
    out = quantize_kv_triton(keys, values, config, valid=valid)
    assert_matches_reference(out, quantize_kv(keys, values, config, valid=valid), config, "left padding")
    with pytest.raises(ValueError, match="padding mask must be bool"):
        quantize_kv_triton(keys, values, config, valid=valid[:, :64])


def _random_storage(layout: StorageLayout, batch: int, heads: int, head_dim: int, tokens: int):
    """Storage whose every field holds random bits (a flush must leave untouched rows exactly as they were)."""
    stored = layout.empty(batch, heads, head_dim, heads, head_dim, tokens, DEVICE)
    for tensor in stored:
        if tensor is not None:
            tensor.view(torch.uint8).copy_(torch.randint(0, 256, tensor.view(torch.uint8).shape, dtype=torch.uint8))
    return stored


@pytest.mark.parametrize(
    ("held", "padded", "method", "bits"),
    [
        (0, False, "paper", (2, 2)),
        (5, False, "paper", (2, 2)),
        (32, False, "paper", (2, 2)),
        (96, False, "paper", (2, 2)),
        (97, False, "paper", (2, 2)),
        (32, True, "paper", (2, 2)),
        (32, True, "oscar", (2, 2)),
        (32, True, "oscar", (4, 2)),
        (96, False, "paper", (4, 2)),
        (64, False, "paper", (2, 4)),
        (32, True, "oscar", (3, 2)),
        (64, False, "paper", (2, 3)),
    ],
)
def test_flush_writes_a_complete_window_at_the_counter_and_nothing_else(held, padded, method, bits):
    """The compiled decode step's flush: with `held` a positive multiple of the window R, tokens [held - R, held) of
    the storage become exactly `quantize_kv_triton` of the residual (with the padding mask's columns for those
    positions, if any, and method="oscar"'s per-(row, head) key rotation); every other bit is unchanged. `bits`:
    (key_bits, value_bits), whose packed rows of keys and values lie at different offsets where they differ."""
    config = OscarConfig(residual_length=32, method=method, key_bits=bits[0], value_bits=bits[1], sink_tokens=0)
    # method="oscar": a mixed choice, so that a flag the flush ignored would show
    key_rotated = torch.tensor([[True, False], [False, True]], device=DEVICE) if method == "oscar" else None
    keys, values, _ = make_inputs(Case(batch=2, kv_heads=2, quantized=32, head_dim=64))
    layout = StorageLayout.of(config)
    storage = _random_storage(layout, 2, 2, 64, 128)
    before = [None if t is None else t.clone() for t in storage]
    # row 0: 20 padding positions (the mask covers 24 positions; later ones are real); row 1: none
    padding = torch.arange(24, device=DEVICE)[None] >= torch.tensor([[20], [0]], device=DEVICE) if padded else None
    flush_residual_triton(keys, values, storage, torch.tensor(held, device=DEVICE), config, padding, key_rotated)
    written = held > 0 and held % 32 == 0
    expected = [None if t is None else t.clone() for t in before]
    if written:
        valid = None if padding is None else torch.cat([padding, padding.new_ones(2, 8)], dim=1)[:, held - 32 : held]
        block = quantize_kv_triton(keys, values, config, key_rotated, valid=valid)
        for buf, part in zip(layout.rows(expected, held - 32, held), block):
            if buf is not None:
                buf.copy_(part)
    for name, got, want in zip(storage._fields, storage, expected):
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"held={held}: {name}"


@pytest.mark.parametrize(
    ("method", "bits", "padded"), [("paper", (2, 2), False), ("oscar", (4, 2), True), ("paper", (3, 3), False)]
)
def test_quantize_into_storage_writes_its_rows_and_nothing_else(method, bits, padded):
    """`out`/`start`: the block goes straight to rows [start, start + N) of a storage, bit for bit the new block
    `quantize_kv_triton` returns (padding columns are the block's tokens), and every other bit stays as it was."""
    config = OscarConfig(method=method, key_bits=bits[0], value_bits=bits[1], sink_tokens=0)
    key_rotated = torch.tensor([[True, False], [False, True]], device=DEVICE) if method == "oscar" else None
    keys, values, _ = make_inputs(Case(batch=2, kv_heads=2, quantized=64, head_dim=64), seed=3)
    valid = torch.arange(64, device=DEVICE)[None] >= torch.tensor([[0], [40]], device=DEVICE) if padded else None
    layout = StorageLayout.of(config)
    storage = _random_storage(layout, 2, 2, 64, 192)
    expected = [None if t is None else t.clone() for t in storage]
    block = quantize_kv_triton(keys, values, config, key_rotated, valid=valid)
    for buf, part in zip(layout.rows(expected, 96, 160), block):
        if buf is not None:
            buf.copy_(part)
    written = quantize_kv_triton(keys, values, config, key_rotated, valid=valid, out=storage, start=96)
    for name, got, want in zip(storage._fields, storage, expected):
        if want is not None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
    assert all(w is None or w.data_ptr() == r.data_ptr() for w, r in zip(written, layout.rows(storage, 96, 160)))
    for start, problem in ((16, "multiple of group_size"), (160, "do not fit a storage of 192")):
        with pytest.raises(ValueError, match=problem):
            quantize_kv_triton(keys, values, config, key_rotated, valid=valid, out=storage, start=start)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter meets the NaN
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("seed", range(4))
def test_finite_flags_from_the_kernel_match_the_reference(seed):
    """`finite`: the flags the kernel clears are `reference.finite_flags` of the block it wrote, for random K/V with a
    NaN or an inf at a random real token (cleared), at a padding token (kept: padding may hold anything), or values
    so large that a float16 scale overflows (the parameters' flag); one flag pair gathers several blocks."""
    gen = torch.Generator().manual_seed(seed)
    config = OscarConfig(bits=2, sink_tokens=0)

    def randint(high):
        return int(torch.randint(high, (), generator=gen))

    def block(problem):
        keys, values, _ = make_inputs(Case(batch=2, kv_heads=2, quantized=64, head_dim=64, dtype=torch.float32), seed)
        valid = torch.arange(64, device=DEVICE)[None] >= torch.tensor([[0], [24]], device=DEVICE)
        b, h, t, d = randint(2), randint(2), randint(64), randint(64)
        real = bool(valid[b, t])
        target = keys if randint(2) else values
        if problem == "nan":
            target[b, h, t, d] = float("nan")
        elif problem == "inf":
            target[b, h, t, d] = float("-inf") if randint(2) else float("inf")
        elif problem == "padding":  # row 1's first 24 tokens
            b, t, real = 1, randint(24), False
            target[b, h, t, d] = float("nan")
        elif problem == "overflow":  # a value group's (max - min) / 3 above float16's 65504 (keys: token-scaled)
            b, t, real = 0, randint(64), True
            values[b, h, t] = 3e5
        return keys, values, valid, problem != "none" and real

    for problem in ("none", "nan", "inf", "padding", "overflow"):
        keys, values, valid, broken = block(problem)
        finite = torch.ones(2, dtype=torch.bool, device=DEVICE)
        out = quantize_kv_triton(keys, values, config, valid=valid, finite=finite)
        want = finite_flags(out, keys, values, valid)
        assert torch.equal(finite, want), f"{problem}: kernel {finite.tolist()}, reference {want.tolist()}"
        assert bool(finite.all()) != broken, f"{problem}: flags {finite.tolist()}"
    gathered, want = torch.ones(2, dtype=torch.bool, device=DEVICE), []
    for problem in ("none", "nan", "overflow"):
        keys, values, valid, _ = block(problem)
        out = quantize_kv_triton(keys, values, config, valid=valid, finite=gathered)
        want.append(finite_flags(out, keys, values, valid))
    assert torch.equal(gathered, torch.stack(want).all(0)), f"{gathered.tolist()} vs {[w.tolist() for w in want]}"
    with pytest.raises(ValueError, match="finite must be a"):
        quantize_kv_triton(keys, values, config, finite=gathered.int())


def test_flush_rejects_bad_inputs():
    config = OscarConfig(residual_length=32, bits=2, sink_tokens=0)
    keys, values, _ = make_inputs(replace(BLOCK, quantized=32))
    storage = _random_storage(StorageLayout.of(config), 1, 2, 64, 64)
    held = torch.tensor(32, device=DEVICE)
    with pytest.raises(ValueError, match="got 64 residual tokens, expected 32"):
        flush_residual_triton(keys.repeat(1, 1, 2, 1), values.repeat(1, 1, 2, 1), storage, held, config)
    with pytest.raises(ValueError, match="key_codes has shape"):
        flush_residual_triton(keys, values, storage._replace(key_codes=storage.key_codes[:, :1]), held, config)
    with pytest.raises(ValueError, match="length must be one integer"):
        flush_residual_triton(keys, values, storage, held.float(), config)


GPU_CASES = [
    Case(batch=2, kv_heads=8, quantized=4096, head_dim=128),
    Case(batch=1, kv_heads=8, quantized=2048, head_dim=128, key_bits=4, value_bits=4, dtype=torch.float16),
    Case(batch=2, kv_heads=8, quantized=2048, head_dim=128, key_bits=4, value_bits=2),
    Case(batch=2, kv_heads=8, quantized=2048, head_dim=128, key_bits=3, value_bits=2),
    Case(batch=1, kv_heads=4, quantized=1024, head_dim=256, extreme_norms=True),
    Case(batch=3, kv_heads=2, quantized=512, head_dim=64, views=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_quantize_large(case: Case):
    keys, values, config = make_inputs(case, seed=1)
    assert_matches_reference(
        quantize_kv_triton(keys, values, config), quantize_kv(keys, values, config), config, case.id
    )
