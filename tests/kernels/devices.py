"""Where the kernel tests run, and which of their cases a CPU leaves to the slow run (pyproject.toml's `pythonpath`
makes this module importable by name)."""

import pytest
import torch

# CUDA when there is a GPU; otherwise CPU tensors, the kernels in Triton's interpreter (tests/conftest.py)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def slow_on_cpu(*values):
    """A parameter set that only repeats, at other sizes or options, what the default run checks on a CPU, where
    Triton's interpreter makes it long: slow there, in the default run on a GPU (tests/conftest.py)."""
    return pytest.param(*values, marks=pytest.mark.slow_on_cpu)
