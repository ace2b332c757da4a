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
defaults are calibrated on the CPU testbed and in real SGLang on the real pair (docs/diagnosis.md:
false alarms per text domain, window size and load; detection per fault).
"""

from __future__ import annotations

import math
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
                        features_match: bool | None = None,
                        th: AcceptanceThresholds | None = None) -> list[Finding]:
    """``acceptance_drop`` (critical) when the window shows a collapse; nothing otherwise.

    ``features_match``: the live slots match the profile (True), do not (False), unknown (None). It
    decides what the finding says about the cause; the grouping in :mod:`hs_tracer.diagnosis.causes`
    puts it under the wiring finding when the features are wrong.
    """
    th = th or AcceptanceThresholds()
    if live is None or live.steps < th.min_steps:
        return []
    b = bound(live, expected, th)
    if not b.collapsed:
        return []
    rates = ", ".join(f"{r:.2f}" for r in live.per_position_rate)
    if b.expected is not None:
        exp_rates = ", ".join(f"{r:.2f}" for r in expected.per_position_rate[:len(live.per_position_rate)])
        what = (f"mean accept length {live.mean_accept_length:.2f} over {live.steps} steps, far below the "
                f"{1 + b.expected:.2f} this draft reaches on {_measured_on(expected)} (per position "
                f"[{rates}] vs [{exp_rates}])")
    else:
        what = (f"mean accept length {live.mean_accept_length:.2f} over {live.steps} steps with "
                "speculation on: "
                f"the draft's tokens are almost never accepted (per position [{rates}]; no expected "
                "acceptance in the profile to compare with)")
    if features_match is False:
        cause = "; the draft is fed features it was not trained on (the wiring finding is the cause)"
        fix = "fix the wiring named by the slot/layer-id findings; acceptance follows"
    elif features_match is True:
        cause = ("; the draft is fed the features it was trained on, so the cause is downstream of them. "
                 "In order of likelihood: (1) the vocabulary map: d2t missing, or regenerated so it no "
                 "longer "
                 "matches the lm_head rows (hs-tracer check --profile compares it with the training data's "
                 "map); (2) normalisation flags (norm_before_fc, fc_norm, norm_output) the engine honours "
                 "differently from the trainer (check compares them with the flags the expectation was "
                 "measured with); (3) sampling: temperature > 0 or top-p/top-k lower acceptance without "
                 "any fault (compare with a greedy request); (4) prompts unlike the training data "
                 "(feature_drift on the same slots); (5) rows computed on other requests' tokens (per-slot "
                 "statistics stay right; hs-tracer replay on a capture names it)")
        fix = ("run `hs-tracer check --draft D --target T --profile P`: a d2t or norm-flag finding names the "
               "cause; if it reports none, replay a capture (hs-tracer replay) with a greedy request")
        if b.expected is None:
            cause += ("; or (6) the draft itself: the profile holds no expected acceptance, so a draft that "
                      "never learned to speculate (too few training steps) cannot be told from these")
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
                 "features_match": features_match})]


def _measured_on(expected: ExpectedAcceptance) -> str:
    return "held-out data of its training domain" if expected.data == "held-out" else "its training data"
