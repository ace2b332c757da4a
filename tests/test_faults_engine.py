"""Faults while serving, on the real CPU engine with tracing on (the short version of
``benchmarks/soak.py faults``, run through the engine harness's ``run_tool``; the full results are in
docs/reliability.md).

One traced EAGLE-3 engine serves request batches while the OTLP collector is slow and then down,
stalled scrapers hang on hs_tracer's /metrics, the capture directory's disk (a small tmpfs in a
private mount namespace) fills up, and the report directory is removed. Every request completes,
tracing stays on with hs_tracer's counts equal to SGLang's own, capture stops with one log line, and
the report comes back.
"""

from __future__ import annotations

import json

import pytest

from tests.engine_runs import run_tool

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def result(testbed, testbed_profile) -> dict:
    proc = run_tool(["benchmarks/soak.py", "faults", "--requests", "8", "--concurrency", "4",
                     "--max-new-tokens", "12", "--tmpfs-kib", "128"])
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK-RESULT "))
    return json.loads(line[len("SOAK-RESULT "):])


def test_serving_is_unaffected(result: dict) -> None:
    assert result["requests"] == 4 * 8 and result["incomplete_requests"] == 0
    assert result["tracer_enabled"] is True and result["disabled_reason"] is None
    assert result["traceback_lines"] == 0


def test_counts_equal_sglangs_under_faults(result: dict) -> None:
    counts = result["counts"]
    assert counts["drafts_equal"] and counts["accepted_equal"], counts
    assert counts["hs_tracer"]["hook_errors"] == 0 and counts["hs_tracer"]["enabled"] == 1


def test_full_capture_disk_stops_capture_in_one_line(result: dict) -> None:
    cap = result["capture"]
    assert len(cap["stopped_log_lines"]) == 1, cap
    assert "No space left on device" in cap["stopped_log_lines"][0]
    assert cap["sink"]["stopped"]


def test_removed_report_dir_comes_back(result: dict) -> None:
    assert result["report_recreated"]
