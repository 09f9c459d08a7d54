"""benchmarks/bench_throughput.py: its batch search against a simulated GPU memory, and the script on the CPU with a
tiny model through its real code path (the record's layout, a row per cache and context naming its run, failures and
the time budget kept as rows). (Its timings need a GPU; they are benchmark records, not tests.)"""

import importlib
import json

import pytest
import torch

FIELDS = ("run", "model", "context", "cache", "variant", "compiled", "prefill_chunk_size", "max_batch")
MEASURED = ("tokens_per_s", "step_ms", "prefill_s", "peak_gib")
ROOF = ("cache_bytes", "cache_bf16_bytes", "roof_ms", "roof_fraction", "bf16_roof_ms")


@pytest.fixture(scope="module")
def throughput():
    return importlib.import_module("bench_throughput")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)


class FakeGPU:
    """Peak memory fixed + per_sequence x batch; a timed run needs `timed_extra` more (CUDA graphs, compile)."""

    def __init__(self, capacity, fixed=16.0, per_sequence=4.0, timed_extra=0.0):
        self.capacity, self.fixed, self.per_sequence, self.timed_extra = capacity, fixed, per_sequence, timed_extra
        self.calls = []

    def _peak(self, batch, extra):
        peak = self.fixed + self.per_sequence * batch + extra
        if peak > self.capacity:
            raise torch.OutOfMemoryError(f"B={batch}")
        return peak

    def probe(self, batch):
        self.calls.append(("probe", batch))
        return {"peak_gib": self._peak(batch, 0.0)}

    def timed(self, batch):
        self.calls.append(("timed", batch))
        return {"peak_gib": self._peak(batch, self.timed_extra), "batch": batch}


def test_the_memory_model_predicts_the_largest_batch(throughput):
    gpu = FakeGPU(capacity=80.0)
    batch, result, search = throughput.largest_batch(gpu.probe, gpu.timed, 72.0, max_batch=64, tries=3)
    # (72 - 16) / 4 = 14 sequences within the capacity the search may fill; one timed run, no OOM
    assert (batch, result["batch"]) == (14, 14) and gpu.calls == [("probe", 1), ("probe", 2), ("timed", 14)]
    assert (search.fixed_gib, search.per_sequence_gib, search.predicted_batch) == (16.0, 4.0, 14)
    assert search.capped is False and search.oom_batches == []


def test_a_timed_run_out_of_memory_bisects_to_the_largest_batch_that_fits(throughput):
    gpu = FakeGPU(capacity=80.0, timed_extra=10.0)  # compiled runs need more than the eager probes showed
    batch, _, search = throughput.largest_batch(gpu.probe, gpu.timed, 80.0, max_batch=64, tries=6)
    # predicted (80 - 16) / 4 = 16: OOM (90 GiB); then 0.85 x 16 -> 13 fits (78 GiB) and 14 does not (82): adjacent,
    # 13 is the largest batch that fits
    assert batch == 13 and search.oom_batches == [16, 14]
    assert gpu.calls[2:] == [("timed", 16), ("timed", 13), ("timed", 14)]
    gpu = FakeGPU(capacity=80.0, timed_extra=22.0)  # steps down until one fits (10 at 78 GiB), then bisects
    batch, _, search = throughput.largest_batch(gpu.probe, gpu.timed, 80.0, max_batch=64, tries=6)
    assert batch == 10 and search.oom_batches == [16, 13, 11]
    assert gpu.calls[2:] == [("timed", 16), ("timed", 13), ("timed", 11), ("timed", 9), ("timed", 10)]
    gpu = FakeGPU(capacity=80.0, timed_extra=6.0)  # out of tries: the largest batch that ran (14; 15 never tried)
    batch, _, search = throughput.largest_batch(gpu.probe, gpu.timed, 80.0, max_batch=64, tries=3)
    assert batch == 14 and search.oom_batches == [16] and gpu.calls[2:] == [("timed", 16), ("timed", 13), ("timed", 14)]
    gpu = FakeGPU(capacity=80.0, timed_extra=50.0)  # only B=2 fits timed: the last try takes the batch known to fit
    batch, _, search = throughput.largest_batch(gpu.probe, gpu.timed, 80.0, max_batch=64, tries=3)
    assert batch == 2 and search.oom_batches == [16, 13]


def test_the_time_budget_stops_a_search_between_timed_runs(throughput):
    """Past `--budget-s` (`out_of_time`) no further timed run starts: the largest batch that ran so far stands."""
    gpu = FakeGPU(capacity=80.0, timed_extra=10.0)
    budget = iter([False, True])  # time left before the second timed run, none before the third
    batch, result, search = throughput.largest_batch(
        gpu.probe, gpu.timed, 80.0, max_batch=64, tries=6, out_of_time=lambda: next(budget)
    )
    assert batch == 13 and result["batch"] == 13 and search.out_of_time and search.oom_batches == [16]
    assert gpu.calls[2:] == [("timed", 16), ("timed", 13)]


def test_the_cap_and_what_does_not_fit(throughput):
    gpu = FakeGPU(capacity=1000.0)
    batch, _, search = throughput.largest_batch(gpu.probe, gpu.timed, 1000.0, max_batch=8, tries=3)
    assert batch == 8 and search.capped is True
    gpu = FakeGPU(capacity=22.0)  # B=1 fits (20 GiB), B=2 does not (24)
    batch, _, search = throughput.largest_batch(gpu.probe, gpu.timed, 22.0, max_batch=8, tries=3)
    assert batch == 1 and search.oom_batches == [2] and gpu.calls[-1] == ("timed", 1)
    gpu = FakeGPU(capacity=10.0)  # not even B=1
    batch, result, search = throughput.largest_batch(gpu.probe, gpu.timed, 10.0, max_batch=8, tries=3)
    assert (batch, result, search.oom_batches) == (0, None, [1]) and gpu.calls == [("probe", 1)]


def test_every_cache_gets_a_row_of_one_run(throughput, tmp_path):
    args = ["--model", "tiny-llama", "--device", "cpu", "--contexts", "256", "--max-batch", "2", "--new-tokens", "4"]
    path = throughput.main([*args, "--prefill-chunk-size", "64", "--out", str(tmp_path)])
    assert path == tmp_path / "throughput_cpu.json"
    record = json.loads(path.read_text())
    [(run, header)] = record["runs"].items()
    assert header["device"] == "cpu" and header["model"] == "tiny-llama" and header["capacity_gib"] is None
    assert [row["variant"] for row in record["rows"]] == list(throughput.CACHES)
    for row in record["rows"]:
        assert all(field in row for field in FIELDS + MEASURED + ROOF), row
        assert row["run"] == run and row["context"] == 256 and "error" not in row, row
        # no memory to measure on the CPU: the search takes --max-batch
        assert row["max_batch"] == 2 and row["capped"] is True and row["oom"] is False
        assert row["tokens_per_s"] == pytest.approx(2000 / row["step_ms"]) and row["prefill_s"] > 0
        assert row["prefill_chunk_size"] == (None if row["variant"] == "dynamic" else 64)
        # the byte roof of the step at the batch found (bytes over GB/s: ms)
        read = header["weight_bytes"] + row["cache_bytes"]
        assert row["roof_ms"] == pytest.approx(read / (header["copy_bandwidth"]["GBps"] * 1e6))
        assert row["roof_fraction"] == pytest.approx(row["roof_ms"] / row["step_ms"])
        if row["cache"] == "oscar":
            assert row["cache_bytes"] < row["cache_bf16_bytes"]
        else:  # bf16 caches
            assert row["cache_bytes"] == row["cache_bf16_bytes"] and row["roof_ms"] == row["bf16_roof_ms"]
    assert {(r["oscar"], r["baseline"]) for r in record["ratios"]} == {
        ("oscar-compiled", "static-compiled"),
        ("oscar-compiled", "dynamic"),
    }
    rows = {row["variant"]: row for row in record["rows"]}
    for ratio in record["ratios"]:
        oscar, base = rows[ratio["oscar"]], rows[ratio["baseline"]]
        assert ratio["run"] == run and ratio["max_batch_ratio"] == 1.0
        assert ratio["tokens_per_s_ratio"] == oscar["tokens_per_s"] / base["tokens_per_s"]
        assert ratio["prefill_ratio"] == oscar["prefill_s"] / base["prefill_s"]


def test_a_failing_cache_and_the_time_budget_are_rows(throughput, tmp_path, monkeypatch):
    """One invocation always leaves a record: a cache that crashes is a row with its error, and jobs after the time
    budget are rows saying so."""

    def fake_generate(model, batch, context, new_tokens, options):
        if (
            options.get("prefill_chunk_size")
            and "compile_config" in options
            and options["cache_implementation"] == "oscar"
        ):
            raise RuntimeError("torch._dynamo.exc.Unsupported: can't trace functools.wraps\n(traceback)")
        measured = {"step_ms": 2.0, "prefill_s": 1.0, "peak_gib": None, "tokens_per_s": batch * 500.0}
        return {**measured, "cache_bytes": 1 << 20, "cache_bf16_bytes": 1 << 22}

    monkeypatch.setattr(throughput.bench, "timed_generate", fake_generate)
    args = ["--model", "tiny-llama", "--device", "cpu", "--contexts", "256", "--max-batch", "4", "--out", str(tmp_path)]
    record = json.loads(throughput.main(args).read_text())
    rows = {row["variant"]: row for row in record["rows"]}
    assert rows["oscar-compiled"]["error"] == "RuntimeError: torch._dynamo.exc.Unsupported: can't trace functools.wraps"
    assert rows["oscar-compiled"]["tokens_per_s"] is None and rows["dynamic"]["max_batch"] == 4
    assert record["ratios"] == []

    record = json.loads(throughput.main([*args, "--budget-s", "0", "--contexts", "256", "512"]).read_text())
    late = [row for row in record["rows"] if row["run"] != rows["dynamic"]["run"]]
    assert len(late) == 6 and all(row["skipped"].startswith("time budget") for row in late)
