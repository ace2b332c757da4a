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
    PROFILE_MISMATCH = "profile_mismatch"  # warning: the reference profile is of another model, unused


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
    """What one slot of the draft input carries, compared with what the draft was trained on.

    ``score`` (kept for the JSON) is ``0.5 ** distance``: 1 identical, 0.5 at the calibrated
    same-source level. ``distance`` says the same in the unit a reader can judge: the divergence of
    the slot's statistics from the observed source's, in multiples of that level; ``alternative`` is
    the source a reader would compare with (the trained one when another was observed, else the
    nearest other) at ``alternative_distance``. A preflight slot (from the config, nothing measured)
    has no distance.
    """

    index: int
    expected_source: str
    observed_source: str
    score: float
    margin: float | None = None
    distance: float | None = None
    alternative: str | None = None
    alternative_distance: float | None = None
    candidates: list[str] | None = None  # sources this window cannot tell apart (observed "unknown")

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k == "score"}

    def evidence(self) -> str:
        """The slot's evidence in words: what it matches, how near, and what the other candidate would be."""
        if self.distance is None:
            return "(SGLang's layer-id rule read from the config; nothing measured)"
        if self.observed_source == self.expected_source:
            near = "matches training"
        elif self.candidates:  # sources.UNKNOWN with candidates: the window cannot tell them apart
            near = f"one of {' or '.join(self.candidates)}, not told apart"
        elif self.observed_source == "unknown":  # sources.UNKNOWN: no candidate is near enough
            near = "no source fits"
        else:
            near = f"nearest is {self.observed_source}"
        other = ""
        if self.alternative is not None and self.alternative_distance is not None:
            trained = " (trained)" if self.alternative == self.expected_source else ""
            other = f"; {self.alternative}{trained} would be {_num(self.alternative_distance)}"
        return f"{near} (distance {_num(self.distance)}{other})"


def _num(x: float) -> str:
    """Distances span 0.001..1000: two significant digits read at any scale."""
    return f"{x:.2g}" if x < 10 else f"{x:.0f}"


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

    def human(self, lead: bool = True) -> str:
        """Root causes first (unless the caller printed them already), then status, slots, evidence."""
        lines = self.causes_human() if lead else []
        unchecked = self.status == "ok" and any(f.code is Code.INSUFFICIENT_DATA for f in self.findings)
        lines.append(f"status: {self.status}" + (" (not everything was checked: see the info below)"
                                                  if unchecked else ""))
        for s in self.slots:
            mark = "" if s.expected_source == s.observed_source else (
                "<-- ambiguous: " if s.expected_source in (s.candidates or ())
                else "<-- mismatch: " if s.distance is not None else "<-- mismatch ")
            seen = "observed" if s.distance is not None else "fed     "
            lines.append(f"  slot {s.index}: trained on {s.expected_source:<10} {seen} "
                         f"{s.observed_source:<10} {mark}{s.evidence()}")
        if self.acceptance:
            a = self.acceptance
            rates = ", ".join(f"{r:.2f}" for r in a.per_position_rate)
            lines.append(f"  acceptance: {a.steps} steps, mean accept length {a.mean_accept_length:.2f}"
                         f", per-position rate [{rates}]")
        if self.findings:
            lines.append("  evidence:")
        lines.extend("    " + f.one_line() for f in self.findings)
        return "\n".join(lines)
