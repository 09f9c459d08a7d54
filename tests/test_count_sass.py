"""benchmarks/count_sass.py: the Gluon kernel, over the cache's blocks and over the pool's pages, compiles for sm_90 on
a CPU (Gluon has no interpreter: this is the CPU's only check that its source lowers), and the paged loop costs about
what the cache's does."""

import count_sass  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
import pytest
import torch
from oscar_hf.kernels import decode_attention
from oscar_hf.kernels.decode_tuning import default_tuning


@pytest.mark.slow
@pytest.mark.skipif(decode_attention.decode_gluon is None, reason="Triton predates the Gluon kernel")
def test_the_gluon_kernel_compiles_over_blocks_and_pages():
    tuning = default_tuning(128, 4, torch.float16)
    loops = {}
    for paged in (False, True):
        kernel = count_sass.compile_kernel(tuning, 4, 128, 90, gluon=True, paged=paged)
        body, opcodes, usage = count_sass.loop_report(kernel)
        assert "LOCAL:0" in usage, usage  # no spills
        assert opcodes["HMMA"] > 0 and opcodes["LDGSTS"] > 0  # the tensor-core loop, fed by cp.async copies
        loops[paged] = len(body)
    assert loops[False] <= loops[True] <= 1.05 * loops[False], loops  # the page lookup adds a few instructions
