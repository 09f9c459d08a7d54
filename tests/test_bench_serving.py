"""benchmarks/bench_serving.py on the CPU with a tiny model (`--quick`): a row per cache naming its run, with every
measured field, and the 2-bit pool's ratios over bf16's. (Its timings need a GPU; they are records, not tests.)"""

import importlib
import json

import pytest

MEASURED = ("pool_tokens", "peak_concurrent", "output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "peak_gib")


@pytest.fixture(scope="module")
def serving():
    return importlib.import_module("bench_serving")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)


def test_quick_run_records_both_pools(serving, tmp_path):
    """The default caches (bf16 and the 2-bit pool) and `oscar-gluon` (the 2-bit pool's row, run with the Gluon kernel
    reading its pages where it applies: not on a CPU), rows of one run with their ratios."""
    args = ["--quick", "--model", "tiny-llama", "--device", "cpu", "--num-blocks", "64", "--out", str(tmp_path)]
    path = serving.main([*args, "--caches", "bf16", "oscar", "oscar-gluon"])
    assert path == tmp_path / "serving_cpu.json"
    record = json.loads(path.read_text())
    [(run, header)] = record["runs"].items()
    assert record["benchmark"] == "serving" and header["device"] == "cpu" and header["commit"] is not None
    assert header["requests"] == 8 and header["cache_config"] == {"bits": 2} and "versions" in header
    assert header["copy_bandwidth"]["GBps"] > 0
    assert [(row["cache"], row["variant"]) for row in record["rows"]] == [
        ("bf16", "bf16"),
        ("oscar", "oscar"),
        ("oscar", "oscar-gluon"),
    ]
    for row in record["rows"]:
        assert row["run"] == run and "error" not in row, row
        assert all(field in row for field in (*MEASURED, "roof_ms", "roof_fraction")), row
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] and 1 <= row["peak_concurrent"] <= 8
        assert row["decode_steps"] >= serving.QUICK["new_tokens"] - 1  # at least the last request's own steps
        assert row["roof_ms"] > 0 and row["roof_fraction"] > 0  # the CPU's own copy bandwidth (records.py)
        assert 0 < row["prompt_step_ms"] <= 1000 * row["prompt_steps_s"] < 1000 * row["wall_s"]
        assert 0 <= row["setup_s"] < row["wall_s"] and row["profile"] is None
    rows = {row["variant"]: row for row in record["rows"]}
    assert [(r["oscar"], r["baseline"]) for r in record["ratios"]] == [("oscar", "bf16"), ("oscar-gluon", "bf16")]
    ratio = record["ratios"][0]
    assert (
        ratio["run"] == run and ratio["pool_tokens_ratio"] == rows["oscar"]["pool_tokens"] / rows["bf16"]["pool_tokens"]
    )


def test_each_row_runs_its_warmup_first(serving, tmp_path, monkeypatch):
    """`--warmup N`: before each timed row, the set's first N requests through the same cache with 2 new tokens, its
    measurements dropped; the record names N."""
    calls = []
    run_cache = serving.run_cache
    monkeypatch.setattr(
        serving,
        "run_cache",
        lambda model, cache, prompts, args, *rest: (
            calls.append((cache, len(prompts), args.new_tokens)) or run_cache(model, cache, prompts, args, *rest)
        ),
    )
    args = ["--quick", "--model", "tiny-llama", "--device", "cpu", "--num-blocks", "64", "--out", str(tmp_path)]
    record = json.loads(serving.main([*args, "--caches", "bf16", "oscar", "--warmup", "2"]).read_text())
    new = serving.QUICK["new_tokens"]
    assert calls == [("bf16", 2, 2), ("bf16", 8, new), ("oscar", 2, 2), ("oscar", 8, new)]
    assert [header["warmup"] for header in record["runs"].values()] == [2]
    assert [row["decode_steps"] >= new - 1 for row in record["rows"]] == [True, True]  # the timed runs' rows


def test_profiles_prompt_steps(serving, tmp_path):
    """`--profile-kind prompt`: that many steps with prompt tokens under the profiler, after PROFILE_AFTER of them,
    none of them timed (small batches: a request set of many prompt steps)."""
    args = ["--model", "tiny-llama", "--device", "cpu", "--num-blocks", "64", "--caches", "oscar", "--requests", "2"]
    args += ["--min-prompt", "300", "--max-prompt", "300", "--new-tokens", "1", "--max-batch-tokens", "128"]
    args += ["--profile-steps", "2", "--profile-kind", "prompt", "--out", str(tmp_path)]
    [row] = json.loads(serving.main(args).read_text())["rows"]
    assert row["profile"]["steps"] == 2 and row["profile"]["wall_ms"] > 0, row
    assert row["steps"] - row["decode_steps"] >= serving.PROFILE_AFTER + 2  # the prompt steps, profiled ones too


def test_request_set_is_seeded(serving):
    first = serving.request_set(5, 10, 20, vocab=50, seed=3)
    assert first == serving.request_set(5, 10, 20, vocab=50, seed=3) != serving.request_set(5, 10, 20, 50, seed=4)
    assert all(10 <= len(p) <= 20 and max(p) < 50 for p in first)


def test_the_paged_kernel_rows_set_gluon_pages_for_themselves(serving):
    """`paged_kernel`: `decode_paged.GLUON_PAGES` on while an `oscar-gluon` row runs, off while an `oscar-triton` row
    runs, the library's default for the others, undone afterwards."""
    default = serving.decode_paged.GLUON_PAGES
    with serving.paged_kernel("oscar-gluon"):
        assert serving.decode_paged.GLUON_PAGES is True
    with serving.paged_kernel("oscar-triton"):
        assert serving.decode_paged.GLUON_PAGES is False
    with serving.paged_kernel("oscar"):
        assert serving.decode_paged.GLUON_PAGES is default
    assert serving.decode_paged.GLUON_PAGES is default


def test_step_times_run_from_the_previous_steps_end(serving):
    """`StepClock.finish`: a step's time is from the end of the previous step's computation (the first step's from
    when it began), so the host's time between steps counts; a profiled step (synchronised) and the one after it are
    not timed."""
    clock = serving.StepClock(serving.torch.device("cpu"))
    clock.first_mark = 2.0
    ends, profiled = (3.0, 3.5, 5.0, 5.25, 7.0), (False, False, True, False, False)
    clock.steps = [serving.Step(True, 0, 1, end, flag) for end, flag in zip(ends, profiled)]
    clock.finish()
    assert [step.seconds for step in clock.steps] == [1.0, 0.5, None, None, 1.75]
