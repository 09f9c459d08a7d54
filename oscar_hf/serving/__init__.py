"""The 2-bit KV pool in transformers' continuous batching (`generate_batch`, `init_continuous_batching`, `transformers
serve --continuous-batching`): `cache_implementation="oscar"` in the generation config turns it on (`hooks`); the pool
is `pool.OscarPagedCache` (imported on demand: it is built on transformers 5.25's internals). docs/serving.md describes
the design."""

from .hooks import SUPPORTED_TRANSFORMERS, pool_config

__all__ = ["SUPPORTED_TRANSFORMERS", "pool_config"]
