"""Bad input gets a clear error naming the problem and the fix, never a silent wrong answer."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from oscar_hf import OscarCache, OscarConfig
from oscar_hf.config import DEFAULT_AVG_BITS
from oscar_hf.methods import DEFAULT_METHOD, METHODS
from oscar_hf.reference import round_trip_kv


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("bits", 5, r"bits=5 is not supported; use 'auto' \(default: layer-wise widths under avg_bits\), 2, 3 or 4"),
        ("bits", 2.0, "bits must be an int"),
        ("key_bits", 8, r"key_bits=8 is not supported; use 2, 3 or 4 \(default 2\)"),
        ("value_bits", True, "value_bits must be an int"),
        ("group_size", 48, "group_size=48 is not supported"),
        ("residual_length", 100, "residual_length=100 must be a positive multiple of group_size=32"),
        ("residual_length", 0, "residual_length=0 must be a positive multiple"),
        ("rotation", "yes", "rotation must be True or False"),
        ("token_scaling", 1, "token_scaling must be True or False"),
        ("scale_dtype", "bfloat16", "scale_dtype='bfloat16' is not supported"),
        ("attention", "flash", "attention='flash' is not supported"),
        ("method", "kivi", "method='kivi' is not supported; use 'auto'"),
    ],
)
def test_invalid_field_is_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        OscarConfig(**{field: value})


def test_unknown_keys_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"Unknown OscarCache option\(s\) \['q_group_size', 'residual'\]") as err:
        OscarConfig.from_dict({"bits": 2, "residual": 64, "q_group_size": 32})
    assert "valid options are ['bits', 'key_bits', 'value_bits', 'group_size', 'residual_length'" in str(err.value)


def test_from_dict_round_trip():
    config = OscarConfig(bits=4, group_size=64, residual_length=256, rotation=False, scale_dtype="float32")
    assert OscarConfig.from_dict(config.to_dict()) == config and OscarConfig.from_dict(None) == OscarConfig()
    mixed = OscarConfig(key_bits=4, value_bits=2)
    assert OscarConfig.from_dict(mixed.to_dict()) == mixed


def test_bits_is_the_shorthand_for_key_and_value_bits():
    """`bits` sets both widths; key_bits/value_bits set one each (the other stays 2); after construction `bits` is
    the common width, or None where they differ. With no width given, each layer chooses its own (bits="auto")."""
    assert (OscarConfig(bits=2).key_bits, OscarConfig(bits=2).value_bits, OscarConfig(bits=2).bits) == (2, 2, 2)
    assert OscarConfig(bits=4) == OscarConfig(key_bits=4, value_bits=4) == OscarConfig(bits=4, key_bits=4)
    assert OscarConfig(bits=4).bits == 4
    k4v2 = OscarConfig(key_bits=4)
    assert (k4v2.key_bits, k4v2.value_bits, k4v2.bits) == (4, 2, None) and k4v2 == OscarConfig(key_bits=4, value_bits=2)
    assert OscarConfig(value_bits=4).key_bits == 2
    with pytest.raises(ValueError, match="contradicts"):  # a resolved config changed in one width names the fix
        dataclasses.replace(OscarConfig(bits=2), key_bits=4)
    assert dataclasses.replace(OscarConfig(bits=2), bits=None, key_bits=4) == k4v2
    assert dataclasses.replace(k4v2, bits=4, key_bits=None, value_bits=None) == OscarConfig(bits=4)
    assert dataclasses.replace(OscarConfig(), bits=2) == OscarConfig(bits=2)  # the default's budget is no obstacle


def test_the_default_is_layer_wise_widths_under_3_2_bits_with_4_sinks():
    """`OscarConfig()` is the method the records call DEFAULT_METHOD: bits="auto" under DEFAULT_AVG_BITS (or the
    model's all-2-bit cost where that is higher), 4 exact sinks; a budget given alone implies bits="auto"."""
    default = OscarConfig()
    assert default.auto_bits and (default.key_bits, default.value_bits, default.avg_bits) == (None, None, None)
    assert default.sink_tokens == 4 and OscarConfig(bits="auto") == default
    method = OscarConfig(**METHODS[DEFAULT_METHOD][1])
    assert method.avg_bits == DEFAULT_AVG_BITS and dataclasses.replace(method, avg_bits=None) == default
    assert default.budget(3.125) == DEFAULT_AVG_BITS == 3.2 and default.budget(3.5) == 3.5
    assert OscarConfig(avg_bits=3.6).auto_bits and OscarConfig(avg_bits=3.6).budget(3.5) == 3.6
    with pytest.raises(ValueError, match=r"reference.quantize_kv: bits='auto' \(the default\).*OscarConfig\(bits=2\)"):
        round_trip_kv(torch.randn(1, 1, 32, 64), torch.randn(1, 1, 32, 64), default.resolve("eager"))


@pytest.mark.parametrize(
    "options,named",
    [({"bits": 2, "key_bits": 4}, "bits=2 contradicts key_bits=4"), ({"bits": 4, "value_bits": 2}, "value_bits=2")],
)
def test_bits_contradicting_key_or_value_bits_is_refused(options, named):
    with pytest.raises(ValueError, match=f"{named}.*Pass bits alone, or key_bits and value_bits without bits"):
        OscarConfig(**options)


def test_unsupported_head_dim_is_refused_at_construction():
    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=48, hidden_size=192
    )
    with pytest.raises(ValueError, match=r"cannot quantize head_dim=48.*keep this model on its default cache"):
        OscarCache(config, OscarConfig())
    config.head_dim = 96
    with pytest.raises(ValueError, match=r"cannot quantize head_dim=96.*group_size=64.*use group_size=32"):
        OscarCache(config, OscarConfig(group_size=64))


def test_unsupported_value_head_dim_is_refused_at_first_update():
    """K and V head dims can differ (e.g. MLA models): the real shapes are checked when the first tokens arrive."""
    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256
    )
    cache = OscarCache(config, OscarConfig())
    with pytest.raises(ValueError, match="cannot quantize head_dim=40"):
        cache.update(torch.randn(1, 2, 4, 64), torch.randn(1, 2, 4, 40), 0)


# On CPU the Triton interpreter runs the kernel in numpy, which warns about the fp16 overflow (and the inf/inf that
# follows) that this test provokes on purpose; the cache's finiteness check turns it into the error asserted here.
INTERPRETER_OVERFLOW = pytest.mark.filterwarnings(
    "ignore:overflow encountered in cast:RuntimeWarning:triton.runtime.interpreter",
    "ignore:invalid value encountered in divide:RuntimeWarning:triton.runtime.interpreter",
)


@pytest.mark.parametrize("attention", ["portable", pytest.param("fused", marks=INTERPRETER_OVERFLOW)])
def test_values_too_large_for_fp16_scales_are_refused(attention, one_layer_config):
    """Both quantizers (PyTorch, and the Triton kernel: on CPU through its interpreter) go through the same check."""
    config = one_layer_config
    options = dict(rotation=False, token_scaling=False, attention=attention, bits=2, sink_tokens=0)
    huge = torch.randn(1, 1, 129, 64) * 1e6
    with pytest.raises(ValueError, match="scale_dtype='float32'"):
        OscarCache(config, OscarConfig(**options)).update(huge, huge, 0)
    OscarCache(config, OscarConfig(scale_dtype="float32", **options)).update(huge, huge, 0)


# The interpreter's min/max (numpy's nanmin/nanmax) warn about the groups that the rotation has made all NaN.
INTERPRETER_ALL_NAN = pytest.mark.filterwarnings(
    "ignore:All-NaN slice encountered:RuntimeWarning:triton.runtime.interpreter"
)


@pytest.mark.parametrize("attention", ["portable", pytest.param("fused", marks=INTERPRETER_ALL_NAN)])
@pytest.mark.parametrize("rotation", [True, False], ids=["rotated", "unrotated"])
@pytest.mark.parametrize("poisoned", ["keys", "values"])
def test_non_finite_keys_or_values_are_named_as_such(poisoned, rotation, attention, one_layer_config):
    """NaN/inf from the model is not a scale overflow: the error must not suggest scale_dtype='float32'. The Triton
    quantizer's min/max skip NaN, so its scales can stay finite around one (the keys and the unrotated values passed
    unnoticed until the check read the K/V themselves). The query rule quantizes a prompt's blocks when its attention
    call hands the queries over: the error comes there, in the same forward."""
    config = one_layer_config
    kv = {"keys": torch.randn(1, 1, 129, 64), "values": torch.randn(1, 1, 129, 64)}
    kv[poisoned][0, 0, 5, 3] = float("nan")
    options = OscarConfig(attention=attention, scale_dtype="float32", rotation=rotation, bits=2, sink_tokens=0)
    cache = OscarCache(config, options)
    with pytest.raises(ValueError, match="non-finite keys or values") as error:
        keys, _ = cache.update(kv["keys"], kv["values"], 0)
        cache.layers[0].observe_queries(torch.randn(1, 2, 129, 64), keys)  # what the sdpa attention call hands over
    assert "scale_dtype" not in str(error.value)


def test_the_default_method_resolves_by_the_models_attention():
    """method="auto" (default) is the query rule where the cache sees the queries (sdpa) and the paper's method
    elsewhere; an explicit method is kept; code below the cache refuses the unresolved "auto" rather than guess."""
    assert OscarConfig().method == "auto"
    assert OscarConfig().resolve("sdpa").method == "oscar"
    for implementation in ("eager", "flash_attention_2", "flex_attention", None):
        assert OscarConfig().resolve(implementation) == OscarConfig(method="paper")
    assert OscarConfig(method="oscar").resolve("eager").method == "oscar"  # the cache then names the fix
    assert OscarConfig(method="paper").resolve("sdpa").method == "paper"
    keys = torch.randn(1, 2, 64, 64)
    with pytest.raises(ValueError, match="method='auto' means 'oscar' or 'paper'"):
        round_trip_kv(keys, keys, OscarConfig(), moment=torch.eye(64).expand(1, 2, 64, 64))
