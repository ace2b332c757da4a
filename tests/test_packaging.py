"""What a production install carries: hs_tracer without the CPU testbed, which is its own distribution
(testbed/) and is named only by the two commands that need it, with a one-line hint when missing."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hs_tracer import commands
from hs_tracer.cli import main

ROOT = Path(__file__).resolve().parents[1]
# The only production modules that may name the testbed: they check for it and say how to install it.
TESTBED_USERS = {"hs_tracer/commands/demo.py", "hs_tracer/commands/testbed.py"}


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_production_package_imports_no_testbed() -> None:
    offenders = sorted(
        str(path.relative_to(ROOT))
        for path in (ROOT / "hs_tracer").rglob("*.py")
        if str(path.relative_to(ROOT)) not in TESTBED_USERS
        and any(m.split(".")[0] == "hs_tracer_testbed" for m in _imported_modules(path))
    )
    assert offenders == []


def test_wheel_of_the_production_package_has_no_testbed(tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", ".cache", "build",
                                                             "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
         str(tmp_path / "dist"), str(src)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("hs_tracer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hs_tracer/cli.py" in names
    assert "hs_tracer/fingerprint/graph_replay.c" in names  # the probe compiles it where it runs
    assert not [n for n in names if "testbed/" in n or n.startswith("hs_tracer_testbed")]
    assert not [n for n in names if n.endswith((".safetensors", "sitecustomize.py"))]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    for extra in ("testbed", "dashboards", "gpu"):
        assert f"Provides-Extra: {extra}" in metadata


@pytest.mark.parametrize("argv", [["demo"], ["testbed", "build", "--out", "{tmp}/tb"]])
def test_commands_without_the_testbed_say_how_to_install_it(
    argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(commands, "testbed_installed", lambda: False)
    code = main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert code == 2
    assert "pip install ./testbed" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "tb").exists()
