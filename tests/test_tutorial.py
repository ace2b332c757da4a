"""docs/tutorial.md, run as written (tests/docs_blocks.py): every command block, in order, in one
shell, from a fresh temporary folder, and every output it quotes checked line by line against the real
output (each printed line shown or elided with "…", numbers within the tolerance the tutorial states)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import ROOT, blocks, output_problems, run_document, unfenced_commands

TUTORIAL = ROOT / "docs/tutorial.md"
TOLERANCE = 0.15
"""Relative tolerance of the tutorial's numbers (token and step counts, rates, distances); it states it."""


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
    problems = run_document(TUTORIAL, tmp_path, timeout=3600, tolerance=TOLERANCE)
    assert problems == [], "\n\n".join(problems)


def test_tutorial_states_its_tolerance() -> None:
    assert f"within {TOLERANCE:.0%} of the values shown" in TUTORIAL.read_text()


OUTPUT = """status: ok
  slot 0: trained on block:1    observed block:1    matches training (distance 0.76; block:2 would be 3.1)
  acceptance: 700 steps, mean accept length 2.78
  evidence:
    [info] spec_args_adjusted: something long
"""


@pytest.mark.parametrize(("quoted", "ok"), [
    (OUTPUT.splitlines(), True),
    # numbers within the tolerance, the tail of a line and whole lines elided
    (["status: ok", "  slot 0: trained on block:1    observed block:1    matches training (distance 0.8; …",
      "  acceptance: 690 steps, mean accept length 2.7…", "…"], True),
    # a printed line neither shown nor elided
    (["status: ok", "  acceptance: 700 steps, mean accept length 2.78", "…"], False),
    # a slot number, a layer number: exact
    (["status: ok", "  slot 0: trained on block:2    observed block:1    …", "…"], False),
    # a count beyond the tolerance
    (["status: ok", "…", "  acceptance: 900 steps, mean accept length 2.78", "…"], False),
    # a quoted line the command did not print
    ([*OUTPUT.splitlines(), "status: miswired"], False),
])
def test_quoted_output_check(quoted: list[str], ok: bool) -> None:
    assert (output_problems(quoted, OUTPUT + "@@RC 0 0\n", TOLERANCE) == []) is ok
