"""benchmarks/ab_kernels.py names each version of the decode kernels in its records by the git tree hash of its
`kernels/` files: the same hash for a folder and for a revision holding those files, and the one git computes, so that
a record's arm can be found in the history. (Its timings need a GPU; they are benchmark records, not tests.)"""

import importlib
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ab_kernels():
    return importlib.import_module("ab_kernels")  # benchmarks/ is on pytest's pythonpath (pyproject.toml)


def _git(*args: str, stdin: str | None = None, repo: Path = ROOT) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], input=stdin, capture_output=True, text=True, check=True
    ).stdout.strip()


def _git_tree_of_folder(folder: Path, scratch: Path) -> str:
    """Git's own tree hash of a folder's .py files: their blobs (`git hash-object`) listed into `git mktree`, in a
    scratch repository (mktree stores the tree it makes)."""
    _git("init", "-q", str(scratch), repo=folder)
    blobs = {f.name: _git("hash-object", str(f), repo=scratch) for f in sorted(folder.glob("*.py"))}
    entries = [f"100644 blob {blob}\t{name}" for name, blob in blobs.items()]
    return _git("mktree", "--missing", stdin="\n".join(entries) + "\n", repo=scratch)


def test_arm_tree_is_gits_for_a_folder_and_a_revision(ab_kernels, tmp_path, monkeypatch):
    pytest.importorskip("triton.experimental.gluon")
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout of the repository (the README installs from a clone)")
    # a folder that differs from every committed version, as a probe would: one kernel file edited
    probe = tmp_path / "kernels"
    shutil.copytree(ROOT / "kernels", probe, ignore=shutil.ignore_patterns("__pycache__"))
    gluon = probe / "decode_gluon.py"
    gluon.write_text(gluon.read_text() + "\n# probe\n")
    launcher, tree = ab_kernels.load_arm(str(probe))
    assert tree == _git_tree_of_folder(probe, tmp_path / "scratch")
    assert callable(launcher.decode_attention_triton) and launcher.decode_gluon.WARPS == 2
    assert launcher.__name__ != "oscar_hf.kernels"  # a package of its own, not the installed one
    # the committed kernels, by revision: git's tree of HEAD's kernels/ (git runs in the repo root, as the tool does)
    monkeypatch.chdir(ROOT)
    _, head_tree = ab_kernels.load_arm("HEAD")
    assert head_tree == _git("rev-parse", "HEAD:kernels") != tree


def test_arm_that_is_neither_folder_nor_revision_is_refused(ab_kernels, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit, match="neither a folder nor a revision"):
        ab_kernels.load_arm("no-such-revision-or-folder")


def test_shared_kv_views_the_first_heads_data(ab_kernels):
    """`--shared-kv`: every (batch, KV head) views the first one's quantized data (stride 0, nothing copied), in the
    shapes the storage layout checks, so the kernels see the real grid while the codes stay in L2."""
    from oscar_hf import OscarConfig
    from oscar_hf.layout import StorageLayout
    from oscar_hf.reference import quantize_kv

    config, gen = OscarConfig(bits=2, sink_tokens=0), torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, 3, 64, 128, generator=gen)
    quantized = quantize_kv(keys, values, config)
    shared = ab_kernels.shared_across_heads(quantized)
    assert StorageLayout.of(config).check(shared, 2, 3, 128, keys.device, "test") == 64
    for name, field, first in zip(quantized._fields, shared, quantized):
        if first is None:
            continue
        assert field.data_ptr() == first.data_ptr(), name
        assert all(stride == 0 for stride, n in zip(field.stride()[:2], field.shape[:2]) if n > 1), name
        assert torch.equal(field, first[:1, :1].expand_as(first)) and not torch.equal(field, first), name
