"""benchmarks/run_accuracy.py: its record is shared by processes that run plans for one model side by side."""

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_two_processes_adding_entries_keep_both(tmp_path, monkeypatch):
    """Each process loads the record when it starts and saves after every entry: a save merges into what is on disk,
    so neither loses the other's entries (each saved whole: no half-written file left behind)."""
    spec = importlib.util.spec_from_file_location("run_accuracy", ROOT / "benchmarks" / "run_accuracy.py")
    run_accuracy = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_accuracy)
    monkeypatch.setattr(run_accuracy, "RESULTS", tmp_path)
    first, second = run_accuracy.load_results("tiny"), run_accuracy.load_results("tiny")
    first["entries"]["oscar-k4v2|oscar_niah_2k"] = {"acc": 0.9, "n": 30}
    run_accuracy.save_results(first)
    second["entries"]["oscar-auto-3.6|oscar_pg_ppl_1k"] = {"word_perplexity": 58.7, "n": 20}
    second["kv_decomposition"] = {"oscar_niah_2k": {"key": 0.1}}
    run_accuracy.save_results(second)
    first["entries"]["oscar-k4v2|oscar_passkey_2k"] = {"acc": 0.8, "n": 30}
    run_accuracy.save_results(first)
    record = json.loads((tmp_path / "accuracy_tiny.json").read_text())
    assert sorted(record["entries"]) == [
        "oscar-auto-3.6|oscar_pg_ppl_1k", "oscar-k4v2|oscar_niah_2k", "oscar-k4v2|oscar_passkey_2k",
    ]  # fmt: skip
    assert record["kv_decomposition"] == {"oscar_niah_2k": {"key": 0.1}}
    assert [p.name for p in tmp_path.iterdir()] == ["accuracy_tiny.json"]
