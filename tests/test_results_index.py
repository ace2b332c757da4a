"""benchmarks/results/INDEX.md names the current result of every benchmark: each file it links
exists, each JSON among them records the commit the index gives, every benchmark script has a row,
and every file left beside the index is one it names (superseded runs live in archive/)."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROW = re.compile(r"^\| `(?P<script>[a-z_]+\.py)`[^|]*\| (?P<files>[^|]+) \|[^|]*\| "
                 r"`(?P<commit>[0-9a-f]{10})` \|")


def rows() -> list[re.Match[str]]:
    found = [m for line in (RESULTS / "INDEX.md").read_text().splitlines() if (m := ROW.match(line))]
    assert found
    return found


def test_every_result_in_the_index_exists_and_records_its_commit() -> None:
    named = set()
    for row in rows():
        files = re.findall(r"\]\(([^)]+)\)", row["files"])
        named.update(files)
        for name in files:
            assert (RESULTS / name).is_file(), name
        data = json.loads((RESULTS / files[0]).read_text()) if files[0].endswith(".json") else None
        if data is not None:
            assert data["commit"].startswith(row["commit"]), files[0]
    left = {p.name for p in RESULTS.iterdir() if p.is_file()} - {"INDEX.md"}
    assert left == named, sorted(left ^ named)


def test_every_benchmark_has_a_row() -> None:
    helpers = {"provenance.py", "profile_build_data.py"}  # imported by the benchmarks, not run
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py")} - helpers
    assert scripts <= {row["script"] for row in rows()}
