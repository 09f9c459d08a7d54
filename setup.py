# The `kernels/` folder ships as `oscar_hf.kernels`: a top-level `kernels` package would shadow HuggingFace's own
# `kernels` package, which transformers probes with find_spec("kernels"). pyproject.toml cannot express this
# package_dir mapping with an explicit package list, hence this file. `oscar_eval` (the oscar-eval command line) is a
# module of its own, outside the oscar_hf package: see its docstring.
from setuptools import setup

setup(
    py_modules=["oscar_eval"],
    packages=["oscar_hf", "oscar_hf.cache", "oscar_hf.integrations", "oscar_hf.kernels", "oscar_hf.serving"],
    package_dir={"oscar_hf": "oscar_hf", "oscar_hf.kernels": "kernels"},
)
