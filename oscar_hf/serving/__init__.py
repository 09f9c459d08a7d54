"""The 2-bit KV pool in transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers
serve --continuous-batching`): `cache_implementation="oscar"` in the generation config turns it on (`hooks`).
docs/serving.md describes the design."""

from .hooks import SUPPORTED_TRANSFORMERS, pool_config
from .pool import OscarPagedCache

__all__ = ["SUPPORTED_TRANSFORMERS", "OscarPagedCache", "pool_config"]
