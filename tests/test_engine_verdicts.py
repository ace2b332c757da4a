"""Verdicts on the real CPU engine (SGLang 0.5.23 + EAGLE-3, the trained testbed, the profile with
its expected acceptance): the severity follows what is served, and the report leads with one root
cause.

* a vocabulary map regenerated after training (features right, tokens wrong) -> critical
  ``acceptance_drop`` with the vocabulary map named as the cause;
* layer ids at the top level whose served wiring (SGLang's default) is the trained one -> exit 0,
  a warning that says when it bites;
* one wrong id list -> one critical root cause with its fix.
"""

from __future__ import annotations

from typing import Any

import pytest

from hs_tracer_testbed.corpus import prompts as corpus_prompts
from hs_tracer_testbed.miswire import regenerated_d2t, write_variant, write_vocab_variant
from tests.engine_runs import run_scenarios

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def runs(testbed, testbed_profile, tmp_path_factory) -> dict[str, dict[str, Any]]:
    drafts = tmp_path_factory.mktemp("drafts")
    variants = {
        "d2t_regenerated": write_vocab_variant(testbed.draft, drafts / "d2t", regenerated_d2t(testbed)),
        "ids_top_level": write_variant(testbed.draft, drafts / "top", "ids_top_level"),
        "ids_shifted": write_variant(testbed.draft, drafts / "shifted", "ids_shifted"),
    }
    scenarios = [{"name": n, "draft": str(d), "profile": str(testbed_profile)} for n, d in variants.items()]
    return run_scenarios(testbed.target, scenarios, corpus_prompts(seed=1234, n=8), max_new_tokens=24)


def _critical(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for r in d["root_causes"] if r["severity"] == "critical"]


def test_broken_vocabulary_map_is_critical_with_the_vocabulary_as_cause(runs) -> None:
    d = runs["d2t_regenerated"]["diagnosis"]
    # the engine captures the trained layers (its own layers_to_capture); a slot's window statistics may
    # still sit nearer a neighbour (rows of rejected draft tokens): that stays a warning, not the cause
    assert d["wiring"]["sources"] == [s["expected_source"] for s in d["slots"]] and d["slots"]
    drop = [f for f in d["findings"] if f["code"] == "acceptance_drop"]
    assert drop and drop[0]["severity"] == "critical", d["findings"]
    assert d["acceptance"]["mean_accept_length"] < 1.3
    roots = _critical(d)
    assert len(roots) == 1 and roots[0]["cause"] == "vocabulary_map", roots
    assert "vocabulary map (d2t)" in roots[0]["summary"]


def test_top_level_ids_served_right_exit_0_with_a_warning(runs) -> None:
    from hs_tracer.diagnosis.findings import Report

    d = runs["ids_top_level"]["diagnosis"]
    assert d["status"] == "warning", d["findings"]
    assert not _critical(d)
    ignored = [f for f in d["findings"] if f["code"] == "layer_ids_ignored"]
    assert ignored and ignored[0]["severity"] == "warning" and "bites" in ignored[0]["message"]
    assert Report.from_json(d).exit_code == 0


def test_one_wrong_id_list_gives_one_root_cause_with_its_fix(runs) -> None:
    d = runs["ids_shifted"]["diagnosis"]
    roots = _critical(d)
    assert len(roots) == 1 and roots[0]["cause"] == "layer_ids", roots
    assert roots[0]["fix"] == "set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]"
    crit = [i for i, f in enumerate(d["findings"]) if f["severity"] != "info"]
    assert sorted(roots[0]["findings"]) == crit  # every finding is evidence under that one cause

