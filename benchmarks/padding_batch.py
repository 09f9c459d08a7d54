"""Does a left-padded batch answer like each prompt alone? Greedy generation on an offline model, with and without
padding-aware quantization (`OscarCache.set_padding`, which `generate` calls with the prompt's mask).

Prompts: the first tokens of `--prompts` essays of pg_ppl_1k, of lengths spread evenly over `--lengths`, generated in
batches of `--batch` (left padding) and one by one, `--new` greedy tokens each, float32 compute. Per cache setting,
a row *differs* when its generated tokens are not those of the same prompt alone; also recorded: how many tokens the
two share before the first difference. "before" is the same code with `set_padding` made a no-op (the padding's keys
enter the key groups' min/max and the per-head rotation choice, as before padding-aware quantization); the exact
cache (a DynamicCache) shows the floor set by floating-point differences between batched and single-row matmuls.

    python benchmarks/padding_batch.py --models smollm2-135m qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from pathlib import Path
from unittest import mock

import records
import torch
from tqdm import tqdm

from oscar_hf import OscarCache
from oscar_hf.offline_models import load_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# name -> (cache_config or None for the exact DynamicCache, padding-aware); the 2-bit cache the record measured
INT2 = {"bits": 2, "sink_tokens": 0}
SETTINGS: dict[str, tuple[dict | None, bool]] = {
    "exact": (None, True),
    "paper-before": ({"method": "paper", **INT2}, False),
    "paper-after": ({"method": "paper", **INT2}, True),
    "perhead-before": ({"method": "oscar", **INT2}, False),
    "perhead-after": ({"method": "oscar", **INT2}, True),
}


def generate(model, input_ids, attention_mask, options: dict | None, padding_aware: bool, new: int) -> torch.Tensor:
    """The `new` greedy tokens of each row."""
    cache = {} if options is None else {"cache_implementation": "oscar", "cache_config": options}
    blind = mock.patch.object(OscarCache, "set_padding", lambda self, mask: None)
    with torch.no_grad(), contextlib.nullcontext() if padding_aware else blind:
        out = model.generate(
            input_ids, attention_mask=attention_mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, **cache
        )
    return out[:, input_ids.shape[1] :]


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(name: str, args, meta: dict) -> dict:
    """Every setting of SETTINGS on one model; resumable: the record is saved after each setting (with `meta`), and
    settings already in it (for the same prompts) are kept."""
    out = RESULTS / f"padding_{name}.json"
    model, tokenizer = load_model(name, dtype=torch.float32)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = [json.loads(x) for x in (ROOT / "eval_configs" / "data" / "pg_ppl_1k.jsonl").read_text().splitlines()]
    low, high = args.lengths
    lengths = [round(low + (high - low) * i / max(args.prompts - 1, 1)) for i in range(args.prompts)]
    prompts = [tokenizer(rows[i]["text"]).input_ids[:n] for i, n in enumerate(lengths)]
    record = json.loads(out.read_text()) if out.exists() else {}
    if record.get("lengths") != lengths or record.get("new_tokens") != args.new or record.get("batch") != args.batch:
        record = {"lengths": lengths, "settings": {}}
    todo = [s for s in SETTINGS if s not in record["settings"]]
    for setting in tqdm(todo, desc=name):
        options, aware = SETTINGS[setting]
        alone_key = "exact" if options is None else options["method"]
        if alone_key not in record.setdefault("alone", {}):  # one prompt, no padding: set_padding has no effect
            record["alone"][alone_key] = [
                generate(model, torch.tensor([p]), None, options, True, args.new)[0].tolist() for p in prompts
            ]
        together = []
        for start in range(0, len(prompts), args.batch):
            batch = tokenizer.pad({"input_ids": prompts[start : start + args.batch]}, return_tensors="pt")
            together += generate(model, batch.input_ids, batch.attention_mask, options, aware, args.new).tolist()
        alone = record["alone"][alone_key]
        same = [shared_prefix(a, b) for a, b in zip(together, alone)]
        differs = [s < args.new for s in same]
        n = len(differs)
        rate = sum(differs) / n
        record["settings"][setting] = {
            "rows_differing": sum(differs),
            "rows": n,
            "rate": rate,
            "rate_stderr": math.sqrt(rate * (1 - rate) / n),
            "mean_shared_prefix": sum(same) / n,
            "shared_prefix": same,
            "together": together,
        }
        record.update(meta, model=name, batch=args.batch, new_tokens=args.new)
        records.write_record(out, record, indent=1)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lengths", type=int, nargs=2, default=[150, 700], help="shortest and longest prompt")
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    meta = {
        **records.header("greedy tokens of a left-padded batch against each prompt alone", "cpu"),
        "dtype": "float32",
        "machine": records.machine(),
    }
    for name in args.models:
        record = run(name, args, meta)
        print(f"\n{name}: rows whose {args.new} greedy tokens differ from the prompt alone (batch {args.batch})")
        for setting, r in record["settings"].items():
            print(
                f"  {setting:15s} {r['rows_differing']}/{r['rows']} = {r['rate']:.2f} +- {r['rate_stderr']:.2f}, "
                f"mean shared prefix {r['mean_shared_prefix']:.1f}"
            )


if __name__ == "__main__":
    main()
