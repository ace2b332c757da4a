"""Findings and the diagnosis report: the stable JSON documented in docs/interfaces.md.

Every part of hs_tracer that judges something (preflight ``check``, live ``diagnose``, the online
recorder) speaks in :class:`Finding` objects and reports through :class:`Report`, so the JSON, the
human output and the exit status are the same everywhere.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import Any


class Severity(str, enum.Enum):
    """How bad a finding is. ``critical`` means speculation is (or will be) fed the wrong features."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Code(str, enum.Enum):
    """Stable finding codes (docs/interfaces.md). Add new ones at the end; never rename."""

    DRAFT_INPUT_WIDTH_MISMATCH = "draft_input_width_mismatch"
    SLOT_SOURCE_MISMATCH = "slot_source_mismatch"
    FEATURE_DRIFT = "feature_drift"
    ACCEPTANCE_DROP = "acceptance_drop"
    LAYER_IDS_IGNORED = "layer_ids_ignored"
    LAYER_ID_CONVENTION = "layer_id_convention"
    D2T_INVALID = "d2t_invalid"
    DRAFT_WEIGHTS_MISSING = "draft_weights_missing"
    DRAFT_WEIGHTS_UNUSED = "draft_weights_unused"
    SPEC_ARGS_ADJUSTED = "spec_args_adjusted"
    NON_FINITE_FEATURES = "non_finite_features"
    DRAFT_FORMAT = "draft_format"  # draft format / architecture / config flag the engine cannot serve
    DRAFT_SHAPE_MISMATCH = "draft_shape_mismatch"  # a draft weight whose shape the engine will reject
    INSUFFICIENT_DATA = "insufficient_data"  # info: too few tokens (or no profile) to decide yet
    NORM_FLAGS = "norm_flags"  # a draft normalisation flag the engine applies differently from training
    FEATURES_FROM_OTHER_REQUESTS = "features_from_other_requests"  # right layers, other requests' tokens


NOT_WIRING = (Code.FEATURE_DRIFT, Code.ACCEPTANCE_DROP)
"""Critical codes that judge something other than the wiring (the features drifted, acceptance
fell): a report with only these is ``drift``, not ``miswired``, and they have alerts of their own."""


@dataclass(frozen=True)
class Finding:
    """One problem, named in canonical terms, with the fix a user should apply."""

    code: Code
    severity: Severity
    message: str
    fix: str = ""
    slot: int | None = None
    expected: str | None = None
    observed: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code.value, "severity": self.severity.value}
        for key in ("slot", "expected", "observed"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["message"] = self.message
        out["fix"] = self.fix
        if self.details:
            out["details"] = self.details
        return out

    def one_line(self) -> str:
        fix = f"  fix: {self.fix}" if self.fix else ""
        return f"[{self.severity.value}] {self.code.value}: {self.message}{fix}"


@dataclass
class SlotVerdict:
    """What one slot of the draft input carries, compared with what the draft was trained on."""

    index: int
    expected_source: str
    observed_source: str
    score: float
    margin: float | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        if self.margin is None:
            del out["margin"]
        return out


@dataclass
class Acceptance:
    """Acceptance summary over the steps seen (accept length counts the bonus token)."""

    steps: int
    mean_accept_length: float
    per_position_rate: list[float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    """The diagnosis JSON. ``status`` is derived from the findings so it cannot disagree with them."""

    slots: list[SlotVerdict] = field(default_factory=list)
    acceptance: Acceptance | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def status(self) -> str:
        codes = {f.code for f in self.findings if f.severity is Severity.CRITICAL}
        wiring = codes - set(NOT_WIRING)
        if wiring:
            return "miswired"
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
        from hs_tracer.diagnosis.causes import group

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

    def causes_human(self) -> list[str]:
        """The root causes, one line each with its fix under it (what the human output leads with)."""
        lines = []
        for r in self.root_causes():
            lines.append(f"[{r.severity.value}] root cause: {r.summary}")
            if r.fix:
                lines.append(f"  fix: {r.fix}")
        return lines

    def human(self, lead: bool = True) -> str:
        """Root causes first (unless the caller printed them already), then status, slots, evidence."""
        lines = self.causes_human() if lead else []
        lines.append(f"status: {self.status}")
        for s in self.slots:
            mark = "" if s.expected_source == s.observed_source else "   <-- mismatch"
            lines.append(
                f"  slot {s.index}: trained on {s.expected_source:<12} observed {s.observed_source:<12}"
                f" score {s.score:.3f}{mark}"
            )
        if self.acceptance:
            a = self.acceptance
            rates = ", ".join(f"{r:.2f}" for r in a.per_position_rate)
            lines.append(f"  acceptance: {a.steps} steps, mean accept length {a.mean_accept_length:.2f}"
                         f", per-position rate [{rates}]")
        if self.findings:
            lines.append("  evidence:")
        lines.extend("    " + f.one_line() for f in self.findings)
        return "\n".join(lines)
