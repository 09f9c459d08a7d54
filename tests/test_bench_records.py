"""benchmarks/records.py: the header every record starts with, the runs layout, and the byte roof's arithmetic (the
bytes a decode step must read, counted from the model and the cache, against hand counts from the shapes). On the CPU
with tiny models; no timing is asserted."""

import importlib
import json
import random
import subprocess

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import QuantizedCache

from oscar_hf import OscarCache, OscarConfig, average_bits, cache_kwargs

records = importlib.import_module("records")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)
bench = importlib.import_module("bench_generate")


def test_the_header_names_the_commit_its_override_and_a_new_run_each_time(monkeypatch):
    records.commit.cache_clear()  # read once per process: cleared to read it again here
    monkeypatch.delenv(records.COMMIT_VARIABLE, raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=records.ROOT, capture_output=True, text=True).stdout
    first, second = records.header("a benchmark", "cpu"), records.header("a benchmark", "cpu")
    assert first["commit"] == (head.strip() or None) and first["run"] != second["run"]
    assert first["benchmark"] == "a benchmark" and first["device"] == "cpu" and first["date"] <= second["date"]
    assert set(first["versions"]) == {"torch", "triton", "transformers"}
    records.commit.cache_clear()
    monkeypatch.setenv(records.COMMIT_VARIABLE, "0123abc")  # the GPU machine's copy of the tree has a stale .git
    assert records.header("a benchmark", "cpu")["commit"] == "0123abc"
    records.commit.cache_clear()


def test_a_run_is_added_to_a_record_of_runs_and_another_format_is_refused(tmp_path):
    path = tmp_path / "x_cpu.json"
    header = records.header("a benchmark", "cpu")
    record = records.start_run(path, header, model="tiny", argv=["--x"])
    assert record["benchmark"] == "a benchmark" and record["rows"] == [] and record["ratios"] == []
    fields = {k: v for k, v in header.items() if k not in ("benchmark", "run")}
    assert record["runs"] == {header["run"]: {**fields, "model": "tiny", "argv": ["--x"]}}
    records.write_record(path, record)
    later = records.header("a benchmark", "cpu")
    again = records.start_run(path, later)
    assert list(again["runs"]) == [header["run"], later["run"]] and again["runs"][header["run"]]["model"] == "tiny"
    path.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a record of runs"):
        records.start_run(path, later)


def test_the_roof_is_the_bytes_read_over_the_copy_bandwidth():
    rng = random.Random(0)
    weights, held, bf16 = rng.randint(1, 10**10), rng.randint(1, 10**9), rng.randint(10**9, 10**10)
    gbps, step_ms = rng.uniform(1000, 5000), rng.uniform(1, 50)
    fields = records.roof(step_ms, weights, held, bf16, {"GBps": gbps})
    assert fields["roof_ms"] == pytest.approx(1e3 * (weights + held) / (gbps * 1e9), rel=1e-12)
    assert fields["bf16_roof_ms"] == pytest.approx(1e3 * (weights + bf16) / (gbps * 1e9), rel=1e-12)
    assert fields["roof_fraction"] == pytest.approx(fields["roof_ms"] / step_ms, rel=1e-12)
    assert records.roof(None, weights, held, bf16, {"GBps": gbps})["roof_fraction"] is None  # a row not measured


def test_the_copy_bandwidth_is_bytes_read_and_written_over_the_median_time():
    measured = records.copy_bandwidth("cpu")
    assert measured["bytes"] == 2 * (1 << 26) and measured["us"] > 0
    assert measured["GBps"] == pytest.approx(measured["bytes"] / measured["us"] / 1e3)


def test_the_weights_a_step_reads_leave_out_an_untied_embedding_table():
    llama = bench.build_model("tiny-llama", "cpu")  # untied: the step gathers rows of the embedding table
    c = llama.config
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = 2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
    per_layer += 2 * c.hidden_size  # the two RMSNorms
    read = c.num_hidden_layers * per_layer + c.hidden_size + c.vocab_size * c.hidden_size  # final norm, the head
    assert records.weight_bytes(llama) == 2 * read  # bf16
    gemma = bench.build_model("tiny-gemma", "cpu")  # tied: the head reads the whole table, counted once
    assert gemma.get_output_embeddings().weight is gemma.get_input_embeddings().weight
    assert records.weight_bytes(gemma) == sum(p.nbytes for p in gemma.parameters())


def _quanto_importable() -> bool:
    try:
        importlib.import_module("optimum.quanto")
    except Exception:  # noqa: BLE001  (what bench_generate.quanto_missing treats as missing)
        return False
    return True


CACHES = ["dynamic", "static", "oscar-int2", "quantized-quanto-int2"]


@pytest.mark.parametrize("name", CACHES)
def test_cache_bytes_count_what_each_cache_holds(name):
    """After a 300-token prompt and 3 decode steps (batch 2, tiny Llama, bf16): the bytes each cache holds against a
    count from the shapes, and the same tokens' bf16 K/V (a Static cache's: its capacity, which its attention reads)."""
    if name == "quantized-quanto-int2" and not _quanto_importable():
        pytest.skip("optimum-quanto is not importable")
    model = bench.build_model("tiny-llama", "cpu")
    c = model.config
    batch, prompt, steps, capacity = 2, 300, 3, 320
    cache = {
        "dynamic": lambda: DynamicCache(config=c),
        "static": lambda: StaticCache(config=c, max_cache_len=capacity),
        "oscar-int2": lambda: OscarCache(c, {"bits": 2, "sink_tokens": 0}),
        "quantized-quanto-int2": lambda: QuantizedCache(backend="quanto", config=c, nbits=2),
    }[name]()
    ids = torch.randint(0, c.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_kwargs(cache))
        for step in range(steps):
            model(ids[:, step : step + 1], **cache_kwargs(cache))
    tokens = prompt + steps
    per_token = c.num_hidden_layers * batch * 2 * c.num_key_value_heads * c.head_dim  # K and V elements
    expected_bf16 = 2 * per_token * (capacity if name == "static" else tokens)
    if name in ("dynamic", "static"):
        expected = expected_bf16
    elif name == "oscar-int2":  # the quantized region at the layout's bits per element, the rest exact (bf16)
        quantized = cache.layers[0].quantized_length
        bits = average_bits(OscarConfig(bits=2, sink_tokens=0), c.head_dim, c.num_key_value_heads)
        expected = per_token * (quantized * bits / 8 + 2 * (tokens - quantized))
    else:  # quanto: 2-bit codes and a bf16 scale and shift per 64 codes; the residual tokens exact
        quantized = cache.layers[0]._quantized_keys.shape[-2]
        expected = per_token * (quantized * (2 / 8 + 2 * 2 / 64) + 2 * (tokens - quantized))
    assert records.cache_bytes(cache) == (expected, expected_bf16)
