"""The offline tasks: build_data.py makes deterministic, well-formed documents, and lm-eval loads the task YAMLs
from local files with no network, from any working directory."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from lm_eval.tasks import TaskManager

EVAL_CONFIGS = Path(__file__).resolve().parents[1] / "eval_configs"


def load_build_data():
    spec = importlib.util.spec_from_file_location("build_data", EVAL_CONFIGS / "build_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def build_data():
    return load_build_data()


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_build_is_deterministic_and_well_formed(build_data, tmp_path):
    first = build_data.build(["1k"], n_docs=10, seed=0, out_dir=tmp_path / "a")
    second = build_data.build(["1k"], n_docs=10, seed=0, out_dir=tmp_path / "b")
    assert [p.read_bytes() for p in first] == [p.read_bytes() for p in second]
    assert {p.name for p in first} == {"passkey_1k.jsonl", "niah_1k.jsonl", "multikey_1k.jsonl", "pg_ppl_1k.jsonl"}

    passkey = read(tmp_path / "a" / "passkey_1k.jsonl")
    assert [d["depth"] for d in passkey] == [build_data.DEPTHS[i % 5] for i in range(10)]
    for doc in passkey:
        assert doc["answer"].isdigit() and len(doc["answer"]) == 5
        assert f"The pass key is {doc['answer']}." in doc["context"]
        assert doc["context"].endswith("The pass key is")
        # The needle sits near its depth (measured on characters, within 10% of the document).
        position = doc["context"].index(f"The pass key is {doc['answer']}") / len(doc["context"])
        assert abs(position - doc["depth"]) < 0.1
        # About 1k tokens at ~4.4 characters per token.
        assert 3000 < len(doc["context"]) < 5000

    for doc in read(tmp_path / "a" / "multikey_1k.jsonl"):
        needles = doc["context"].count("One of the special magic numbers for")
        assert needles == 4 and f"is: {doc['answer']}." in doc["context"]
        asked_key = doc["context"].rsplit("magic number for ", 1)[1].split()[0]
        assert f"special magic numbers for {asked_key} is: {doc['answer']}." in doc["context"]

    texts = [d["text"] for d in read(tmp_path / "a" / "pg_ppl_1k.jsonl")]
    assert len(texts) == 10 and len(set(texts)) == 10


@pytest.fixture(scope="module")
def task_data(build_data):
    """The 1k tasks in eval_configs/data/ (git-ignored; built here if missing, as a user would)."""
    if not (build_data.DATA_DIR / "pg_ppl_1k.jsonl").exists():
        build_data.build(["1k"], n_docs=20, seed=0)


@pytest.mark.slow  # lm-eval's TaskManager indexes every task it ships: minutes on a CPU
def test_offline_tasks_load_without_network(task_data, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # data_files are relative to eval_configs/, not to the working directory
    names = ["oscar_passkey_1k", "oscar_niah_1k", "oscar_multikey_1k", "oscar_passkey_gen_1k", "oscar_pg_ppl_1k"]
    tasks = TaskManager(include_path=str(EVAL_CONFIGS)).load(names)["tasks"]
    for name in names:
        task = tasks[name]
        docs = list(task.test_docs())
        assert len(docs) >= 5, name
        if name == "oscar_pg_ppl_1k":
            assert task.OUTPUT_TYPE == "loglikelihood_rolling" and len(task.doc_to_target(docs[0])) > 3000
        elif name == "oscar_passkey_gen_1k":
            assert task.OUTPUT_TYPE == "generate_until" and task.doc_to_target(docs[0]) == docs[0]["answer"]
        else:
            # The request continuation is the answer with its leading space (loglikelihood adds no delimiter).
            assert task.OUTPUT_TYPE == "loglikelihood"
            assert task.doc_to_target(docs[0]) == " " + docs[0]["answer"]
            assert docs[0]["context"].endswith(" is")


def test_missing_data_names_the_fix(tmp_path):
    spec = importlib.util.spec_from_file_location("eval_utils", EVAL_CONFIGS / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(FileNotFoundError, match="build_data.py"):
        module.load_jsonl("data/no_such_task.jsonl")


@pytest.mark.slow  # lm-eval's TaskManager indexes every task it ships: minutes on a CPU
def test_online_group_is_indexed():
    """The online group resolves to lm-eval's own tasks (its data is not downloaded here)."""
    manager = TaskManager(include_path=str(EVAL_CONFIGS))
    assert "oscar_online" in manager.all_groups
    assert {"gsm8k", "longbench_passage_retrieval_en", "longbench_hotpotqa"} <= set(manager.all_tasks)
