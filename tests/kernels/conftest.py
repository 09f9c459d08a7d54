"""Kernel tests run on CUDA when there is a GPU, and on CPU tensors through Triton's interpreter otherwise.

Triton decides between compiling and interpreting when `@triton.jit` decorates a kernel (it reads TRITON_INTERPRET
then), so the variable is set here before the kernel modules are imported, and modules imported earlier (say by a
parent conftest) are re-executed so that their kernels are decorated again.
"""

import importlib
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in ("oscar_hf.kernels.quantize_pack", "oscar_hf.kernels.decode_attention", "oscar_hf.kernels"):
        if _name in sys.modules:
            importlib.reload(sys.modules[_name])

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

_INT_POISON = 0x5A5A5A5A


def _poisoned(factory):
    def wrapper(*args, **kwargs):
        out = factory(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        elif out.dtype in (torch.int32, torch.int64):
            out.fill_(_INT_POISON)
        return out

    return wrapper


@pytest.fixture(autouse=True)
def poison_empty(monkeypatch):
    """Fill every torch.empty / empty_like result with NaN (floats) or a pattern (ints): unwritten outputs fail."""
    monkeypatch.setattr(torch, "empty", _poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", _poisoned(torch.empty_like))


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
