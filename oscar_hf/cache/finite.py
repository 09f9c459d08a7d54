"""The finite check of quantized blocks: one host synchronisation per update, none in an eager decode step on CUDA."""

from __future__ import annotations

import contextlib

import torch

from ..config import OscarConfig
from ..reference import raise_unless_finite


class FiniteCheck:
    """Reads the `finite_flags` of the blocks a layer quantizes (reading device flags synchronises the host) and
    raises on a non-finite block:

    * blocks quantized inside `gathered` (an update, a choice of the key rotation: a long prompt is quantized in
      several blocks) are checked together on leaving it, so that the host waits for the GPU once, not once per block;
    * a block that an eager decode step flushes on CUDA is checked later without waiting (`defer`): its flags go to
      pinned host memory behind the block's kernels and are read by the first update that finds them arrived (in
      `generate`, the next step's: it synchronises after every token). The next flush waits for them if they have
      not arrived;
    * any other block, at once."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self._pending: tuple[torch.Tensor, torch.cuda.Event] | None = None
        self._gathered: torch.Tensor | None = None  # the flags of the blocks quantized in the open `gathered`, AND-ed
        self._depth = 0

    def flags(self, device: torch.device, decoding: bool) -> torch.Tensor:
        """Flags for the quantizer kernel to clear (`quantize_kv_triton(finite=)`), then `check`ed: inside `gathered`,
        the update's (one pair for all its blocks); otherwise the block's own."""
        if self._depth and not decoding:
            if self._gathered is None:
                self._gathered = torch.ones(2, dtype=torch.bool, device=device)
            return self._gathered
        return torch.ones(2, dtype=torch.bool, device=device)

    def check(self, flags: torch.Tensor, decoding: bool) -> None:
        """A block's `finite_flags` (or the `flags` the kernel cleared); `decoding`: a decode step flushed it."""
        if decoding and flags.is_cuda:
            self.defer(flags)
        elif self._depth:
            if flags is not self._gathered:
                self._gathered = flags if self._gathered is None else self._gathered & flags
        else:
            raise_unless_finite(flags, self.config)

    @contextlib.contextmanager
    def gathered(self):
        """Check the blocks quantized inside (nested: the outermost) together, on leaving; on entering, a deferred
        flush's flags if they have arrived."""
        if not self._depth:
            self.read(wait=False)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._gathered is not None:
            flags, self._gathered = self._gathered, None
            raise_unless_finite(flags, self.config)

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
        self._pending, self._gathered, self._depth = None, None, 0
