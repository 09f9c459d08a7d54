"""benchmarks/run_accuracy.py: its record is shared by processes that run plans for one model side by side, and the
tables docs/accuracy.md prints from it."""

import importlib
import json
from pathlib import Path


def _run_accuracy(results: Path, monkeypatch):
    run_accuracy = importlib.import_module("run_accuracy")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
    monkeypatch.setattr(run_accuracy, "RESULTS", results)
    return run_accuracy


def test_two_processes_adding_entries_keep_both(tmp_path, monkeypatch):
    """Each process loads the record when it starts and saves after every entry: a save merges into what is on disk,
    so neither loses the other's entries (each saved whole: no half-written file left behind)."""
    run_accuracy = _run_accuracy(tmp_path, monkeypatch)
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


def test_the_retrieval_cells_table_has_a_row_per_cell_and_leaves_cells_not_run_empty(tmp_path, monkeypatch):
    run_accuracy = _run_accuracy(tmp_path, monkeypatch)
    record = run_accuracy.load_results("tiny")
    record["entries"] = {
        "bf16|oscar_niah_2k": {"acc": 0.9, "n": 30},
        "bf16|oscar_passkey_4k": {"acc": 0.5, "n": 30},
        "oscar-auto-3.2-sinks4|oscar_niah_2k": {"acc": 0.8666, "n": 30},
        "kivi-int2|oscar_pg_ppl_1k": {"word_perplexity": 30.0, "n": 20},
    }
    for key, entry in record["entries"].items():  # what each method measures now (else refused as stale)
        entry["key_rotation"] = run_accuracy.key_rotation(key.split("|")[0])
    run_accuracy.save_results(record)
    assert run_accuracy.retrieval_cells_table("tiny").splitlines() == [
        "| cell | bf16 | oscar-auto-3.2-sinks4 (default) |",
        "|---|---|---|",
        "| niah_2k | 0.90 | 0.87 |",
        "| passkey_4k | 0.50 |  |",
    ]


def test_the_summary_takes_the_head_shape_from_the_record_and_loads_no_model(tmp_path, monkeypatch):
    """`--plot-only` and the end of every run summarise all four records: the stored bits need each model's KV heads
    and head_dim, which the record holds; reading them from the model's config made a summary fetch and convert every
    model it had not loaded (Qwen2.5-1.5B: a 1.1 GB download and a 6 GB float32 conversion)."""
    run_accuracy = _run_accuracy(tmp_path, monkeypatch)

    def no_model(*args, **kwargs):
        raise AssertionError("the summary loaded a model")

    monkeypatch.setattr(run_accuracy, "load_model", no_model)
    monkeypatch.setattr("oscar_hf.offline_models.model_path", no_model)
    record = run_accuracy.load_results("tiny")
    record.update(kv_heads=2, head_dim=128)
    record["entries"] = {
        "bf16|oscar_niah_2k": {"acc": 0.9, "n": 30},
        "oscar-int2|oscar_niah_2k": {"acc": 0.8, "n": 30},
    }
    for key, entry in record["entries"].items():
        entry["key_rotation"] = run_accuracy.key_rotation(key.split("|")[0])
    run_accuracy.save_results(record)
    summary = json.loads(run_accuracy.summarize(["tiny"]).read_text())["tiny"]
    int2 = run_accuracy.METHODS["oscar-int2"][1]
    assert summary["oscar-int2"]["avg_bits"] == round(run_accuracy.avg_bits("oscar-int2", int2, 128, 2), 4)
    assert summary["oscar-int2"]["avg_bits"] != round(run_accuracy.avg_bits("oscar-int2", int2, 64, 3), 4)
    assert summary["oscar-int2"]["retrieval_cells"]["niah_2k"] == {"acc": 0.8, "se": 0.073, "n": 30}
    # effective bits at 2k, 4k and 32k: the exact window's 64.5 tokens at 16 bits on top of the stored bits
    stored, effective = summary["oscar-int2"]["avg_bits"], summary["oscar-int2"]["effective_bits"]
    assert effective == {k: round((stored * (n - 64.5) + 16 * 64.5) / n, 4) for k, n in (("2k", 2048), ("4k", 4096),
                                                                                        ("32k", 32768))}  # fmt: skip
    assert summary["bf16"]["effective_bits"] == {"2k": 16, "4k": 16, "32k": 16}


def test_the_pareto_front_keeps_the_points_nothing_beats_on_both_counts(tmp_path, monkeypatch):
    run_accuracy = _run_accuracy(tmp_path, monkeypatch)
    points = [(3.3, 2.0), (3.4, 2.5), (4.3, 0.5), (4.3, 0.7), (6.3, 6.0), (3.3, 2.0001)]
    assert run_accuracy.pareto_front(points) == [(3.3, 2.0), (4.3, 0.5)]


def test_the_long_prompt_rows_are_the_latest_of_the_latest_protocol_and_plot(tmp_path, monkeypatch):
    """Rows of runs with the latest run's protocol, the latest per method; an older protocol's (other documents) and
    diagnosis rows (`@`) left out, and a later run of diagnosis rows alone (its bf16 reference beside them) decides
    no protocol; accuracy.png drawn from them."""
    run_accuracy = _run_accuracy(tmp_path, monkeypatch)
    protocol = {"prompt": 1536, "scored": 1536, "chunk": 64}
    runs = {"20260101T000000Z-a": {"docs": 2, **protocol}, "20260102T000000Z-b": {"docs": 3, **protocol},
            "20260103T000000Z-c": {"docs": 3, **protocol}, "20260104T000000Z-d": {"docs": 2, **protocol}}  # fmt: skip

    def row(run, method, change):
        bits = {"stored_bits": 4.08, "effective_bits": 4.4, "effective_bits_4k": 4.3}
        return {"run": run, "method": method, "ppl_change_pct": change, "se_pct": 0.2, **bits}

    rows = [
        row("20260101T000000Z-a", "oscar-k4v2", 9.0),
        row("20260102T000000Z-b", "bf16", 0.0),
        row("20260102T000000Z-b", "oscar-k4v2", 0.5),
        row("20260102T000000Z-b", "oscar-auto-3.2-sinks4", 3.0),
        row("20260103T000000Z-c", "oscar-auto-3.2-sinks4", 2.0),
        row("20260103T000000Z-c", "oscar-auto-3.2-sinks4@direct", 1.0),
        row("20260104T000000Z-d", "bf16", 0.0),
        row("20260104T000000Z-d", "oscar-auto-3.2-sinks4@K2V2/0=K4V2", 7.0),
    ]
    (tmp_path / "long_prompt_tiny.json").write_text(json.dumps({"runs": runs, "rows": rows}))
    latest, chosen = run_accuracy.long_prompt_rows("tiny")
    assert latest["docs"] == 3
    assert {m: r["ppl_change_pct"] for m, r in chosen.items()} == {
        "bf16": 0.0, "oscar-k4v2": 0.5, "oscar-auto-3.2-sinks4": 2.0,
    }  # fmt: skip
    assert run_accuracy.plot_front(["tiny"]).stat().st_size > 0
    table = run_accuracy.long_prompt_table(["tiny"]).splitlines()
    assert len(table) == 4 and "bf16" not in "".join(table)  # a row per method against bf16
    assert table[2].startswith("| tiny | oscar-k4v2 |") and table[2].endswith("+0.50 ± 0.20 % | yes |")
