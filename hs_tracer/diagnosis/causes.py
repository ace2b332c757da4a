"""Root causes: the findings that share one cause, with the one fix an on-call engineer applies.

Why: one wrong id list shows as a convention finding per slot, a live mismatch per slot, warnings
about the id rule and an acceptance collapse, each with its own fix. They are one cause. Grouping is
by finding code (plus an explicit ``details["cause"]``), and the symptom joins its cause: an
``acceptance_drop`` sits under the wiring when the features are wrong, under the vocabulary map or
the norm flags when those were found, and stands alone (naming the non-wiring causes in order)
otherwise. Info findings (``insufficient_data``, settled warnings) are evidence, never a cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hs_tracer.findings import NOT_WIRING, Code, Finding, Severity

LAYER_IDS = "layer_ids"
INPUT_WIDTH = "draft_input_width"
FEATURES = "features"
VOCABULARY = "vocabulary_map"
NORM_FLAGS = "norm_flags"
ACCEPTANCE = "acceptance"
CAPTURE_LOOP = "capture_loop"  # the engine feeds another layer than its record says
CAPTURE_ORDER = "capture_order"  # the engine concatenates the slots in another order than trained
CAPTURE_CHANNEL = "capture_channel"  # the engine feeds a value none of the target's layers has

# The fix of each capture cause: what to change where the engine collects the aux states.
ORDER_FIX = ("the engine concatenates the aux states in another order than the draft was trained on: its "
             "loop appends each captured layer as it reaches it, so the slots come in ascending layer order "
             "whatever order the ids are listed in (SGLang sorts them), unless the code that collects and "
             "concatenates them (the model body's loop, an aux-state packer, the logits processor) reorders "
             "them; fix that code, or serve a draft whose fc input blocks are permuted to the served order. "
             "Reordering the draft config's ids changes nothing the engine feeds")
CHANNEL_FIX = ("the engine's capture channel hands the draft a value none of the target's layers has{how}: "
               "fix the code that appends the aux state in the target's model loop: it must append the "
               "residual stream entering the captured layer (hidden_states + residual, before that layer's "
               "input norm, gathered over the tensor ranks, unscaled). The draft's layer ids cannot fix this")
CHANNEL_HOW = {
    "residual_left_out": " (it appends the sublayer output without adding the residual, which fused add-norm "
                         "layers hand back separately)",
    "input_norm": " (it appends the value after the next layer's input norm)",
    "shard": " (it appends one tensor rank's shard where the gathered state belongs)",
    "scale": " (it rescales the value: a dtype or dequantisation scale in between)",
}


def channel_fix(transform: dict[str, Any] | None) -> str:
    """The fix of a slot fed a value no layer has: the capture channel's code, and which value it
    appends where a tested transform says so."""
    return CHANNEL_FIX.format(how=CHANNEL_HOW.get((transform or {}).get("transform", ""), ""))


_BY_CODE = {
    Code.LAYER_IDS_IGNORED: LAYER_IDS,
    Code.LAYER_ID_CONVENTION: LAYER_IDS,
    Code.SLOT_SOURCE_MISMATCH: FEATURES,
    Code.SLOT_SOURCE_UNRESOLVED: FEATURES,
    Code.CAPTURE_RECORD_MISMATCH: CAPTURE_LOOP,
    Code.DRAFT_INPUT_WIDTH_MISMATCH: INPUT_WIDTH,
    Code.D2T_INVALID: VOCABULARY,
    Code.NORM_FLAGS: NORM_FLAGS,
    Code.ACCEPTANCE_DROP: ACCEPTANCE,
}
# Where a symptom goes, first match wins: wiring causes, then the non-wiring ones in likelihood order.
_SYMPTOM_HOSTS = (LAYER_IDS, CAPTURE_CHANNEL, CAPTURE_ORDER, CAPTURE_LOOP, INPUT_WIDTH, FEATURES,
                  Code.FEATURES_FROM_OTHER_REQUESTS.value,
                  VOCABULARY, NORM_FLAGS)
_RANK = {Severity.CRITICAL: 0, Severity.WARNING: 1, Severity.INFO: 2}
_TRAILING_PARENTHESIS = re.compile(r"\s*\((?:[^()]|\([^()]*\))*\)\s*$")


@dataclass
class RootCause:
    cause: str
    severity: Severity
    summary: str
    fix: str
    findings: list[int]  # indices into the report's findings
    wiring: bool = False  # a critical finding of it changes what the draft is fed (status miswired)

    @property
    def headline(self) -> str:
        """The summary without its running figures (a trailing parenthesis: evidence, a symptom), so
        one cause keeps one wording while a process runs (metric labels, alert texts)."""
        return _TRAILING_PARENTHESIS.sub("", self.summary) or self.summary

    def to_json(self) -> dict[str, Any]:
        return {"cause": self.cause, "severity": self.severity.value, "summary": self.summary,
                "fix": self.fix, "findings": list(self.findings), "wiring": self.wiring}


def cause_of(f: Finding) -> str:
    return str(f.details.get("cause") or _BY_CODE.get(f.code) or f.code.value)


def group(findings: list[Finding]) -> list[RootCause]:
    """Root causes of ``findings`` (critical first, then warnings)."""
    members: dict[str, list[int]] = {}
    for i, f in enumerate(findings):
        if f.severity is Severity.INFO:
            continue
        members.setdefault(cause_of(f), []).append(i)
    # slot mismatches explained by the id list are the same cause
    if LAYER_IDS in members and FEATURES in members and _critical(findings, members[LAYER_IDS]):
        members[LAYER_IDS] += members.pop(FEATURES)
    if ACCEPTANCE in members:
        right = any(findings[i].details.get("features_match") is True for i in members[ACCEPTANCE])
        hosts = (VOCABULARY, NORM_FLAGS) if right else _SYMPTOM_HOSTS  # layers right: not a wiring cause
        host = next((c for c in hosts if c in members and _critical(findings, members[c])), None)
        if host is None:
            host = next((c for c in hosts if c in members), None)
        if host is None and right:
            host = VOCABULARY  # features right, nothing else found: the most likely cause
            members[host] = []
        if host is not None:
            members[host] += members.pop(ACCEPTANCE)
    out = [_root(cause, sorted(idx), findings) for cause, idx in members.items()]
    return sorted(out, key=lambda r: (_RANK[r.severity], r.findings[0]))


def _critical(findings: list[Finding], idx: list[int]) -> bool:
    return any(findings[i].severity is Severity.CRITICAL for i in idx)


def _root(cause: str, idx: list[int], findings: list[Finding]) -> RootCause:
    fs = [findings[i] for i in idx]
    severity = min((f.severity for f in fs), key=lambda s: _RANK[s])
    own = [f for f in fs if f.code is not Code.ACCEPTANCE_DROP] or fs
    lead = min(own, key=lambda f: (_RANK[f.severity], f.slot is not None))
    summary, fix = lead.message, lead.fix
    wiring = next((f for f in own if "fed" in f.details and "trained" in f.details), None)
    misplaced = next((f for f in own if f.details.get("misplaced")), None)
    if cause == LAYER_IDS and misplaced is not None:
        # the ids are right where the key sits wrong: the fix moves the key (with the ids it must carry)
        summary, fix = misplaced.message, misplaced.fix
    elif cause == LAYER_IDS and wiring is not None:
        d = wiring.details
        summary = (f"the draft config's layer ids {d.get('ids')} make SGLang feed {_fmt(d['fed'])}; "
                   "the draft "
                   f"was trained on {_fmt(d['trained'])}")
        fix = wiring.fix
    elif cause == LAYER_IDS:
        concrete = next((f.fix for f in own if f.fix.startswith("set eagle_config")), None)
        fix = concrete or fix
    symptom = next((f for f in fs if f.code is Code.ACCEPTANCE_DROP), None)
    if cause == VOCABULARY and symptom is lead:
        summary = ("acceptance collapsed while the draft is fed the features it was trained on: the "
                   "vocabulary "
                   f"map (d2t) is the most likely cause (mean accept length {symptom.observed}"
                   + (f", expected {symptom.expected}" if symptom.expected else "") + ")")
        fix = ("check the draft's d2t against the training data's map: hs-tracer check --draft D --target T "
               "--profile P (then norm flags, then sampling settings)")
    elif symptom is not None and symptom is not lead:
        summary += f" (symptom: mean accept length {symptom.observed})"
    feeds_wrong = any(f.severity is Severity.CRITICAL and f.code not in NOT_WIRING for f in fs)
    return RootCause(cause, severity, summary, fix, idx, feeds_wrong)


def _fmt(sources: list[str]) -> str:
    return "[" + ", ".join(sources) + "]"
