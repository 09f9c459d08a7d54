"""`oscar-eval`: lm-eval's command line with the `oscar-hf` model registered and the cache method as an option.

lm-eval has no plugin entry point for models, so the model has to be registered (by importing
`oscar_hf.integrations.lm_eval`) in the process that runs lm-eval's CLI. Every other option is lm-eval's own and
handled by lm-eval; `--method` and `--cache_config` are folded into `--model_args`, and `--model` defaults to
`oscar-hf`.

A module outside the `oscar_hf` package: importing anything under `oscar_hf` runs its `__init__`, which registers the
cache with transformers (seconds of torch and transformers imports), so `--help` would not be quick. It reads the
methods' table (`oscar_hf/methods.py`, plain data) from its file instead; only an evaluation imports oscar_hf and
lm-eval.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
from pathlib import Path

NOT_APPLICABLE = "Custom kwargs can be passed to `--metadata`"
EXAMPLE = """\
example (offline, from the repository root; SmolLM2-135M, 4 documents, about 3 CPU-minutes):
  python eval_configs/build_data.py --lengths 1k
  oscar-eval --model_args pretrained=smollm2-135m --method oscar-auto-3.2-sinks4 \\
      --include_path eval_configs --tasks oscar_passkey_1k --limit 4

pretrained= takes a local model folder, a hub id, or an offline model of oscar_hf.offline_models
(smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, gemma-3-270m). Every other option is lm-eval's: see
`oscar-eval --lm-eval-help` (e.g. --tasks, --limit, --batch_size, --output_path, --include_path, --device)."""


INSTALL = 'oscar-eval needs lm-eval: install the evaluation extra, `pip install -e ".[eval]"` in the repository.'


def methods_module():
    """`oscar_hf.methods` (METHODS, DEFAULT_METHOD), read from its file without importing the oscar_hf package (see
    the docstring)."""
    package = importlib.util.find_spec("oscar_hf")
    spec = importlib.util.spec_from_file_location(
        "_oscar_eval_methods", Path(package.submodule_search_locations[0]) / "methods.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parser() -> argparse.ArgumentParser:
    module = methods_module()
    table, default = module.METHODS, module.DEFAULT_METHOD
    methods_help = "\n".join(f"  {name:26} {_describe(*options)}" for name, options in table.items())
    parser = argparse.ArgumentParser(
        prog="oscar-eval",
        description=f"{__doc__.splitlines()[0][14:]}\n\nmethods (--method):\n{methods_help}",
        epilog=EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--method", choices=sorted(table), help=f"the KV cache to evaluate (default: {default})")
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
    if implementation == "tiny-turboquant":
        return f"tiny-turboquant's TinyKVCache {options}"
    return f"OscarCache {options}"


def main(argv: list[str] | None = None) -> None:
    ours, rest = _parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    # Imported only now: lm-eval's CLI and oscar_hf take seconds to import.
    try:
        from lm_eval.__main__ import cli_evaluate
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] != "lm_eval":
            raise
        raise SystemExit(f"{INSTALL} ({error})") from error

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
