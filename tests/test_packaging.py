"""The built wheel (not only the editable install) ships `oscar_hf.kernels` and no top-level `kernels` package,
which would shadow HuggingFace's own `kernels` that transformers probes with find_spec("kernels"); its only other
top-level name is the `oscar_eval` module of the oscar-eval command line."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # builds a wheel and installs it in a fresh environment
def test_the_wheel_ships_kernels_inside_oscar_hf_and_imports_outside_the_checkout(tmp_path):
    """The wheel's files, then the wheel installed into a folder of its own, imported by the interpreter running the
    tests (whose packages, torch and transformers, it needs) from outside the checkout: PYTHONPATH puts the folder
    before site-packages, so the wheel's copy wins over any editable install of the checkout. One test: the build
    writes the checkout's build/ folder, which two test workers building at once would race for."""
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", tmp_path, ROOT],
        check=True,
    )
    (wheel,) = tmp_path.glob("oscar_hf-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "oscar_hf/kernels/__init__.py" in names and "oscar_eval.py" in names
    assert not [n for n in names if n.startswith("kernels/")]
    top_level = [n for n in names if n.endswith("top_level.txt")]
    assert top_level and zipfile.ZipFile(wheel).read(top_level[0]).decode().split() == ["oscar_eval", "oscar_hf"]

    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target, wheel], check=True
    )
    probe = (
        "import importlib.util, oscar_eval, oscar_hf, oscar_hf.kernels; "
        "spec = importlib.util.find_spec('kernels'); "
        "print(oscar_hf.__file__); print(oscar_hf.kernels.__file__); print(oscar_eval.__file__); "
        "print(spec.origin if spec else None)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, f"the probe failed:\n{result.stderr}"
    lines = result.stdout.splitlines()
    assert all(line.startswith(str(target)) for line in lines[:3]), lines
    # the `kernels` found is HuggingFace's (transformers >= 5.25 installs it), neither the wheel's nor the checkout's
    installed = _huggingface_kernels()
    assert (lines[3] == "None" and not installed) or os.path.realpath(lines[3]) in installed, (lines, installed)


def _huggingface_kernels() -> list[str]:
    """Where HuggingFace's `kernels` package is installed (empty: it is not; transformers >= 5.25 requires it)."""
    return [
        os.path.realpath(d.locate_file("kernels/__init__.py")) for d in importlib.metadata.distributions(name="kernels")
    ]


def test_python_started_at_the_checkouts_root_imports_huggingface_kernels():
    """From the checkout's root (`python -c`, `python -m pytest`, a REPL put it first on sys.path) `import kernels`
    finds this kernels/ folder first, which hands over to HuggingFace's package (transformers >= 5.25 imports it);
    `oscar_hf.kernels` stays this folder. Two processes: a probe, and pytest collecting a test file that imports a
    transformers model (whose module imports `kernels` where it is installed)."""
    probe = (
        "import json, oscar_hf, kernels, sys; from transformers import LlamaForCausalLM; "
        "from transformers.utils.import_utils import is_kernels_available; "
        "print(kernels.__file__); print(oscar_hf.kernels.__file__); print(is_kernels_available()); "
        "print(json.dumps([m.__file__ for n, m in sys.modules.items() if n.startswith('kernels.') and m.__file__]))"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    found, ours, available, submodules = result.stdout.splitlines()
    assert os.path.realpath(ours) == str(ROOT / "kernels" / "__init__.py")
    installed = _huggingface_kernels()
    if installed:  # HuggingFace's package and its submodules, never this folder
        assert os.path.realpath(found) in installed and available == "True", result.stdout
        home, files = os.path.dirname(os.path.realpath(found)), json.loads(submodules)
        assert files and all(os.path.realpath(f).startswith(home + os.sep) for f in files), submodules
    else:  # no HuggingFace package to hand over to: transformers takes `kernels` as absent
        assert available == "False", result.stdout

    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "tests/test_config.py"]
    result = subprocess.run(collect, cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and " collected" in result.stdout, result.stdout + result.stderr


@pytest.mark.slow  # an environment without HuggingFace's kernels, in a subprocess
def test_without_huggingface_kernels_transformers_takes_the_folder_for_absent(tmp_path):
    """Where HuggingFace's `kernels` is not installed (transformers < 5.25), the folder found as `kernels` from the
    checkout's root stays: find_spec finds it, but transformers' check reads no version and says `kernels` is absent,
    and models import. The environment without it: this interpreter's site-packages linked entry by entry into a
    folder, HuggingFace's package and its metadata left out, read by `python -S` (no other site-packages)."""
    packages = Path(importlib.metadata.distribution("transformers").locate_file(""))
    hidden = tmp_path / "site-packages"
    hidden.mkdir()
    for entry in packages.iterdir():
        if entry.name != "kernels" and not (entry.name.startswith("kernels-") and entry.name.endswith(".dist-info")):
            (hidden / entry.name).symlink_to(entry)
    probe = (
        f"import site; site.addsitedir({str(hidden)!r}); "
        "import importlib.metadata, importlib.util, oscar_hf; from transformers import LlamaForCausalLM; "
        "from transformers.utils.import_utils import is_kernels_available; "
        "print(list(importlib.metadata.distributions(name='kernels'))); "
        "print(importlib.util.find_spec('kernels').origin); print(is_kernels_available())"
    )
    result = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    distributions, origin, available = result.stdout.splitlines()
    assert distributions == "[]" and os.path.realpath(origin) == str(ROOT / "kernels" / "__init__.py"), result.stdout
    assert available == "False", result.stdout


def test_a_checkout_without_the_kernels_mapping_says_how_to_fix_it(tmp_path):
    """A copy of oscar_hf/ first on the path with nothing mapping kernels/ into it (a checkout's root in front of a
    non-editable install): `import oscar_hf` names the fix. `python -S`: no site-packages, so no editable install's
    finder maps `oscar_hf.kernels` (the check runs before anything else is imported)."""
    shutil.copytree(ROOT / "oscar_hf", tmp_path / "oscar_hf", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-S", "-c", "import oscar_hf"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0 and "pip install -e ." in result.stderr, result.stderr
