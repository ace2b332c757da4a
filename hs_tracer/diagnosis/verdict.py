"""The live verdict: static findings, the measured slot identity, the window's statistics and the
acceptance, judged together under one rule of evidence.

Which evidence decides what a slot is fed, strongest first:

1. **same-token identity** (:mod:`hs_tracer.diagnosis.same_token`): the slot's rows compared with every
   candidate source computed on the same tokens, in the engine or by ``--target``. Exact up to the
   dtype's rounding.
2. **decisive statistics**: the window's slot statistics against the profile and its atlas, where the
   matcher names one source (a match, or a mismatch that excludes the trained source).
3. **accounts**: the engine's own record of what it feeds (its ``layers_to_capture`` read through
   hs_tracer's layer-id rules at startup, a capture's manifest ``sources``) and the config checks.
   They explain a finding and predict before serving, but never overrule 1 or 2: an account that
   disagrees with a measurement is a finding of its own (``capture_record_mismatch``), whose fix
   points at the engine's capture loop, not at the draft config.

Where nothing measured decides, the slot reads as the sources the window cannot tell apart and the
record is named as unconfirmed, never as proof. Severity follows what is served: a config fault
whose served sources measurably equal the trained ones is a warning. The online recorder calls
:func:`live_report` whenever steps, a window or a measurement arrive; it is cheap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hs_tracer import engines
from hs_tracer.diagnosis.acceptance import AcceptanceThresholds, acceptance_findings
from hs_tracer.diagnosis.causes import CAPTURE_CHANNEL, CAPTURE_LOOP, CAPTURE_ORDER, ORDER_FIX, channel_fix
from hs_tracer.diagnosis.report import Report
from hs_tracer.diagnosis.same_token import MeasuredSlot
from hs_tracer.findings import Acceptance, Code, Finding, Severity, SlotVerdict
from hs_tracer.profile.model import Profile
from hs_tracer.sources import UNKNOWN
from hs_tracer.static_checks.norm_flags import check_norm_flags
from hs_tracer.static_checks.wiring import served_right

LIVE_MATCH = ("The live features match the training profile slot by slot, so this does not bite in what is "
              "served now; it bites on a target with another layer count or an engine release that reads the "
              "ids another way.")
UNCONFIRMED = ("The engine's own record says slot {k} is fed {recorded}; nothing measured confirms it: serve "
               "with HS_TRACER_IDENTITY_EVERY on, or run hs-tracer diagnose CAPTURE --target T, to measure "
               "which layer the slot carries")
CAPTURE_LOOP_FIX = ("the engine's capture loop does not feed what its layers_to_capture says (a model class "
                    "that captures a layer's output where the rules take its input, or a per-model id rule "
                    "that differs from hs_tracer's): fix or report the target's model class in the engine, "
                    "or serve on a release whose loop captures as recorded; the draft config cannot fix this."
                    " hs-tracer check shows the ids as the engine reads them")
_WIRING_CODES = (Code.LAYER_IDS_IGNORED, Code.LAYER_ID_CONVENTION, Code.DRAFT_INPUT_WIDTH_MISMATCH,
                 Code.SLOT_SOURCE_MISMATCH, Code.CAPTURE_RECORD_MISMATCH)
_SLOT_CODES = (Code.SLOT_SOURCE_MISMATCH, Code.SLOT_SOURCE_UNRESOLVED, Code.FEATURE_DRIFT)


def recorded_wiring(recorded: Sequence[str] | None, profile: Profile | None) -> tuple[list[Finding], bool]:
    """The engine's own record of what it fed each slot (a capture's ``sources``, resolved from its
    ``layers_to_capture``) against the profile's trained sources: one critical finding per slot the
    record says is fed another source, and whether the record matches the profile."""
    if profile is None or not recorded or len(recorded) != profile.num_slots:
        return [], False
    findings = [Finding(
        Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL,
        f"slot {k} is fed {got} by the engine's own record (its layers_to_capture, in the capture's "
        f"manifest); the draft was trained on {want}",
        fix=f"make the engine feed {want} in slot {k} (it feeds {got}): check the draft config's "
        "eagle_aux_hidden_state_layer_ids and the engine's layer-id convention (hs-tracer check)",
        slot=k, expected=want, observed=got, details={"recorded": list(recorded), "account": True})
        for k, (want, got) in enumerate(zip(profile.sources, recorded, strict=True)) if want != got]
    return findings, not findings


def fed_by_record(static: Sequence[Finding]) -> dict[int, tuple[str, str]]:
    """Per slot, (trained, fed) from the critical static wiring findings that name the source the
    engine says it feeds: its own layers_to_capture at startup, or a capture's record."""
    return {f.slot: (f.expected, f.observed) for f in static
            if f.code in _WIRING_CODES and f.severity is Severity.CRITICAL and f.slot is not None
            and f.expected is not None and f.observed not in (None, UNKNOWN)}


def records_of(static: Sequence[Finding], trained: Mapping[int, str],
               engine_layers_checked: bool) -> dict[int, str]:
    """Per slot, the source the engine's record says it feeds: where a static finding names another
    source than trained, that one; every other slot its trained source when the record was compared
    with the profile (``engine_layers_checked``)."""
    out = {k: got for k, (_want, got) in fed_by_record(static).items()}
    if engine_layers_checked:
        for k, source in trained.items():
            out.setdefault(k, source)
    return out


@dataclass(frozen=True)
class SlotEvidence:
    """What decided one slot: ``observed`` the source named (``UNKNOWN`` when nothing decides),
    ``by`` "measured", "statistics" or "" (undecided), ``recorded`` the engine's account, if any."""

    observed: str
    by: str
    recorded: str | None
    candidates: tuple[str, ...] = ()
    none: bool = False  # measured: the rows equal none of the target's layers


def reordered(k: int, fed: Mapping[int, str | None], trained: Mapping[int, str]) -> bool:
    """Slot ``k`` is fed another slot's trained source while its own trained source is fed elsewhere:
    the slots are in another order, not another layer."""
    got = fed.get(k)
    return (got is not None and got != trained.get(k) and got in trained.values()
            and any(j != k and f == trained.get(k) for j, f in fed.items()))


def _decide(v: SlotVerdict, measured: MeasuredSlot | None, window: Finding | None,
            recorded: str | None) -> SlotEvidence:
    if measured is not None and measured.fed_none:  # a result: statistics never name it as a layer
        return SlotEvidence(UNKNOWN, "measured", recorded, none=True)
    if measured is not None and measured.sources:
        if measured.source is not None:
            return SlotEvidence(measured.source, "measured", recorded)
        if v.expected_source in measured.sources:  # sources of equal values: the trained one among them
            return SlotEvidence(v.expected_source, "measured", recorded, measured.sources)
        return SlotEvidence(UNKNOWN, "measured", recorded, measured.sources)
    undecided = window is not None and window.code is Code.SLOT_SOURCE_UNRESOLVED
    if v.observed_source != UNKNOWN and not undecided:
        return SlotEvidence(v.observed_source, "statistics", recorded)
    if v.observed_source == UNKNOWN and window is not None and window.severity is Severity.CRITICAL:
        # the window excludes the trained source without naming one: decisive about the mismatch
        return SlotEvidence(UNKNOWN, "statistics", recorded, tuple(v.candidates or ()))
    return SlotEvidence(UNKNOWN, "", recorded, tuple(v.candidates or ()))


def _measured_slot(v: SlotVerdict, m: MeasuredSlot, e: SlotEvidence) -> SlotVerdict:
    """A slot named by same-token identity: the measurement's numbers replace the window's distances."""
    if e.none:
        return replace(v, observed_source=UNKNOWN, score=0.0, margin=None, distance=None,
                       alternative=m.runner_up, alternative_distance=None, candidates=None,
                       measured_error=m.error, measured_rows=m.rows,
                       measured_runner_up_error=m.runner_up_error,
                       fed_none=True, nearest=m.nearest, transform=m.transform)
    return replace(v, observed_source=e.observed, score=1.0 if e.observed == v.expected_source else 0.0,
                   margin=None, distance=None, alternative=m.runner_up, alternative_distance=None,
                   candidates=list(e.candidates) or None, measured_error=m.error, measured_rows=m.rows,
                   measured_runner_up_error=m.runner_up_error)


def _cause_fix(m: MeasuredSlot, trained: str, record_wrong: bool, reorder: bool) -> tuple[str | None, str]:
    """The root cause (None: the wiring's, grouped by code) and the fix of a measured mismatch: a value
    no layer has points at the capture channel, slots in another order at the concatenation order,
    another layer at the capture loop when the engine's record is right about what it should feed,
    else at the ids that make the engine feed it."""
    if m.fed_none:
        return CAPTURE_CHANNEL, channel_fix(m.transform)
    if reorder:
        return CAPTURE_ORDER, ORDER_FIX
    if record_wrong:
        return CAPTURE_LOOP, CAPTURE_LOOP_FIX
    fed = m.source or " or ".join(m.sources) or UNKNOWN
    return None, (f"make the engine feed {trained} in slot {m.index} (it feeds {fed}): check the draft "
                  "config's eagle_aux_hidden_state_layer_ids and the engine's layer-id convention "
                  "(hs-tracer check)")


def _measured_mismatch(m: MeasuredSlot, trained: str, record_wrong: bool, reorder: bool = False) -> Finding:
    cause, fix = _cause_fix(m, trained, record_wrong, reorder)
    if m.fed_none:
        what = (f"slot {m.index} is fed none of the target's layers; the draft was trained on {trained} "
                f"(measured on the same tokens: {m.describe()})")
    else:
        fed = m.source or " or ".join(m.sources) or UNKNOWN
        what = (f"slot {m.index} carries {fed}; the draft was trained on {trained} (measured on the same "
                f"tokens: {m.describe()})")
    return Finding(
        Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL, what, fix=fix, slot=m.index, expected=trained,
        observed=m.source or UNKNOWN,
        details={"measured": m.to_json(), **({"cause": cause} if cause else {}), **(
            {"fed_none": True, "nearest": m.nearest, "transform": m.transform} if m.fed_none else {})})


def _record_mismatch(k: int, e: SlotEvidence, trained: str, measured: MeasuredSlot | None,
                     window: Finding | None, reorder: bool = False) -> Finding:
    """The engine's account of slot ``k`` against what its rows measurably are."""
    cause, fix = CAPTURE_LOOP, CAPTURE_LOOP_FIX
    if measured is not None and e.by == "measured" and (e.none or reorder):
        cause, fix = _cause_fix(measured, trained, True, reorder)
    elif reorder:
        cause, fix = CAPTURE_ORDER, ORDER_FIX
    if e.by == "measured" and measured is not None:
        how = f"the rows it feeds: {measured.describe()}"
    else:
        shown = e.observed if e.observed != UNKNOWN else " or ".join(e.candidates) or "another source"
        distance = "" if window is None or " (distance" not in window.message else \
            window.message[window.message.find(" (distance"):]
        how = f"the window's statistics show {shown}{distance}"
    served_right_now = e.observed == trained
    severity = Severity.WARNING if served_right_now and e.by == "measured" else Severity.CRITICAL
    when = (" The draft is fed its trained source now; this bites when the record is trusted (a config "
            "change that follows it, another engine release)." if severity is Severity.WARNING else "")
    return Finding(
        Code.CAPTURE_RECORD_MISMATCH, severity,
        f"the engine records {e.recorded} for slot {k}; {how}: its capture is not what it records{when}",
        fix=fix, slot=k, expected=e.recorded, observed=e.observed,
        details={"recorded": e.recorded, "evidence": e.by, "trained": trained, "cause": cause,
                 **({"fed_none": True} if e.none else {})})


def _unconfirmed(f: Finding, recorded: str | None) -> Finding:
    """An unresolved slot: the record, if any, is named as what it is — an account."""
    if recorded is None:
        return f
    return replace(f, message=f"{f.message}. {UNCONFIRMED.format(k=f.slot, recorded=recorded)}")


def judge_slots(static: Sequence[Finding], judged: Report | None,
                measured: Sequence[MeasuredSlot] | None, trained: Mapping[int, str],
                engine_layers_checked: bool) -> tuple[list[SlotVerdict], list[Finding]]:
    """The slot table and the slot findings under the rule of evidence (the module docstring): each
    slot named by what measurably decides it, the window's findings kept where they agree with that,
    a finding for every account that disagrees."""
    by_slot = {m.index: m for m in measured or ()}
    window = {f.slot: f for f in (judged.findings if judged is not None else []) if f.code in _SLOT_CODES}
    rest = [f for f in (judged.findings if judged is not None else []) if f.code not in _SLOT_CODES]
    records = records_of(static, trained, engine_layers_checked)
    base = list(judged.slots) if judged is not None and judged.slots else [
        SlotVerdict(k, t, UNKNOWN, 0.0) for k, t in trained.items() if k in by_slot]
    slots, findings = [], list(rest)
    decided = {v.index: _decide(v, by_slot.get(v.index), window.get(v.index), records.get(v.index))
               for v in base}
    fed = {k: e.observed if e.observed != UNKNOWN else None for k, e in decided.items()}
    for v in base:
        k, want = v.index, v.expected_source
        m, w, e = by_slot.get(k), window.get(k), decided[k]
        record_wrong = e.recorded is not None and e.by != "" and (
            e.none or (e.recorded != e.observed if e.observed != UNKNOWN
                       else bool(e.candidates) and e.recorded not in e.candidates))
        order = reordered(k, fed, trained)
        if e.by == "measured" and m is not None:
            slots.append(_measured_slot(v, m, e))
            if e.observed != want:
                findings.append(_measured_mismatch(m, want, record_wrong and e.recorded == want, order))
            elif w is not None and w.code is Code.FEATURE_DRIFT:
                findings.append(w)
        else:
            slots.append(v)
            if w is not None:
                shifted = record_wrong and e.recorded == want and w.code is Code.SLOT_SOURCE_MISMATCH
                cause, fix = (CAPTURE_ORDER, ORDER_FIX) if order else (CAPTURE_LOOP, CAPTURE_LOOP_FIX)
                findings.append(_unconfirmed(w, e.recorded) if e.by == "" else
                                replace(w, fix=fix, details={**w.details, "cause": cause}) if shifted else w)
        if record_wrong:
            findings.append(_record_mismatch(k, e, want, m, w, order))
    return slots, findings


def _account_superseded(f: Finding, slots: Mapping[int, SlotVerdict]) -> bool:
    """A static finding that says what a slot is fed, where a measurement or decisive statistics
    named the slot otherwise: the ``capture_record_mismatch`` finding carries the disagreement."""
    s = slots.get(f.slot) if f.slot is not None else None
    return (s is not None and f.code in _WIRING_CODES and f.observed not in (None, UNKNOWN)
            and (bool(s.fed_none) or s.observed_source not in (UNKNOWN, f.observed)))


def _with_record_fix(f: Finding, static: Sequence[Finding]) -> Finding:
    """A measured slot finding the record agrees with keeps the record's fix: the record knows the
    cause (which config key, which convention), the measurement only what is fed."""
    for r in static:
        if (r.code, r.slot, r.observed) == (f.code, f.slot, f.observed) and r.fix:
            return replace(f, fix=r.fix)
    return f


def live_report(
    static: Sequence[Finding],
    judged: Report | None,
    acceptance: Acceptance | None,
    profile: Profile | None,
    draft_config: Mapping[str, Any] | None = None,
    thresholds: AcceptanceThresholds | None = None,
    engine_layers_checked: bool = False,
    measured: Sequence[MeasuredSlot] | None = None,
    engine: str = engines.DEFAULT,
    engine_version: str = "",
) -> Report:
    """The report of a running engine or a capture. ``judged``: the latest window's diagnosis (None
    before the first window or without a profile); ``measured``: same-token identity per slot, when
    taken; ``engine_layers_checked``: the engine's record was compared with the profile's sources
    (a static finding names every slot it says is fed another source); ``engine`` and
    ``engine_version``: the serving engine, whose reading of the draft's norm flags applies."""
    trained = ({s.index: s.expected_source for s in judged.slots} if judged is not None and judged.slots
               else dict(enumerate(profile.sources)) if profile is not None and "sources" in profile.meta
               else {})
    slots, slot_findings = judge_slots(static, judged, measured, trained, engine_layers_checked)
    named = {s.index: s for s in slots}
    # A slot's finding that names one source (measured, or decisive statistics) replaces the record's
    # finding of the same code and slot; where the window leaves candidates, the record's narrows them.
    decided = {(f.code, f.slot) for f in slot_findings
               if f.observed not in (None, UNKNOWN) or f.details.get("fed_none")}
    findings = [f for f in static if not _account_superseded(f, named) and (f.code, f.slot) not in decided]
    seen = {(f.code, f.slot) for f in findings}
    findings += [_with_record_fix(f, static) for f in slot_findings if (f.code, f.slot) not in seen]
    match = _features_match(slots, slot_findings, findings)
    if match is True:
        findings = served_right(findings, LIVE_MATCH)
    expected = profile.expected_acceptance if profile is not None else None
    if expected is not None and draft_config:
        have = {f.details.get("flag") for f in findings if f.code is Code.NORM_FLAGS}
        findings += [f for f in check_norm_flags(draft_config, expected.draft_flags, engine, engine_version)
                     if f.details.get("flag") not in have]
    findings += acceptance_findings(acceptance, expected, features_match=match, th=thresholds)
    return Report(slots=slots, acceptance=acceptance, findings=findings)


def _features_match(slots: Sequence[SlotVerdict], live: Sequence[Finding],
                    findings: Sequence[Finding]) -> bool | None:
    """True: every slot is named its trained source by a measurement or decisive statistics and no
    account disagrees; False: a slot or the width is wrong (live, or a critical wiring finding when
    nothing was judged yet); None: unknown."""
    critical = [f for f in live if f.code in _WIRING_CODES and f.severity is Severity.CRITICAL]
    if critical:
        return False
    if slots:
        return True if all(s.observed_source == s.expected_source for s in slots) else None
    if any(f.code in _WIRING_CODES and f.severity is Severity.CRITICAL for f in findings):
        return False
    return None
