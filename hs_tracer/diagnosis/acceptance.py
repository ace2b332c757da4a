"""``acceptance_drop``: live acceptance against what the draft reaches on its training data.

Why a confidence bound and not a plain ratio: a window of a few dozen verify steps from one or two
requests swings widely. The rule asks whether the live accepted draft tokens per step are *certainly*
below ``collapse_ratio`` times the expected ones:

    a = mean accept length - 1                  (accepted draft tokens per verify step)
    var(a) = max(sum_i (2i+1) r_i - a^2, 1/steps)   (from the cumulative per-position rates r_i)
    upper = a + z * sqrt(var(a) * design / steps)
    critical  iff  steps >= min_steps  and  upper < collapse_ratio * expected

``design`` inflates the variance for steps of one request being correlated (the same prompt makes a
run of easy or hard steps). Without an expectation (a profile built without the draft), the same
bound against ``floor`` (accept length 1 + floor) catches "speculation on, nothing accepted". The
defaults are calibrated on the CPU testbed and on the real pair (docs/diagnosis.md: false alarms per
text domain and window size, detection per fault).

**The text or a fault.** A draft speculates worse on text unlike its training data with nothing
wrong (the real pair: 2.6 on held-out chat, 1.4 on licence prose, same wiring). Where every slot is
measured as its trained source, what is left to tell apart is the text from a fault downstream of the
features (vocabulary map, norm flags, sampling). The draft's input statistics do that: each slot's
drift score (its distance from the trained source's statistics in the profile, in match levels)
stays low on text like the training data and grows with the change of text (the real pair: at most
0.15 on held-out chat of its training domain, 0.97-2.6 on four other domains). Above
``text_drift`` the collapse is the text's (a warning that names it); at or below it, a fault
(critical). Until the statistics are judged, a collapse with the features right waits (info).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hs_tracer.findings import Acceptance, Code, Finding, Severity
from hs_tracer.profile.expectation import ExpectedAcceptance


@dataclass(frozen=True)
class AcceptanceThresholds:
    min_steps: int = 64  # verify steps before acceptance is judged
    collapse_ratio: float = 0.5  # "far below": fewer than half the expected accepted tokens
    floor: float = 0.2  # without an expectation: accept length certainly below 1.2
    z: float = 3.0
    design: float = 4.0  # variance inflation for steps correlated within a request
    text_drift: float = 0.5  # a slot's drift score above this: the live text is unlike the training data


@dataclass(frozen=True)
class AcceptanceBound:
    """The quantities the rule compares (kept in the finding's details and in benchmarks)."""

    steps: int
    accepted: float  # live accepted draft tokens per step
    upper: float  # its upper confidence bound
    expected: float | None  # expected accepted draft tokens per step at the live draft length
    limit: float  # what ``upper`` must stay below to be a collapse

    @property
    def collapsed(self) -> bool:
        return self.upper < self.limit


def bound(live: Acceptance, expected: ExpectedAcceptance | None,
          th: AcceptanceThresholds | None = None) -> AcceptanceBound:
    th = th or AcceptanceThresholds()
    rates = list(live.per_position_rate)
    a = max(live.mean_accept_length - 1.0, 0.0)
    second = sum((2 * i + 1) * r for i, r in enumerate(rates))
    var = max(second - a * a, 0.0)
    # a window where nothing was accepted has zero sample variance: keep one accepted token's worth
    var = max(var, 1.0 / max(live.steps, 1))
    upper = a + th.z * math.sqrt(var * th.design / max(live.steps, 1))
    if expected is not None:
        exp = expected.accept_length(len(rates) or expected.num_steps) - 1.0
        return AcceptanceBound(live.steps, a, upper, exp, th.collapse_ratio * exp)
    return AcceptanceBound(live.steps, a, upper, None, th.floor)


def acceptance_findings(live: Acceptance | None, expected: ExpectedAcceptance | None, *,
                        features_match: bool | None = None, drift: Sequence[float | None] = (),
                        th: AcceptanceThresholds | None = None) -> list[Finding]:
    """``acceptance_drop`` when the window shows a collapse; nothing otherwise.

    ``features_match``: the live slots match the profile (True), do not (False), unknown (None). It
    decides what the finding says about the cause; the grouping in :mod:`hs_tracer.diagnosis.causes`
    puts it under the wiring finding when the features are wrong. ``drift``: each slot's drift score
    (empty: the statistics are not judged yet); with the features right it tells the text from a
    fault (module docstring).
    """
    th = th or AcceptanceThresholds()
    if live is None or live.steps < th.min_steps:
        return []
    b = bound(live, expected, th)
    if not b.collapsed:
        return []
    scores = [d for d in drift if d is not None]
    if features_match is True and b.expected is not None:
        if not scores:
            return [Finding(
                Code.INSUFFICIENT_DATA, Severity.INFO,
                f"mean accept length {live.mean_accept_length:.2f} over {live.steps} steps is far below the "
                f"{1 + b.expected:.2f} expected, with every slot fed its trained source; whether the text or "
                "a fault downstream of the features causes it is decided once the draft's input statistics "
                "are judged", details={"steps": live.steps, "features_match": True})]
        if max(scores) > th.text_drift:
            return [_text_finding(live, b, expected, scores, th)]
    rates = ", ".join(f"{r:.2f}" for r in live.per_position_rate)
    if b.expected is not None:
        exp_rates = ", ".join(f"{r:.2f}" for r in expected.per_position_rate[:len(live.per_position_rate)])
        what = (f"mean accept length {live.mean_accept_length:.2f} over {live.steps} steps, far below the "
                f"{1 + b.expected:.2f} this draft reaches on {_measured_on(expected)} (per position "
                f"[{rates}] vs "
                f"[{exp_rates}])")
    else:
        what = (f"mean accept length {live.mean_accept_length:.2f} over {live.steps} steps with "
                "speculation on: "
                f"the draft's tokens are almost never accepted (per position [{rates}]; no expected "
                "acceptance in the profile to compare with)")
    if features_match is False:
        cause = "; the draft is fed features it was not trained on (the wiring finding is the cause)"
        fix = "fix the wiring named by the slot/layer-id findings; acceptance follows"
    elif features_match is True:
        like = (f" and the live text is like its training data (drift scores {_fmt(scores)}, within "
                f"{th.text_drift:g})" if scores else "")
        cause = (f"; the draft is fed the features it was trained on{like}, so the cause is downstream of "
                 "them. In order of likelihood: (1) the vocabulary map: d2t missing, or regenerated so it no "
                 "longer matches the lm_head rows (hs-tracer check --profile compares it with the training "
                 "data's map); (2) normalisation flags (norm_before_fc, fc_norm, norm_output) the engine "
                 "honours differently from the trainer (check compares them with the flags the expectation "
                 "was measured with); (3) sampling: temperature > 0 or top-p/top-k lower acceptance without "
                 "any fault (compare with a greedy request); (4) rows computed on other requests' tokens "
                 "(per-slot statistics stay right; hs-tracer replay on a capture names it)")
        fix = ("run `hs-tracer check --draft D --target T --profile P`: a d2t or norm-flag finding names the "
               "cause; if it reports none, replay a capture (hs-tracer replay) with a greedy request")
        if b.expected is None:
            cause += ("; or (5) prompts unlike the training data, or the draft itself: the profile holds no "
                      "expected acceptance, so text the draft speculates poorly on and a draft that never "
                      "learned to speculate (too few training steps) cannot be told from these")
            fix += "; build the profile with --draft to measure what this draft reaches on its training data"
    else:
        cause = ("; without a profile the features cannot be checked: a miswiring, a broken vocabulary map "
                 "(d2t), normalisation flags and sampling settings all look like this")
        fix = ("serve with HS_TRACER_PROFILE (a profile built with --draft --target) to tell the wiring "
               "from the vocabulary and norm causes; run hs-tracer check on the draft")
    return [Finding(
        Code.ACCEPTANCE_DROP, Severity.CRITICAL, what + cause, fix,
        expected=f"{1 + b.expected:.2f}" if b.expected is not None else None,
        observed=f"{live.mean_accept_length:.2f}",
        details={"steps": live.steps, "accepted_per_step": round(b.accepted, 4),
                 "upper_bound": round(b.upper, 4), "limit": round(b.limit, 4),
                 "features_match": features_match,
                 **({"drift": [round(d, 3) for d in scores]} if scores else {})})]


def _fmt(scores: Sequence[float]) -> str:
    return "[" + ", ".join(f"{d:.2f}" for d in scores) + "]"


def _measured_on(expected: ExpectedAcceptance | None) -> str:
    held = expected is not None and expected.data == "held-out"
    return "held-out data of its training domain" if held else "its training data"


def _text_finding(live: Acceptance, b: AcceptanceBound, expected: ExpectedAcceptance, scores: list[float],
                  th: AcceptanceThresholds) -> Finding:
    """The collapse explained by the live text: a warning (nothing served is wrong)."""
    worst = max(range(len(scores)), key=scores.__getitem__)
    return Finding(
        Code.ACCEPTANCE_DROP, Severity.WARNING,
        f"mean accept length {live.mean_accept_length:.2f} over {live.steps} steps, far below the "
        f"{1 + (b.expected or 0.0):.2f} this draft reaches on {_measured_on(expected)}, while every slot "
        "is fed its trained source: the live text is unlike the draft's training data (the draft's input "
        f"statistics sit {scores[worst]:.1f} match levels from the training data's in slot {worst}, "
        f"beyond the {th.text_drift:g} that text like the training data stays within). A draft speculates "
        "worse on such text; nothing is miswired",
        fix=("nothing to fix in the serving; if this traffic is what the deployment serves, train the draft "
             "on the target's responses to such prompts (and rebuild the profile from that data). A "
             "downstream fault on top of it is not excluded: hs-tracer check --draft D --target T "
             "--profile P compares the vocabulary map and norm flags with training"),
        expected=f"{1 + (b.expected or 0.0):.2f}", observed=f"{live.mean_accept_length:.2f}",
        details={"steps": live.steps, "accepted_per_step": round(b.accepted, 4),
                 "upper_bound": round(b.upper, 4), "limit": round(b.limit, 4), "features_match": True,
                 "drift": [round(d, 3) for d in scores], "cause": "feature_drift"})
