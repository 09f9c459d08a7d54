"""The OScaR KV cache: `OscarCache` (cache.py) and its `OscarLayer`s (layer.py), with one module per job of a layer:
the sinks, window and quantized region (storage.py), the backend that quantizes, reads back and attends (backends.py:
the reference or the Triton kernels, chosen once), the finite check (finite.py), a step attended in place (step.py)
and what it attends to (history.py), compiled decode (compiled.py), method="oscar"'s query rule (key_rotation.py),
bits="auto"'s layer-wise widths (layer_bits.py), padding (padding.py) and memory accounting (memory.py)."""

from .cache import OscarCache
from .layer import OscarLayer
from .memory import KVMemory, average_bits, effective_bits, kv_memory

__all__ = ["KVMemory", "OscarCache", "OscarLayer", "average_bits", "effective_bits", "kv_memory"]
