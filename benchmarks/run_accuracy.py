"""Side-by-side accuracy of KV cache methods on real offline models, through lm-eval with the oscar-hf wrapper.

    python eval_configs/build_data.py                     # once: the offline tasks
    python benchmarks/run_accuracy.py                     # the default plan below (hours on 2 CPU cores)
    python benchmarks/run_accuracy.py --models smollm2-135m --tasks oscar_passkey_1k --limit 4
    python benchmarks/run_accuracy.py --plot-only         # redraw the plots and print the tables from the JSONs
    python benchmarks/run_accuracy.py --device cuda --dtype bfloat16 --threads 16   # on a GPU

Results go to benchmarks/results/accuracy_<model>.json, one entry per (method, task), written as soon as it is
measured: a rerun skips what is there, so a crash loses one entry. All methods of a model share one exact prefill
per context (see `PrefillStore`), which is what makes several methods affordable on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
from pathlib import Path

import lm_eval
import matplotlib
import records
import torch
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
from tqdm import tqdm

from oscar_hf import OscarConfig, cache_kwargs
from oscar_hf.integrations.lm_eval import OscarHFLM, PrefillStore, avg_bits, effective_avg_bits, kv_heads_and_dim
from oscar_hf.methods import DEFAULT_METHOD, METHODS
from oscar_hf.offline_models import load_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import FixedLocator, FormatStrFormatter  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
EVAL_CONFIGS = ROOT / "eval_configs"

ALL_METHODS = list(METHODS)
# The issue-9 evidence: the new default against the paper's method and KIVI, bf16 and INT4.
EVIDENCE_METHODS = ["bf16", "oscar-int2", "oscar-paper-int2", "kivi-int2", "oscar-int4"]
# The INT2 comparison the targets are about: the summary pools retrieval over the tasks all of these ran.
COMPARED_METHODS = ["bf16", "oscar-int2", "oscar-paper-int2", "kivi-int2"]
ABLATIONS = ["oscar-int2-rotation-only", "oscar-int2-scaling-only"]
RETRIEVAL = ("passkey", "niah", "multikey")
MODELS = ["smollm2-135m", "qwen2.5-0.5b", "gemma-3-270m", "qwen2.5-1.5b"]
# Quality against stored bits (`avg_bits`) between INT2 and INT4, ours and the peers': transformers'
# QuantizedCache (quanto) and tiny-turboquant.
BITS_METHODS = [
    "oscar-k4v2",
    "oscar-int2-sinks4",
    "oscar-auto-3.2",
    "oscar-auto-3.2-sinks4",
    "oscar-auto-3.6",
    "oscar-auto-4.1",
    "oscar-auto-4.1-sinks4",
    "hf-quanto-int2",
    "hf-quanto-int4",
    "tiny-turboquant-k3v2",
    "tiny-turboquant-k4v4",
]


def retrieval(*lengths: str) -> list[str]:
    return [f"oscar_{task}_{length}" for length in lengths for task in RETRIEVAL]


def bits_methods(model_name: str, for_retrieval: bool = True) -> list[str]:
    """The evidence methods and `BITS_METHODS` that run on a model's perplexity or (`for_retrieval`) retrieval tasks.
    Transformers' QuantizedCache refuses Gemma 3's sliding-window layers. tiny-turboquant keeps them full-length (the
    model's mask still limits them to the window): its perplexity runs, each window through a cache of its own, but
    not retrieval, whose caches the wrapper fills from the shared exact prefill (its sliding layers keep only their
    window)."""
    sliding = model_name == "gemma-3-270m"
    refused = ("quantized", "tiny-turboquant") if for_retrieval else ("quantized",)
    return EVIDENCE_METHODS + [m for m in BITS_METHODS if not (sliding and METHODS[m][0] in refused)]


# Runs of (model, tasks, methods), in priority order (documents per task: `documents`): 2k retrieval with 30
# documents per task and perplexity on 20 documents on every model first, then 4k and generation-based passkey, then
# the 8k retrieval tasks on SmolLM2 (its context limit is 8192 tokens; the prompts are ~7.7K of its tokens); last,
# issue 39's quality against stored bits: perplexity and the 2k and 4k retrieval cells of every evidence method and
# `BITS_METHODS` on every model (what is already measured is skipped). Build the data with
# `python eval_configs/build_data.py --lengths 1k 2k 4k 8k --docs 30`. The whole plan takes many hours on 2 shared CPU
# cores; every entry is saved as soon as it is measured, so it can run in pieces.
SWEEP_MODEL, SWEEP_METHODS = "smollm2-135m", ["bf16", "oscar-int2", "oscar-paper-int2", "kivi-int2"]
PLAN = [
    *((name, ["oscar_multikey_2k"], EVIDENCE_METHODS) for name in MODELS),
    *((name, ["oscar_pg_ppl_1k"], EVIDENCE_METHODS) for name in MODELS),
    *((name, ["oscar_niah_2k", "oscar_passkey_2k"], EVIDENCE_METHODS) for name in MODELS),
    *((name, retrieval("4k"), EVIDENCE_METHODS) for name in MODELS),
    *((name, ["oscar_passkey_gen_2k"], EVIDENCE_METHODS) for name in MODELS),
    ("smollm2-135m", retrieval("8k"), COMPARED_METHODS),
    *((name, ["oscar_pg_ppl_1k"], bits_methods(name, for_retrieval=False)) for name in MODELS),
    *((name, retrieval("2k", "4k"), bits_methods(name)) for name in MODELS),
]


def documents(task: str) -> int:
    """The plan's documents per task: 20 per perplexity task, 30 per retrieval or generation task. One number per
    task, whichever plan row or command line runs it, so that every method of a task is scored on the same documents."""
    return 20 if "_ppl_" in task else 30


# Where the INT2 loss comes from (keys or values), on the main retrieval tasks: (model, tasks, documents per task).
DECOMPOSE = [
    ("smollm2-135m", ["oscar_niah_2k", "oscar_multikey_2k"], 10),
    ("qwen2.5-0.5b", ["oscar_niah_2k", "oscar_multikey_2k"], 10),
    ("gemma-3-270m", ["oscar_niah_2k", "oscar_multikey_2k"], 10),
    ("qwen2.5-1.5b", ["oscar_niah_1k", "oscar_multikey_1k"], 10),
]
# The metrics kept from lm-eval's results, by task family.
METRICS = {"ppl": ("word_perplexity", "bits_per_byte"), "retrieval": ("acc", "perplexity"), "gen": ("exact_match",)}


def task_metrics(task: str) -> tuple[str, ...]:
    if "_ppl_" in task:
        return METRICS["ppl"]
    return METRICS["gen"] if "_gen_" in task else METRICS["retrieval"]


def context_tokens(task: str, tokenizer, limit: int) -> int:
    """Mean prompt (or document) length in this model's tokens over the first `limit` documents."""
    name = task.removeprefix("oscar_").replace("passkey_gen", "passkey")
    rows = [json.loads(line) for line in (EVAL_CONFIGS / "data" / f"{name}.jsonl").read_text().splitlines()[:limit]]
    return round(statistics.mean(len(tokenizer(r.get("context", r.get("text"))).input_ids) for r in rows))


_CAPTURED_QUERIES: dict[int, torch.Tensor] = {}
_CAPTURED_MOMENTS: dict[int, torch.Tensor] = {}


def _capture_queries(module, query, key, value, attention_mask, **kwargs):
    """sdpa, recording each layer's last 64 (post-RoPE) queries for `kv_stats`, and the second moment of all of them
    (method="oscar" chooses its key rotation from it)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from oscar_hf.reference import query_moment

    _CAPTURED_QUERIES[module.layer_idx] = query[..., -64:, :].float()
    _CAPTURED_MOMENTS[module.layer_idx] = query_moment(query, key.shape[1])
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@torch.no_grad()
def kv_stats(model, tokenizer, text: str) -> dict:
    """What the cache has to quantize, from one exact prefill of (up to) 1024 tokens of `text`, over the full-attention
    layers:
    - key_norms: Token Norm Imbalance, n_t = ||k_t|| over all KV heads (OScaR's scale): max/median, min/median, and
      the first (attention-sink) token's n_t / median (median over layers);
    - key_channel_offset: per layer, the largest |mean over tokens| of a key channel / the median channel's std over
      tokens (a constant per-channel offset, e.g. Qwen2's k_proj bias); median and max over layers;
    - relative_error: after quantize + dequantize (oscar_hf.reference, the cache's own math) for each OScaR-family
      method: ||x^ - x|| / ||x|| for keys, values and the first token's key (median over layers), and "logits": the
      error of the attention logits q.k of the last 64 queries over the quantized keys, centered per query (a constant
      shift does not move the softmax), relative to the spread of the logits; median and max over layers.
    """
    from transformers import AttentionInterface, DynamicCache
    from transformers.cache_utils import DynamicLayer

    from oscar_hf.reference import round_trip_kv

    AttentionInterface.register("capture_queries", _capture_queries)
    original = model.config._attn_implementation
    model.set_attn_implementation("capture_queries")
    try:
        cache = DynamicCache(config=model.config)
        input_ids = tokenizer(text, return_tensors="pt").input_ids[:, :1024].to(model.device)
        model(input_ids, **cache_kwargs(cache), logits_to_keep=1)
    finally:
        model.set_attn_implementation(original)
    group = OscarConfig().group_size
    norms = {"max_over_median": [], "min_over_median": [], "first_over_median": []}
    offsets = []
    # as a cache on this model runs them (its queries are captured: method="auto" is the query rule)
    configs = {m: OscarConfig(**options).resolve("sdpa") for m, (impl, options) in METHODS.items() if impl == "oscar"}
    errors = {m: {"keys": [], "values": [], "first_token_keys": [], "logits": []} for m in configs}
    for idx, layer in enumerate(cache.layers):
        if type(layer) is not DynamicLayer:
            continue
        n = layer.keys.shape[-2] // group * group
        keys, values = layer.keys[..., :n, :].float(), layer.values[..., :n, :].float()
        n_t = keys.square().sum(dim=(1, 3)).sqrt()[0]
        norms["max_over_median"].append(float(n_t.max() / n_t.median()))
        norms["min_over_median"].append(float(n_t.min() / n_t.median()))
        norms["first_over_median"].append(float(n_t[0] / n_t.median()))
        offsets.append(float(keys.mean(dim=2).abs().max() / keys.std(dim=2).median()))
        queries = _CAPTURED_QUERIES[idx]
        expand = queries.shape[1] // keys.shape[1]  # GQA: each KV head serves `expand` query heads
        logits = queries @ keys.repeat_interleave(expand, dim=1).transpose(-1, -2)
        spread = (logits - logits.mean(-1, keepdim=True)).std()
        for method, config in configs.items():
            k, v = round_trip_kv(keys, values, config, moment=_CAPTURED_MOMENTS[idx])
            errors[method]["keys"].append(float((k - keys).norm() / keys.norm()))
            errors[method]["values"].append(float((v - values).norm() / values.norm()))
            first = keys[..., :1, :]
            errors[method]["first_token_keys"].append(float((k[..., :1, :] - first).norm() / first.norm()))
            error = queries @ (k - keys).repeat_interleave(expand, dim=1).transpose(-1, -2)
            errors[method]["logits"].append(float((error - error.mean(-1, keepdim=True)).std() / spread))

    def summary(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    return {
        "key_norms": {k: summary(v) for k, v in norms.items()},
        "key_channel_offset": {"median": summary(offsets), "max": round(max(offsets), 1)},
        "relative_error": {
            m: {k: summary(v) for k, v in e.items()} | {"logits_max": round(max(e["logits"]), 3)}
            for m, e in errors.items()
        },
    }


@torch.no_grad()
def kv_decomposition(model, tokenizer, task: str, limit: int) -> dict:
    """Which half of INT2 costs retrieval: the exact prefill's keys and/or values of the full-attention layers are
    replaced by their quantize-dequantize round trip (oscar_hf.reference, the cache's own math) over the quantized
    region (every full residual-length block), then the answer is scored as the wrapper scores it. "KV" reproduces
    the cache itself, an independent check of its numbers."""
    from transformers.cache_utils import DynamicLayer

    from oscar_hf.reference import round_trip_kv

    wrapper = OscarHFLM(pretrained=model, tokenizer=tokenizer, method="bf16")
    methods = ("oscar-int2", "oscar-paper-int2", "kivi-int2")
    configs = {m: OscarConfig(**METHODS[m][1]).resolve(model.config._attn_implementation) for m in methods}
    variants = [("none", None, "")] + [(f"{m} {part}", m, part) for m in configs for part in ("K", "V", "KV")]
    scores = {name: {"acc": [], "answer_loglik": []} for name, _, _ in variants}
    name = task.removeprefix("oscar_")
    rows = [json.loads(line) for line in (EVAL_CONFIGS / "data" / f"{name}.jsonl").read_text().splitlines()[:limit]]
    for row in tqdm(rows, desc=f"decomposition {task}"):
        context, continuation = wrapper._encode_pair(row["context"], " " + row["answer"])
        targets = torch.tensor(continuation, device=model.device)
        for variant, method, part in variants:
            first, cache = wrapper._prefill(context)  # a fresh copy of the exact prefill
            moments = wrapper.prefill_store.get(wrapper._prefill_key(context))[2]  # its queries' second moments
            for idx, layer in enumerate(cache.layers):
                if method is None or type(layer) is not DynamicLayer:
                    continue
                n = layer.keys.shape[-2] // configs[method].residual_length * configs[method].residual_length
                keys, values = round_trip_kv(
                    layer.keys[..., :n, :], layer.values[..., :n, :], configs[method], moment=moments[idx]
                )
                if "K" in part:
                    layer.keys[..., :n, :] = keys
                if "V" in part:
                    layer.values[..., :n, :] = values
            logits = model(torch.tensor([continuation[:-1]], device=model.device), **cache_kwargs(cache)).logits[0]
            logprobs = torch.cat([first[None], torch.log_softmax(logits.float(), dim=-1)])
            scores[variant]["acc"].append(float((logprobs.argmax(-1) == targets).all()))
            scores[variant]["answer_loglik"].append(float(logprobs.gather(-1, targets[:, None]).sum()))
    return {k: {m: round(statistics.mean(v), 3) for m, v in d.items()} | {"n": len(rows)} for k, d in scores.items()}


def first_ppl_text() -> str:
    return json.loads((EVAL_CONFIGS / "data" / "pg_ppl_1k.jsonl").read_text().splitlines()[0])["text"]


def load_results(model_name: str) -> dict:
    path = RESULTS / f"accuracy_{model_name}.json"
    return json.loads(path.read_text()) if path.exists() else {"model": model_name, "entries": {}}


def key_rotation(method: str) -> str | None:
    """Which keys an OScaR method's cache rotates on these models: "oscar" (per head, the query rule), "paper" (all),
    None (no rotation, or not an OscarCache). The offline models load with sdpa attention, where the default
    (method="auto") is the query rule."""
    implementation, options = METHODS[method]
    if implementation != "oscar":
        return None
    config = OscarConfig(**options).resolve("sdpa")
    return config.method if config.rotation else None


def entry_key_rotation(method: str, entry: dict) -> str | None:
    """`key_rotation` as an entry measured it: recorded since the default became the query rule; before that, the
    paper's method unless the entry's cache_config named another."""
    if "key_rotation" in entry:
        return entry["key_rotation"]
    options = entry.get("cache_config") or {}
    if METHODS[method][0] != "oscar" or not options.get("rotation", True):
        return None
    return options.get("method", "paper")


def stale_entries(entries: dict) -> list[str]:
    """Entries that no longer measure what their method names: a method renamed or removed ("oscar-perhead-int2" is
    "oscar-int2" now), or measured with another key rotation ("oscar-int2" and "oscar-int4" before the default became
    the query rule measured the paper's method)."""
    stale = []
    for key, entry in entries.items():
        method = key.split("|")[0]
        if method not in METHODS or entry_key_rotation(method, entry) != key_rotation(method):
            stale.append(key)
    return stale


def current_entries(model_name: str) -> dict:
    """The entries of a model's record, refused while any is stale (they would be reported under the wrong name)."""
    entries = load_results(model_name)["entries"]
    stale = stale_entries(entries)
    if stale:
        raise ValueError(
            f"accuracy_{model_name}.json holds entries that do not measure what their method now names: {stale}. "
            "Rename them (e.g. 'oscar-perhead-int2' -> 'oscar-int2', the paper's 'oscar-int2' -> 'oscar-paper-int2'), "
            "remove them, or rerun the plan (it redoes the stale entries of current methods)."
        )
    return entries


def save_results(results: dict) -> None:
    """Write a model's record, merged into what is on disk now: another process running a plan for the same model
    (e.g. other methods, one per CPU core) may have added entries since this one loaded the record."""
    path = RESULTS / f"accuracy_{results['model']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    on_disk = load_results(results["model"])
    merged = {**on_disk, **results}
    for part in ("entries", "kv_decomposition"):  # keyed by method|task and by task: each process adds its own
        if part in merged:
            merged[part] = {**on_disk.get(part, {}), **results.get(part, {})}
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
    temporary.replace(path)  # whole: a reader never sees a half-written record


def load(model_name: str, dtype: torch.dtype, device: str):
    model, tokenizer = load_model(model_name, dtype=dtype)
    return model.to(device), tokenizer


def run_model(
    model_name: str, tasks: list[str], limit: int | None, methods: list[str], dtype: torch.dtype, device: str
) -> None:
    """Scores every (task, method) not yet in the model's record on `limit` documents (default: `documents(task)`)."""
    results = load_results(model_name)
    redo = set(stale_entries(results["entries"]))
    todo = [(t, m) for t in tasks for m in methods if f"{m}|{t}" not in results["entries"] or f"{m}|{t}" in redo]
    if not todo and "kv_stats" in results:
        return
    model, tokenizer = load(model_name, dtype, device)
    if model.config._attn_implementation != "sdpa":  # `key_rotation` records method="auto" as the query rule
        raise ValueError(f"{model_name} loaded with {model.config._attn_implementation!r} attention, not 'sdpa'.")
    kv_heads, head_dim = kv_heads_and_dim(model.config)
    results.update(
        model=model_name,
        dtype=str(dtype).removeprefix("torch."),
        head_dim=head_dim,
        kv_heads=kv_heads,
        versions={**records.versions(), "lm_eval": lm_eval.__version__, "python": platform.python_version()},
        machine=records.machine()
        + (f", {torch.cuda.get_device_name(model.device)}" if model.device.type == "cuda" else ""),
    )
    if "kv_stats" not in results:
        results["kv_stats"] = kv_stats(model, tokenizer, first_ppl_text())
        save_results(results)
    task_manager = TaskManager(include_path=str(EVAL_CONFIGS))
    store = PrefillStore(max_entries=None)  # shared by every method of this model, cleared per task
    wrappers = {m: OscarHFLM(pretrained=model, tokenizer=tokenizer, method=m, prefill_store=store) for m in methods}
    current_task = None
    for task, method in tqdm(todo, desc=model_name):  # task-major: one task's prefills are in memory at a time
        if task != current_task:
            store.clear()
            current_task = task
        n_docs = limit or documents(task)
        out = simple_evaluate(
            model=wrappers[method], tasks=[task], limit=n_docs, task_manager=task_manager, bootstrap_iters=1000
        )
        metrics = out["results"][task]
        context = context_tokens(task, tokenizer, n_docs)
        options = wrappers[method].cache_config
        entry = {
            "n": out["n-samples"][task]["effective"],
            "context_tokens": context,
            "cache_config": options,
            "avg_bits": wrappers[method].avg_bits,
            "effective_bits": round(effective_avg_bits(method, options, head_dim, kv_heads, context), 4),
            "key_rotation": key_rotation(method),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": records.commit(),
        }
        for name in task_metrics(task):
            entry[name] = metrics[f"{name},none" if "_gen_" not in task else f"{name},first_number"]
            stderr = metrics.get(f"{name}_stderr,none")
            entry[f"{name}_stderr"] = stderr if isinstance(stderr, float) else None
        results["entries"][f"{method}|{task}"] = entry
        save_results(results)


def run_decomposition(model_name: str, tasks: list[str], limit: int, dtype: torch.dtype, device: str) -> None:
    results = load_results(model_name)
    done = results.setdefault("kv_decomposition", {})
    todo = [t for t in tasks if t not in done]
    if not todo:
        return
    model, tokenizer = load(model_name, dtype, device)
    for task in todo:
        done[task] = kv_decomposition(model, tokenizer, task, limit)
        save_results(results)


def plot(model_names: list[str]) -> Path:
    """(a) retrieval accuracy per method, mean over the tasks of each model's main run; (b) word perplexity change
    vs bf16; (c) retrieval accuracy vs context length on the model of the context sweep."""
    fig, (ax_acc, ax_ppl, ax_len) = plt.subplots(1, 3, figsize=(19, 5.5), gridspec_kw={"width_ratios": [3, 3, 2]})
    width = 0.8 / max(len(model_names), 1)
    main_tasks = {name: tasks for name, tasks, _ in reversed(PLAN)}  # the first run of each model wins
    for i, name in enumerate(model_names):
        entries = current_entries(name)
        acc, ppl = {}, {}
        for key, entry in entries.items():
            method, task = key.split("|")
            if "_ppl_" in task:
                ppl[method] = entry
            elif task in main_tasks[name] and "acc" in entry:
                acc.setdefault(method, []).append(entry["acc"])
        xs = [j + i * width for j in range(len(ALL_METHODS))]
        # A method not run for a model gets no bar (NaN); a measured zero accuracy gets a "0" so it is not missed.
        heights = [statistics.mean(acc[m]) if m in acc else math.nan for m in ALL_METHODS]
        bars = ax_acc.bar(xs, heights, width, label=name)
        for x, h in zip(xs, heights, strict=True):
            if h == 0:
                ax_acc.text(x, 0.005, "0", ha="center", va="bottom", fontsize=7, color=bars.patches[0].get_facecolor())
        changes = [ppl_change_pct(ppl[m], ppl.get("bf16")) if m in ppl else None for m in ALL_METHODS]
        changes = [math.nan if c is None else c for c in changes]
        ax_ppl.bar(xs, changes, width, label=name)
    for ax, title in (
        (ax_acc, "(a) retrieval accuracy, mean of the model's tasks"),
        (ax_ppl, "(b) word perplexity vs bf16 (%), through the cache"),
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(ALL_METHODS))], ALL_METHODS, rotation=35, ha="right")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    ax_ppl.set_yscale("symlog", linthresh=10)
    ax_ppl.set_ylim(bottom=-10)
    ax_acc.legend(fontsize=8, loc="upper right")
    if SWEEP_MODEL in model_names:
        entries = current_entries(SWEEP_MODEL)
        for method in SWEEP_METHODS:
            points = [
                (int(length[:-1]), statistics.mean(entries[f"{method}|oscar_{t}_{length}"]["acc"] for t in RETRIEVAL))
                for length in ("1k", "2k", "4k", "8k")
                if all(f"{method}|oscar_{t}_{length}" in entries for t in RETRIEVAL)
            ]
            if points:
                ax_len.plot(*zip(*points, strict=True), marker="o", label=method)
        ax_len.set_xscale("log", base=2)
        ax_len.set_xlabel("context (k tokens, nominal)")
        ax_len.set_title(f"(c) {SWEEP_MODEL}: retrieval acc vs context")
        ax_len.grid(alpha=0.3)
        ax_len.legend(fontsize=8)
    fig.tight_layout()
    path = RESULTS / "accuracy_methods.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def long_prompt_rows(model_name: str) -> tuple[dict, dict[str, dict]] | None:
    """The long-prompt protocol's rows of a model (`long_prompt_ppl.py`'s record): the latest run's fields, and by
    method, of the runs with its protocol (documents, prompt, scored tokens, chunk), each method's latest row;
    diagnosis rows (`@`), and runs of nothing else (but their bf16 reference), left out. None where the model has no
    record."""
    path = RESULTS / f"long_prompt_{model_name}.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    runs = {row["run"] for row in record["rows"] if "@" not in row["method"] and row["method"] != "bf16"}
    table = [row for row in record["rows"] if row["run"] in runs and "@" not in row["method"]]
    protocol = ("docs", "prompt", "scored", "chunk")
    latest = record["runs"][max(row["run"] for row in table)]
    same = {run for run, fields in record["runs"].items() if all(fields[k] == latest[k] for k in protocol)}
    rows = {}
    for row in sorted(table, key=lambda row: row["run"]):  # run ids start with the time: the latest wins
        if row["run"] in same:
            rows[row["method"]] = row
    return latest, rows


def long_prompt_table(model_names: list[str]) -> str:
    """The long-prompt protocol's rows as markdown (docs/accuracy.md): per model and method, the stored bits, the
    effective bits at the record's context and at 4K, the perplexity change against bf16 with its chunk standard
    error, and whether the method is on the Pareto front at 4K."""
    lines = [
        "| model | method | stored bits | effective bits (context / 4K) | perplexity change | on the front at 4K |",
        "|---|---|---|---|---|---|",
    ]
    for name in model_names:
        found = long_prompt_rows(name)
        if found is None:
            continue
        run, rows = found
        rows = {m: r for m, r in rows.items() if m != "bf16"}
        front = pareto_front([(r["effective_bits_4k"], r["ppl_change_pct"]) for r in rows.values()])
        for method, r in rows.items():
            label = f"**{method}** (default)" if method == DEFAULT_METHOD else method
            lines.append(
                f"| {name} | {label} | {r['stored_bits']:.2f} | {r['effective_bits']:.2f} / "
                f"{r['effective_bits_4k']:.2f} | {r['ppl_change_pct']:+.2f} ± {r['se_pct']:.2f} % | "
                f"{'yes' if (r['effective_bits_4k'], r['ppl_change_pct']) in front else ''} |"
            )
    return "\n".join(lines)


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both counts (fewer or equal bits and a lower or equal perplexity change, one
    of them strictly), by bits."""
    return sorted(p for p in points if not any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points))


def plot_front(model_names: list[str]) -> Path:
    """accuracy.png: per model (a panel), the long-prompt protocol's perplexity change against bf16 (± its chunk
    standard error) against the effective bits per K/V element at 4K tokens (everything each cache holds there,
    exact tokens included: `effective_avg_bits`), every config and peer a labelled point coloured by cache family,
    the Pareto front (`pareto_front`) drawn as a step line; the default in bold."""
    models = [name for name in model_names if long_prompt_rows(name)]
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 5.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        run, rows = long_prompt_rows(name)
        rows = {m: r for m, r in rows.items() if m != "bf16"}
        points = {m: (r["effective_bits_4k"], r["ppl_change_pct"]) for m, r in rows.items()}
        for method, (x, y) in points.items():
            colour = FAMILY_COLOURS[METHODS[method][0]]
            ax.errorbar(x, y, yerr=rows[method]["se_pct"], fmt="o", color=colour, capsize=2)
            ax.annotate(method, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points",
                        fontweight="bold" if method == DEFAULT_METHOD else "normal")  # fmt: skip
        front = pareto_front(list(points.values()))
        xs = [x for x, _ in front] + [max(x for x, _ in points.values())]
        ys = [y for _, y in front] + [front[-1][1]]
        ax.step(xs, ys, where="post", color="grey", linestyle="--", linewidth=1, label="Pareto front")
        ax.set_title(f"{name}: {run['docs']} documents (± chunk standard error)")
        ax.set_yscale("symlog", linthresh=3)
        ax.yaxis.set_major_locator(FixedLocator([-1, 0, 1, 2, 3, 10, 30, 100, 300, 1000]))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xlabel("effective bits per K/V element at 4K tokens (exact tokens included)")
        ax.set_ylabel("perplexity change vs bf16 (%), long prompt")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle("Perplexity of 1536 tokens after a 1536-token prompt, against the memory each cache holds at 4K")
    fig.tight_layout()
    path = RESULTS / "accuracy.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# Colours of the cache families in `plot_bits`, by cache implementation (`METHODS`)
FAMILY_COLOURS = {None: "black", "oscar": "tab:blue", "quantized": "tab:orange", "tiny-turboquant": "tab:green"}


def plot_bits(model_names: list[str]) -> Path:
    """accuracy_bits.png, from accuracy_summary.json: per model (a column), the perplexity change vs bf16 (top) and
    the pooled 2k retrieval accuracy with its standard error (bottom) against the method's stored bits per K/V element
    (`avg_bits`); every method a labelled point, coloured by cache family. A retrieval point pooled over fewer 2k
    tasks than bf16's is hollow, its label marked with a dagger: compare it with care."""
    summary = json.loads((RESULTS / "accuracy_summary.json").read_text())
    fig, axes = plt.subplots(2, len(model_names), figsize=(5 * len(model_names), 9), squeeze=False)
    for column, name in enumerate(model_names):
        rows = summary[name]
        ax_ppl, ax_acc = axes[0, column], axes[1, column]
        full = len(rows.get("bf16", {}).get("retrieval_tasks", []))
        for method, row in rows.items():
            colour = FAMILY_COLOURS[METHODS[method][0]]
            if "ppl_delta_pct" in row:
                ax_ppl.scatter(row["avg_bits"], row["ppl_delta_pct"], color=colour)
                ax_ppl.annotate(method, (row["avg_bits"], row["ppl_delta_pct"]), fontsize=7, xytext=(4, 2),
                                textcoords="offset points")  # fmt: skip
            if "retrieval_acc" in row:
                partial = len(row["retrieval_tasks"]) < full
                ax_acc.errorbar(row["avg_bits"], row["retrieval_acc"], yerr=row["retrieval_se"], fmt="o", color=colour,
                                mfc="none" if partial else colour, capsize=2)  # fmt: skip
                ax_acc.annotate(method + (" †" if partial else ""), (row["avg_bits"], row["retrieval_acc"]),
                                fontsize=7, xytext=(4, 2), textcoords="offset points")  # fmt: skip
        ax_ppl.set_title(f"{name}: perplexity vs bf16 (%)")
        ax_ppl.set_yscale("symlog", linthresh=3)
        ax_ppl.yaxis.set_major_locator(FixedLocator([-10, -3, -1, 0, 1, 3, 10, 30, 100, 300]))
        ax_ppl.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax_ppl.axhline(0, color="black", linewidth=0.5)
        ax_acc.set_title(f"{name}: 2k retrieval, pooled (± SE)")
        ax_acc.set_ylim(-0.05, 1.05)
        for ax in (ax_ppl, ax_acc):
            ax.set_xscale("log", base=2)
            ax.set_xticks([2, 3, 4, 5, 8, 16], ["2", "3", "4", "5", "8", "16"])
            ax.set_xlabel("stored bits per K/V element (avg_bits)")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    path = RESULTS / "accuracy_bits.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# The contexts at which the summary counts each method's effective bits (`effective_avg_bits`): what a user pays there.
EFFECTIVE_CONTEXTS = (2048, 4096, 32768)


def ppl_change_pct(entry: dict, base: dict | None) -> float | None:
    """Word-perplexity change against bf16 in percent; None unless both scored the same documents (same n)."""
    if base is None or entry["n"] != base["n"]:
        return None
    return 100 * (entry["word_perplexity"] / base["word_perplexity"] - 1)


def markdown_table(model_name: str) -> str:
    """The model's results as markdown, one table per set of tasks run with the same methods: retrieval cells are
    "acc / answer perplexity", generation cells exact match, perplexity cells word ppl (+ change vs bf16); then the
    key/value decomposition and the K/V statistics when recorded."""
    results = load_results(model_name)
    entries = current_entries(model_name)
    order = {"passkey": 0, "niah": 1, "multikey": 2}
    tasks = sorted(
        {k.split("|")[1] for k in entries},
        key=lambda t: ("_ppl_" in t, int(t.rsplit("_", 1)[1][:-1]), order.get(t.split("_")[1], 3)),
    )
    groups: dict[tuple[str, ...], list[str]] = {}
    for t in tasks:
        groups.setdefault(tuple(m for m in ALL_METHODS if f"{m}|{t}" in entries), []).append(t)
    lines = []
    for methods, group in sorted(groups.items(), key=lambda item: -len(item[0])):  # the main run first
        lines += ["| method | " + " | ".join(t.removeprefix("oscar_") for t in group) + " |"]
        lines += ["|---" * (len(group) + 1) + "|"]
        for m in methods:
            cells = []
            for t in group:
                e, base = entries[f"{m}|{t}"], entries.get(f"bf16|{t}")
                if "_ppl_" in t:
                    change = ppl_change_pct(e, base)
                    change = "" if change is None else f" ({change:+.1f}%)"
                    cells.append(f"{e['word_perplexity']:.2f}{change}")
                elif "_gen_" in t:
                    cells.append(f"{e['exact_match']:.2f}")
                else:
                    cells.append(f"{e['acc']:.2f} / {e['perplexity']:.3g}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines.append("")
    sizes = sorted({(k.split("|")[1], e["n"], e["context_tokens"]) for k, e in entries.items()})
    lines += ["n / mean tokens: " + ", ".join(f"{t.removeprefix('oscar_')} {n} / {c}" for t, n, c in sizes)]
    for task, variants in results.get("kv_decomposition", {}).items():
        variants = {"none": variants["none"]} | {k: v for k, v in variants.items() if k != "none"}  # exact first
        lines += [
            "",
            f"Key/value decomposition on {task.removeprefix('oscar_')} (acc / mean answer log-likelihood):",
            "",
        ]
        lines += ["| " + " | ".join(variants) + " |", "|---" * len(variants) + "|"]
        lines.append("| " + " | ".join(f"{v['acc']:.1f} / {v['answer_loglik']:.2f}" for v in variants.values()) + " |")
    if "kv_stats" in results:
        stats = results["kv_stats"]
        rows = [
            f"| {m} | {e['logits']:.3f} (max {e['logits_max']:.3f}) | {e['keys']:.3f} | {e['first_token_keys']:.3f} | "
            f"{e['values']:.3f} |"
            for m, e in stats["relative_error"].items()
        ]
        lines += [
            "",
            f"Keys: token norms {stats['key_norms']}; channel offset / std {stats['key_channel_offset']}.",
            "",
            "| round trip | attention-logit error | key error | sink-token key error | value error |",
            "|---|---|---|---|---|",
            *rows,
        ]
    return "\n".join(lines)


def retrieval_cells_table(model_name: str) -> str:
    """Accuracy in every retrieval cell of a model's record: a row per task and length, a column per method that ran
    any (docs/accuracy.md, "Every retrieval cell"); empty: not run."""
    entries = current_entries(model_name)
    ran = {key.split("|")[1] for key in entries}
    lengths = sorted({t.rsplit("_", 1)[1] for t in ran if t.split("_")[1] in RETRIEVAL}, key=lambda n: int(n[:-1]))
    tasks = [t for t in retrieval(*lengths) if t in ran]
    methods = [m for m in ALL_METHODS if any(f"{m}|{t}" in entries for t in tasks)]
    names = [f"{m} (default)" if m == DEFAULT_METHOD else m for m in methods]
    lines = ["| cell | " + " | ".join(names) + " |", "|---" * (len(methods) + 1) + "|"]
    for t in tasks:
        cells = [f"{entries[f'{m}|{t}']['acc']:.2f}" if f"{m}|{t}" in entries else "" for m in methods]
        lines.append(f"| {t.removeprefix('oscar_')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def binomial_se(acc: float, n: int) -> float:
    """Standard error of an accuracy over n independent documents."""
    return math.sqrt(acc * (1 - acc) / n)


def default_targets(rows: dict) -> dict:
    """Issue 9's targets for the default (`oscar-int2`) against the better of KIVI and the paper's method, from one
    model's summary rows: perplexity change at most the better one's + 1 point (goal: at most +3 %); retrieval, pooled
    and per cell, at least the better one's accuracy minus its standard error. Each with its margin (negative: short
    by that much) and whether it is met."""
    default, rivals = rows["oscar-int2"], [rows["kivi-int2"], rows["oscar-paper-int2"]]
    targets = {}
    if all("ppl_delta_pct" in r for r in (default, *rivals)):
        bound = min(r["ppl_delta_pct"] for r in rivals) + 1.0
        margin = bound - default["ppl_delta_pct"]
        targets["ppl_delta_pct"] = {
            "required_max": round(bound, 2), "measured": default["ppl_delta_pct"], "margin": round(margin, 2),
            "met": margin >= 0, "goal_max": 3.0, "goal_met": default["ppl_delta_pct"] <= 3.0,
        }  # fmt: skip

    def against_better(measured: float, rival_cells: list[tuple[float, float]]) -> dict:
        acc, se = max(rival_cells, key=lambda cell: cell[0])  # the better one (accuracy, standard error)
        floor = acc - se
        margin = measured - floor
        return {"required_min": round(floor, 4), "measured": measured, "margin": round(margin, 4), "met": margin >= 0}

    if all("retrieval_acc" in r for r in (default, *rivals)):
        pooled = [(r["retrieval_acc"], r["retrieval_se"]) for r in rivals]
        targets["retrieval_pooled_2k"] = against_better(default["retrieval_acc"], pooled)
    cells = {}
    for cell, own in default.get("retrieval_cells", {}).items():
        if all(cell in r.get("retrieval_cells", {}) for r in rivals):
            rival_cells = [(r["retrieval_cells"][cell]["acc"], r["retrieval_cells"][cell]["se"]) for r in rivals]
            cells[cell] = against_better(own["acc"], rival_cells)
    if cells:
        targets["retrieval_cells"] = cells
        targets["retrieval_cells_missed"] = sorted(cell for cell, t in cells.items() if not t["met"])
    return targets


def summarize(model_names: list[str]) -> Path:
    """accuracy_summary.json: per model and method, the perplexity change vs bf16 (the longest perplexity task run,
    where the method scored the same documents as bf16); the retrieval accuracy pooled over the 2k retrieval tasks
    that the INT2 comparison (bf16, the default, the paper's method, KIVI) ran in full (another method: those of them
    it ran, listed in its `retrieval_tasks`), with its binomial standard error and the number of documents; every
    retrieval cell on its own (`retrieval_cells`, 2k, 4k and 8k); the exact match of each generation task run; the
    method's stored bits per K/V element on this model (`avg_bits`, as each entry records it) and everything its cache
    holds per K/V element at each of `EFFECTIVE_CONTEXTS` (`effective_bits`, exact tokens included); and, where the INT2
    comparison ran, the default's targets (`oscar-int2` -> `targets`, `default_targets`)."""
    summary = {}
    for name in model_names:
        entries = current_entries(name)
        # the record's own (`run_model` writes them): a summary never fetches or converts a model
        record = load_results(name)
        kv_heads, head_dim = record["kv_heads"], record["head_dim"]
        methods = sorted({k.split("|")[0] for k in entries}, key=ALL_METHODS.index)
        ppl_tasks = sorted({k.split("|")[1] for k in entries if "_ppl_" in k and k.startswith("bf16|")})
        compared = [m for m in COMPARED_METHODS if m in methods]
        retrieval_tasks = [t for t in retrieval("2k") if all(f"{m}|{t}" in entries for m in compared)]
        summary[name] = {}
        for m in methods:
            row = {
                "avg_bits": round(avg_bits(m, METHODS[m][1], head_dim, kv_heads), 4),
                "effective_bits": {
                    f"{context // 1024}k": round(effective_avg_bits(m, METHODS[m][1], head_dim, kv_heads, context), 4)
                    for context in EFFECTIVE_CONTEXTS
                },
            }
            if ppl_tasks and f"{m}|{ppl_tasks[-1]}" in entries:
                change = ppl_change_pct(entries[f"{m}|{ppl_tasks[-1]}"], entries[f"bf16|{ppl_tasks[-1]}"])
                if change is not None:
                    n = entries[f"{m}|{ppl_tasks[-1]}"]["n"]
                    row |= {"ppl_task": ppl_tasks[-1], "ppl_delta_pct": round(change, 2), "ppl_n": n}
            ran = [t for t in retrieval_tasks if f"{m}|{t}" in entries]
            cells = [entries[f"{m}|{t}"] for t in ran]
            if cells:
                n = sum(c["n"] for c in cells)
                acc = sum(c["acc"] * c["n"] for c in cells) / n
                row |= {
                    "retrieval_tasks": ran,
                    "retrieval_acc": round(acc, 4),
                    "retrieval_se": round(binomial_se(acc, n), 4),
                    "retrieval_n": n,
                }
            own = {t: entries[f"{m}|{t}"] for t in retrieval("2k", "4k", "8k") if f"{m}|{t}" in entries}
            if own:
                row["retrieval_cells"] = {
                    t.removeprefix("oscar_"): {
                        "acc": round(e["acc"], 4),
                        "se": round(binomial_se(e["acc"], e["n"]), 4),
                        "n": e["n"],
                    }
                    for t, e in own.items()
                }
            for key, e in sorted(entries.items()):
                method, task = key.split("|")
                if method == m and "_gen_" in task:
                    row[task.removeprefix("oscar_")] = {"exact_match": round(e["exact_match"], 4), "n": e["n"]}
            summary[name][m] = row
        if all(m in summary[name] for m in COMPARED_METHODS):
            summary[name]["oscar-int2"]["targets"] = default_targets(summary[name])
    path = RESULTS / "accuracy_summary.json"
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS, choices=MODELS)
    parser.add_argument("--tasks", nargs="+", help="override the plan's tasks")
    parser.add_argument("--methods", nargs="+", choices=ALL_METHODS, help="override the plan's methods")
    parser.add_argument("--limit", type=int, help="override the plan's documents per task")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu (default), cuda, cuda:1, ...")
    parser.add_argument(
        "--steps",
        nargs="+",
        default=["plan", "decompose"],
        choices=["plan", "decompose", "stats"],
        help="stats: recompute the K/V statistics (the plan computes them once per model)",
    )
    parser.add_argument("--plot-only", action="store_true")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 by default: on a shared 2-core machine two threads wait on each other at every small "
        "op (measured 10-30x slower here), while one thread loses at most 2x on the large matmuls",
    )
    args = parser.parse_args()
    records.commit()  # read now: entries name the commit the run started from
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not args.plot_only and "plan" in args.steps:
        for name, tasks, methods in PLAN:
            if name in args.models:
                run_model(name, args.tasks or tasks, args.limit, args.methods or methods, dtype, args.device)
    if not args.plot_only and "stats" in args.steps:
        for name in args.models:
            results = load_results(name)
            model, tokenizer = load(name, dtype, args.device)
            results["kv_stats"] = kv_stats(model, tokenizer, first_ppl_text())
            save_results(results)
    if not args.plot_only and "decompose" in args.steps:
        for name, tasks, limit in DECOMPOSE:
            if name in args.models:
                run_decomposition(name, tasks, limit, dtype, args.device)
    done = [n for n in MODELS if (RESULTS / f"accuracy_{n}.json").exists()]
    print(f"methods: {plot(done)}\nsummary: {summarize(done)}\nquality vs stored bits: {plot_bits(done)}")
    print(f"quality vs effective bits, long prompt: {plot_front(MODELS)}\n\n{long_prompt_table(MODELS)}")
    for name in done:
        print(f"\n### {name}\n\n{markdown_table(name)}\n\nEvery retrieval cell:\n\n{retrieval_cells_table(name)}")


if __name__ == "__main__":
    main()
