"""benchmarks/plot_speed.py draws a generate record: rows with and without `run`/`model`, out-of-memory rows, and
several runs of one measurement (the last one in the record is drawn)."""

import importlib
import json

import pytest


@pytest.fixture(scope="module")
def plot_speed():
    pytest.importorskip("matplotlib")
    return importlib.import_module("plot_speed")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)


ROWS = [
    {"batch": 1, "context": 4096, "cache": "dynamic", "compiled": False, "step_ms": 30.0},
    {"batch": 1, "context": 32768, "cache": "dynamic", "compiled": False, "step_ms": 60.0},
    {"batch": 1, "context": 32768, "cache": "oscar", "compiled": True, "step_ms": 12.0, "run": "a", "model": "llama"},
    {"batch": 1, "context": 32768, "cache": "oscar", "compiled": True, "step_ms": 10.0, "run": "b", "model": "llama"},
    {"batch": 8, "context": 32768, "cache": "static", "compiled": True, "error": "out of memory: ..."},
    {"batch": 8, "context": 32768, "cache": "quantized-quanto-int2", "compiled": False, "step_ms": 90.0, "run": "b"},
]


def test_the_last_run_of_a_measurement_is_drawn(plot_speed):
    rows = plot_speed.latest_rows(ROWS)
    assert rows[("llama", 1, 32768, "oscar (compiled)")]["run"] == "b"
    assert rows[(None, 1, 32768, "dynamic")]["step_ms"] == 60.0
    assert len(rows) == 5


def test_a_record_becomes_a_png_next_to_it(plot_speed, tmp_path):
    record = tmp_path / "generate_test-gpu.json"
    record.write_text(json.dumps({"device": "Test GPU", "rows": ROWS}))
    out = plot_speed.plot_record(record)
    assert out == tmp_path / "generate_test-gpu.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
