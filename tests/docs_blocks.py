"""Run a Markdown document's command blocks as written, and check the outputs it quotes.

Commands are the ``sh`` and ``console`` fenced blocks (in ``console`` blocks, the ``$ `` lines and
their ``\\`` continuations; the other lines are the quoted output). Plain ``` blocks are not
commands (log excerpts, layouts) and must not look like them. A command block the tests cannot run
(the test suite itself, a template for the reader's own server) carries a visible marker right
above its fence, saying why::

    > **Not run by the docs tests:** the reason.

All blocks of a document run in order, in one shell, from a fresh temporary folder (not the
repository), with the project's Python environment activated as the docs ask (its ``python`` and
``hs-tracer`` first on PATH). Quoted output is checked loosely by default: every ``status:`` line and
every slot verdict (trained-on and observed source) quoted must appear in the real output of the same
block. A document checked strictly (docs/tutorial.md) must show every line a command prints, in
order, or elide it: a line that is only ``…`` stands for any number of lines, ``…`` inside a line for
any text; numbers must be within the document's stated tolerance (small integers exactly).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
MARKER = re.compile(r"^> \*\*Not run by the docs tests:\*\* (\S.*)$")
STATUS = re.compile(r"status: (\w+)")
SLOT = re.compile(r"slot (\d+): trained on (\S+)\s+(?:observed|measured|fed)\s+(\S+)")
COMMAND_KINDS = ("sh", "console")


@dataclass
class Block:
    line: int
    commands: str
    quoted: list[str]
    not_run: str | None = None  # the marker's reason


def blocks(text: str) -> list[Block]:
    """The command blocks of ``text``, in order (marked ones included, with their reason)."""
    out = []
    for m in FENCE.finditer(text):
        kind, body = m.group(1), m.group(2)
        if kind not in COMMAND_KINDS:
            continue
        line = text[: m.start()].count("\n") + 1
        before = [ln for ln in text[: m.start()].splitlines() if ln.strip()]
        marker = MARKER.match(before[-1]) if before else None
        reason = marker.group(1) if marker else None
        if kind == "sh":
            out.append(Block(line, body, [], reason))
            continue
        commands, quoted, continued = [], [], False
        for ln in body.splitlines():
            if ln.startswith("$ ") or continued:
                commands.append(ln[2:] if ln.startswith("$ ") else ln)
                continued = ln.endswith("\\")
            else:
                quoted.append(ln)
        out.append(Block(line, "\n".join(commands) + "\n", quoted, reason))
    return out


def unfenced_commands(text: str) -> list[str]:
    """Lines of plain or other fenced blocks that look like commands to type (``$ ...``)."""
    return [ln for m in FENCE.finditer(text) if m.group(1) not in COMMAND_KINDS
            for ln in m.group(2).splitlines() if ln.startswith("$ ")]


def environment(tmp: Path) -> dict[str, str]:
    """The docs' "activate .venv": this Python and its ``hs-tracer`` first on PATH."""
    bindir = tmp / ".bin"
    bindir.mkdir()
    (bindir / "python").symlink_to(sys.executable)
    script = Path(sys.executable).parent / "hs-tracer"
    if script.exists():
        (bindir / "hs-tracer").symlink_to(script)
    else:  # a checkout used without installing it: the same entry point
        (bindir / "hs-tracer").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hs_tracer.cli "$@"\n')
        (bindir / "hs-tracer").chmod(0o755)
    # No tracer setting leaks in from the caller; where the testbed is cached may.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HS_TRACER") or k == "HS_TRACER_TESTBED_DIR"}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


ELISION = "…"
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
EXACT_BELOW = 10
"""Integers below this are ids, slots, layer numbers, positions: they must match exactly. Larger
integers (token and step counts, distances) and decimals (rates, distances) may differ by the
document's tolerance: the testbed engine's batching varies them a little from run to run."""


def _line_pattern(quoted: str) -> tuple[re.Pattern[str], list[str]]:
    """A quoted line as a regex over a real line (``…`` stands for any text) and its numbers."""
    numbers: list[str] = []
    parts = []
    for piece in quoted.split(ELISION):
        out, last = [], 0
        for m in NUMBER.finditer(piece):
            out.append(re.escape(piece[last:m.start()]))
            out.append(r"(-?\d+(?:\.\d+)?)")
            numbers.append(m.group(0))
            last = m.end()
        out.append(re.escape(piece[last:]))
        parts.append("".join(out))
    return re.compile(".*?".join(parts) + r"\Z"), numbers


def _numbers_close(quoted: list[str], real: tuple[str, ...], rel: float) -> bool:
    for q, r in zip(quoted, real, strict=True):
        if "." not in q and abs(int(q)) < EXACT_BELOW:
            if q != r:
                return False
        elif abs(float(q) - float(r)) > rel * max(abs(float(q)), abs(float(r))) + 1e-12:
            return False
    return True


def line_matches(quoted: str, real: str, rel: float) -> bool:
    """``real`` is ``quoted`` up to its ``…`` elisions and numbers within ``rel`` (relative)."""
    pattern, numbers = _line_pattern(quoted)
    m = pattern.match(real)
    return m is not None and _numbers_close(numbers, m.groups(), rel)


def output_problems(quoted: list[str], output: str, rel: float) -> list[str]:
    """Every line the command printed must be shown in ``quoted`` (in order, numbers within ``rel``)
    or elided by a line that is only ``…``; returns what does not hold."""
    real = [ln for ln in output.splitlines() if ln.strip() and not ln.startswith("@@RC ")]
    want = [ln for ln in quoted if ln.strip()]
    # dynamic programming over (quoted line, real line): an elision line absorbs any number of lines
    reach = {(0, 0)}
    frontier = [(0, 0)]
    while frontier:
        i, j = frontier.pop()
        nxt = []
        if i < len(want) and want[i].strip() == ELISION:
            nxt += [(i + 1, j)] + ([(i, j + 1)] if j < len(real) else [])
        elif i < len(want) and j < len(real) and line_matches(want[i], real[j], rel):
            nxt.append((i + 1, j + 1))
        for state in nxt:
            if state not in reach:
                reach.add(state)
                frontier.append(state)
    if (len(want), len(real)) in reach:
        return []
    i, j = max(reach)
    shown = repr(want[i]) if i < len(want) else "nothing (the quoted output ends)"
    printed = repr(real[j]) if j < len(real) else "nothing (the output ends)"
    return [f"the output's line {j + 1}, {printed}, is neither shown nor elided where the document "
            f"quotes {shown}"]


def run_document(doc: Path, tmp: Path, timeout: int, tolerance: float | None = None) -> list[str]:
    """Run every unmarked command block of ``doc`` in order from a fresh folder under ``tmp``; the
    problems found (a block that exits other than 0 or 1, a quoted verdict missing from its output).
    With ``tolerance`` (relative, for numbers) every quoted output must be the real output line by
    line (:func:`output_problems`). The whole transcript is kept in ``tmp/transcript.txt``."""
    work = tmp / "work"
    work.mkdir()
    found = [b for b in blocks(doc.read_text()) if b.not_run is None]
    script = []
    for i, b in enumerate(found):
        script += [f"echo '@@BLOCK {i}'", b.commands, f"echo \"@@RC {i} $?\""]
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=environment(tmp),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    (tmp / "transcript.txt").write_text(proc.stdout)
    parts = re.split(r"^@@BLOCK (\d+)$", proc.stdout, flags=re.M)
    outputs = {int(parts[k]): parts[k + 1] for k in range(1, len(parts), 2)}
    if sorted(outputs) != list(range(len(found))):
        return [f"{doc.name}: not every block ran\n{proc.stdout[-4000:]}"]
    problems = []
    for i, b in enumerate(found):
        out = outputs[i]
        where = f"{doc.name}:{b.line}"
        rc = int(re.search(rf"^@@RC {i} (\d+)$", out, re.M).group(1))
        if rc not in (0, 1):  # 1 is the answer "critical findings" of a miswired step
            problems.append(f"{where}: exit {rc}\n{out[-3000:]}")
            continue
        if tolerance is not None and b.quoted:
            problems += [f"{where}: {p}\n{out[-3000:]}" for p in output_problems(b.quoted, out, tolerance)]
        for q in b.quoted:
            if (m := STATUS.search(q)) and not re.search(rf"status: {m.group(1)}\b", out):
                problems.append(f"{where}: expected 'status: {m.group(1)}'\n{out[-3000:]}")
            if m := SLOT.search(q):
                n, trained, observed = m.groups()
                if not re.search(rf"slot {n}: trained on {re.escape(trained)}\s+(?:observed|measured|fed)\s+"
                                 rf"{re.escape(observed)}\b", out):
                    problems.append(f"{where}: expected slot {n} {trained} -> {observed}\n{out[-3000:]}")
    return problems
