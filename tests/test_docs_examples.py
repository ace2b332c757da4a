"""Inline ``hs-tracer ...`` examples in the docs are commands the CLI's parser accepts (no unknown or
misspelt option, no missing required argument). What an example needs beyond the parser (a
``profile build`` needs ``--target`` for the layer count of its data) only a run shows. Mentions
of a command or of one option (``hs-tracer check --json``) are not examples; an example is one that
names a path or gives three or more arguments."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from hs_tracer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
INLINE = re.compile(r"`(hs-tracer [^`]*)`")
PLACEHOLDER = ("...", "[", "|", "<", "COMMAND", "build/merge", "build/push")


def _examples() -> list[tuple[str, str]]:
    out = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in INLINE.finditer(doc.read_text()):
            text = m.group(1)
            if any(p in text for p in PLACEHOLDER):
                continue
            words = shlex.split(text)[1:]
            args = [w for w in words if w.startswith("-") or "/" in w or w.isupper() or "." in w]
            if "/" in text or len(args) >= 3:
                out.append((doc.name, text))
    return out


def test_inline_examples_parse() -> None:
    found = _examples()
    assert len(found) >= 10
    problems = []
    for doc, text in found:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                build_parser().parse_args(shlex.split(text)[1:])
        except SystemExit:
            problems.append(f"{doc}: {text}: {err.getvalue().strip()}")
    assert problems == [], "\n".join(problems)
