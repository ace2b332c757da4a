"""Thresholds from the reference's own variability, per live window size.

A profile keeps a hash-chosen sample of short token pieces of its training data. To calibrate for a
live window of ``n`` tokens, draw ``calibration_windows`` windows of ``ceil(n / piece_tokens)`` pieces
(without replacement, seeded), compare each with the profile *minus that window* (leave-out: the sums
subtract) exactly as a live window is compared, and record

* ``D(expected)`` - how far a correct window strays from its own source, and
* ``D(expected) / min D(other)`` - how close a correct window comes to preferring another source.

``t_match`` is ``match_safety`` x the largest ``D(expected)``; ``rho`` is the larger of ``rho_min`` and
``rho_safety`` x the largest ratio. Window sizes are rounded down to a power-of-two number of pieces,
so a calibration is reused (cached on the profile) and is never for a window larger than the live one;
a larger live window only has less noise than it was calibrated for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hs_tracer.diagnosis.matcher import Candidates, Thresholds, candidates_of, divergence
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.profile.model import Profile, ProfileError


@dataclass(frozen=True)
class Calibration:
    window_tokens: int  # window size the thresholds were calibrated at (<= the live window)
    windows: int
    t_match: float
    rho: float
    max_d_expected: list[float]  # per slot
    max_ratio: float
    resolution: list[float | None]  # per slot: D(trained source, nearest other candidate) / t_match
    margin: list[float]  # per slot: the excess (in units of the distance between two sources) that excludes
    min_margin: list[float | None]  # per slot: the smallest such excess of another source on a correct window
    statistic: str = "jeffreys"  # the divergence the thresholds are for (matcher.JEFFREYS or MEAN)


def candidates(profile: Profile, thresholds: Thresholds) -> Candidates:
    key = ("candidates", thresholds.var_floor)
    if key not in profile._cache:
        profile._cache[key] = candidates_of(
            profile.slots, profile.sources, profile.extras, profile.atlas, thresholds.var_floor
        )
    return profile._cache[key]


def pieces_per_window(profile: Profile, tokens: int) -> int:
    """Power-of-two number of pieces whose tokens fit in ``tokens`` (at least 1, at most a quarter of the
    sample). Why a quarter: the left-out reference must keep most of the data. With half, a small
    profile's reference was as noisy as the window: SmolLM2-135M's 32 pieces calibrated 1 024-token
    windows at a ratio of 1.54 (1.25 at 512 tokens), which kept a last slot two layers late ambiguous
    on whole-domain windows that 512-token windows excluded."""
    p = int(profile.meta["piece_tokens"])
    m = len(profile.pieces["keys"])
    if m < 2:
        raise ProfileError(
            "the profile holds fewer than 2 calibration pieces; rebuild it from more data "
            "(or with a smaller --piece-tokens)"
        )
    fit = max(1, tokens // p)
    cap = max(1, m // 4)
    return 2 ** math.floor(math.log2(min(fit, cap)))


def calibrate(profile: Profile, tokens: int, thresholds: Thresholds) -> Calibration:
    ppw = pieces_per_window(profile, tokens)
    key = ("calibration", ppw, thresholds)
    if key in profile._cache:
        return profile._cache[key]
    cands = candidates(profile, thresholds)
    sources = profile.sources
    exp_idx = [cands.index(s) for s in sources]
    k = profile.num_slots
    pieces = profile.pieces
    psum = pieces["sum"].astype(np.float64)
    psq = pieces["sumsq"].astype(np.float64)
    ptok = pieces["tokens"].astype(np.float64)
    tot_n = profile.slots.count
    tot_s = profile.slots.sum
    tot_q = profile.slots.sumsq
    rng = np.random.default_rng(thresholds.seed)
    m = len(ptok)
    d_exp = np.zeros((thresholds.calibration_windows, k))
    ratio = np.zeros((thresholds.calibration_windows, k))
    lowest = np.full(k, np.inf)  # how near (in units of the pair distance) another source came
    for b in range(thresholds.calibration_windows):
        pick = rng.choice(m, size=ppw, replace=False)
        n = ptok[pick].sum()
        ws, wq = psum[pick].sum(0), psq[pick].sum(0)
        w_mean = ws / n
        w_var = np.maximum(wq / n - w_mean**2, 0.0)
        lo_n = np.maximum(tot_n - n, 1.0)  # leave the window out of its own reference
        lo_mean = (tot_s - ws) / lo_n
        lo_var = np.maximum((tot_q - wq) / lo_n - lo_mean**2, 0.0)
        ref_mean, ref_var = cands.mean.copy(), cands.var.copy()
        for slot, c in enumerate(exp_idx):
            ref_mean[c], ref_var[c] = lo_mean[slot], lo_var[slot]
        dist = divergence(w_mean, w_var, ref_mean, ref_var, cands.floor, cands.statistic)
        for slot, c in enumerate(exp_idx):
            others = np.delete(dist[slot], c)
            d_exp[b, slot] = dist[slot, c]
            ratio[b, slot] = dist[slot, c] / max(float(others.min()), 1e-30) if len(others) else 0.0
            if len(others):
                pair = np.maximum(np.delete(cands.pair[c], c), 1e-30)
                excess = (np.delete(dist[slot], c) - dist[slot, c]) / pair
                lowest[slot] = min(lowest[slot], float(excess.min()))
    t_match = max(thresholds.match_safety * float(d_exp.max()), 1e-12)
    max_ratio = float(ratio.max())
    rho = max(thresholds.rho_min, thresholds.rho_safety * max_ratio)
    # How far each trained source is from its nearest other candidate, in units of t_match: below ~1 a
    # swap between the two cannot be told apart at this window size.
    ref = divergence(cands.mean[exp_idx], cands.var[exp_idx], cands.mean, cands.var, cands.floor,
                     cands.statistic)
    resolution: list[float | None] = []
    for slot, c in enumerate(exp_idx):
        others = np.delete(ref[slot], c)
        resolution.append(round(float(others.min()) / t_match, 3) if len(others) else None)
    # A correct window whose nearest other source came nearer than its own (lowest < 0) shows how
    # far the right source can trail: excluding a source needs more than that (per depth: each slot).
    margin = [max(thresholds.margin_min, -thresholds.margin_safety * float(v)) if np.isfinite(v)
              else thresholds.margin_min for v in lowest]
    cal = Calibration(
        window_tokens=ppw * int(profile.meta["piece_tokens"]),
        windows=thresholds.calibration_windows,
        t_match=t_match,
        rho=rho,
        max_d_expected=[round(float(v), 6) for v in d_exp.max(0)],
        max_ratio=max_ratio,
        resolution=resolution,
        margin=[round(v, 4) for v in margin],
        min_margin=[round(float(v), 4) if np.isfinite(v) else None for v in lowest],
        statistic=cands.statistic,
    )
    profile._cache[key] = cal
    return cal


def profile_findings(profile: Profile, thresholds: Thresholds | None = None) -> list[Finding]:
    """Self-check of a profile with an atlas: each trained slot's statistics should sit nearest the
    atlas entry of the source its ids declare. If not, the ids or their convention are probably wrong
    (the data was captured from other layers than the provenance says)."""
    th = thresholds or Thresholds()
    if profile.atlas is None:
        return []
    atlas = profile.atlas
    a_mean, a_var = atlas.stats.mean(), atlas.stats.var()
    floor = th.var_floor * np.maximum(a_var.mean(axis=1), 1e-30)
    dist = divergence(profile.slots.mean(), profile.slots.var(), a_mean, a_var, floor)
    out = []
    for k, declared in enumerate(profile.sources):
        nearest = atlas.names[int(np.argmin(dist[k]))]
        if declared in atlas.names and nearest != declared:
            out.append(
                Finding(
                    Code.LAYER_ID_CONVENTION,
                    Severity.WARNING,
                    f"profile slot {k} is declared {declared} (ids {profile.meta.get('layer_ids')}, "
                    f"{profile.meta.get('convention')}) but its statistics match the atlas's {nearest}",
                    fix="rebuild the profile with the ids and --convention the data was really captured "
                    "with (or check that the atlas comes from the same target)",
                    slot=k,
                    expected=declared,
                    observed=nearest,
                )
            )
    return out
