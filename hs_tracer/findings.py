"""Findings and the diagnosis report: the stable JSON documented in docs/interfaces.md.

Every part of hs_tracer that judges something (preflight ``check``, live ``diagnose``, the online
recorder) speaks in :class:`Finding` objects and reports through :class:`Report`, so the JSON, the
human output and the exit status are the same everywhere.
"""

from __future__ import annotations

import enum
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
    CAPTURE_RAISES = "capture_raises"  # capturing the configured layers raises at the first forward
    CAPTURE_RECORD_MISMATCH = "capture_record_mismatch"  # the engine's record of a slot is not what it feeds
    TRAINING_RECORD_MISMATCH = "training_record_mismatch"  # a dump's ids say other layers than its rows hold
    SLOT_SOURCE_UNRESOLVED = "slot_source_unresolved"  # warning: the window cannot name a slot's source
    PROFILE_UNREADABLE = "profile_unreadable"  # warning: HS_TRACER_PROFILE cannot be read, unused


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
    has no distance. A slot named by same-token identity has no distance either but
    ``measured_error``: the relative error of its rows against the named source's, computed on the
    same ``measured_rows`` tokens (``measured_runner_up_error`` that of ``alternative``).
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
    measured_error: float | None = None
    measured_rows: int | None = None
    measured_runner_up_error: float | None = None
    rule: str | None = None  # the engine whose layer-id rule names a fed slot's source (None: SGLang)
    # the statistics' distance from the trained source's in the profile, in match levels (the
    # matcher's drift score): low on text like the training data; other text and a collapse (verify
    # rows of rejected draft tokens) raise it
    drift: float | None = None
    # measured: the rows equal none of the target's layers (``observed_source`` stays ``unknown``), the
    # nearest candidate (its error is ``measured_error``) and the tested channel transform that explains
    # the rows, if one does
    fed_none: bool | None = None
    nearest: str | None = None
    transform: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None or k == "score"}

    def evidence(self) -> str:
        """The slot's evidence in words: what it matches, how near, and what the other candidate would be."""
        if self.measured_rows is not None and self.fed_none:
            how = ("no tested transform explains them" if self.transform is None else
                   f"they are {self.transform['words']}")
            return (f"(measured on {self.measured_rows} tokens: rows equal none of the target's layers; "
                    f"nearest {self.nearest} differs by {_pct(self.measured_error)}; {how})")
        if self.measured_rows is not None:
            if self.candidates:
                what = f"rows equal each of {' or '.join(self.candidates)}, not told apart"
            else:
                what = f"rows equal it: relative error {_pct(self.measured_error)}"
            other = "" if self.alternative is None else (
                f"; {self.alternative}{' (trained)' if self.alternative == self.expected_source else ''}"
                f" differs by {_pct(self.measured_runner_up_error)}")
            return f"(measured on {self.measured_rows} tokens: {what}{other})"
        if self.distance is None:
            return f"({self.rule or 'SGLang'}'s layer-id rule read from the config; nothing measured)"
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


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.2g} %"


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
