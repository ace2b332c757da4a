"""A diagnosis report: the slot verdicts, the acceptance and the findings, and how it reads (status,
exit code, root causes, JSON). Above :mod:`.findings` and :mod:`.causes`, which it puts together."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hs_tracer.diagnosis.causes import group
from hs_tracer.findings import NOT_WIRING, Acceptance, Code, Finding, Severity, SlotVerdict


@dataclass
class Report:
    """The diagnosis JSON. ``status`` is derived from the findings so it cannot disagree with them."""

    slots: list[SlotVerdict] = field(default_factory=list)
    acceptance: Acceptance | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def status(self) -> str:
        """``miswired``: a critical wiring finding; ``acceptance``: acceptance collapsed while the
        features are measurably the trained ones (the cause is downstream of them); ``drift``: other
        critical findings or drifting features; ``warning``; ``ok``."""
        critical = [f for f in self.findings if f.severity is Severity.CRITICAL]
        codes = {f.code for f in critical}
        wiring = codes - set(NOT_WIRING)
        if wiring:
            return "miswired"
        if codes == {Code.ACCEPTANCE_DROP} and all(f.details.get("features_match") is True for f in critical):
            return "acceptance"
        if codes or any(f.code is Code.FEATURE_DRIFT for f in self.findings):
            return "drift"
        if any(f.severity is Severity.WARNING for f in self.findings):
            return "warning"
        return "ok"

    @property
    def exit_code(self) -> int:
        """Exit status: 0 healthy, 1 critical findings (2 is for usage errors, raised elsewhere)."""
        return 1 if any(f.severity is Severity.CRITICAL for f in self.findings) else 0

    def root_causes(self) -> list[Any]:
        """The findings grouped by the cause they share, critical first (:mod:`.causes`)."""
        return group(self.findings)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "slots": [s.to_json() for s in self.slots],
            "acceptance": self.acceptance.to_json() if self.acceptance else None,
            "findings": [f.to_json() for f in self.findings],
            "root_causes": [r.to_json() for r in self.root_causes()],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Report:
        """The inverse of :meth:`to_json`, e.g. for a report a scheduler wrote (``status`` is derived
        again from the findings, not read)."""
        acceptance = d.get("acceptance")
        return cls(
            slots=[SlotVerdict(**s) for s in d.get("slots", [])],
            acceptance=Acceptance(**acceptance) if acceptance else None,
            findings=[Finding(code=Code(f["code"]), severity=Severity(f["severity"]), message=f["message"],
                              fix=f.get("fix", ""), slot=f.get("slot"), expected=f.get("expected"),
                              observed=f.get("observed"), details=f.get("details", {}))
                      for f in d.get("findings", [])],
        )

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)

    def causes_human(self, verbose: bool = False) -> list[str]:
        """One block per root cause, critical first (what every command's output leads with): the
        cause, its fix, the slots it explains, then the findings under it (listed with ``verbose``,
        counted otherwise; the JSON has them all)."""
        lines = []
        slots = {s.index: s for s in self.slots}
        for r in self.root_causes():
            lines.append(f"[{r.severity.value}] root cause: {r.summary}")
            if r.fix:
                lines.append(f"  fix: {r.fix}")
            lines.extend("  " + _slot_line(slots[k]) for k in self._slots_of(r.findings) if k in slots)
            if verbose:
                lines.extend("  - " + self.findings[i].one_line() for i in r.findings)
            elif len(r.findings) > 1:
                lines.append(f"  ({len(r.findings)} findings under this cause: --verbose or --json lists "
                             "them)")
        return lines

    def _slots_of(self, findings: list[int]) -> list[int]:
        return sorted({k for i in findings if (k := self.findings[i].slot) is not None})

    def verdict(self) -> str:
        """One line: what a person must do, from the first root cause (or that nothing is needed, and
        what was not checked when an info finding says so)."""
        causes = self.root_causes()
        first = causes[0] if causes else None
        more = f" ({len(causes) - 1} more cause(s) above)" if len(causes) > 1 else ""
        if first is not None and first.severity is Severity.CRITICAL:
            return f"verdict: fix this before relying on speculation: {first.fix or first.summary}{more}"
        if first is not None:
            return f"verdict: speculation is served as trained; to do: {first.fix or first.summary}{more}"
        unchecked = next((f for f in self.findings if f.code is Code.INSUFFICIENT_DATA), None)
        if unchecked is not None:
            then = f"; {unchecked.fix}" if unchecked.fix else ""
            return f"verdict: nothing to fix in what was checked, but {unchecked.message}{then}"
        if self.slots:
            return "verdict: nothing to do: the draft is fed what it was trained on"
        return "verdict: nothing to do: no problem found"

    def human(self, lead: bool = True, verbose: bool = False) -> str:
        """The root-cause blocks (unless the caller printed them already), then the status, the slots no
        cause explains, the acceptance and the findings that belong to no cause (info: what was not
        checked)."""
        lines = self.causes_human(verbose) if lead else []
        unchecked = self.status == "ok" and any(f.code is Code.INSUFFICIENT_DATA for f in self.findings)
        lines.append(f"status: {self.status}" + (" (not everything was checked: see the info below)"
                                                  if unchecked else ""))
        causes = self.root_causes()
        explained = set(self._slots_of([i for r in causes for i in r.findings]))
        lines.extend("  " + _slot_line(s) for s in self.slots if s.index not in explained)
        if self.acceptance:
            a = self.acceptance
            rates = ", ".join(f"{r:.2f}" for r in a.per_position_rate)
            lines.append(f"  acceptance: {a.steps} steps, mean accept length {a.mean_accept_length:.2f}"
                         f", per-position rate [{rates}]")
        grouped = {i for r in causes for i in r.findings}
        lines.extend("  " + f.one_line() for i, f in enumerate(self.findings) if i not in grouped)
        return "\n".join(lines)


def _slot_line(s: SlotVerdict) -> str:
    """One slot: what it was trained on, what it carries and by which evidence."""
    mark = "" if s.expected_source == s.observed_source else (
        "<-- ambiguous: " if s.expected_source in (s.candidates or ())
        else "<-- mismatch: " if s.distance is not None else "<-- mismatch ")
    seen = ("observed" if s.distance is not None else "measured" if s.measured_rows is not None
            else "fed     ")
    return (f"slot {s.index}: trained on {s.expected_source:<10} {seen} {s.observed_source:<10} "
            f"{mark}{s.evidence()}")
