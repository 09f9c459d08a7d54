"""benchmarks/bench_generate.py on the CPU with tiny models, through its real code path: the record's layout (runs,
rows naming their run, ratios within a run), every cache's row, and failures kept as rows. (Its timings need a GPU;
they are benchmark records, not tests.)"""

import importlib
import json

import pytest
import torch

ORACLE_FIELDS = ("run", "model", "batch", "context", "new_tokens", "variant", "cache", "compiled", "oom")
MEASURED = ("step_ms", "prefill_s", "peak_gib")


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("bench_generate")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)


def _quanto_importable() -> bool:
    try:
        importlib.import_module("optimum.quanto")
    except Exception:  # noqa: BLE001  (what bench_generate.quanto_missing treats as missing)
        return False
    return True


@pytest.mark.parametrize("model", ["tiny-llama", pytest.param("tiny-gemma", marks=pytest.mark.slow)])
def test_every_cache_gets_a_row_of_one_run(bench, tmp_path, model):
    args = ["--model", model, "--device", "cpu", "--batches", "2", "--contexts", "256", "--new-tokens", "5"]
    path = bench.main([*args, "--out", str(tmp_path)])
    assert path == tmp_path / "generate_cpu.json"
    record = json.loads(path.read_text())
    [(run, header)] = record["runs"].items()
    assert header["device"] == "cpu" and header["model"] == model and header["new_tokens"] == 5
    assert set(header["versions"]) == {"torch", "transformers", "triton"} and header["commit"] is not None
    rows = {row["variant"]: row for row in record["rows"]}
    assert list(rows) == list(bench.VARIANTS) and len(record["rows"]) == len(bench.VARIANTS)
    for row in record["rows"]:
        assert all(field in row for field in ORACLE_FIELDS + MEASURED), row
        assert row["run"] == run and row["model"] == model and (row["batch"], row["context"]) == (2, 256)
        assert row["oom"] is False, row
    hybrid = model == "tiny-gemma"
    quanto = rows["quantized-quanto-int2"]
    if not _quanto_importable():
        assert "optimum-quanto is not importable" in quanto["skipped"] and quanto["step_ms"] is None
    elif hybrid:  # transformers' QuantizedCache refuses hybrid models: recorded as the row's error
        assert "only full attention" in quanto["error"] and quanto["step_ms"] is None
    if hybrid and bench.oscar_compile_blockers(bench.build_model(model, "cpu")):
        # the compiled row says why OscarCache does not compile instead of timing the eager path again
        assert "not compileable" in rows["oscar-compiled"]["skipped"] and rows["oscar-compiled"]["step_ms"] is None
    measured = [row for row in record["rows"] if row["step_ms"] is not None]
    expected = {"dynamic", "static-compiled", "oscar"}
    if not hybrid:
        expected |= {"oscar-compiled"} | ({"quantized-quanto-int2"} if _quanto_importable() else set())
    assert expected <= {row["variant"] for row in measured}
    for row in measured:
        assert "error" not in row and "skipped" not in row, row
        assert row["step_ms"] > 0 and row["prefill_s"] > 0 and row["peak_gib"] is None  # no allocator stats on CPU
        assert row["tokens_per_s"] == pytest.approx(2000 / row["step_ms"])
        assert row["graphs_compiled"] == 0  # generate compiles on CUDA only
        assert row["steps_timed"] == 2 == len(row["steady_steps_ms"])  # the second half of 4 steps
    # the byte roof: the run's weights and copy bandwidth, each row's cache bytes (bytes over GB/s: ms)
    assert header["weight_bytes"] == bench.records.weight_bytes(bench.build_model(model, "cpu"))
    bytes_per_ms = header["copy_bandwidth"]["GBps"] * 1e6
    for row in measured:
        assert row["roof_ms"] == pytest.approx((header["weight_bytes"] + row["cache_bytes"]) / bytes_per_ms)
        assert row["bf16_roof_ms"] == pytest.approx((header["weight_bytes"] + row["cache_bf16_bytes"]) / bytes_per_ms)
        assert row["roof_fraction"] == pytest.approx(row["roof_ms"] / row["step_ms"])
    if not hybrid:  # DynamicCache holds the prompt and every new token but the last, in bf16; OScaR the same tokens
        c = bench.build_model(model, "cpu").config
        tokens = 256 + 5 - 1
        dynamic_bytes = c.num_hidden_layers * 2 * 2 * c.num_key_value_heads * tokens * c.head_dim * 2  # B = 2, K and V
        assert rows["dynamic"]["cache_bytes"] == rows["dynamic"]["cache_bf16_bytes"] == dynamic_bytes
        for oscar in (row for row in measured if row["cache"] == "oscar"):
            assert oscar["cache_bf16_bytes"] == dynamic_bytes and oscar["cache_bytes"] < dynamic_bytes
            assert oscar["roof_ms"] < oscar["bf16_roof_ms"]
    # ratios: each measured OScaR row over each measured baseline of the same shape, in this run
    oscars = {row["variant"] for row in measured if row["cache"] == "oscar"}
    baselines = {row["variant"] for row in measured if row["cache"] != "oscar"}
    assert {(r["oscar"], r["baseline"]) for r in record["ratios"]} == {(o, b) for o in oscars for b in baselines}
    for ratio in record["ratios"]:
        oscar, base = rows[ratio["oscar"]], rows[ratio["baseline"]]
        assert ratio["run"] == run and (ratio["model"], ratio["batch"], ratio["context"]) == (model, 2, 256)
        assert ratio["step_ratio"] == oscar["step_ms"] / base["step_ms"]
        assert ratio["prefill_ratio"] == oscar["prefill_s"] / base["prefill_s"]
        assert ratio["peak_ratio"] is None

    # a second invocation is a second run: it adds its rows and never touches the first run's rows or ratios
    bench.main([*args, "--variants", "dynamic", "--out", str(tmp_path)])
    again = json.loads(path.read_text())
    [second] = set(again["runs"]) - {run}
    assert again["rows"][: len(record["rows"])] == record["rows"] and again["ratios"] == record["ratios"]
    assert [row["run"] for row in again["rows"][len(record["rows"]) :]] == [second]


def test_prefill_chunk_size_chunks_every_variant_but_the_dynamic_baseline(bench, tmp_path, monkeypatch):
    chunks = []
    original = bench.timed_generate
    monkeypatch.setattr(
        bench, "timed_generate", lambda *a: (chunks.append(a[-1].get("prefill_chunk_size")), original(*a))[1]
    )
    args = ["--model", "tiny-llama", "--device", "cpu", "--batches", "2", "--contexts", "256", "--new-tokens", "4"]
    path = bench.main([*args, "--variants", "dynamic", "oscar", "--prefill-chunk-size", "100", "--out", str(tmp_path)])
    rows = {row["variant"]: row for row in json.loads(path.read_text())["rows"]}
    assert rows["dynamic"]["prefill_chunk_size"] is None and rows["oscar"]["prefill_chunk_size"] == 100
    assert rows["oscar"]["step_ms"] > 0 and rows["oscar"]["prefill_s"] > 0
    assert 100 in chunks  # the timed oscar generate ran chunked (the warm-ups run unchunked)


def test_out_of_memory_and_failures_are_rows(bench, tmp_path, monkeypatch):
    """A row that runs out of memory or fails otherwise is recorded as such and the run goes on."""

    def fake_generate(model, batch, context, new_tokens, options):
        if options["cache_implementation"] == "static":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB.\nmore")
        if options["cache_implementation"] == "oscar" and new_tokens > bench.WARMUP_TOKENS:
            raise RuntimeError("Unsupported: functools.wraps")
        measured = {"step_ms": 2.0, "prefill_s": 1.0, "peak_gib": 3.0, "graphs_compiled": 0}
        return {**measured, "cache_bytes": 1 << 20, "cache_bf16_bytes": 1 << 22}

    monkeypatch.setattr(bench, "timed_generate", fake_generate)
    variants = ["dynamic", "static-compiled", "oscar"]
    args = ["--model", "tiny-llama", "--device", "cpu", "--contexts", "256", "--variants", *variants]
    record = json.loads(bench.main([*args, "--out", str(tmp_path)]).read_text())
    rows = {row["variant"]: row for row in record["rows"]}
    assert len(record["rows"]) == 2 * 3  # --batches 1 4 by default
    assert rows["dynamic"]["step_ms"] == 2.0 and rows["dynamic"]["oom"] is False
    assert rows["static-compiled"]["oom"] is True and rows["static-compiled"]["step_ms"] is None
    assert rows["static-compiled"]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 7.00 GiB."
    assert rows["oscar"]["oom"] is False and rows["oscar"]["error"] == "RuntimeError: Unsupported: functools.wraps"
    assert record["ratios"] == []  # nothing to compare OScaR's failed rows with


def test_a_record_of_another_format_is_refused(bench, tmp_path):
    (tmp_path / "generate_cpu.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a record of runs"):
        bench.main(["--model", "tiny-llama", "--device", "cpu", "--variants", "dynamic", "--out", str(tmp_path)])
