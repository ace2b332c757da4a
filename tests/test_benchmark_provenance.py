"""The commit a benchmark result names: the caller's declaration, else git's (dirty when a tracked file
differs), else unknown."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _provenance():
    spec = importlib.util.spec_from_file_location("provenance", ROOT / "benchmarks" / "provenance.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def test_commit_and_dirty_come_from_git_then_the_environment(tmp_path: Path) -> None:
    prov = _provenance()
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(repo, "rev-parse", "HEAD")
    assert prov.source_state(repo, env={}) == {"commit": head, "dirty": False, "from": "git"}
    (repo / "new.txt").write_text("untracked files are not code that ran\n")
    assert prov.source_state(repo, env={})["dirty"] is False
    (repo / "a.py").write_text("x = 2\n")
    assert prov.source_state(repo, env={}) == {"commit": head, "dirty": True, "from": "git"}
    # a copied tree whose .git is stale or missing: the caller's declaration wins
    env = {prov.COMMIT_ENV: "abc123", prov.DIRTY_ENV: "0"}
    assert prov.source_state(repo, env=env) == {"commit": "abc123", "dirty": False, "from": prov.COMMIT_ENV}
    plain = tmp_path / "copy"
    plain.mkdir()
    assert prov.source_state(plain, env={prov.COMMIT_ENV: "abc123"})["dirty"] is None
    assert prov.source_state(plain, env={}) == {"commit": None, "dirty": None, "from": None}
