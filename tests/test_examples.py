"""The examples run: the README's quickstart, and the notebook (executed by a Jupyter kernel, as a reader would),
whose stored outputs are what a reader on a code host sees."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NOTEBOOK = EXAMPLES / "why_oscar_works.ipynb"


@pytest.mark.slow
def test_quickstart_runs_and_both_caches_answer(smollm2):  # smollm2: the model is fetched and converted once
    result = subprocess.run(
        [sys.executable, EXAMPLES / "quickstart.py", "--repeats", "12", "--max-new-tokens", "6"],
        capture_output=True,
        text=True,
        check=True,
    )
    answers = [line for line in result.stdout.splitlines() if line.strip().startswith("output:")]
    assert len(answers) == 2 and all("68217" in line for line in answers), result.stdout
    assert "vs the model's dtype" in result.stdout and "the quantized region alone" in result.stdout


def test_notebook_is_stored_with_its_outputs():
    """Every code cell ran, in order, without an error, and the figures are there; the file stays small."""
    notebook = json.loads(NOTEBOOK.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert [cell["execution_count"] for cell in code] == list(range(1, len(code) + 1))
    assert all(cell["outputs"] for cell in code)
    outputs = [output for cell in code for output in cell["outputs"]]
    assert not [output for output in outputs if output["output_type"] == "error"]
    assert sum("image/png" in output.get("data", {}) for output in outputs) == 2
    assert NOTEBOOK.stat().st_size < 300_000


@pytest.mark.slow
def test_notebook_runs_in_a_kernel(smollm2):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    notebook.cells.append(nbformat.v4.new_code_cell("import json\nprint(json.dumps(rows))"))
    nbclient.NotebookClient(notebook, timeout=1200, resources={"metadata": {"path": str(EXAMPLES)}}).execute()
    errors = {name: errors for name, *errors in json.loads(notebook.cells[-1].outputs[0]["text"])}
    # Sanity of what the notebook shows, true on any data: every error is finite and positive, and 4 bits beat
    # every 2-bit method on keys, values and attention outputs.
    four_bit = errors.pop("OScaR 4-bit")
    for name, two_bit in errors.items():
        assert all(0 < f < t < 1 for f, t in zip(four_bit, two_bit)), (name, two_bit, four_bit)
