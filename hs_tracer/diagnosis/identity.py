"""``diagnose``: a live window of per-channel statistics vs a reference profile -> :class:`Report`.

Pure and cheap (a few ``[K, C, H]`` array operations; calibration is computed once per window size and
cached on the profile), so the online recorder can call it on every window the GPU probe reads back,
and the CLI calls it on whole captures.
"""

from __future__ import annotations

from dataclasses import dataclass

from hs_tracer.diagnosis.calibration import Calibration, calibrate, candidates
from hs_tracer.diagnosis.matcher import (
    SlotMatch,
    Thresholds,
    match_slots,
    nonfinite_finding,
    slot_findings,
    width_findings,
)
from hs_tracer.diagnosis.report import Report
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.profile.model import Profile


@dataclass
class Diagnosis:
    """The report plus what it was decided on (for logs, benchmarks and the JSON ``details``)."""

    report: Report
    tokens: int
    calibration: Calibration | None
    matches: list[SlotMatch]


def diagnose(
    stats: ChannelStats,
    profile: Profile,
    *,
    tokens: int | None = None,
    nonfinite: int = 0,
    width: int | None = None,
    thresholds: Thresholds | None = None,
) -> Report:
    """Judge one live window. ``stats`` is ``[K', H']`` (the live slots as the probe split them);
    ``tokens`` the window's token count (default: the largest per-channel count); ``nonfinite`` the
    number of non-finite values seen; ``width`` the draft input width if it is not ``K' * H'``."""
    return diagnose_detailed(
        stats, profile, tokens=tokens, nonfinite=nonfinite, width=width, thresholds=thresholds
    ).report


def diagnose_detailed(
    stats: ChannelStats,
    profile: Profile,
    *,
    tokens: int | None = None,
    nonfinite: int = 0,
    width: int | None = None,
    thresholds: Thresholds | None = None,
) -> Diagnosis:
    th = thresholds or Thresholds()
    k_live, h_live = stats.num_slots, stats.hidden
    width = width if width is not None else k_live * h_live
    tokens = int(tokens if tokens is not None else stats.count.max(initial=0))
    findings: list[Finding] = []
    findings += width_findings(width, profile.num_slots, profile.hidden_size, profile.sources)
    findings += nonfinite_finding(nonfinite, tokens * width)
    if h_live != profile.hidden_size:
        findings.append(
            Finding(
                Code.INSUFFICIENT_DATA,
                Severity.INFO,
                f"live slots are {h_live} wide but the profile's hidden size is {profile.hidden_size}:"
                " slot identity cannot be compared",
                fix="split the draft input into slots of the target's hidden size",
            )
        )
        return Diagnosis(Report(findings=findings), tokens, None, [])
    if tokens < th.min_tokens:
        findings.append(
            Finding(
                Code.INSUFFICIENT_DATA,
                Severity.INFO,
                f"{tokens} tokens seen; slot identity is decided from {th.min_tokens} tokens on",
                details={"tokens": tokens, "min_tokens": th.min_tokens},
            )
        )
        return Diagnosis(Report(findings=findings), tokens, None, [])
    cal = calibrate(profile, tokens, th)
    cands = candidates(profile, th)
    matches = match_slots(
        stats, profile.sources, cands, t_match=cal.t_match, rho=cal.rho, thresholds=th, tokens=tokens,
        margin=cal.margin,
    )
    verdicts, slot_f = slot_findings(matches, cal.t_match, profile.atlas is not None)
    return Diagnosis(Report(slots=verdicts, findings=findings + slot_f), tokens, cal, matches)
