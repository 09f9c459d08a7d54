"""Issue 66, step 1: do 3-bit keys (and values) move the long-prompt Pareto front? A measurement before building.

Width 3 exists only in the portable backend here (the layout's bit-plane packing in plain PyTorch; no kernel unpacks
it), so this script adds 3 to the widths for the methods that need it while they run (`WIDTHS3`), on the CPU, through
long_prompt_ppl.py's protocol, into its own records (benchmarks/results/three_bit_probe_<model>.json, the runs layout of
long_prompt_<model>.json). Rows named `...-w234` are bits="auto" with the candidate widths (2, 3, 4)
(its start chain then K2V2, K3V2, K3V3, K4V3, K4V4); the others run with today's widths (2, 4).

    python benchmarks/three_bit_probe.py --models qwen2.5-0.5b --docs 2
"""

from __future__ import annotations

import contextlib
import operator
import sys

import long_prompt_ppl

from oscar_hf import config as config_module
from oscar_hf import layer_widths
from oscar_hf.cache import layer_bits
from oscar_hf.methods import METHODS

PROBE_METHODS = {
    "oscar-k3v2-sinks4": ("oscar", {"key_bits": 3, "value_bits": 2, "sink_tokens": 4}),
    "oscar-k3v3-sinks4": ("oscar", {"key_bits": 3, "value_bits": 3, "sink_tokens": 4}),
    "oscar-k4v3-sinks4": ("oscar", {"key_bits": 4, "value_bits": 3, "sink_tokens": 4}),
    "oscar-auto-3.2-sinks4-w234": ("oscar", {"bits": "auto", "avg_bits": 3.2, "sink_tokens": 4}),
    "oscar-auto-3.4-sinks4-w234": ("oscar", {"bits": "auto", "avg_bits": 3.4, "sink_tokens": 4}),
    "oscar-auto-3.6-sinks4-w234": ("oscar", {"bits": "auto", "avg_bits": 3.6, "sink_tokens": 4}),
    "oscar-auto-3.7-sinks4-w234": ("oscar", {"bits": "auto", "avg_bits": 3.7, "sink_tokens": 4}),  # K3V2 and a bit
    "oscar-auto-3.9-sinks4-w234": ("oscar", {"bits": "auto", "avg_bits": 3.9, "sink_tokens": 4}),
    "oscar-auto-3.6-sinks4": ("oscar", {"bits": "auto", "avg_bits": 3.6, "sink_tokens": 4}),
}
WIDTHS3 = {name for name, (_, options) in PROBE_METHODS.items() if name.endswith("-w234") or 3 in options.values()}
# The chooser's modules see (2, 3, 4) only while a `-w234` row runs; the config accepts width 3 throughout (`install`).
CHOOSER_MODULES = (layer_widths, layer_bits)


@contextlib.contextmanager
def widths(supported: tuple[int, ...]):
    """bits="auto" chooses from `supported` while active."""
    saved = [m.SUPPORTED_WIDTHS for m in CHOOSER_MODULES]
    for m in CHOOSER_MODULES:
        m.SUPPORTED_WIDTHS = supported
    try:
        yield
    finally:
        for m, s in zip(CHOOSER_MODULES, saved):
            m.SUPPORTED_WIDTHS = s


def install(setattr=setattr, setitem=operator.setitem) -> None:
    """Add the probe's methods to `METHODS` and width 3 to what long_prompt_ppl.py runs: the config accepts it (a
    row's bits are counted outside its documents' runs) and each document of a row runs under its candidate widths.
    `setattr`, `setitem`: how to set each attribute and method (a test passes pytest's `monkeypatch`'s, which undo
    them)."""
    original = long_prompt_ppl.document_nll

    def document_nll(model, method, ids, prompt, chunk):
        with widths((2, 3, 4) if method in WIDTHS3 else (2, 4)):
            return original(model, method, ids, prompt, chunk)

    for name, method in PROBE_METHODS.items():
        setitem(METHODS, name, method)
    setattr(config_module, "SUPPORTED_WIDTHS", (2, 3, 4))
    setattr(long_prompt_ppl, "document_nll", document_nll)
    setattr(long_prompt_ppl, "RECORD", "three_bit_probe_{}.json")


if __name__ == "__main__":
    install()
    sys.exit(long_prompt_ppl.main())
