"""Loader for the offline tasks: `custom_dataset: !function utils.load_jsonl` in the task YAMLs.

`datasets.load_dataset("json", data_files=...)` resolves a relative path against the current directory, so a task
would only load when lm-eval runs from one particular folder. Here `data_files` is resolved against this folder,
wherever lm-eval runs from.
"""

from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load_jsonl(data_files: str, **metadata) -> datasets.DatasetDict:
    """The JSONL at `data_files` (relative to eval_configs/) as the "test" split. lm-eval also passes the task
    metadata (version, and the --metadata / model args), which the data does not depend on."""
    path = HERE / data_files
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: build the offline tasks with `python {HERE / 'build_data.py'}`.")
    return datasets.load_dataset("json", data_files={"test": str(path)})
