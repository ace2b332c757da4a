"""benchmarks/results/INDEX.md names the current result of every benchmark: each file it links
exists, and each JSON among them records the commit the index gives (``commit``, or ``source.commit``
as the scripts write it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROW = re.compile(r"^\| `(?P<script>[a-z_]+\.py)`[^|]*\| (?P<files>[^|]+) \|[^|]*\| "
                 r"`(?P<commit>[0-9a-f]{7,10})` \|")


def rows() -> list[re.Match[str]]:
    found = [m for line in (RESULTS / "INDEX.md").read_text().splitlines() if (m := ROW.match(line))]
    assert found
    return found


def test_every_result_in_the_index_exists_and_records_its_commit() -> None:
    for row in rows():
        files = re.findall(r"\]\(([^)]+)\)", row["files"])
        for name in files:
            assert (RESULTS / name).is_file(), name
        data = json.loads((RESULTS / files[0]).read_text()) if files[0].endswith(".json") else None
        if data is not None:
            commit = data.get("commit") or data["source"]["commit"]
            assert commit[:7] == row["commit"][:7], files[0]
