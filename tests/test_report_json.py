"""A report read back from its JSON (what a scheduler writes to HS_TRACER_REPORT_DIR) is the same
report: same JSON, same status, same human text (the demo prints it with Report.human)."""

from __future__ import annotations

import json

from hs_tracer.diagnosis.report import Report
from hs_tracer.findings import Acceptance, Code, Finding, Severity, SlotVerdict


def test_report_survives_its_json() -> None:
    report = Report(
        slots=[SlotVerdict(0, "block:1", "embedding", 0.91, margin=0.4),
               SlotVerdict(1, "block:3", "block:3", 0.7)],
        acceptance=Acceptance(steps=120, mean_accept_length=1.9, per_position_rate=[0.43, 0.28]),
        findings=[Finding(Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL, "slot 0 carries embedding",
                          "feed block:1", slot=0, expected="block:1", observed="embedding",
                          details={"d": 0.01}),
                  Finding(Code.INSUFFICIENT_DATA, Severity.INFO, "few tokens")],
    )
    back = Report.from_json(json.loads(report.dumps()))
    assert back.to_json() == report.to_json()
    assert back.status == "miswired" and back.human() == report.human()
