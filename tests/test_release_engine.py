"""What depends on the installed SGLang release, through its real CPU engine (the CPU testbed).

Run in a release's virtualenv, it checks that release's own hooks in its own engine:

* every EAGLE-3 worker the release ships (0.5.12: V2 by default, V1 with
  ``SGLANG_ENABLE_SPEC_V2=0``; 0.5.23: V2 only) serves the trained testbed draft traced: the same
  tokens as untraced, every hook of that worker applied, verify steps recorded, status ``ok``;
* the release's layer-id rule: a draft config whose first id is 0 makes the target capture exactly
  the layers :mod:`hs_tracer.sources` predicts for that release (other layers on 0.5.12 than on
  0.5.23);
* an exception injected into each hook the release's family has and the newest family does not
  (the newest family's hooks are faulted in tests/test_hook_faults.py and on the engine by
  test_engine_eagle.py) leaves the tokens unchanged and switches tracing off.

On the newest release the engines are the suite's shared ``correct``, ``ids_shifted`` and
``untraced`` ones, so there this module starts no engine of its own; an older release gets its own
(without capture: the capture sink reads a prefill helper that older releases lack).
"""

from __future__ import annotations

import pytest

from hs_tracer import sources
from hs_tracer.integrations.sglang import versions
from tests.engine_runs import EngineResult, EngineSpec

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600)]

FAMILY = versions.installed_family()
assert FAMILY is not None, f"sglang {versions.installed_version()} is not a supported release"
NEWEST = versions.FAMILIES[0]
WORKERS = FAMILY.workers


def _fault_cases() -> list[tuple[str, str]]:
    """(worker, hook name) for each hook of this family that the newest family does not have
    (same target and handler), run on a worker that calls it."""
    newest = {(h.target, h.handler) for h in NEWEST.hooks}
    cases: dict[str, str] = {}
    for worker in WORKERS:
        for hook in FAMILY.hooks_for(worker):
            if (hook.target, hook.handler) not in newest:
                cases.setdefault(hook.name, worker)
    return sorted((worker, name) for name, worker in cases.items())


FAULTS = _fault_cases()


def _worker_engine(engines, worker: str) -> EngineResult:
    if FAMILY is NEWEST and worker == WORKERS[0]:
        return engines["correct"]
    env = tuple(FAMILY.worker_env.get(worker, {}).items())
    return engines.run(f"correct:{worker}", EngineSpec("testbed", ("lossless", "diagnosis"), env=env))


def _ids_shifted(engines) -> EngineResult:
    if FAMILY is NEWEST:
        return engines["ids_shifted"]
    return engines.run("ids_shifted:release", EngineSpec("ids_shifted", ("diagnosis",)))


@pytest.mark.parametrize("worker", WORKERS)
def test_each_worker_is_traced_without_changing_tokens(engines, worker: str) -> None:
    run = _worker_engine(engines, worker)
    assert run.output_ids("lossless") == engines["untraced"].output_ids("lossless")
    report = run.report
    assert report["enabled"], report["disabled_reason"]
    assert {h.target for h in FAMILY.hooks_for(worker)} <= set(report["hooks_applied"])
    assert report["wiring"]["sglang_version"] == versions.installed_version()
    assert report["probes"]["decode_steps"] > 0 and report["probes"]["prefill_steps"] > 0
    diag = run.diagnosis_after("diagnosis")
    assert diag["status"] == "ok", diag["findings"]
    assert diag["acceptance"]["mean_accept_length"] > 1.3  # the trained draft is accepted


def test_layer_id_rule_of_the_installed_release_through_the_engine(engines) -> None:
    report = _ids_shifted(engines).report
    n, ids = report["target"]["num_layers"], report["wiring"]["configured_layer_ids"]
    version = versions.installed_version()
    want = sources.sglang_sources(ids, sources.Family.DEEPSEEK, n, sglang_version=version)
    assert ids[0] == 0
    assert report["target"]["layers_to_capture"] == want.layers_to_capture  # SGLang's own rule
    assert report["capture"]["layers_in_order"] == sorted(want.layers_to_capture)  # its model loop
    assert report["wiring"]["sources"] == want.sources
    # the same ids feed other layers on the releases with the other DeepSeek rule
    other = "0.5.12" if sources.layer_id_rules(version).deepseek_first_id_rule else sources.NEWEST_SGLANG
    assert sources.sglang_layers_to_capture(ids, sources.Family.DEEPSEEK, n,
                                            sglang_version=other) != want.layers_to_capture


def test_fault_in_each_release_hook_leaves_serving_unchanged(engines) -> None:
    if FAMILY is NEWEST:  # its hooks are faulted by test_hook_faults.py and test_engine_eagle.py
        assert FAULTS == []
    untraced = engines["untraced"].output_ids("lossless")
    for worker, where in FAULTS:
        env = (*FAMILY.worker_env.get(worker, {}).items(), ("HS_TRACER_FAULT_INJECT", where))
        run = engines.run(f"fault:{where}", EngineSpec("testbed", ("lossless",), env=env))
        assert run.output_ids("lossless") == untraced, where
        assert not run.report["enabled"], where
        assert run.report["disabled_reason"].startswith(f"{where}: RuntimeError: fault injected"), where
