"""The live verdict: static findings, the window's slot findings and acceptance, judged together.

Why one place: severity must follow what is served, and live evidence outranks inference from the
config. When the live slots match the profile, a config fault that only *could* change the wiring is
a warning; when acceptance collapses, whether the features match decides what the collapse is
blamed on (:mod:`hs_tracer.diagnosis.acceptance`, grouped by :mod:`hs_tracer.diagnosis.causes`).
The online recorder calls :func:`live_report` whenever steps or a window arrive; it is cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from hs_tracer.diagnosis.acceptance import AcceptanceThresholds, acceptance_findings, bound
from hs_tracer.diagnosis.findings import Acceptance, Code, Finding, Severity, SlotVerdict
from hs_tracer.diagnosis.norm_flags import check_norm_flags
from hs_tracer.diagnosis.report import Report
from hs_tracer.diagnosis.wiring import served_right
from hs_tracer.profile.model import Profile
from hs_tracer.sources import UNKNOWN

LIVE_MATCH = ("The live features match the training profile slot by slot, so this does not bite in what is "
              "served now; it bites on a target with another layer count or an engine release that reads the "
              "ids another way.")
LAYERS_RIGHT = ("The engine captures the layers the draft was trained on (its layers_to_capture matches the "
                "profile), so this is not a layer wiring fault: the rows' statistics differ from training's")
LAYERS_RIGHT_FIX = ("no layer to rewire; if the acceptance, once judged, falls short of the profile's "
                    "expectation, compare the live rows with the training rows (hs-tracer replay on a "
                    "capture)")
RECORD_DECIDES = ("The engine's own layers_to_capture matches the profile, so the slot carries its trained "
                  "source")
_WIRING_CODES = (Code.LAYER_IDS_IGNORED, Code.LAYER_ID_CONVENTION, Code.DRAFT_INPUT_WIDTH_MISMATCH,
                 Code.SLOT_SOURCE_MISMATCH)


def features_match(judged: Report | None, static: Sequence[Finding]) -> bool | None:
    """True: every live slot is its trained source; False: a slot or the width is wrong (live, or a
    critical static wiring finding when no window was judged yet); None: unknown."""
    slots = judged.slots if judged is not None else []
    live = list(judged.findings) if judged is not None else []
    if any(f.code in _WIRING_CODES and f.severity is Severity.CRITICAL for f in live):
        return False
    if slots and all(s.observed_source == s.expected_source for s in slots):
        return True
    if slots:
        return None
    if any(f.code in _WIRING_CODES and f.severity is Severity.CRITICAL for f in static):
        return False
    return None


def recorded_wiring(recorded: Sequence[str] | None, profile: Profile | None) -> tuple[list[Finding], bool]:
    """The engine's own record of what it fed each slot (a capture's ``sources``, resolved from its
    ``layers_to_capture``) against the profile's trained sources: one critical finding per slot fed
    another source, and whether the record matches. Why: neighbouring layers of a real model under a
    change of text domain can be beyond what window statistics separate; the record is exact."""
    if profile is None or not recorded or len(recorded) != profile.num_slots:
        return [], False
    findings = [Finding(
        Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL,
        f"slot {k} is fed {got} by the engine's own record (its layers_to_capture, in the capture's "
        f"manifest); the draft was trained on {want}",
        fix=f"make the engine feed {want} in slot {k}: check the draft config's "
        "eagle_aux_hidden_state_layer_ids and the engine's layer-id convention (hs-tracer check)",
        slot=k, expected=want, observed=got, details={"recorded": list(recorded)})
        for k, (want, got) in enumerate(zip(profile.sources, recorded, strict=True)) if want != got]
    return findings, not findings


def _settled(f: Finding, steps: int) -> str:
    """A statistics mismatch the engine's record overrules, said as what it is."""
    measured = f.message[f.message.find(" (distance"):] if " (distance" in f.message else ""
    return (f"slot {f.slot}'s statistics sit nearer {f.observed} than its trained {f.expected}{measured}. "
            f"{RECORD_DECIDES}, and the acceptance over {steps} verify steps shows the draft working")


def _not_told_apart(slot: SlotVerdict) -> SlotVerdict:
    """A slot whose statistics sit nearer a neighbour while the engine's record feeds its trained
    source: what the window shows is that it cannot tell the two apart."""
    if slot.observed_source in (slot.expected_source, UNKNOWN):
        return slot
    return replace(slot, observed_source=UNKNOWN, candidates=[slot.observed_source, slot.expected_source])


def fed_by_record(static: Sequence[Finding]) -> dict[int, tuple[str, str]]:
    """Per slot, (trained, fed) from the critical static wiring findings that name the source the
    engine really feeds it: its own layers_to_capture at startup, or a capture's record. Why: that
    record is exact, window statistics are inference; a report names one source per slot."""
    return {f.slot: (f.expected, f.observed) for f in static
            if f.code in _WIRING_CODES and f.severity is Severity.CRITICAL and f.slot is not None
            and f.expected is not None and f.observed not in (None, UNKNOWN)}


def _as_recorded(slot: SlotVerdict, fed: str) -> SlotVerdict:
    """A slot the engine's record feeds ``fed``: named so, with what the window's statistics sat
    nearest kept as the source to compare with (no distance: the record, not a measurement, decides)."""
    if slot.observed_source == fed:
        return slot
    nearest = slot.observed_source if slot.observed_source != UNKNOWN else (slot.candidates or [None])[0]
    return replace(slot, observed_source=fed, score=0.0, margin=None, distance=None, candidates=None,
                   alternative=nearest,
                   alternative_distance=slot.distance if nearest is not None else None)


def slots_as_recorded(static: Sequence[Finding], slots: Sequence[SlotVerdict]) -> list[SlotVerdict]:
    """The window's slot verdicts with each slot the engine's record decides named as fed: what the
    report's slot table says, and so what the slot metrics say."""
    recorded = fed_by_record(static)
    return [_as_recorded(v, recorded[v.index][1]) if recorded.get(v.index, (None,))[0] == v.expected_source
            else v for v in slots]


def _follows_record(f: Finding, fed: Mapping[int, tuple[str, str]]) -> Finding:
    """A window finding on a slot the engine's record decides: kept where it names the recorded
    source, else said as the statistics' reading the record overrules (the record's own critical
    finding carries the slot)."""
    if f.slot not in fed or f.code not in (Code.SLOT_SOURCE_MISMATCH, Code.FEATURE_DRIFT):
        return f
    _trained, got = fed[f.slot]
    if f.observed == got:
        return f
    return replace(f, severity=Severity.INFO, fix="",
                   message=f"{f.message}. The engine's own record feeds slot {f.slot} {got}, which decides")


def live_report(
    static: Sequence[Finding],
    judged: Report | None,
    acceptance: Acceptance | None,
    profile: Profile | None,
    draft_config: Mapping[str, Any] | None = None,
    thresholds: AcceptanceThresholds | None = None,
    engine_layers_checked: bool = False,
) -> Report:
    """The report of a running engine. ``judged``: the latest window's diagnosis (None before the
    first window or without a profile)."""
    findings = list(static)
    seen = {(f.code, f.slot) for f in findings}
    recorded = fed_by_record(static)
    if judged is not None:
        # the engine's record of what each slot is fed decides before the window's statistics do
        judged = replace(judged, slots=slots_as_recorded(static, judged.slots),
                         findings=[_follows_record(f, recorded) for f in judged.findings])
        findings += [f for f in judged.findings if (f.code, f.slot) not in seen]
    if engine_layers_checked and profile is not None and judged is not None and not any(
            f.code in _WIRING_CODES and f.severity is Severity.CRITICAL for f in static):
        th = thresholds or AcceptanceThresholds()
        steps = acceptance.steps if acceptance is not None else 0
        working = (acceptance is not None and steps >= th.min_steps
                   and not bound(acceptance, profile.expected_acceptance, th).collapsed)
        # The engine's own layers_to_capture already matched the profile's sources: a slot whose window
        # statistics sit nearer another layer is not a layer wiring fault (rejected draft tokens' rows,
        # other requests' rows, a prompt shift move the statistics). Once the acceptance is judged and
        # did not collapse, the record decides (the slot reads as not told apart, trained source among
        # the candidates); before that it stays evidence, as a warning with nothing to rewire.
        overruled = {f.slot for f in findings
                     if f.code is Code.SLOT_SOURCE_MISMATCH and f.severity is Severity.CRITICAL}
        findings = [f if f.slot not in overruled or f.code is not Code.SLOT_SOURCE_MISMATCH
                    else replace(f, severity=Severity.INFO, fix="", message=_settled(f, steps)) if working
                    else replace(f, severity=Severity.WARNING, fix=LAYERS_RIGHT_FIX,
                                 message=f"{f.message}. {LAYERS_RIGHT}")
                    for f in findings]
        if working:
            judged = replace(judged, slots=[_not_told_apart(v) if v.index in overruled else v
                                            for v in judged.slots])
        # A window that cannot tell the trained source from a neighbour is decided by that record once
        # the acceptance is judged (a collapse is then critical on its own): before that, nothing live
        # shows speculation working, and the ambiguity stays a warning.
        pending = (f"The engine's own layers_to_capture matches the profile; the acceptance is judged from "
                   f"{th.min_steps} verify steps ({steps} so far)")
        findings = [(replace(f, severity=Severity.INFO, fix="", message=f"{f.message}. {RECORD_DECIDES}")
                     if steps >= th.min_steps else replace(f, message=f"{f.message}. {pending}"))
                    if f.code is Code.SLOT_SOURCE_MISMATCH and f.severity is Severity.WARNING
                    and f.expected in f.details.get("candidates", ()) else f for f in findings]
        judged = replace(judged, findings=[f for f in judged.findings
                                           if f.code is not Code.SLOT_SOURCE_MISMATCH])
    match = features_match(judged, static)
    checked = engine_layers_checked and profile is not None and judged is not None and bool(judged.slots)
    if match is None and checked and not any(
            f.code in _WIRING_CODES and f.severity is Severity.CRITICAL for f in findings):
        match = True
    if match is True:
        findings = served_right(findings, LIVE_MATCH)
    expected = profile.expected_acceptance if profile is not None else None
    if expected is not None and draft_config:
        have = {f.details.get("flag") for f in findings if f.code is Code.NORM_FLAGS}
        findings += [f for f in check_norm_flags(draft_config, expected.draft_flags)
                     if f.details.get("flag") not in have]
    findings += acceptance_findings(acceptance, expected, features_match=match, th=thresholds)
    return Report(slots=list(judged.slots) if judged is not None else [], acceptance=acceptance,
                  findings=findings)
