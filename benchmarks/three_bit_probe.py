"""Issue 66, step 1: do 3-bit keys (and values) move the long-prompt Pareto front? The measurement made before width 3
was built, rerunnable now that it is (`SUPPORTED_WIDTHS` holds 3: the config, the portable backend and the kernels
take it).

Runs long_prompt_ppl.py's protocol into its own records (benchmarks/results/three_bit_probe_<model>.json, the runs
layout of long_prompt_<model>.json) with the probe's methods added to `METHODS`: the 3-bit fixed configs
(`oscar-k3v2-sinks4` and `oscar-k3v3-sinks4` are `METHODS`' own) and the rows named `...-w234`, bits="auto" choosing
among widths (2, 3, 4) (`auto_widths`; start chain K2V2, K3V2, K3V3, K4V3, K4V4), beside their `oscar-auto-...`
twins, which choose among the default (2, 4).

    python benchmarks/three_bit_probe.py --models qwen2.5-0.5b --docs 2
"""

from __future__ import annotations

import operator
import sys

import long_prompt_ppl

from oscar_hf.methods import METHODS

PROBE_METHODS = {
    "oscar-k4v3-sinks4": ("oscar", {"key_bits": 4, "value_bits": 3, "sink_tokens": 4}),
    **{
        f"oscar-auto-{budget}-sinks4-w234": (
            "oscar",
            {"bits": "auto", "avg_bits": budget, "auto_widths": (2, 3, 4), "sink_tokens": 4},
        )
        for budget in (3.2, 3.4, 3.6, 3.7, 3.9)  # 3.7: K3V2 and a bit
    },
}


def install(setattr=setattr, setitem=operator.setitem) -> None:
    """Add the probe's methods to `METHODS` and send long_prompt_ppl.py's rows to the probe's records. `setattr`,
    `setitem`: how to set each attribute and method (a test passes pytest's `monkeypatch`'s, which undo them)."""
    for name, method in PROBE_METHODS.items():
        setitem(METHODS, name, method)
    setattr(long_prompt_ppl, "RECORD", "three_bit_probe_{}.json")


if __name__ == "__main__":
    install()
    sys.exit(long_prompt_ppl.main())
