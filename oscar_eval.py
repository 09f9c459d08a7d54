"""`oscar-eval`: lm-eval's command line with the `oscar-hf` model registered and the cache method as an option.

lm-eval has no plugin entry point for models, so the model has to be registered (by importing
`oscar_hf.integrations.lm_eval`) in the process that runs lm-eval's CLI. Every other option is lm-eval's own and
handled by lm-eval; `--method` and `--cache_config` are folded into `--model_args`, and `--model` defaults to
`oscar-hf`.

A module outside the `oscar_hf` package, which also holds the methods' table: importing anything under `oscar_hf`
runs its `__init__`, which registers the cache with transformers (seconds of torch and transformers imports), so
`--help` would not be quick. Only an evaluation imports oscar_hf and lm-eval.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

# The KV cache methods the evaluations compare (lm-eval model `oscar-hf`, `oscar-eval`, benchmarks/run_accuracy.py):
# method name -> (cache_implementation for generate, cache_config). None: transformers' default DynamicCache.
# "quantized" is transformers' own QuantizedCache (needs optimum-quanto or hqq; refuses sliding-window models).
METHODS: dict[str, tuple[str | None, dict]] = {
    "bf16": (None, {}),
    # the default (method="auto"): the query rule (each KV head's key rotation chosen from the prompt's queries) on a
    # model with sdpa attention, as transformers loads one by default; the paper's method elsewhere, with a warning
    "oscar-int2": ("oscar", {"bits": 2}),
    "oscar-paper-int2": ("oscar", {"bits": 2, "method": "paper"}),  # the paper's method: every key rotated
    "oscar-int4": ("oscar", {"bits": 4}),  # the default at 4 bits
    "oscar-paper-int4": ("oscar", {"bits": 4, "method": "paper"}),  # the paper's method at 4 bits
    "kivi-int2": ("oscar", {"bits": 2, "rotation": False, "token_scaling": False}),
    # the paper's ablations: its rotation (every key) without token scaling, and token scaling without rotation
    "oscar-int2-rotation-only": ("oscar", {"bits": 2, "token_scaling": False, "method": "paper"}),
    "oscar-int2-scaling-only": ("oscar", {"bits": 2, "rotation": False}),
    "hf-quanto-int2": ("quantized", {"backend": "quanto", "nbits": 2}),
    "hf-quanto-int4": ("quantized", {"backend": "quanto", "nbits": 4}),
    "hf-hqq-int2": ("quantized", {"backend": "hqq", "nbits": 2}),
}

NOT_APPLICABLE = "Custom kwargs can be passed to `--metadata`"
EXAMPLE = """\
example (offline, from the repository root; SmolLM2-135M, 4 documents, about 3 CPU-minutes):
  python eval_configs/build_data.py --lengths 1k
  oscar-eval --model_args pretrained=smollm2-135m --method oscar-int2 \\
      --include_path eval_configs --tasks oscar_passkey_1k --limit 4

pretrained= takes a local model folder, a hub id, or an offline model of oscar_hf.offline_models
(smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, gemma-3-270m). Every other option is lm-eval's: see
`oscar-eval --lm-eval-help` (e.g. --tasks, --limit, --batch_size, --output_path, --include_path, --device)."""


def _parser() -> argparse.ArgumentParser:
    methods = "\n".join(f"  {name:26} {_describe(*METHODS[name])}" for name in METHODS)
    parser = argparse.ArgumentParser(
        prog="oscar-eval",
        description=f"{__doc__.splitlines()[0][14:]}\n\nmethods (--method):\n{methods}",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--method", choices=sorted(METHODS), help="the KV cache to evaluate (default: oscar-int2)")
    parser.add_argument(
        "--cache_config",
        type=json.loads,
        metavar="JSON",
        help="options merged over the method's own, e.g. '{\"residual_length\": 64}'",
    )
    parser.add_argument("--lm-eval-help", action="store_true", help="show lm-eval's own options and exit")
    return parser


def _describe(implementation: str | None, options: dict) -> str:
    if implementation is None:
        return "transformers' DynamicCache in the model's dtype (the baseline)"
    if implementation == "quantized":
        return f"transformers' QuantizedCache {options}"
    return f"OscarCache {options}"


def main(argv: list[str] | None = None) -> None:
    ours, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    # Imported only now: lm-eval's CLI and oscar_hf take seconds to import.
    from lm_eval.__main__ import cli_evaluate

    import oscar_hf.integrations.lm_eval  # noqa: F401  (registers the lm-eval model `oscar-hf`)

    # The tasks of eval_configs/ build their documents with a `custom_dataset` function, which makes lm-eval suggest
    # `--metadata` kwargs that they do not take; that advice never applies here.
    logging.getLogger("lm_eval.api.task").addFilter(lambda record: NOT_APPLICABLE not in record.getMessage())
    if ours.lm_eval_help:
        rest = ["run", "--help"]
    elif not rest or rest[0] not in ("ls", "validate"):  # an evaluation ("run", explicit or implied)
        extra = {key: value for key, value in vars(ours).items() if value is not None and key != "lm_eval_help"}
        if not any(arg in ("--model", "-M") or arg.startswith("--model=") for arg in rest):
            rest = [*rest, "--model", "oscar-hf"]
        if extra:
            rest = [*rest, "--model_args", json.dumps(extra)]  # lm-eval merges repeated --model_args
    # lm-eval's CLI reads sys.argv itself (it inserts the implicit "run" subcommand there).
    sys.argv = ["oscar-eval", *rest]
    cli_evaluate()
