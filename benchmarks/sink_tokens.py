"""Does keeping the first tokens exact (`sink_tokens`, attention sinks) help the INT2 default? Perplexity of the start
of Hamlet fed in chunks through an `OscarCache` per sink count, against the exact cache (the text and the feeding of
`chunked_prefill_consistency.py`: each chunk attends to the quantized history, float32 on CPU, one thread).

    python benchmarks/sink_tokens.py --models smollm2-135m qwen2.5-0.5b --tokens 2048 --sinks 0 4 16 64

Rows go to benchmarks/results/sink_tokens.json: model, tokens, chunk, method, sink_tokens, ppl, change (relative to
the exact cache), run.
"""

from __future__ import annotations

import argparse
import sys

import records
import torch
from chunked_prefill_consistency import MODELS, RESULTS, choice_of, hamlet, perplexity, run_record

from oscar_hf import OscarCache
from oscar_hf.offline_models import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=MODELS[:2], choices=MODELS)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--sinks", type=int, nargs="+", default=[0, 4, 16, 64])
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)  # the CPU is shared
    run, meta = run_record()
    path = RESULTS / "sink_tokens.json"
    for name in args.models:
        model, tokenizer = load_model(name)
        ids = tokenizer(hamlet(), return_tensors="pt").input_ids[:, : args.tokens]
        assert ids.shape[1] == args.tokens, f"the text has only {ids.shape[1]} tokens"
        # the exact cache: the whole text in one forward (a prefill attends to its own exact K/V)
        exact, one_prefill = choice_of(model, ids)
        rows = [dict(method="bf16", sink_tokens=None, ppl=exact, chunk=args.tokens)]
        for sinks in args.sinks:
            cache = OscarCache(model.config, {"bits": 2, "sink_tokens": sinks})
            ppl, _ = perplexity(model, ids, cache, args.chunk, one_prefill)
            rows.append(dict(method="oscar-int2", sink_tokens=sinks, ppl=ppl, chunk=args.chunk))
            print(f"{name} sink_tokens={sinks}: ppl {ppl:.4f} (exact {exact:.4f})", file=sys.stderr)
        for row in rows:
            row.update(model=name, tokens=args.tokens, change=row["ppl"] / exact - 1, run=run, **meta)
        records.append_rows(path, rows)


if __name__ == "__main__":
    main()
