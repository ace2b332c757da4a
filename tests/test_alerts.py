"""Alert rules: promtool checks them and runs their unit tests; the unit tests cover every alert both
ways and really discriminate (thresholds that would page a correct-but-modest draft make them fail);
every alert has a runbook section; rules use only documented metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hs_tracer.dashboards import RULES_FILE, alerts, manifests
from tests.infra.prom import ensure_prometheus

ROOT = Path(__file__).resolve().parents[1]
TESTS_FILE = ROOT / "deploy/prometheus/tests/hs-tracer.rules.test.yml"
RUNBOOK = ROOT / "docs/runbook.md"
METRICS_DOC = ROOT / "docs/metrics.md"


@pytest.fixture(scope="module")
def promtool() -> str:
    ensure_prometheus()  # Debian's package ships promtool next to prometheus
    path = shutil.which("promtool")
    assert path, "promtool missing after installing Debian's prometheus package"
    return path


def _run(promtool: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool, *map(str, args)], capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(promtool: str) -> None:
    proc = _run(promtool, "check", "rules", ROOT / RULES_FILE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alerts.alert_names())} rules found" in proc.stdout


def test_promtool_unit_tests_pass(promtool: str) -> None:
    proc = _run(promtool, "test", "rules", TESTS_FILE)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_is_tested_firing_and_quiet() -> None:
    spec = yaml.safe_load(TESTS_FILE.read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for test in spec["tests"]:
        for case in test.get("alert_rule_test", []):
            (firing if case.get("exp_alerts") else quiet).add(case["alertname"])
    names = set(alerts.alert_names())
    assert names == firing, f"alerts never tested firing: {names - firing}"
    assert names == quiet, f"alerts never tested quiet: {names - quiet}"
    # a correct deployment with modest acceptance is one of the quiet cases, for every alert
    modest = [t for t in spec["tests"] if "modest acceptance" in t["name"]]
    assert len(modest) == 1
    assert {c["alertname"] for c in modest[0]["alert_rule_test"] if not c["exp_alerts"]} == names


@pytest.mark.parametrize(("knob", "value", "failing_test"), [
    # a floor that high would page a weak but correctly wired draft (accept length 1.45 .. 1.9)
    ("AL_FLOOR", 2.0, "modest acceptance"),
    # a drop factor that tight would page on normal wobble (0.30 -> 0.25)
    ("DROP_FACTOR", 0.9, "modest acceptance"),
    # without the traffic guard a nearly idle server pages on noise
    ("MIN_DRAFTS", 0, "nearly idle server"),
])
def test_unit_tests_catch_a_bad_threshold(promtool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          knob: str, value: float, failing_test: str) -> None:
    monkeypatch.setattr(alerts, knob, value)
    (tmp_path / "rules").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "rules" / Path(RULES_FILE).name).write_text(manifests.rules_file())
    shutil.copy(TESTS_FILE, tmp_path / "tests" / TESTS_FILE.name)
    proc = _run(promtool, "test", "rules", tmp_path / "tests" / TESTS_FILE.name)
    assert proc.returncode != 0, f"promtool tests still pass with {knob}={value}"
    assert failing_test in proc.stdout + proc.stderr


def _runbook_sections() -> dict[str, str]:
    text = RUNBOOK.read_text()
    parts = re.split(r"^## (\S+)\s*$", text, flags=re.M)
    return {parts[i].lower(): parts[i + 1] for i in range(1, len(parts), 2)}


@pytest.mark.parametrize("rule", [r for g in alerts.groups() for r in g["rules"]], ids=lambda r: r["alert"])
def test_alert_has_annotations_and_a_runbook_section(rule: dict) -> None:
    ann = rule["annotations"]
    assert ann["summary"] and ann["description"]
    # absolute (a pager opens it outside any checkout), from the one configurable base
    base, anchor = ann["runbook_url"].split("#")
    assert base == alerts.RUNBOOK_BASE and base.startswith("https://") and base.endswith("docs/runbook.md")
    sections = _runbook_sections()
    assert anchor in sections, f"docs/runbook.md has no section '## {rule['alert']}'"
    body = sections[anchor]
    for heading in ("Meaning", "Likely causes", "Confirm", "Fix"):
        assert re.search(rf"^### {heading}\b", body, flags=re.M), f"{rule['alert']}: no '### {heading}'"
    if rule["alert"] != "HsTracerRecordsDropped":  # a capacity problem: the dashboard confirms it
        assert "hs-tracer " in body, f"{rule['alert']}: the runbook should name the hs-tracer command"


def _metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bhs_tracer_[a-z_]+", expr))


def _documented(name: str, doc: str) -> bool:
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return f"`{name}" in doc or f"`{base}`" in doc or f"`{base}{{" in doc


def test_rules_use_only_documented_metrics() -> None:
    doc = METRICS_DOC.read_text()
    used = set().union(*(_metric_names(r["expr"]) for g in alerts.groups() for r in g["rules"]))
    assert used and not {m for m in used if not _documented(m, doc)}


def test_rule_labels_do_not_clash_with_series_labels() -> None:
    """Rule labels override series labels: they must not reuse the exporter's label names."""
    from hs_tracer.export.prometheus import BASE_LABELS

    series_labels = {*BASE_LABELS, "slot", "expected_source", "observed_source", "code", "position"}
    for g in alerts.groups():
        for r in g["rules"]:
            assert not set(r["labels"]) & series_labels, r["alert"]


def test_runbook_base_is_one_setting(tmp_path: Path) -> None:
    """``hs-tracer dashboards build --runbook-base URL`` relinks every rule and nothing else; a relative
    base is refused with one line."""
    from hs_tracer.cli import main

    base = "https://wiki.example.com/ops/hs_tracer/runbook.md"
    root = tmp_path / "out"
    (root / "grafana/dashboards").mkdir(parents=True)
    assert main(["dashboards", "build", "--root", str(root), "--runbook-base", base]) == 0
    rules = yaml.safe_load((root / RULES_FILE).read_text())
    urls = [r["annotations"]["runbook_url"] for g in rules["groups"] for r in g["rules"]]
    assert urls == [f"{base}#{name.lower()}" for name in alerts.alert_names()]
    default = yaml.safe_load(manifests.rules_file())
    for g, d in zip(rules["groups"], default["groups"], strict=True):
        for r, dr in zip(g["rules"], d["rules"], strict=True):
            assert {**r, "annotations": {}} == {**dr, "annotations": {}}
    with pytest.raises(ValueError, match="absolute"):
        alerts.runbook_url("HsTracerAbsent", "docs/runbook.md")
    assert main(["dashboards", "build", "--root", str(root), "--runbook-base", "docs/runbook.md"]) == 2
