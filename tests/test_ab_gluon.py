"""benchmarks/ab_gluon.py names each kernel version in its records by the git blob hash of its file: the same hash for
a file and for a revision holding that file, and the one `git hash-object` gives, so that a record's arm can be found
in the history. (Its timings need a GPU; they are benchmark records, not tests.)"""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "kernels" / "decode_attention_gluon.py"


@pytest.fixture(scope="module")
def ab_gluon():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("ab_gluon", ROOT / "benchmarks" / "ab_gluon.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout.strip()


def test_arm_blob_is_gits_for_a_file_and_a_revision(ab_gluon, tmp_path, monkeypatch):
    pytest.importorskip("triton.experimental.gluon")
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout of the repository (the README installs from a clone)")
    # a file that differs from every committed version, as a probe would
    probe = tmp_path / "probe.py"
    probe.write_text(KERNEL.read_text() + "\n# probe\n")
    module, blob = ab_gluon.load_arm(str(probe))
    assert blob == _git("hash-object", str(probe))
    assert callable(module.launch) and module.WARPS == 2
    # the committed kernel, by revision: git's blob of HEAD's file (git show runs in the repo root, as the tool does)
    monkeypatch.chdir(ROOT)
    _, head_blob = ab_gluon.load_arm("HEAD")
    assert head_blob == _git("rev-parse", "HEAD:kernels/decode_attention_gluon.py") != blob


def test_arm_that_is_neither_file_nor_revision_is_refused(ab_gluon, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match="neither a file nor a revision"):
        ab_gluon.load_arm("no-such-revision-or-file")
