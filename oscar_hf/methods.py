"""The named KV cache methods the evaluations compare (lm-eval model `oscar-hf`, `oscar-eval`,
benchmarks/run_accuracy.py).

Plain data, importing nothing: `oscar-eval --help` reads this file without importing the oscar_hf package (whose
`__init__` registers with transformers, seconds of imports).
"""

# The KV cache methods the evaluations compare (lm-eval model `oscar-hf`, `oscar-eval`, benchmarks/run_accuracy.py):
# method name -> (cache implementation, cache_config). None: transformers' default DynamicCache. "oscar": OscarCache.
# "quantized" is transformers' own QuantizedCache (needs optimum-quanto or hqq; refuses sliding-window models).
# "tiny-turboquant": tiny-turboquant's TinyKVCache(**cache_config), a peer that generate takes as a cache object (it is
# no cache_implementation of transformers).
# The method whose config is `OscarConfig()`'s defaults (tests/test_config.py holds them equal).
DEFAULT_METHOD = "oscar-auto-3.2-sinks4"
# Every OScaR method names its widths and sinks, so that a change of `OscarConfig`'s defaults leaves its records true.
METHODS: dict[str, tuple[str | None, dict]] = {
    "bf16": (None, {}),
    # the default cache (`OscarConfig()`): layer-wise widths under 3.2 stored bits per K/V element, 4 exact sinks,
    # method="auto" (the query rule on an sdpa model, as transformers loads one by default; the paper's method
    # elsewhere, with a warning)
    "oscar-auto-3.2-sinks4": ("oscar", {"bits": "auto", "avg_bits": 3.2, "sink_tokens": 4}),
    "oscar-int2": ("oscar", {"bits": 2, "sink_tokens": 0}),  # 2-bit keys and values, the query rule
    "oscar-paper-int2": ("oscar", {"bits": 2, "sink_tokens": 0, "method": "paper"}),  # the paper's: every key rotated
    "oscar-int4": ("oscar", {"bits": 4, "sink_tokens": 0}),
    "oscar-k4v2": ("oscar", {"key_bits": 4, "value_bits": 2, "sink_tokens": 0}),  # 4-bit keys, 2-bit values
    "oscar-int2-sinks4": ("oscar", {"bits": 2, "sink_tokens": 4}),  # with 4 exact attention-sink tokens
    "oscar-k4v2-sinks4": ("oscar", {"key_bits": 4, "value_bits": 2, "sink_tokens": 4}),
    # a 64-token exact window: 32 fewer exact tokens on average, 0.09 effective bits less at 4K tokens
    "oscar-k4v2-sinks4-window64": ("oscar", {"key_bits": 4, "value_bits": 2, "sink_tokens": 4, "residual_length": 64}),
    "oscar-paper-int4": ("oscar", {"bits": 4, "sink_tokens": 0, "method": "paper"}),  # the paper's method at 4 bits
    # 3-bit keys (bit planes): K3V2 stores half a bit more than K2V2 for most of K4V2's gain; K3V3 costs K4V2's bits
    "oscar-k3v2-sinks4": ("oscar", {"key_bits": 3, "value_bits": 2, "sink_tokens": 4}),
    "oscar-k3v3-sinks4": ("oscar", {"key_bits": 3, "value_bits": 3, "sink_tokens": 4}),
    # layer-wise widths chosen from each prompt under a budget of average stored bits per K/V element
    "oscar-auto-3.2": ("oscar", {"bits": "auto", "avg_bits": 3.2, "sink_tokens": 0}),  # INT2's memory, a few 4-bit
    "oscar-auto-3.6": ("oscar", {"bits": "auto", "avg_bits": 3.6, "sink_tokens": 0}),
    "oscar-auto-4.1": ("oscar", {"bits": "auto", "avg_bits": 4.1, "sink_tokens": 0}),
    "oscar-auto-4.1-sinks4": ("oscar", {"bits": "auto", "avg_bits": 4.1, "sink_tokens": 4}),  # `avg_bits=4.1` alone
    # at most 4.2 effective bits per K/V element at 4K tokens (exact sinks and window included: oscar_hf.effective_bits)
    "oscar-auto-3.9-sinks4": ("oscar", {"bits": "auto", "avg_bits": 3.9, "sink_tokens": 4}),
    "kivi-int2": ("oscar", {"bits": 2, "sink_tokens": 0, "rotation": False, "token_scaling": False}),
    # the paper's ablations: its rotation (every key) without token scaling, and token scaling without rotation
    "oscar-int2-rotation-only": ("oscar", {"bits": 2, "sink_tokens": 0, "token_scaling": False, "method": "paper"}),
    "oscar-int2-scaling-only": ("oscar", {"bits": 2, "sink_tokens": 0, "rotation": False}),
    "hf-quanto-int2": ("quantized", {"backend": "quanto", "nbits": 2}),
    "hf-quanto-int4": ("quantized", {"backend": "quanto", "nbits": 4}),
    "hf-hqq-int2": ("quantized", {"backend": "hqq", "nbits": 2}),
    # tiny-turboquant's presets "aggressive" (3-bit keys, 2-bit values in groups of 32 channels) and "safe" (default)
    "tiny-turboquant-k3v2": ("tiny-turboquant", {"key_bits": 3, "value_bits": 2, "value_group_size": 32}),
    "tiny-turboquant-k4v4": ("tiny-turboquant", {"key_bits": 4, "value_bits": 4}),
}
