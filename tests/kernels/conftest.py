"""Kernel tests run on CUDA when there is a GPU, and on CPU tensors through Triton's interpreter otherwise
(tests/conftest.py sets TRITON_INTERPRET=1 before Triton is first imported)."""

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

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


class _ForceTokens(LogitsProcessor):
    """Teacher forcing inside generate: step i must emit tokens[:, i] (the raw logits are still reported)."""

    def __init__(self, tokens: torch.Tensor, prompt_length: int):
        self.tokens, self.prompt_length = tokens, prompt_length

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        step = input_ids.shape[1] - self.prompt_length
        return forced.scatter_(1, self.tokens[:, step : step + 1], 0.0)


@pytest.fixture
def teacher_forcing():
    """`teacher_forcing(tokens, prompt_length)`: logits processors that make generate emit `tokens`, so that two
    paths compare their logits step by step on the same inputs."""
    return lambda tokens, prompt_length: LogitsProcessorList([_ForceTokens(tokens, prompt_length)])
