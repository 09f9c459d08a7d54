"""The KV cache methods the evaluations compare (lm-eval model `oscar-hf`, `oscar-eval`, benchmarks/run_accuracy.py).

A module of its own, free of lm-eval and torch imports, so that `oscar-eval --help` can list them quickly.
"""

# method name -> (cache_implementation for generate, cache_config). None: transformers' default DynamicCache.
# "quantized" is transformers' own QuantizedCache (needs optimum-quanto or hqq; refuses sliding-window models).
METHODS: dict[str, tuple[str | None, dict]] = {
    "bf16": (None, {}),
    "oscar-int2": ("oscar", {"bits": 2}),  # the default: the paper's method
    "oscar-paper-int2": ("oscar", {"bits": 2, "method": "paper"}),  # the paper's method, named explicitly
    "oscar-perhead-int2": ("oscar", {"bits": 2, "method": "oscar"}),  # experimental: per-head key-rotation choice
    "oscar-int4": ("oscar", {"bits": 4}),
    "kivi-int2": ("oscar", {"bits": 2, "rotation": False, "token_scaling": False}),
    "oscar-int2-rotation-only": ("oscar", {"bits": 2, "token_scaling": False}),
    "oscar-int2-scaling-only": ("oscar", {"bits": 2, "rotation": False}),
    "hf-quanto-int2": ("quantized", {"backend": "quanto", "nbits": 2}),
    "hf-quanto-int4": ("quantized", {"backend": "quanto", "nbits": 4}),
    "hf-hqq-int2": ("quantized", {"backend": "hqq", "nbits": 2}),
}
