"""benchmarks/count_sass.py: the Gluon kernel, over the cache's blocks and over the pool's pages, compiles for sm_90 on
a CPU (Gluon has no interpreter: this is the CPU's only check that its source lowers), and the paged loop costs about
what the cache's does. Each compile runs in its own process: Triton's interpreter, which the other tests run on a CPU,
patches Triton's language objects in the process that used it."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from oscar_hf.kernels import decode_attention

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "count_sass.py"


def _loop(*flags: str) -> tuple[int, str]:
    """count_sass.py's report with `flags`: the loop's instructions per step and warp, and the resource usage line."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, env=env, check=True)
    return int(re.search(r"(\d+) instructions per step", out.stdout).group(1)), out.stdout


@pytest.mark.slow
@pytest.mark.skipif(decode_attention.decode_gluon is None, reason="Triton predates the Gluon kernel")
def test_the_gluon_kernel_compiles_over_blocks_and_pages():
    (blocks, report), (pages, paged_report) = _loop("--gluon"), _loop("--paged")
    for text in (report, paged_report):
        assert "LOCAL:0" in text and "HMMA" in text, text  # no spills; the tensor-core loop
    assert blocks <= pages <= 1.05 * blocks, (blocks, pages)  # the page lookup adds a few instructions
