"""The deferred finite check of blocks that eager decode steps flush on CUDA."""

from __future__ import annotations

import torch

from ..config import OscarConfig
from ..reference import raise_unless_finite


class FiniteCheck:
    """A decode flush's `finite_flags` on their way to pinned host memory, and the event after which they are there:
    read by the first update that finds them arrived (in `generate`, the next step's: it synchronises after every
    token), so that eager decode never waits for the GPU. The next flush waits for them if they have not arrived."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None

    def defer(self, flags: torch.Tensor) -> None:
        """Send `flags` to the host behind the block's kernels (after reading the previous ones)."""
        self.read(wait=True)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self._pending = (host, arrived)

    def read(self, wait: bool) -> None:
        """Raise if the pending flush's block was not finite; without `wait`, only once its flags arrived."""
        if self._pending is None:
            return
        host, arrived = self._pending
        if not wait and not arrived.query():
            return
        arrived.synchronize()
        self._pending = None
        raise_unless_finite(host, self.config)

    def reset(self) -> None:
        self._pending = None
