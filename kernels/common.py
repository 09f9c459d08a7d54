"""What the quantizer (kernels/quantize_pack.py) and the decode kernels (kernels/decode_*.py) share: the model dtypes
they accept, whether Triton runs them through its CPU interpreter, the Walsh-Hadamard transform of rows and the
reduction combine functions."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from transformers.utils import logging

from oscar_hf.layout import WORD_BITS as _WORD_BITS

logger = logging.get_logger(__name__)

MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# The storage's code words (`oscar_hf.layout.WORD_BITS`) as a kernel constant: a word of b-bit codes holds
# `WORD_BITS // b` of them (b = 2, 4), or one bit of `WORD_BITS` tokens (b = 3: bit planes, `word_tokens`).
WORD_BITS: tl.constexpr = tl.constexpr(_WORD_BITS)


@triton.constexpr_function
def word_tokens(bits):
    """Tokens one code word covers at `bits` bits: `WORD_BITS // bits` codes side by side where the width divides the
    word (2, 4 bits), else `WORD_BITS` tokens, one bit of each (3 bits: a bit plane; `word_planes` words per group of
    `WORD_BITS` tokens, `oscar_hf.layout`). `WORD_BITS // word_tokens(bits)` bits of each token are in a word."""
    return _WORD_BITS // bits if _WORD_BITS % bits == 0 else _WORD_BITS


@triton.constexpr_function
def word_planes(bits):
    """Consecutive code rows that hold the same `word_tokens(bits)` tokens: 1, or `bits` bit planes (plane p at row
    offset p, bit p of each code)."""
    return 1 if _WORD_BITS % bits == 0 else bits


@triton.jit
def code_row(t0, BITS: tl.constexpr):
    """The first code row of the tokens from `t0` (a multiple of `word_tokens(BITS)`), one formula for every width:
    `t0 // W` where W codes share a word, `3 * (t0 // 32)` for 3-bit planes. Every kernel's row arithmetic. (Not
    `t0 * BITS // WORD_BITS`, the same number: a division of the product compiles to more instructions and, in the
    decode loop, 28 more registers at 2 bits.)"""
    return t0 // word_tokens(BITS) * word_planes(BITS)


# Triton's CPU interpreter (the CPU CI), as a kernel constant: it multiplies raw bf16 bit patterns in tl.dot (3.9), so
# dot operands are upcast there, and it cannot run PTX, so codes are unpacked there with plain integer ops.
INTERPRETER: tl.constexpr = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


def interpreting() -> bool:
    """True when Triton runs kernels on CPU tensors through its interpreter (TRITON_INTERPRET=1, the CPU CI)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device(device: torch.device):
    """The context a launch on `device` runs in: the device made current (Triton launches on the current one), or
    nothing where it is current already (the usual case: switching costs microseconds per call)."""
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# Said once per process, at the first launch on a GPU (README, Troubleshooting): the first prefill and the first
# decode step of a process compile the kernels they use, each shape of launch facts once (or load them from Triton's
# on-disk cache), so the first request waits seconds more than the next. Not warmed up in advance: what Triton
# specialises (the integer arguments equal to 1 or divisible by 16, the pointers' alignment, the constants a launch
# picks from the context length, the batch, the padding and the query rule) is only known at the first real call.
FIRST_LAUNCH = (
    "oscar_hf: the first prefill and the first decode step of this process compile their Triton kernels (once per "
    "process and kernel variant; Triton keeps them in its on-disk cache): expect a few seconds more before the first "
    "token. A server can warm up with one short generate() of the same batch and padding before its first request."
)


def announce_first_launch() -> None:
    logger.warning_once(FIRST_LAUNCH)


@triton.jit
def fwht_rows(x, ROWS: tl.constexpr, D: tl.constexpr, LOG2_D: tl.constexpr):
    """Normalized Walsh-Hadamard transform of each row of an fp32 [ROWS, D] tile (x H), butterflies in registers.

    Same pairing and order as `oscar_hf.reference.hadamard_transform`: at stride h, (i, i + h) -> (a + b, a - b).
    """
    for i in tl.static_range(LOG2_D):
        y = tl.permute(tl.reshape(x, (ROWS, D // (2 << i), 2, 1 << i)), (0, 1, 3, 2))
        a, b = tl.split(y)
        x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, D))
    return x * (D**-0.5)


# Reductions through tl.reduce rather than tl.max/tl.sum: those are @triton.jit functions of Triton itself, decorated
# once when Triton is imported, so they would stay compiled-mode functions when Triton was imported before
# TRITON_INTERPRET was set (as under a test suite that imports transformers first); the kernels here are re-decorated
# by re-importing this module. The combine functions are Triton's own (the ones tl.sum/tl.max/tl.min reduce with):
# Triton's interpreter recognises those and reduces in numpy, but calls any other one element by element in Python,
# orders of magnitude slower.
add, maximum, minimum = tl.standard._sum_combine, tl.standard._elementwise_max, tl.standard._elementwise_min
