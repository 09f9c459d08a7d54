"""The examples run: the README's quickstart, and every code cell of the notebook, in order."""

import json
import subprocess
import sys
from pathlib import Path

import matplotlib

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_quickstart_runs_and_both_caches_answer(smollm2):  # smollm2: the model is installed and converted once
    result = subprocess.run(
        [sys.executable, EXAMPLES / "quickstart.py", "--repeats", "12", "--max-new-tokens", "6"],
        capture_output=True,
        text=True,
        check=True,
    )
    answers = [line for line in result.stdout.splitlines() if line.strip().startswith("output:")]
    assert len(answers) == 2 and all("68217" in line for line in answers), result.stdout
    assert "vs the model's dtype" in result.stdout and "the quantized region alone" in result.stdout


def test_notebook_code_cells_run(smollm2, monkeypatch):
    matplotlib.use("Agg")  # no display: plt.show() is a no-op
    notebook = json.loads((EXAMPLES / "why_oscar_works.ipynb").read_text())
    namespace: dict = {}
    for cell in notebook["cells"]:
        if cell["cell_type"] == "code":
            exec(compile("".join(cell["source"]), "why_oscar_works.ipynb", "exec"), namespace)  # noqa: S102
    errors = {name: errors for name, *errors in namespace["rows"]}
    # Sanity of what the notebook shows, true on any data: every error is finite and positive, and 4 bits beat
    # every 2-bit method on keys, values and attention outputs.
    four_bit = errors.pop("OScaR 4-bit")
    for name, two_bit in errors.items():
        assert all(0 < f < t < 1 for f, t in zip(four_bit, two_bit)), (name, two_bit, four_bit)
