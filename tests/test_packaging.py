"""The built wheel (not only the editable install) ships `oscar_hf.kernels` and no top-level `kernels` package,
which would shadow HuggingFace's own `kernels` that transformers probes with find_spec("kernels"); its only other
top-level name is the `oscar_eval` module of the oscar-eval command line."""

import importlib.metadata
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
    installed = [
        os.path.realpath(d.locate_file("kernels/__init__.py")) for d in importlib.metadata.distributions(name="kernels")
    ]
    assert (lines[3] == "None" and not installed) or os.path.realpath(lines[3]) in installed, (lines, installed)


def test_the_checkout_kernels_folder_found_as_huggingface_kernels_says_so():
    """From the checkout's root (`python -c` there puts it on sys.path) `import kernels` finds this kernels/ folder:
    where HuggingFace's `kernels` is installed (transformers >= 5.25 requires it) that is an error naming the fix,
    not transformers failing inside it; without it, transformers takes the folder for an absent `kernels`."""
    result = subprocess.run([sys.executable, "-c", "import kernels"], cwd=ROOT, capture_output=True, text=True)
    if any(importlib.metadata.distributions(name="kernels")):
        assert result.returncode != 0 and "Run from another directory, or with `python -P`" in result.stderr
    else:
        assert result.returncode == 0, result.stderr
