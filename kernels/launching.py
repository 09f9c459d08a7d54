"""`BoundKernel`: one launch of a Triton (or Gluon) kernel whose grid and constant arguments are fixed, the tensors
given per call, for launchers that repeat the same launch every decode step.

Triton's `kernel[grid](...)` binds and specialises every argument on every call (about a hundred for the split kernel)
before it finds its compiled kernel. A `BoundKernel` does that once: its first call on a CUDA device goes through
`kernel[grid]` and keeps the compiled kernel it returns; later calls hand that kernel's own launcher
(`CompiledKernel.run`, the same call `JITFunction.run` ends with in Triton 3.6 and 3.9) the arguments in order, on the
stream the caller names. That is only valid for the specialisation the first call compiled: the owner keys a
`BoundKernel` on everything Triton specialises on (argument dtypes, integer values, pointer alignment), and passes per
call only integers the kernel does not specialise on (`do_not_specialize`). Where that launcher is not there (another
Triton, the interpreter) or launch hooks are set (a profiler: `hooks_set`), every call goes through `kernel[grid]`.
"""

from __future__ import annotations

import warnings

import torch
import triton
from triton import knobs
from triton.runtime import driver


class BoundKernel:
    """`kernel[grid](**constants, **dict(zip(names, values)))` for the `values` of each call."""

    def __init__(self, kernel, grid: tuple[int, ...], constants: dict, names: tuple[str, ...]):
        params = list(kernel.arg_names)
        self.kernel, self.grid, self.constants, self.names = kernel, grid, constants, names
        self.options = {name: value for name, value in constants.items() if name not in params}  # num_warps, ...
        missing = set(params) - set(constants) - set(names)
        if missing:
            raise TypeError(f"BoundKernel: no value for {sorted(missing)} of {kernel.fn.__name__}.")
        self._template = [constants.get(name) for name in params]
        # the per-call values' parameter slots, as runs of consecutive ones: a slice assignment each
        self._runs: list[tuple[int, int, int]] = []  # (first slot, first value, count)
        for index, slot in enumerate(params.index(name) for name in names):
            run = self._runs[-1] if self._runs else None
            if run and run[0] + run[2] == slot:
                self._runs[-1] = (run[0], run[1], run[2] + 1)
            else:
                self._runs.append((slot, index, 1))
        self._grid3 = (*grid, *(1,) * (3 - len(grid)))
        self._compiled = None

    def arguments(self, *values) -> list:
        """Every parameter's value, in the kernel's order."""
        if len(values) != len(self.names):
            raise TypeError(f"BoundKernel: {len(values)} values for {len(self.names)} names {self.names}.")
        args = self._template.copy()
        for slot, first, count in self._runs:
            args[slot : slot + count] = values[first : first + count]
        return args

    def __call__(self, stream: int | None, *values) -> None:
        """Launch with these values; `stream`: the raw CUDA stream to launch on directly (`current_stream`: the current
        stream of the current device), or None to go through `kernel[grid]` (the CPU's interpreter, launch hooks)."""
        args = self.arguments(*values)
        compiled = self._compiled
        if not compiled or stream is None:
            launched = self.kernel[self.grid](*args, **self.options)
            if self._compiled is None:  # the first call: None (not tried yet) becomes the compiled kernel or False
                self._compiled = _direct_launcher(launched, self.kernel)
            return
        compiled.run(*self._grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)


def current_stream(device: torch.device) -> int | None:
    """The raw handle of `device`'s current CUDA stream (what Triton's own launch reads), None for a CPU tensor."""
    return driver.active.get_current_stream(device.index) if device.type == "cuda" else None


def hooks_set() -> bool:
    """Whether launch hooks are registered (a profiler's): Triton's own launch calls them, so launch through it."""
    hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    return any(getattr(hook, "calls", hook) for hook in hooks)  # hook chains (3.6, 3.9) or plain callables


def _direct_launcher(compiled, kernel):
    """The compiled kernel whose own launcher later calls use, or False (keep `kernel[grid]`: the interpreter returns
    no compiled kernel; a Triton without `CompiledKernel.run` / `function` / `packed_metadata` is warned of once)."""
    if compiled is None:
        return False
    if hasattr(compiled, "result"):  # a compilation future (Triton's asynchronous compile mode)
        compiled = compiled.result()
    if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
        return compiled
    warnings.warn(
        f"oscar_hf.kernels: Triton {triton.__version__}'s compiled kernels have no `run`/`function`/`packed_metadata`;"
        f" {kernel.fn.__name__} launches through `kernel[grid]` (slower on the host).",
        stacklevel=3,
    )
    return False
