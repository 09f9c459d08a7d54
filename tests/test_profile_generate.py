"""benchmarks/profile_generate.py: every labelled region names a function that exists (a renamed one would stop the
profile before it starts, on the GPU)."""

import importlib
import inspect


def test_every_region_names_a_function():
    profile_generate = importlib.import_module("profile_generate")  # benchmarks/ is on pytest's pythonpath
    for name, owner, attr in profile_generate.REGIONS:
        assert callable(getattr(owner, attr, None)), (name, owner, attr)
        assert inspect.isclass(owner) or inspect.ismodule(owner)
