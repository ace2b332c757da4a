"""Multi-rank serving, traced, on the CPU: real SGLang 0.5.23 engines with two scheduler processes.

SGLang runs tensor parallelism on the CPU over gloo (plain ``torch.distributed`` collectives; the
testbed builds the process groups without pynccl, docs/testbed.md). The engines are the suite's
shared ones (tests/engine_runs.py: ``tp2``, ``tp2:tree``, ``dp_attention``,
``dp_attention:ids_shifted``, ``dp_attention:fault``); the tests read what each generated, what
each scheduler reported and what each rank's ``/metrics`` port served:

* TP 2, EAGLE-3 chain: greedy output equal to plain TP 1 decoding; only attention-TP rank 0 emits,
  on its own port with its own labels; its diagnosis ``ok``; its accept length SGLang's own;
* attention DP 2 inside TP 2: both ranks emit, each on its own port with its own labels, each
  diagnoses its own requests (``ok`` for the configured draft, the embedding in slot 0 for the
  ``ids_shifted`` copy), each rank's accept length equal to SGLang's counters of the requests that
  rank served;
* TP 2, EAGLE-3 tree (topk 2): lossless, accept length SGLang's;
* a fault in one rank's per-step hook (``HS_TRACER_FAULT_INJECT=<hook>@tp1``):
  tracing off on that rank only, serving unchanged, the other rank's records intact;
* the real pair (SmolLM2-135M-Instruct and its draft) at TP 2: lossless, rank 0 alone diagnoses it,
  ``ok`` with the trained blocks, its accept length SGLang's.

What only a GPU run shows (NCCL, CUDA graphs per rank, the in-graph fingerprint under TP):
docs/testing.md.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.engine_runs import COUNTERS, FAULT_ONE_RANK, OLDER_RELEASE, TP2, EngineResult, EngineSpec

pytestmark = [pytest.mark.engine, pytest.mark.timeout(3600),
              pytest.mark.skipif(OLDER_RELEASE, reason="multi-rank CPU serving is run on the newest release")]


def by_tp(reports: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """The schedulers' reports by TP rank (one scheduler process per rank)."""
    out = {r["ranks"]["tp"]: r for r in reports}
    assert len(out) == len(reports), [r["ranks"] for r in reports]
    return out


def labels_served(metrics: str | None) -> set[tuple[str, str, str, str]]:
    """(tp_rank, pp_rank, dp_rank, attn_dp_rank) of every hs_tracer series a port served."""
    from prometheus_client.parser import text_string_to_metric_families

    assert metrics is not None
    return {(s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"], s.labels["attn_dp_rank"])
            for fam in text_string_to_metric_families(metrics) if fam.name.startswith("hs_tracer")
            for s in fam.samples if "tp_rank" in s.labels}


def served(run: EngineResult, workload: str) -> dict[int, str | None]:
    """What each scraped port served after ``workload``, by its offset from the base port."""
    ports = {int(p): text for p, text in run.workloads[workload]["metrics"].items()}
    base = min(ports)
    return {port - base: text for port, text in ports.items()}


# SGLang's ``meta_info["dp_rank"]`` is the serving scheduler's ``get_parallel().dp_rank``, the value
# hs_tracer reports as ``ranks.dp``: the requests of one rank are those carrying its ``dp``.
def sglang_accept(meta: list[dict[str, Any]]) -> tuple[int, float]:
    """(verify steps, mean accept length) from SGLang's own per-request counters."""
    verify = sum(m["spec_verify_ct"] for m in meta)
    return verify, 1 + sum(m[COUNTERS.accepted_drafts] for m in meta) / verify


def assert_acceptance_is_sglangs(report: dict[str, Any], meta: list[dict[str, Any]]) -> None:
    steps, mean = sglang_accept(meta)
    acc = report["diagnosis"]["acceptance"]
    assert acc["steps"] == steps
    assert acc["mean_accept_length"] == pytest.approx(mean, abs=1e-9)


# ---- TP 2 ------------------------------------------------------------------------------------------
def test_tp2_chain_is_lossless(engines) -> None:
    run = engines["tp2"]
    assert run.output_ids("lossless") == engines["plain"].output_ids("lossless")
    assert all(m["spec_verify_ct"] > 0 for m in run.meta("lossless"))  # speculation ran


def test_tp2_only_attention_tp_rank_0_emits(engines) -> None:
    ranks = by_tp(engines["tp2"].workloads["lossless"]["schedulers"])
    assert sorted(ranks) == [0, 1]
    for tp, rep in ranks.items():
        assert rep["enabled"] is True and rep["hook_errors"] == 0
        assert rep["hooks_applied"]  # the plugin loaded in both scheduler processes
        assert rep["ranks"] == {"tp": tp, "pp": 0, "dp": 0, "attn_dp": 0}
        assert rep["emitting"] is (tp == 0)
    assert ranks[0]["diagnosis"]["acceptance"]["steps"] > 0
    assert ranks[1]["probes"] is None and (ranks[1].get("diagnosis") or {}).get("acceptance") is None


def test_tp2_rank_0_serves_its_labels_on_its_port(engines) -> None:
    ports = served(engines["tp2"], "lossless")
    assert labels_served(ports[0]) == {("0", "0", "0", "0")}
    assert ports[1] is None  # TP rank 1 emits nothing, so serves nothing
    assert ports[64] is None and ports[65] is None  # no second DP replica


def test_tp2_diagnosis_ok_and_accept_length_is_sglangs(engines, testbed) -> None:
    from tests.test_engine_eagle import trained_sources

    run = engines["tp2"]
    assert_acceptance_is_sglangs(by_tp(run.workloads["lossless"]["schedulers"])[0], run.meta("lossless"))
    d = run.diagnosis_after("diagnosis")
    assert d["status"] == "ok", d["findings"]
    assert [s["observed_source"] for s in d["slots"]] == trained_sources(testbed)


def test_tp2_tree_is_lossless_and_its_accept_length_is_sglangs(engines) -> None:
    run = engines["tp2:tree"]
    assert run.output_ids("lossless") == engines["plain"].output_ids("lossless")
    ranks = by_tp(run.schedulers)
    assert [ranks[tp]["emitting"] for tp in (0, 1)] == [True, False]
    assert_acceptance_is_sglangs(ranks[0], run.meta("lossless"))


# ---- attention DP 2 --------------------------------------------------------------------------------
def test_dp_attention_chain_is_lossless(engines) -> None:
    run = engines["dp_attention"]
    assert run.output_ids("lossless") == engines["plain"].output_ids("lossless")
    assert {m["dp_rank"] for m in run.meta("lossless")} == {0, 1}  # both ranks served requests


def test_dp_attention_each_rank_emits_with_its_labels_and_port(engines) -> None:
    run = engines["dp_attention"]
    ranks = by_tp(run.workloads["lossless"]["schedulers"])
    assert sorted(ranks) == [0, 1]
    expected: dict[int, set[tuple[str, str, str, str]]] = {}
    for tp, rep in ranks.items():
        assert rep["enabled"] is True and rep["emitting"] is True
        r = rep["ranks"]
        assert (r["tp"], r["pp"], r["attn_dp"]) == (tp, 0, tp)
        expected[tp + 64 * r["dp"]] = {(str(tp), "0", str(r["dp"]), str(tp))}  # base + tp + 64 dp
    ports = served(run, "lossless")
    assert len(expected) == 2  # two ports
    assert {port: labels_served(text) for port, text in ports.items() if text is not None} == expected


def test_dp_attention_each_rank_diagnoses_its_own_requests(engines, testbed) -> None:
    from tests.test_engine_eagle import trained_sources

    run = engines["dp_attention"]
    meta = run.meta("lossless")
    for rep in run.workloads["lossless"]["schedulers"]:
        assert_acceptance_is_sglangs(rep, [m for m in meta if m["dp_rank"] == rep["ranks"]["dp"]])
    for tp, rep in by_tp(run.schedulers).items():
        # under attention DP nothing is measured on the same tokens: each rank's statistics decide, and
        # a slot whose neighbouring layer its window cannot exclude is named with both (a warning),
        # never as another layer and never with a critical finding
        d = rep["diagnosis"]
        assert {f["code"] for f in d["findings"] if f["severity"] != "info"} <= {"slot_source_unresolved"}, \
            (tp, d["findings"])
        assert d["status"] in ("ok", "warning"), (tp, d["findings"])
        for s, trained in zip(d["slots"], trained_sources(testbed), strict=True):
            assert s["observed_source"] == trained or (
                s["observed_source"] == "unknown" and trained in s["candidates"]), (tp, s)


def test_dp_attention_each_rank_names_the_shifted_ids(engines, testbed) -> None:
    from tests.test_engine_eagle import codes, trained_sources

    run = engines["dp_attention:ids_shifted"]
    trained = trained_sources(testbed)
    reports = by_tp(run.schedulers)
    assert sorted(reports) == [0, 1]
    for tp, rep in reports.items():
        d = rep["diagnosis"]
        assert rep["emitting"] is True and d["acceptance"]["steps"] > 0
        assert d["status"] == "miswired", tp
        assert "slot_source_mismatch" in codes(d)
        slots = {s["index"]: s for s in d["slots"]}
        assert slots[0]["observed_source"] == "embedding" and slots[0]["expected_source"] == trained[0]


# ---- a fault on one rank ---------------------------------------------------------------------------
def test_fault_on_one_rank_turns_off_that_rank_only(engines) -> None:
    run = engines["dp_attention:fault"]
    assert run.output_ids("lossless") == engines["plain"].output_ids("lossless")  # serving unchanged
    meta = run.meta("lossless")
    assert all(m["spec_verify_ct"] > 0 for m in meta)
    ranks = by_tp(run.schedulers)
    hook = FAULT_ONE_RANK.split("@")[0]
    assert ranks[1]["enabled"] is False and ranks[1]["hook_errors"] >= 1
    assert hook in ranks[1]["disabled_reason"]
    assert ranks[0]["enabled"] is True and ranks[0]["hook_errors"] == 0
    assert ranks[0]["disabled_reason"] is None
    assert_acceptance_is_sglangs(ranks[0], [m for m in meta if m["dp_rank"] == ranks[0]["ranks"]["dp"]])
    assert ranks[0]["diagnosis"]["status"] == "ok", ranks[0]["diagnosis"]["findings"]


# ---- the real pair at TP 2 -------------------------------------------------------------------------
# SmolLM2-135M has 9 attention heads and 3 KV heads, which 2 ranks do not divide: SGLang on the CPU
# pads them (adjust_config_with_unaligned_cpu_tp: 10 and 4 heads, the added ones zero) and serves.
REAL_TP2 = EngineSpec("testbed", ("real",), parallel=TP2)


def test_the_real_pair_at_tp2_is_lossless_and_rank_0_alone_diagnoses_it(real_engines) -> None:
    plain = real_engines.run("real:plain", EngineSpec(None, ("real",), profile=False))
    run = real_engines.run("real:tp2", REAL_TP2)
    assert run.output_ids("real") == plain.output_ids("real")  # TP 1 plain decoding, bf16
    ranks = by_tp(run.schedulers)
    assert [(k, r["emitting"], r["enabled"], r["hook_errors"]) for k, r in sorted(ranks.items())] == [
        (0, True, True, 0), (1, False, True, 0)]
    d = ranks[0]["diagnosis"]
    assert d["status"] == "ok", d["findings"]
    assert [(s["expected_source"], s["observed_source"]) for s in d["slots"]] == [
        ("block:1", "block:1"), ("block:14", "block:14"), ("block:26", "block:26")]
    assert_acceptance_is_sglangs(ranks[0], run.meta("real"))
