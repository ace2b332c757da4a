"""Slot identity: which canonical source each live slot carries, from per-channel statistics alone.

The statistic: for a live slot and a reference source, the per-channel **symmetric KL divergence**
(Jeffreys) between the two diagonal Gaussians given by their per-channel mean and variance, averaged
over channels::

    D = mean_h [ ((s1 + d) / s2 + (s2 + d) / s1) / 2 - 1 ],   d = (m1 - m2)^2,  s = variance (floored)

It is 0 for identical moments, blind to a channel's absolute scale, and sensitive to what tells layers
apart (massive-activation channels, the per-channel norm profile, the mean direction). ``D`` only needs
count/sum/sumsq per channel, so it works on the GPU probe's windows and on profiles alike. Where the
mean term alone separates a profile's trained sources from their neighbours (:data:`MEAN_SHARE`),
that profile is judged with the mean term alone: it survives a change of text domain on a real model.

Decisions, per slot (thresholds calibrated per window size from the profile's own calibration pieces,
see :mod:`hs_tracer.diagnosis.calibration`):

* the observed source is the reference candidate with the smallest ``D`` (the layer atlas when the
  profile has one, else the trained slots and the extra states of the training dump);
* **mismatch** when that candidate is not the trained source *and* it wins decisively:
  ``D(expected) / D(best) >= rho`` (rho: calibrated, at least ``rho_min``) - a ratio, because a change of
  prompt distribution inflates all distances together but keeps their order;
* **unknown** when even the best candidate is farther than ``unknown_factor * t_match``;
* **drift** when the trained source is still the best but farther than ``drift_factor * t_match``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from hs_tracer.diagnosis.causes import CAPTURE_ORDER, ORDER_FIX
from hs_tracer.diagnosis.report import Report
from hs_tracer.findings import Code, Finding, Severity, SlotVerdict
from hs_tracer.fingerprint.stats import ChannelStats
from hs_tracer.sources import UNKNOWN, Source

JEFFREYS = "jeffreys"
MEAN = "mean"
MEAN_SHARE = 0.4
"""A profile is judged with the mean term alone (:data:`MEAN`) when, for every trained source, it
carries at least this share of ``D`` between that source and its nearest other candidate.
SmolLM2-135M: 0.48-0.95 for its three trained blocks; the toy target, whose layers differ mostly in
their variances: 0.22-0.29 (it keeps ``D``)."""

CHANNEL_TRIM = 0.02
"""Fraction of channels (the largest per-channel divergences) left out of ``D``'s mean. A real model's
residual stream carries massive-activation channels: on a handful of tokens in ten thousand one
channel reaches 100x its usual size (SmolLM2-135M: 20 736 in channel 507 against a spread of ~3), so
whether a window holds one of those tokens dominates that channel's moments and, untrimmed, ``D``
itself; a window of another layer can then sit nearer than the right one."""


@dataclass(frozen=True)
class Thresholds:
    """Decision knobs (docs/diagnosis.md explains each; the defaults are what the measurements used)."""

    min_tokens: int = 256  # a live window decides once it holds this many tokens
    match_safety: float = 1.5  # t_match = match_safety x the largest D of a correct calibration window
    rho_min: float = 1.25  # a mismatch needs D(expected) >= rho x D(best), rho >= rho_min
    rho_safety: float = 1.25  # rho >= rho_safety x the largest D(expected)/D(best other) seen on correct data
    drift_factor: float = 4.0  # feature_drift when D(expected) > drift_factor x t_match and it is still best
    drift_min_tokens: int = 1024  # drift is judged on windows at least this long (small ones are too noisy)
    unknown_factor: float = 15.0  # "unknown" when D(best) > this x max(t_match, largest trained gap)
    margin_min: float = 0.5  # a candidate is excluded when D(c) - D(best) >= margin x D(best <-> c)
    margin_safety: float = 1.5  # margin >= margin_safety x the deepest a correct window let a neighbour in
    max_candidates: int = 4  # sources listed for a slot the statistics cannot pin to one
    calibration_windows: int = 64  # bootstrap windows per calibrated window size
    var_floor: float = 1e-4  # variance floor, relative to the mean variance of the reference source
    seed: int = 0


def moments(stats: ChannelStats) -> tuple[np.ndarray, np.ndarray]:
    return stats.mean(), stats.var()


def divergence(
    live_mean: np.ndarray, live_var: np.ndarray, ref_mean: np.ndarray, ref_var: np.ndarray, floor: np.ndarray,
    statistic: str = JEFFREYS,
) -> np.ndarray:
    """``D`` between every live row ``[K, H]`` and every reference row ``[C, H]`` -> ``[K, C]``.

    ``floor`` ``[C]``: variance floor per reference row (applied to both sides, so near-constant
    channels cannot dominate). ``statistic`` :data:`MEAN`: the mean term of ``D`` alone, untrimmed,
    ``mean_h d (1/s1 + 1/s2) / 2``. Why: a change of text domain moves a real model's per-channel
    *variances* toward those of deeper layers (SmolLM2-135M on licence prose: a block:14 window's
    variances sit nearest block:16), while its mean direction stays with its layer (docs/diagnosis.md).
    """
    fl = floor[None, :, None]
    s1 = np.maximum(live_var[:, None, :], fl)
    s2 = np.maximum(ref_var[None, :, :], fl)
    d = (live_mean[:, None, :] - ref_mean[None, :, :]) ** 2
    if statistic == MEAN:
        return np.mean(0.5 * d * (1.0 / s1 + 1.0 / s2), axis=2)
    per_channel = 0.5 * ((s1 + d) / s2 + (s2 + d) / s1) - 1.0
    keep = per_channel.shape[2] - int(per_channel.shape[2] * CHANNEL_TRIM)
    if keep < per_channel.shape[2]:
        per_channel = np.partition(per_channel, keep - 1, axis=2)[:, :, :keep]
    return np.mean(per_channel, axis=2)


@dataclass
class Candidates:
    """Reference sources a live slot is compared with, as moments."""

    names: list[str]
    mean: np.ndarray  # [C, H]
    var: np.ndarray  # [C, H]
    floor: np.ndarray  # [C]
    origin: list[str] = field(default_factory=list)  # "trained" | "extra" | "atlas" per candidate
    statistic: str = JEFFREYS  # which divergence every distance to these candidates uses
    gap: np.ndarray | None = None  # [C]: D from each candidate to its nearest other candidate
    pair: np.ndarray | None = None  # [C, C]: D between candidates (symmetrised; inf on the diagonal)
    adjacent: np.ndarray | None = None  # [C, C]: the two are neighbouring layers (embedding, block:0, ...)

    def __post_init__(self) -> None:
        if self.adjacent is None:
            depth = np.array([_layer_depth(n) for n in self.names], dtype=float)
            self.adjacent = np.abs(depth[:, None] - depth[None, :]) == 1
        if self.pair is None:
            # row by row: a [C, C, H] temporary would be ~0.2 GB per array for 63 candidates at H=7168
            d = np.stack(
                [
                    divergence(self.mean[i : i + 1], self.var[i : i + 1], self.mean, self.var, self.floor,
                               self.statistic)[0]
                    for i in range(len(self.names))
                ]
            )
            d = 0.5 * (d + d.T)  # each row uses its own variance floor
            np.fill_diagonal(d, np.inf)
            self.pair = d
        if self.gap is None:
            n = len(self.names)
            self.gap = self.pair.min(axis=1) if n > 1 else np.full(n, np.inf)

    def index(self, name: str) -> int | None:
        return self.names.index(name) if name in self.names else None

    def mean_share(self, c: int) -> float:
        """The mean term's share of ``D`` between candidate ``c`` and its nearest other candidate."""
        n = int(np.argmin(self.pair[c]))
        d_mean = divergence(self.mean[c : c + 1], self.var[c : c + 1], self.mean[n : n + 1],
                            self.var[n : n + 1], self.floor[n : n + 1], MEAN)[0, 0]
        return float(d_mean / max(float(self.pair[c, n]), 1e-30))


def _layer_depth(name: str) -> float:
    """Depth in the residual stream's sequence (embedding -1, block:j j); NaN for anything else (the
    final norm is not a neighbour of the last block: another kind of value)."""
    source = Source.parse(name)
    return float(source.depth) if source.kind in ("embedding", "block") else float("nan")


def candidates_of(
    slots: ChannelStats,
    sources: list[str],
    extras=None,
    atlas=None,
    var_floor: float = 1e-4,
) -> Candidates:
    """Trained slots first (the training data is authoritative for its own sources), then the dump's
    extra states, then atlas sources not already present; judged with the mean term alone where it
    separates every trained source from its nearest neighbour (:data:`MEAN_SHARE`), else with ``D``."""
    names: list[str] = []
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    origin: list[str] = []

    def add(name: str, stats: ChannelStats, k: int, how: str) -> None:
        if name in names:
            return
        names.append(name)
        rows.append((stats.mean()[k], stats.var()[k]))
        origin.append(how)

    for k, name in enumerate(sources):
        add(name, slots, k, "trained")
    for group, how in ((extras, "extra"), (atlas, "atlas")):
        if group is not None:
            for k, name in enumerate(group.names):
                add(name, group.stats, k, how)
    mean = np.stack([r[0] for r in rows])
    var = np.stack([r[1] for r in rows])
    floor = var_floor * np.maximum(var.mean(axis=1), 1e-30)
    full = Candidates(names, mean, var, floor, origin)
    trained = [names.index(s) for s in dict.fromkeys(sources)]
    if len(names) < 2 or any(full.mean_share(c) < MEAN_SHARE for c in trained):
        return full
    return Candidates(names, mean, var, floor, origin, MEAN)


def score_of(d: float, t_match: float) -> float:
    """Similarity in (0, 1]: 1 for identical moments, 0.5 at the calibrated match threshold."""
    return float(0.5 ** (d / t_match)) if t_match > 0 else float(d == 0)


@dataclass
class SlotMatch:
    index: int
    expected: str
    observed: str
    d_expected: float
    d_best: float
    best: str
    runner_up: str | None
    d_runner_up: float | None
    verdict: str  # "ok" | "mismatch" | "unknown" | "ambiguous" | "drift"
    drift_score: float = (
        0.0  # D(expected) / max(t_match, gap of the expected source): drift above drift_factor
    )
    candidates: list[str] = field(default_factory=list)  # sources the window cannot exclude, nearest first


def not_excluded(row: np.ndarray, best: int, pair: np.ndarray, margin: float, rho: float,
                 adjacent: np.ndarray | None = None) -> np.ndarray:
    """Candidates a window's divergences ``row`` cannot exclude, nearest first (``best`` included).

    A candidate is excluded when it is farther than the best by ``margin`` times the distance between
    the two sources, or by the calibrated ratio ``rho`` (which the toy target's close layers need; on
    licence prose it wrongly excludes the right layer of SmolLM2-135M: docs/diagnosis.md). A layer
    next to the best (``adjacent[best]``) is excluded by the margin only: the ratio alone never
    names a slot as one layer while its neighbour is within the calibrated margin. The margin is
    what survives a change of text domain: such a change inflates every
    divergence by about the same amount, so a ratio test calibrated on the training text both keeps
    and (on licence prose, SmolLM2-135M) wrongly excludes neighbours, while the excess of a wrong source
    over the right one stays about the distance between them.
    """
    excess = row - row[best]
    ratio_keeps = row < rho * max(row[best], 1e-30)
    if adjacent is not None:
        ratio_keeps = ratio_keeps | adjacent[best]
    keep = ((excess < margin * pair[best]) & ratio_keeps) | (excess <= 0)
    idx = np.flatnonzero(keep)
    return idx[np.argsort(row[idx], kind="stable")]


def match_slots(
    live: ChannelStats,
    expected: list[str],
    cands: Candidates,
    *,
    t_match: float,
    rho: float,
    thresholds: Thresholds,
    tokens: int,
    margin: Sequence[float] | None = None,
) -> list[SlotMatch]:
    """Per live slot: distances to all candidates and the decision described in the module docstring."""
    mean, var = moments(live)
    dist = divergence(mean, var, cands.mean, cands.var, cands.floor, cands.statistic)
    # "no source" is one rule for every slot: the nearest candidate farther than unknown_factor units,
    # a unit being the match level or, where larger, the largest distance of a trained source to its
    # nearest other candidate (never the nearest candidate's own gap, which would let a far-off source
    # such as the embedding claim any slot)
    trained = [i for i in (cands.index(s) for s in expected) if i is not None]
    unit = max([t_match, *(float(cands.gap[i]) for i in trained if np.isfinite(cands.gap[i]))])
    out = []
    for k in range(live.num_slots):
        row = dist[k]
        order = np.argsort(row)
        best = int(order[0])
        runner = int(order[1]) if len(order) > 1 else None
        exp_name = expected[k] if k < len(expected) else UNKNOWN
        e = cands.index(exp_name)
        d_exp = float(row[e]) if e is not None else float("inf")
        d_best = float(row[best])
        # Far is relative: at least the noise level (t_match), and at least the distance between the
        # source and its nearest neighbour (a prompt-distribution change moves a slot by about that much).
        far_exp = max(t_match, float(cands.gap[e])) if e is not None else t_match
        mu = margin[k] if margin is not None and k < len(margin) else thresholds.margin_min
        kept = not_excluded(row, best, cands.pair, mu, rho, cands.adjacent)
        names = [cands.names[int(i)] for i in kept]
        if d_best > thresholds.unknown_factor * unit:
            verdict, observed, names = "unknown", UNKNOWN, []
        elif names == [exp_name]:
            drifted = d_exp > thresholds.drift_factor * far_exp and tokens >= thresholds.drift_min_tokens
            verdict = "drift" if drifted else "ok"
            observed = exp_name
        elif (e == best and d_exp > thresholds.drift_factor * far_exp
              and tokens >= thresholds.drift_min_tokens):
            # nearest is still the trained source, but the window moved far from every source: drift
            # (what moved it is the cause), with the sources it can no longer tell apart
            verdict, observed = "drift", UNKNOWN
        elif exp_name not in names:
            # the trained source is excluded: a mismatch, named exactly only when one source is left
            verdict, observed = "mismatch", names[0] if len(names) == 1 else UNKNOWN
        else:
            verdict, observed = "ambiguous", UNKNOWN  # the trained source and another both fit
        if len(names) > thresholds.max_candidates:  # the nearest few, and the trained one if it fits
            head = names[: max(thresholds.max_candidates, 2)]
            if exp_name in names and exp_name not in head:
                head[-1] = exp_name
            names = head
        out.append(
            SlotMatch(
                k,
                exp_name,
                observed,
                d_exp,
                d_best,
                cands.names[best],
                cands.names[runner] if runner is not None else None,
                float(row[runner]) if runner is not None else None,
                verdict,
                d_exp / far_exp,
                names if len(names) > 1 else [],
            )
        )
    return out


def slot_findings(
    matches: list[SlotMatch], t_match: float, has_atlas: bool
) -> tuple[list[SlotVerdict], list[Finding]]:
    """Slot verdicts for the report and one finding per slot that is not ``ok``."""
    verdicts: list[SlotVerdict] = []
    findings: list[Finding] = []
    trained = {m.index: m.expected for m in matches}
    named = {m.index: m.observed for m in matches if m.observed != UNKNOWN}
    for m in matches:
        d_obs = m.d_expected if m.observed == m.expected else m.d_best
        margin = None
        if m.d_runner_up is not None:
            margin = round(score_of(m.d_best, t_match) - score_of(m.d_runner_up, t_match), 4)
        if m.observed == m.expected:  # the nearest other candidate
            alt, d_alt = (m.runner_up, m.d_runner_up) if m.best == m.expected else (m.best, m.d_best)
        else:  # what the trained source would have scored
            alt, d_alt = m.expected, m.d_expected
        unit = t_match if t_match > 0 else 1.0
        verdicts.append(SlotVerdict(
            m.index, m.expected, m.observed, round(score_of(d_obs, t_match), 4), margin,
            distance=_rounded(d_obs / unit), alternative=alt,
            alternative_distance=None if d_alt is None or alt is None else _rounded(d_alt / unit),
            candidates=list(m.candidates) or None,
            drift=None if m.expected == UNKNOWN else _rounded(m.drift_score)))
        if m.expected == UNKNOWN or m.verdict == "ok":
            continue  # slots beyond the trained K: the width finding already says so
        order = (m.observed in trained.values() and m.observed != m.expected
                 and any(j != m.index and got == m.expected for j, got in named.items()))
        findings.append(_slot_finding(m, t_match, has_atlas, order))
    return verdicts, findings


def _rounded(x: float) -> float | None:
    """Distances in the report: 4 significant digits (JSON has no infinity: an unknown is None)."""
    return float(f"{x:.4g}") if np.isfinite(x) else None


def _slot_finding(m: SlotMatch, t_match: float, has_atlas: bool, order: bool = False) -> Finding:
    details = {
        "d_expected": round(m.d_expected, 6),
        "d_best": round(m.d_best, 6),
        "best": m.best,
        "runner_up": m.runner_up,
        "t_match": round(t_match, 6),
    }
    if m.candidates:
        details["candidates"] = list(m.candidates)
    common = {"slot": m.index, "expected": m.expected, "details": details}
    level = max(t_match, 1e-30)
    either = " or ".join(m.candidates)
    if m.verdict == "mismatch" and m.candidates:
        return Finding(
            Code.SLOT_SOURCE_MISMATCH,
            Severity.CRITICAL,
            f"slot {m.index} carries {either} (this window cannot tell them apart); the draft was trained"
            f" on {m.expected}, which the window excludes (distance {m.d_best / level:.2g} to {m.best} vs"
            f" {m.d_expected / level:.3g} to {m.expected}, in match levels)",
            fix=f"make the engine feed {m.expected} in slot {m.index} (it feeds {either}): check the"
            " draft config's eagle_aux_hidden_state_layer_ids and the engine's layer-id convention"
            " (hs-tracer check)",
            observed=UNKNOWN,
            **common,
        )
    if m.verdict == "mismatch" and order:  # another slot's trained source, its own fed elsewhere
        return Finding(
            Code.SLOT_SOURCE_MISMATCH,
            Severity.CRITICAL,
            f"slot {m.index} carries {m.observed}, the source another slot was trained on; the draft was "
            f"trained on {m.expected} here, which another slot carries (distance {m.d_best / level:.2g} vs "
            f"{m.d_expected / level:.3g} to {m.expected}, in match levels)",
            fix=ORDER_FIX,
            observed=m.observed,
            **{**common, "details": {**details, "cause": CAPTURE_ORDER}},
        )
    if m.verdict == "mismatch":
        how = (
            ""
            if has_atlas
            else " (nearest of the trained sources: no atlas, so a neighbouring layer is possible)"
        )
        return Finding(
            Code.SLOT_SOURCE_MISMATCH,
            Severity.CRITICAL,
            f"slot {m.index} carries {m.observed}{how}; the draft was trained on {m.expected}"
            f" (distance {m.d_best / level:.2g} vs {m.d_expected / level:.3g} to {m.expected},"
            " in match levels)",
            fix=f"make the engine feed {m.expected} in slot {m.index} (it feeds {m.observed}): check the"
            " draft config's eagle_aux_hidden_state_layer_ids and the engine's layer-id convention"
            " (hs-tracer check)",
            observed=m.observed,
            **common,
        )
    if m.verdict == "unknown":
        hint = "" if has_atlas else "; the profile has no layer atlas (rebuild with --atlas to name it)"
        return Finding(
            Code.SLOT_SOURCE_MISMATCH,
            Severity.CRITICAL,
            f"slot {m.index} matches no source: its statistics sit {m.d_best / level:.0f} match levels from"
            f" the nearest, {m.best}, farther than any layer's windows reach; trained on {m.expected}{hint}",
            fix="measure which value it is (hs-tracer diagnose CAPTURE --target T, or serve with "
            "HS_TRACER_IDENTITY_EVERY on): a value none of the target's layers has points at the engine's "
            "capture channel (residual left out, a norm applied, a shard, a scale); otherwise the serving "
            "target or its dtype is not the one the draft was trained with (hs-tracer check)",
            observed=UNKNOWN,
            **common,
        )
    if m.verdict == "ambiguous" and m.candidates:
        nearer = "" if m.best == m.expected else f" ({m.best} fits best, not decisively)"
        return Finding(
            Code.SLOT_SOURCE_UNRESOLVED,
            Severity.WARNING,
            f"slot {m.index} carries {either}: this window cannot tell them apart{nearer}, so it cannot"
            f" confirm the trained {m.expected} nor exclude a layer shift",
            fix="measure it: serve with HS_TRACER_IDENTITY_EVERY on, or run hs-tracer diagnose on a capture "
            "with --target; a longer window may also decide",
            observed=UNKNOWN,
            **common,
        )
    if m.verdict == "ambiguous":
        return Finding(
            Code.SLOT_SOURCE_UNRESOLVED,
            Severity.WARNING,
            f"slot {m.index} no longer fits its trained source {m.expected} (distance "
            f"{m.d_expected / level:.2g} match levels);"
            f" {m.best} fits better, but not decisively",
            fix="collect a longer window, or rebuild the profile with --atlas",
            observed=UNKNOWN,
            **common,
        )
    return Finding(
        Code.FEATURE_DRIFT,
        Severity.WARNING,
        f"slot {m.index} still matches {m.expected} best, but its statistics moved"
        f" {m.d_expected / level:.1f}x beyond the calibrated match level",
        fix="compare the serving target (checkpoint, dtype, quantization) and prompt mix with those the "
        "training data came from",
        observed=m.expected,
        **common,
    )


def width_findings(width: int, num_slots: int, hidden: int, sources: list[str]) -> list[Finding]:
    expected = num_slots * hidden
    if width == expected:
        return []
    states = f"{width // hidden} state(s) of {hidden}" if width % hidden == 0 else f"{width} values"
    return [
        Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH,
            Severity.CRITICAL,
            f"the draft input is {width} wide ({states}); the draft was trained on"
            f" {num_slots}x{hidden} = {expected} ({', '.join(sources)})",
            fix="serve with --speculative-algorithm EAGLE3 and a draft config whose eagle_config lists the "
            f"{num_slots} aux layers (use_aux_hidden_state: true)",
            expected=f"{expected}",
            observed=f"{width}",
            details={"width": width, "expected_width": expected},
        )
    ]


def nonfinite_finding(nonfinite: int, total: int) -> list[Finding]:
    if nonfinite <= 0:
        return []
    frac = nonfinite / max(total, 1)
    return [
        Finding(
            Code.NON_FINITE_FEATURES,
            Severity.CRITICAL,
            f"{nonfinite} non-finite values ({frac:.2%}) in the draft input features",
            fix="look for overflow in the target (fp16 activations, a broken quantized layer) or "
            "uninitialised capture buffers",
            details={"nonfinite": nonfinite, "fraction": frac},
        )
    ]


def empty_report(message: str) -> Report:
    return Report(findings=[Finding(Code.INSUFFICIENT_DATA, Severity.INFO, message)])
