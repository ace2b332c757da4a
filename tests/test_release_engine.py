"""What depends on the installed SGLang release, through its real CPU engine (the CPU testbed).

Run in a release's virtualenv, it checks that release's own hooks in its own engine:

* every EAGLE-3 worker the release ships (0.5.12: V2 by default, V1 with
  ``SGLANG_ENABLE_SPEC_V2=0``; 0.5.23: V2 only) serves the trained testbed draft traced: the tokens
  of plain decoding, every hook of that worker applied, prefill and decode steps observed, status
  ``ok``;
* the release's layer-id rule: a draft config whose first id is 0 makes the target capture exactly
  the layers :mod:`hs_tracer.sources` predicts for that release, and the fingerprints of the draft's
  input observe exactly those sources (other layers on 0.5.12 than on 0.5.23: ids ``[0, 2, 3]``
  feed ``block:0, block:2, block:3`` on 0.5.12 and ``embedding, block:1, block:2`` on 0.5.23).

A fault in each hook kind of the release's own worker runs on its engine in
tests/test_engine_eagle.py (``test_fault_leaves_serving_unchanged``; every hook is faulted
in-process in tests/test_hook_faults.py). On the newest release the engines are the suite's shared
``correct``, ``ids_shifted`` and ``plain`` ones, so there this module starts no engine of its own; an
older release gets its own, small ones (tests/engine_runs.py).
"""

from __future__ import annotations

import pytest

from hs_tracer import sources
from hs_tracer.integrations.sglang import releases as sglang_releases
from hs_tracer.integrations.sglang import versions
from tests.engine_runs import FAMILY, OLDER_RELEASE, EngineResult

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

assert FAMILY is not None, f"sglang {versions.installed_version()} is not a supported release"
WORKERS = FAMILY.workers


def _worker_engine(engines, worker: str) -> EngineResult:
    return engines[f"correct:{worker}"] if OLDER_RELEASE else engines["correct"]


@pytest.mark.parametrize("worker", WORKERS)
def test_each_worker_is_traced_without_changing_tokens(engines, worker: str) -> None:
    run = _worker_engine(engines, worker)
    assert run.output_ids("lossless") == engines["plain"].output_ids("lossless")  # greedy EAGLE is lossless
    report = run.report
    assert report["enabled"], report["disabled_reason"]
    # every hook of the worker; of the model bodies, those whose module imports in the scheduler
    # process (a model module that needs a kernel op the CPU build lacks is left out there)
    applied = set(report["hooks_applied"])
    assert {h.target for h in FAMILY.hooks_for(worker) if not h.optional} <= applied
    assert applied <= {h.target for h in FAMILY.hooks}
    assert report["capture"]["layers_in_order"]  # the served model's body hook ran
    assert report["wiring"]["sglang_version"] == versions.installed_version()
    assert report["probes"]["decode_steps"] > 0 and report["probes"]["prefill_steps"] > 0
    diag = run.diagnosis_after("diagnosis")
    assert diag["status"] == "ok", diag["findings"]
    assert diag["acceptance"]["mean_accept_length"] > 1.3  # the trained draft is accepted


def test_layer_id_rule_of_the_installed_release_through_the_engine(engines) -> None:
    run = engines["ids_shifted"]
    report = run.report
    n, ids = report["target"]["num_layers"], report["wiring"]["configured_layer_ids"]
    version = versions.installed_version()
    want = sources.sglang_sources(ids, sources.Family.DEEPSEEK, n, engine_version=version)
    assert ids[0] == 0
    assert report["target"]["layers_to_capture"] == want.layers_to_capture  # SGLang's own rule
    assert report["capture"]["layers_in_order"] == sorted(want.layers_to_capture)  # its model loop
    assert report["wiring"]["sources"] == want.sources
    # what the draft is really fed, as the fingerprints of its input say
    assert [slot["observed_source"] for slot in run.diagnosis_after("diagnosis")["slots"]] == want.sources
    # the same ids feed other layers on the releases with the other DeepSeek rule
    newest = sglang_releases.NEWEST_RELEASE
    other = "0.5.12" if sglang_releases.layer_id_rules(version).deepseek_first_id_rule else newest
    assert sources.sglang_layers_to_capture(ids, sources.Family.DEEPSEEK, n,
                                            engine_version=other) != want.layers_to_capture

