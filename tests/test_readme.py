"""README.md, run as written (tests/docs_blocks.py): every command block not marked as too expensive
or as a template, in order, from a fresh temporary folder, with the quoted verdicts checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import ROOT, blocks, run_document, unfenced_commands

README = ROOT / "README.md"


def test_readme_blocks_are_found_and_few_are_not_run() -> None:
    text = README.read_text()
    found = blocks(text)
    not_run = [b for b in found if b.not_run]
    assert len(found) >= 3
    assert len(not_run) <= 2, [(b.line, b.not_run) for b in not_run]
    assert any(b.quoted and b.not_run is None for b in found)  # the demo's output is checked
    assert unfenced_commands(text) == []


@pytest.mark.engine
@pytest.mark.timeout(1800)  # the demo: two engine starts
def test_readme_runs_from_a_fresh_folder(tmp_path: Path) -> None:
    problems = run_document(README, tmp_path, timeout=1800)
    assert problems == [], "\n\n".join(problems)
