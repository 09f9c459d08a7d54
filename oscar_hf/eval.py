"""`oscar-eval`: lm-eval's own command line, with the `oscar-hf` model registered and two cache shortcuts.

lm-eval has no plugin entry point for models, so the model has to be registered (by importing
`oscar_hf.integrations.lm_eval`) in the process that runs lm-eval's CLI. Everything lm-eval accepts is accepted
and handled by lm-eval itself; on top of it:

    --method NAME         a cache method of oscar_hf.integrations.lm_eval.METHODS (default: oscar-int2)
    --cache_config JSON   options merged over the method's own, e.g. '{"residual_length": 64}'

both folded into --model_args; --model defaults to oscar-hf. Example (offline, from the repository root):

    python eval_configs/build_data.py
    oscar-eval --model_args pretrained=smollm2-135m --method kivi-int2 \\
        --include_path eval_configs --tasks oscar_passkey_2k,oscar_pg_ppl_2k --limit 10
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> None:
    from lm_eval.__main__ import cli_evaluate

    from .integrations import lm_eval as _registers_oscar_hf  # noqa: F401

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--method")
    parser.add_argument("--cache_config", type=json.loads)
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in rest):
        print(__doc__)  # our two options, before lm-eval's own help
    if not rest or rest[0] not in ("ls", "validate"):  # an evaluation ("run", explicit or implied)
        extra = {key: value for key, value in vars(ours).items() if value is not None}
        if not any(arg in ("--model", "-M") or arg.startswith("--model=") for arg in rest):
            rest = [*rest, "--model", "oscar-hf"]
        if extra:
            rest = [*rest, "--model_args", json.dumps(extra)]  # lm-eval merges repeated --model_args
    # lm-eval's CLI reads sys.argv itself (it inserts the implicit "run" subcommand there).
    sys.argv = ["oscar-eval", *rest]
    cli_evaluate()
