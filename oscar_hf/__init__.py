"""oscar-hf: the OScaR 2-bit KV cache (Canalized Rotation + Omni-Token Scaling) for HuggingFace transformers.

Importing the package registers `cache_implementation="oscar"` with `generate` (see `register`/`unregister`).
"""

import importlib.util

# The kernels/ folder becomes oscar_hf.kernels by the install's mapping (setup.py). A checkout's oscar_hf/ put first on
# sys.path (Python started at its root) in front of a non-editable install has no such mapping: say so, not fail later
# in a circular-looking import.
if importlib.util.find_spec(f"{__name__}.kernels") is None:
    raise ImportError(
        f"oscar_hf was imported from {__path__[0]} without its kernels (the install maps the checkout's kernels/ "
        "folder to oscar_hf.kernels): install the checkout editable (`pip install -e .`), or start Python outside "
        "the checkout"
    )

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
