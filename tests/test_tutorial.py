"""docs/tutorial.md, run as written (tests/docs_blocks.py): every command block, in order, in one
shell, from a fresh temporary folder, with the quoted verdicts checked in the real output."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import ROOT, blocks, run_document, unfenced_commands

TUTORIAL = ROOT / "docs/tutorial.md"


def test_tutorial_blocks_are_found() -> None:
    text = TUTORIAL.read_text()
    found = blocks(text)
    assert len(found) >= 8
    assert sum(bool(b.quoted) for b in found) >= 5
    assert all(b.commands.strip() for b in found)
    assert [b.line for b in found if b.not_run] == []  # every step of the tutorial runs
    assert unfenced_commands(text) == []


@pytest.mark.engine
@pytest.mark.timeout(3600)  # three engine starts, a profile build and two replays: 14-15 min on 2 busy cores
def test_tutorial_runs_from_a_fresh_folder(tmp_path: Path) -> None:
    problems = run_document(TUTORIAL, tmp_path, timeout=3600)
    assert problems == [], "\n\n".join(problems)
