"""Kernel tests run on CUDA when there is a GPU, and on CPU tensors through Triton's interpreter otherwise
(tests/conftest.py sets TRITON_INTERPRET=1 before Triton is first imported)."""

import pytest
import torch

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
