"""docs/tutorial.md, run as written: every ``sh`` and ``console`` block, in order, in one shell, from a
fresh temporary folder (not the repository), with the environment the tutorial asks for (the
project's Python environment activated). The outputs the text quotes are checked loosely: every
``status:`` line and every slot verdict (trained-on and observed source) it shows must appear in the
real output of the same block. Plain ``` blocks (log excerpts) are not commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs/tutorial.md"
FENCE = re.compile(r"^```(sh|console)\n(.*?)^```", re.M | re.S)
STATUS = re.compile(r"status: (\w+)")
SLOT = re.compile(r"slot (\d+): trained on (\S+)\s+(?:observed|fed) (\S+)")


@dataclass
class Block:
    line: int
    commands: str
    quoted: list[str]


def blocks(text: str) -> list[Block]:
    out = []
    for m in FENCE.finditer(text):
        kind, body = m.group(1), m.group(2)
        line = text[: m.start()].count("\n") + 1
        if kind == "sh":
            out.append(Block(line, body, []))
            continue
        commands, quoted, continued = [], [], False
        for ln in body.splitlines():
            if ln.startswith("$ ") or continued:
                commands.append(ln[2:] if ln.startswith("$ ") else ln)
                continued = ln.endswith("\\")
            else:
                quoted.append(ln)
        out.append(Block(line, "\n".join(commands) + "\n", quoted))
    return out


def test_tutorial_blocks_are_found() -> None:
    found = blocks(TUTORIAL.read_text())
    assert len(found) >= 8
    assert sum(bool(b.quoted) for b in found) >= 5
    assert all(b.commands.strip() for b in found)


def _environment(tmp: Path) -> dict[str, str]:
    """The tutorial's "activate .venv": its Python and ``hs-tracer`` first on PATH."""
    bindir = tmp / ".bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    script = Path(sys.executable).parent / "hs-tracer"
    if script.exists():
        (bindir / "hs-tracer").symlink_to(script)
    else:  # a checkout used without installing it: the same entry point
        (bindir / "hs-tracer").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hs_tracer.cli "$@"\n')
        (bindir / "hs-tracer").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


@pytest.mark.engine
@pytest.mark.timeout(3600)  # three engine starts, a profile build and two replays: 14-15 min on 2 busy cores
def test_tutorial_runs_from_a_fresh_folder(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    found = blocks(TUTORIAL.read_text())
    script = []
    for i, b in enumerate(found):
        script += [f"echo '@@BLOCK {i}'", b.commands, f"echo \"@@RC {i} $?\""]
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=_environment(tmp_path),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3600)
    parts = re.split(r"^@@BLOCK (\d+)$", proc.stdout, flags=re.M)
    outputs = {int(parts[k]): parts[k + 1] for k in range(1, len(parts), 2)}
    assert sorted(outputs) == list(range(len(found))), proc.stdout[-4000:]
    problems = []
    for i, b in enumerate(found):
        out = outputs[i]
        rc = int(re.search(rf"^@@RC {i} (\d+)$", out, re.M).group(1))
        if rc not in (0, 1):  # 1 is the answer "critical findings" of a miswired step
            problems.append(f"tutorial.md:{b.line}: exit {rc}\n{out[-3000:]}")
            continue
        for q in b.quoted:
            if (m := STATUS.search(q)) and not re.search(rf"status: {m.group(1)}\b", out):
                problems.append(f"tutorial.md:{b.line}: expected 'status: {m.group(1)}'\n{out[-3000:]}")
            if m := SLOT.search(q):
                n, trained, observed = m.groups()
                if not re.search(rf"slot {n}: trained on {re.escape(trained)}\s+(?:observed|fed) "
                                 rf"{re.escape(observed)}\b", out):
                    problems.append(f"tutorial.md:{b.line}: expected slot {n} {trained} -> {observed}\n"
                                    f"{out[-3000:]}")
    assert problems == [], "\n\n".join(problems)
