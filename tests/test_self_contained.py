"""Everything a reader of this repository is pointed to is in it: no comment, help text or doc cites
a design document, reference notes or issue tracker outside the repository, nor the numbers of an
incident catalogue that lives there. Public upstream pull requests and issues (named with their
project) are fine: anyone can open them."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".py", ".md", ".toml", ".yml", ".yaml", ".sh", ".txt", ".in", ".cfg", ".jinja")
NAMED = {"Makefile", "run"}

OUTSIDE = [
    (re.compile(r"\bDESIGN\b"), "the shared design document"),
    (re.compile("\u00a7"), "a section sign (a section of a document outside the repo)"),
    (re.compile(r"eagle3-training-formats|sglang-[0-9.]+-(?:internals|on-gpu)|shared/reference"),
     "a reference file outside the repo"),
    (re.compile(r"/work/"), "a machine-specific path"),
    (re.compile(r"(?<![\"'`\w])F\d{1,2}\b(?![\"'`])"), "an incident-catalogue number"),
]
ISSUE = re.compile(r"(?:([\w-]+) )?[Ii]ssue #?\d+")
# Projects whose public trackers a reader can open.
UPSTREAM = {"vllm", "vLLM", "TorchSpec", "EAGLE", "SGLang", "sglang", "SpecForge", "speculators"}


def _files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    me = Path(__file__).resolve()
    return [ROOT / f for f in listed
            if (f.endswith(TEXT) or Path(f).name in NAMED) and (ROOT / f).resolve() != me
            and (ROOT / f).is_file()]


def test_nothing_cites_a_document_outside_the_repo() -> None:
    problems = []
    files = _files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".py" for f in files)
    for path in files:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{n}"
            problems += [f"{where}: {why}: {line.strip()[:100]}" for rx, why in OUTSIDE if rx.search(line)]
            for m in ISSUE.finditer(line):
                if m.group(1) not in UPSTREAM:
                    problems.append(f"{where}: an issue number without its project: {line.strip()[:100]}")
    assert problems == [], "\n".join(problems)


def test_interfaces_doc_lists_every_command_and_finding_code() -> None:
    from hs_tracer.cli import COMMANDS
    from hs_tracer.findings import Code

    doc = (ROOT / "docs/interfaces.md").read_text()
    assert [c for c in COMMANDS if f"| `{c}" not in doc] == []
    assert [c.value for c in Code if f"| `{c.value}` |" not in doc] == []
