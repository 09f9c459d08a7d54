"""examples/multimodal_token_norms.ipynb runs, and shows what it says: token scaling makes the 2-bit key codes blind
to a norm gap, while without it the text tokens sharing groups with large-norm tokens lose precision."""

import json
from pathlib import Path

import matplotlib
import pytest
import torch

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "multimodal_token_norms.ipynb"


@pytest.mark.slow  # loads SmolLM2 (fetched and converted on first use), as the README's notebook tests say
def test_multimodal_notebook_code_cells_run(smollm2):  # smollm2: the model is installed and converted once
    matplotlib.use("Agg")  # no display: plt.show() is a no-op
    namespace: dict = {}
    for cell in json.loads(NOTEBOOK.read_text())["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), NOTEBOOK.name, "exec"), namespace)  # noqa: S102
    errors, codes, factors = namespace["errors"], namespace["codes"], namespace["factors"]
    for name in ("token scaling only", "OScaR (rotation + scaling)"):  # dividing by the norm cancels any factor
        assert all(torch.equal(codes[name, s], codes[name, 1]) for s in factors), name
    kivi = [errors["KIVI (no rotation, no scaling)", s]["text beside image"] for s in factors]
    assert kivi == sorted(kivi) and kivi[-1] > 10 * kivi[0]
