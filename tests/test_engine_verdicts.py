"""Verdicts on the real CPU engine (SGLang 0.5.23 + EAGLE-3, the trained testbed, the profile with
its expected acceptance; the suite's shared engines of tests/engine_runs.py, read after the
diagnosis workload): the severity follows what is served, and the report leads with one root cause.

* a vocabulary map regenerated after training (features right, tokens wrong) -> critical
  ``acceptance_drop`` with the vocabulary map named as the cause;
* layer ids at the top level whose served wiring (SGLang's default) is the trained one -> exit 0,
  a warning that says when it bites;
* one wrong id list -> one critical root cause with its fix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


def _diagnosis(engines, name: str) -> dict[str, Any]:
    return engines[name].diagnosis_after("diagnosis")


def _critical(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in d["root_causes"] if r["severity"] == "critical"]


def test_broken_vocabulary_map_is_critical_with_the_vocabulary_as_cause(engines) -> None:
    d = _diagnosis(engines, "d2t_regenerated")
    # the engine captures the trained layers (its own layers_to_capture); a slot's window statistics may
    # still sit nearer a neighbour (rows of rejected draft tokens): that stays a warning, not the cause
    assert d["wiring"]["sources"] == [s["expected_source"] for s in d["slots"]] and d["slots"]
    drop = [f for f in d["findings"] if f["code"] == "acceptance_drop"]
    assert drop and drop[0]["severity"] == "critical", d["findings"]
    assert d["acceptance"]["mean_accept_length"] < 1.3
    roots = _critical(d)
    assert len(roots) == 1 and roots[0]["cause"] == "vocabulary_map", roots
    assert "vocabulary map (d2t)" in roots[0]["summary"]


def test_top_level_ids_served_right_exit_0_with_a_warning(engines) -> None:
    from hs_tracer.diagnosis.report import Report

    d = _diagnosis(engines, "ids_top_level")
    assert d["status"] == "warning", d["findings"]
    assert not _critical(d)
    ignored = [f for f in d["findings"] if f["code"] == "layer_ids_ignored"]
    assert ignored and ignored[0]["severity"] == "warning" and "bites" in ignored[0]["message"]
    assert Report.from_json(d).exit_code == 0
    # the key sits in the wrong place: the fix moves it (with the ids unchanged), never "retrain"
    root = next(r for r in d["root_causes"] if r["cause"] == "layer_ids")
    assert root["fix"].startswith("move eagle_aux_hidden_state_layer_ids from the top level of config.json "
                                  "into eagle_config") and "unchanged" in root["fix"]
    assert "retrain" not in json.dumps(d)


def test_demo_ends_with_one_verdict_line(engines) -> None:
    """The demo's last line on the real engines' reports: nothing to do for the correct draft and the
    miswiring caught; the fix when the configured draft is the miswired one."""
    from hs_tracer_testbed.demo import Run, exit_code, human

    def run(name: str) -> Run:
        return Run(name, Path("target"), Path("draft"), [], [], [],
                   engines[name].workloads["diagnosis"]["schedulers"])

    caught = human([run("correct"), run("ids_shifted")], expect_miswired=True).splitlines()
    assert caught[-1].startswith("verdict: the draft as configured: ") and "fix this" not in caught[-1]
    # the miswiring with what it costs on these prompts, from the two runs' live acceptance
    assert re.search(r"; the deliberate miswiring \(ids_shifted: accept length \d\.\d\d against \d\.\d\d as "
                     r"configured, [+-]\d+ %\) was caught$", caught[-1]), caught[-1]
    assert exit_code([run("correct"), run("ids_shifted")], expect_miswired=True) == 0
    alone = human([run("ids_shifted")]).splitlines()
    assert alone[-1] == ("verdict: fix this before relying on speculation: set "
                         "eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]")
    assert exit_code([run("ids_shifted")], expect_miswired=False) == 1
    # the miswiring is one block: the cause, its fix, the three slots it explains, the findings counted
    block = alone[alone.index(next(x for x in alone if "root cause:" in x)):]
    assert sum("root cause:" in x for x in alone) == 1
    assert block[1] == "     fix: set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]"
    assert [x.split(":")[0].strip() for x in block[2:5]] == ["slot 0", "slot 1", "slot 2"]
    assert re.fullmatch(r" +\(\d+ findings under this cause: --verbose or --json lists them\)", block[5])
    assert block[6].strip() == "status: miswired" and not any("] slot_source_mismatch" in x for x in alone)
    verbose = human([run("ids_shifted")], verbose=True).splitlines()
    listed = [x for x in verbose if x.strip().startswith("- [critical] ")]
    assert listed and verbose.index(listed[-1]) < verbose.index("   status: miswired")
    # one numbering on screen: canonical sources, SGLang's layers_to_capture only with --verbose
    assert not any("layers_to_capture" in line for line in caught)
    assert any("layers_to_capture [2, 4, 5]" in line
               for line in human([run("correct")], verbose=True).splitlines())


def test_one_wrong_id_list_gives_one_root_cause_with_its_fix(engines) -> None:
    d = _diagnosis(engines, "ids_shifted")
    roots = _critical(d)
    assert len(roots) == 1 and roots[0]["cause"] == "layer_ids", roots
    assert roots[0]["fix"] == "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]"
    crit = [i for i, f in enumerate(d["findings"]) if f["severity"] != "info"]
    assert sorted(roots[0]["findings"]) == crit  # every finding is evidence under that one cause

