"""`oscar-serve`: `transformers serve` (an OpenAI-compatible HTTP server) with the 2-bit pool.

    oscar-serve MODEL --continuous-batching --cache-config '{"bits": 2}' [any other `transformers serve` option]

`--cache-config` (a JSON object of `OscarConfig` fields; default `{}`, the pool's defaults: `pool_config`) is this
command's only option; everything else is `transformers serve`'s, unchanged. Its CLI cannot name a cache, and it loads
the model in a process of its own, which a plugin imported by the command never reaches: `oscar-serve` runs
transformers' `Serve` with a model loader (`OscarModelLoader`) that sets the loaded model's generation config to
`cache_implementation="oscar"` with that `cache_config` (in the model's process, in memory: nothing is saved). The
loader travels to the model's process pickled, and unpickling it imports oscar_hf there, which registers the pool.
Without `--continuous-batching` the server generates with `model.generate`, with the OScaR cache and the same options.
"""

from __future__ import annotations

import json
import sys

import typer
from transformers.cli.serve import Serve
from transformers.cli.serving.model_manager import ModelLoader

from .hooks import CACHE_IMPLEMENTATION, pool_config

OPTION = "--cache-config"


class OscarModelLoader(ModelLoader):
    """transformers serve's loader, with `cache_implementation="oscar"` and `cache_config` set on each model it
    loads."""

    def __init__(self, loader: ModelLoader, cache_config: dict):
        vars(self).update(vars(loader))  # the server's settings, as its own loader resolved them
        self.cache_config = dict(cache_config)

    def load_model_and_processor(self, model_id: str, on_progress=None):
        model, processor = super().load_model_and_processor(model_id, on_progress)
        model.generation_config.cache_implementation = CACHE_IMPLEMENTATION
        model.generation_config.cache_config = dict(self.cache_config)
        return model, processor


class OscarServe(Serve):
    """`Serve` whose models load through `OscarModelLoader` (`cache_config`: set by `command`)."""

    cache_config: dict = {}

    def run(self, socket=None, engine_connection=None) -> None:
        self.loader = OscarModelLoader(self.loader, self.cache_config)
        super().run(socket, engine_connection)

    def run_api_servers(self, count: int) -> None:
        self.loader = OscarModelLoader(self.loader, self.cache_config)
        super().run_api_servers(count)


def command(cache_config: dict) -> type[OscarServe]:
    """The serve command for `cache_config` (a subclass: typer builds the CLI from `Serve.__init__`'s signature)."""
    return type("OscarServe", (OscarServe,), {"cache_config": dict(cache_config)})


def split_arguments(argv: list[str]) -> tuple[dict, list[str]]:
    """(`--cache-config`'s JSON object, the other arguments), refusing a value that is not a JSON object or that the
    pool cannot run."""
    rest, cache_config = [], {}
    arguments = iter(argv)
    for argument in arguments:
        if argument == OPTION or argument.startswith(OPTION + "="):
            text = argument.partition("=")[2] if "=" in argument else next(arguments, None)
            if text is None:
                raise SystemExit(f"{OPTION} needs a JSON object of OscarConfig fields, e.g. '{{\"bits\": 2}}'.")
            try:
                cache_config = json.loads(text)
            except json.JSONDecodeError as error:
                raise SystemExit(f"{OPTION} {text!r} is not JSON: {error}") from None
            if not isinstance(cache_config, dict):
                raise SystemExit(f"{OPTION} must be a JSON object of OscarConfig fields, got {text!r}.")
        else:
            rest.append(argument)
    try:
        pool_config(cache_config)
    except ValueError as error:
        raise SystemExit(f"{OPTION}: {error}") from None
    return cache_config, rest


def main(argv: list[str] | None = None) -> None:
    cache_config, rest = split_arguments(sys.argv[1:] if argv is None else argv)
    app = typer.Typer(add_completion=False, help=__doc__)
    app.command()(command(cache_config))
    app(args=rest, prog_name="oscar-serve")


if __name__ == "__main__":
    main()
