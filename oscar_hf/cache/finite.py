"""The finite check of quantized blocks: on CUDA read behind the kernels, with no host synchronisation."""

from __future__ import annotations

import collections
import contextlib

import torch

from ..config import OscarConfig
from ..reference import raise_unless_finite


class FiniteCheck:
    """Reads the finite flags of the blocks a layer quantizes (`reference.finite_flags`, or the pair the quantizer
    kernel clears) and raises on a non-finite block:

    * the blocks quantized inside `gathered` (an update, a choice of the key rotation: a long prompt is quantized in
      several blocks) share one pair of flags, checked on leaving it;
    * on CUDA, without waiting (`defer`): the flags go to pinned host memory behind the blocks' kernels and are read,
      oldest first, by the first `gathered` or `defer` that finds them arrived (in `generate`, the next step's: it
      synchronises after every token; a chunked prefill's next chunk; the pool's next flush). Reading device flags at
      once would make the host wait for the GPU, and the GPU for the host's next launches, at every layer of a
      prefill, and the continuous-batching pool's host, preparing the next batch while the GPU computes this one,
      wait for this one at each flush. A non-finite block is thus refused a step or a chunk after its quantization
      (a few steps under asynchronous batching), having been read by at most those steps' attention;
    * elsewhere (CPU tensors, a block quantized outside `gathered`), at once."""

    def __init__(self, config: OscarConfig):
        self.config = config
        self._pending: collections.deque[tuple[torch.Tensor, torch.cuda.Event]] = collections.deque()  # oldest first
        self._gathered: torch.Tensor | None = None  # the flags of the blocks quantized in the open `gathered`, AND-ed
        self._depth = 0

    def flags(self, device: torch.device) -> torch.Tensor:
        """Flags for the quantizer kernel to clear (`quantize_kv_triton(finite=)`), then `check`ed: inside `gathered`,
        the scope's (one pair for all its blocks); otherwise the block's own."""
        if not self._depth:
            return torch.ones(2, dtype=torch.bool, device=device)
        if self._gathered is None:
            self._gathered = torch.ones(2, dtype=torch.bool, device=device)
        return self._gathered

    def check(self, flags: torch.Tensor) -> None:
        """A block's `finite_flags` (or the `flags` the kernel cleared)."""
        if not self._depth:
            raise_unless_finite(flags, self.config)
        elif flags is not self._gathered:
            self._gathered = flags if self._gathered is None else self._gathered & flags

    @contextlib.contextmanager
    def gathered(self):
        """Check the blocks quantized inside (nested: the outermost) together, on leaving (on CUDA, deferred); on
        entering, deferred flags if they have arrived."""
        if not self._depth:
            self.read(wait=False)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._gathered is not None:
            flags, self._gathered = self._gathered, None
            if flags.is_cuda:
                self.defer(flags)
            else:
                raise_unless_finite(flags, self.config)

    def defer(self, flags: torch.Tensor) -> None:
        """Send `flags` to the host behind the blocks' kernels (after reading the earlier ones that arrived)."""
        self.read(wait=False)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        arrived = torch.cuda.Event()
        arrived.record()
        self._pending.append((host, arrived))

    def read(self, wait: bool) -> None:
        """Raise if deferred blocks were not finite: all of them, or without `wait` those whose flags arrived."""
        while self._pending:
            host, arrived = self._pending[0]
            if not wait and not arrived.query():
                return
            arrived.synchronize()
            self._pending.popleft()
            raise_unless_finite(host, self.config)

    def reset(self) -> None:
        self._pending.clear()
        self._gathered, self._depth = None, 0
