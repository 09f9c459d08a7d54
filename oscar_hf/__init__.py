"""oscar-hf: the OScaR 2-bit KV cache (Canalized Rotation + Omni-Token Scaling) for HuggingFace transformers.

Importing the package registers `cache_implementation="oscar"` with `generate` (see `register`/`unregister`).
"""

from .cache import KVMemory, OscarCache, OscarLayer, average_bits, effective_bits, kv_memory
from .config import OscarConfig
from .integrations.transformers import cache_kwargs, register, unregister

__all__ = [
    "KVMemory",
    "OscarCache",
    "OscarConfig",
    "OscarLayer",
    "average_bits",
    "cache_kwargs",
    "effective_bits",
    "kv_memory",
    "register",
    "unregister",
]
__version__ = "0.1.0"

register()
