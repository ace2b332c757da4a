"""The standalone drafter test: the draft on live features vs on its training features, and the
rewirings of the live features that bring it back to training-level agreement.

What each recorded slot carries comes from three places, strongest first: the reference profile's
verdict on the captured statistics (``--profile``), an exact test for the embedding (a slot whose
rows equal ``embed_tokens(ids)``), and the sources the live wiring claims (the capture manifest,
from SGLang's ``layers_to_capture``). What the draft was trained on comes from the profile, else
from the draft config's ids in the SpecForge convention. The fix is stated in canonical sources and
as the ``eagle_config`` ids that make SGLang feed them (through :mod:`hs_tracer.sources`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hs_tracer import sources as S
from hs_tracer.draft.model import Eagle3Draft
from hs_tracer.errors import InputError
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.replay import data as D
from hs_tracer.replay.rule import MIN_TOKENS, Level, training_level
from hs_tracer.replay.runner import EMBEDDING, Agreement, Wiring, agreement, describe, unigram_baseline

EMBED_TOLERANCE = 1e-2  # relative error under which a slot is the token embedding (bf16 storage)
MAX_PERMUTED_SLOTS = 4  # K! candidates; above this only shifts and source-based rewirings


@dataclass
class Candidate:
    name: str
    wiring: Wiring
    sources: list[str]
    result: Agreement | None = None

    def to_json(self, slot_sources: list[str]) -> dict[str, Any]:
        r = self.result
        return {"name": self.name, "wiring": describe(self.wiring, slot_sources), "sources": self.sources,
                "agreement": round(r.rate, 4) if r else None, "tokens": r.total if r else 0}


@dataclass
class ReplayResult:
    capture: Path
    slot_sources: list[str]  # what each recorded slot carries (best knowledge)
    slot_evidence: list[str]
    trained_sources: list[str]
    trained_from: str
    as_served: Candidate
    tokens_only: Agreement
    baseline: float
    sequences: int
    cached_prefix_sequences: int
    dropped_captures: int = 0  # steps the engine's capture writer dropped (behind, or over the bound)
    training: Agreement | None = None
    training_path: Path | None = None
    candidates: list[Candidate] = field(default_factory=list)
    fix: dict[str, Any] = field(default_factory=dict)
    acceptance: dict[str, Any] | None = None
    findings: list[Any] = field(default_factory=list)  # e.g. non_finite_features (rows left out)
    rule: Level | None = None  # training level for this capture's size (hs_tracer.replay.rule)

    @property
    def level(self) -> float | None:
        """Training-level agreement: the calibrated bar a healthy wiring reaches on this capture."""
        return self.rule.value if self.rule is not None else None

    @property
    def best(self) -> Candidate:
        return max(self.candidates, key=lambda c: c.result.rate if c.result else -1.0)

    def recovered_by(self) -> Candidate | None:
        """When the served wiring is below training level: the best rewiring that reaches it, if any."""
        level = self.level
        served = self.as_served.result.rate if self.as_served.result else 0.0
        if level is None or served >= level:
            return None
        ranked = sorted(self.candidates, key=lambda c: -(c.result.rate if c.result else -1.0))
        return next((c for c in ranked if c.result and c.result.rate >= level), None)

    @property
    def mismatched(self) -> bool:
        """The recorded slots carry other sources than the draft was trained on (as far as known)."""
        pairs = zip(self.trained_sources, self.slot_sources, strict=False)
        known = [(t, f) for t, f in pairs if f != S.UNKNOWN]
        return bool(self.trained_sources) and any(t != f for t, f in known)

    @property
    def status(self) -> str:
        """``miswired``: agreement below training level (or a rewiring clearly beats the served one when
        there is no training level); ``warning``: sources differ but agreement holds; else ``ok``."""
        level = self.level
        served = self.as_served.result.rate if self.as_served.result else 0.0
        if level is not None and served < level:
            return "miswired"
        if level is None:
            best = self.best.result.rate if self.best.result else 0.0
            margin = 3 * max(self.as_served.result.stderr() if self.as_served.result else 0.0, 0.01)
            if self.best.wiring != self.as_served.wiring and best - served > margin:
                return "miswired"
        return "warning" if self.mismatched else "ok"

    @property
    def cause(self) -> Finding | None:
        """Agreement collapsed although every slot carries the source the draft was trained on and no
        rewiring of the slots recovers it: the features are the right layers computed on other tokens,
        e.g. rows of other requests (an aux all-gather over the wrong process group under attention
        data parallelism)."""
        if self.status != "miswired" or self.mismatched or S.UNKNOWN in self.slot_sources:
            return None
        if self.recovered_by() is not None:
            return None
        return Finding(
            Code.FEATURES_FROM_OTHER_REQUESTS, Severity.CRITICAL,
            "every slot carries the layer the draft was trained on, yet the draft cannot use the features "
            "and no rewiring of the slots helps: the rows are computed on other tokens than the ones they "
            "are paired with (other requests' rows, e.g. an aux all-gather over the wrong process group "
            "under attention data parallelism, or a reordered batch)",
            "check how the target's aux hidden states are gathered and ordered before the draft: with "
            "attention data parallelism they must be gathered over the same group and in the same request "
            "order as the draft's input ids")

    def _at_level(self, c: Candidate) -> bool | None:
        return None if self.rule is None or c.result is None else self.rule.reached(c.result.rate)

    @property
    def exit_code(self) -> int:
        critical = any(f.severity.value == "critical" for f in self.findings)
        return 1 if self.status == "miswired" or critical else 0

    def to_json(self) -> dict[str, Any]:
        rec = self.recovered_by()
        return {
            "status": self.status,
            "capture": {"path": str(self.capture), "sequences": self.sequences,
                        "cached_prefix_sequences": self.cached_prefix_sequences,
                        "dropped_captures": self.dropped_captures,
                        "tokens": self.as_served.result.total if self.as_served.result else 0,
                        "agreement": _r(self.as_served.result), "slot_sources": self.slot_sources,
                        "slot_evidence": self.slot_evidence},
            "training": None if self.training is None else {
                "path": str(self.training_path), "tokens": self.training.total,
                "agreement": _r(self.training)},
            "training_level": None if self.level is None else round(self.level, 4),
            "training_level_rule": None if self.rule is None else self.rule.to_json(),
            "trained_sources": self.trained_sources,
            "trained_sources_from": self.trained_from,
            "baselines": {"most_frequent_token": round(self.baseline, 4),
                          "tokens_only": _r(self.tokens_only)},
            "alternatives": [{**c.to_json(self.slot_sources), "at_training_level": self._at_level(c)} for c in
                             sorted(self.candidates, key=lambda c: -(c.result.rate if c.result else -1))],
            "recovered_by": None if rec is None else rec.to_json(self.slot_sources),
            "fix": self.fix,
            "cause": self.cause.to_json() if self.cause else None,
            "acceptance": self.acceptance,
            "findings": [f.to_json() for f in [*self.findings, *([self.cause] if self.cause else [])]],
        }


def _r(a: Agreement | None) -> float | None:
    return None if a is None else round(a.rate, 4)


# ---- what the slots carry ------------------------------------------------------------------------
def embedding_slots(draft: Eagle3Draft, seqs: list[D.Sequence], num_slots: int, hidden: int) -> list[bool]:
    """Exact test per slot: do its rows equal the token embedding of their ids?"""
    if not seqs:
        return [False] * num_slots
    feats = torch.cat([s.features for s in seqs[:8]])
    with torch.no_grad():
        emb = draft.embed_tokens(torch.cat([s.ids for s in seqs[:8]])).float()
    out = []
    for j in range(num_slots):
        x = feats[:, j * hidden:(j + 1) * hidden]
        if x.shape != emb.shape:
            out.append(False)
            continue
        err = float((x - emb).norm() / emb.norm().clamp(min=1e-12))
        out.append(err < EMBED_TOLERANCE)
    return out


def observed_by_profile(capture: Path, profile: Any) -> list[str] | None:
    """The profile's verdict per slot on the captured statistics (``unknown`` where nothing matches)."""
    from hs_tracer.diagnosis.identity import diagnose_detailed
    from hs_tracer.diagnosis.live import read_live

    live = read_live(capture, profile.hidden_size, int(profile.meta.get("skip_first_positions", 1)))
    result = diagnose_detailed(live.stats, profile, tokens=live.tokens, nonfinite=live.nonfinite,
                               width=live.width)
    slots = result.report.slots
    return [s.observed_source for s in sorted(slots, key=lambda s: s.index)] if slots else None


def identify(manifest: Any, draft: Eagle3Draft, seqs: list[D.Sequence], profile: Any | None,
             capture: Path) -> tuple[list[str], list[str]]:
    """(source per recorded slot, evidence per slot)."""
    k, h = manifest.num_slots, manifest.hidden_size
    claimed = list(manifest.sources or [S.UNKNOWN] * k)
    sources, evidence = list(claimed), ["live wiring (manifest)"] * k
    if profile is not None:
        seen = observed_by_profile(capture, profile)
        for j, src in enumerate(seen or []):
            if j < k and src != S.UNKNOWN:
                sources[j], evidence[j] = src, "profile match"
    for j, is_emb in enumerate(embedding_slots(draft, seqs, k, h)):
        if is_emb:
            sources[j], evidence[j] = S.EMBEDDING, "equals embed_tokens(ids)"
    return sources, evidence


def trained_sources(draft: Eagle3Draft, profile: Any | None, num_layers: int | None) -> tuple[list[str], str]:
    if profile is not None:
        return list(profile.sources), "profile"
    ids = draft.config.aux_layer_ids
    if ids is None or num_layers is None:
        return [], "unknown (no profile, and no eagle_config ids or target depth)"
    return S.to_sources(ids, S.Convention.SPECFORGE, num_layers), "draft config ids (SpecForge convention)"


# ---- candidate wirings ---------------------------------------------------------------------------
def candidates(num_slots: int, slot_sources: list[str], trained: list[str]) -> list[Candidate]:
    """As served, every slot permutation (small K), one-slot shifts, and the rewiring by source."""
    ident = tuple(range(num_slots))
    seen: set[Wiring] = set()
    out: list[Candidate] = []

    def add(name: str, wiring: Wiring) -> None:
        if wiring in seen:
            return
        seen.add(wiring)
        srcs = [S.EMBEDDING if p == EMBEDDING else slot_sources[int(p)] for p in wiring]
        out.append(Candidate(name, wiring, srcs))

    add("as served", ident)
    if len(trained) == num_slots:
        by_source: list[int | str] = []
        for want in trained:
            if want in slot_sources:
                by_source.append(slot_sources.index(want))
            elif want == S.EMBEDDING:
                by_source.append(EMBEDDING)
            else:
                break
        else:
            add("by source", tuple(by_source))
        nearest = _nearest_by_depth(slot_sources, trained)
        if nearest is not None:
            add("nearest source", nearest)
    if num_slots > 1:
        add("shift left", (*range(1, num_slots), num_slots - 1))
        add("shift right", (0, *range(num_slots - 1)))
    if num_slots <= MAX_PERMUTED_SLOTS:
        for perm in itertools.permutations(ident):
            add("permutation", perm)
    return out


def _nearest_by_depth(slot_sources: list[str], trained: list[str]) -> Wiring | None:
    """Each trained source from the recorded slot closest to it in depth (a partial rewiring when
    the trained layers themselves were not captured)."""
    try:
        have = [S.Source.parse(x).depth for x in slot_sources]
        want = [S.Source.parse(x).depth for x in trained]
    except ValueError:  # an unknown slot: depth is not defined
        return None
    return tuple(min(range(len(have)), key=lambda j, w=w: (abs(have[j] - w), j)) for w in want)


# ---- the fix -------------------------------------------------------------------------------------
def config_ids_for(trained: list[str], target_arch: str | None, num_layers: int | None) -> list[int] | None:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` with which SGLang feeds ``trained``."""
    if not trained or num_layers is None or S.FINAL_NORM in trained:
        return None
    family = S.family_of(target_arch)
    for convention in (S.Convention.SPECFORGE, S.Convention.SGLANG_CAPTURE):
        try:
            ids = S.from_sources(trained, convention, num_layers)
            fed = S.sglang_sources(ids, family, num_layers)
        except ValueError:
            continue
        if fed.sources == list(trained) and not fed.unreachable:
            return ids
    return None


def fix_for(result: ReplayResult, manifest: Any) -> dict[str, Any]:
    """The fix in canonical sources and config ids, and what the replay showed about it."""
    trained, fed = result.trained_sources, result.slot_sources
    if result.status == "ok" or not trained:
        return {}
    ids = config_ids_for(trained, manifest.target_arch, manifest.num_layers)
    wrong = [i for i, (t, f) in enumerate(zip(trained, fed, strict=False)) if t != f]
    missing = [t for t in trained if t not in fed and t != S.EMBEDDING]
    configured = (manifest.wiring or {}).get("configured_layer_ids")
    parts = [f"slot {i} must carry {trained[i]} (it is fed {fed[i]})" for i in wrong]
    if ids is not None:
        parts.append(f"set eagle_config.eagle_aux_hidden_state_layer_ids to {ids} in the draft's config.json "
                     f"(served with {configured}); SGLang then feeds {', '.join(trained)}")
    by_source = next((c for c in result.candidates if c.sources == trained), None)
    if by_source is not None and by_source.result is not None:
        verified = (f"the captured features rewired by source give {by_source.result.rate:.3f}"
                    + (" (training level)" if result._at_level(by_source) else ""))
    elif missing:
        verified = (f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not in the capture, so the "
                    "fixed wiring cannot be replayed from it")
    else:
        verified = "the trained sources could not be located in the capture"
    if result.status == "warning":
        verified = f"agreement is at training level as served, the draft tolerates this here; {verified}"
    best = result.best
    rewiring = None
    if best.wiring != result.as_served.wiring and best.result is not None:
        rewiring = {**best.to_json(fed), "reaches_training_level": bool(result._at_level(best))}
    return {
        "sources": trained,
        "fed_sources": fed,
        "eagle_aux_hidden_state_layer_ids": ids,
        "configured_layer_ids": configured,
        "missing_from_capture": missing,
        "verified": verified,
        "best_rewiring": rewiring,
        "message": "; ".join(parts) + f" ({verified})",
    }


# ---- entry point ---------------------------------------------------------------------------------
SMALL_HIDDEN = 1024  # drafts up to this width run single-threaded (see replay())


def replay(capture: Path, draft_dir: Path, *, target_dir: Path | None = None, training: Path | None = None,
           profile_path: Path | None = None, max_tokens: int = 20000, threads: int | None = None
           ) -> ReplayResult:
    """The standalone drafter test. ``threads``: torch intra-op threads (default: 1 for small drafts,
    whose matrices gain nothing from threads and on a busy machine lose 10-40x to spin-waiting
    workers; torch's default otherwise)."""
    saved = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        return _replay(capture, draft_dir, target_dir, training, profile_path, max_tokens, threads is None)
    finally:
        torch.set_num_threads(saved)


def _replay(capture: Path, draft_dir: Path, target_dir: Path | None, training: Path | None,
            profile_path: Path | None, max_tokens: int, auto_threads: bool) -> ReplayResult:
    from hs_tracer.diagnosis.live import acceptance_of

    manifest, seqs, accept = D.load_capture(capture, max_tokens)
    seqs, nonfinite, values = D.finite_only(seqs)
    if not seqs and nonfinite:
        raise InputError(f"{capture}: every captured row holds NaN/Inf values ({nonfinite} of {values}); "
                         "nothing to replay: look for overflow in the target")
    if not seqs:
        raise InputError(f"{capture}: the capture holds no feature rows yet (raise HS_TRACER_CAPTURE_RATE "
                         "or capture longer)")
    target = target_dir or (Path(manifest.target_path) if manifest.target_path else None)
    if target is not None and not target.is_dir():
        target = None
    draft = Eagle3Draft.from_pretrained(draft_dir, target_dir=target)
    draft.eval()
    if auto_threads and draft.config.hidden_size <= SMALL_HIDDEN:
        torch.set_num_threads(1)
    k, h = manifest.num_slots, manifest.hidden_size
    if k * h != draft.config.fc_in:
        raise InputError(f"{capture}: features are {k}x{h} wide, the draft's fc reads {draft.config.fc_in}; "
                         "replay needs the draft the capture was served with")
    profile = None
    if profile_path is not None:
        from hs_tracer.profile.model import Profile

        profile = Profile.load(profile_path)
    slot_sources, evidence = identify(manifest, draft, seqs, profile, capture)
    trained, trained_from = trained_sources(draft, profile, manifest.num_layers)
    cands = candidates(k, slot_sources, trained)
    for c in cands:
        c.result = agreement(draft, seqs, c.wiring)
    ident = tuple(range(k))
    result = ReplayResult(
        capture=capture, slot_sources=slot_sources, slot_evidence=evidence, trained_sources=trained,
        trained_from=trained_from, as_served=cands[0], tokens_only=agreement(draft, seqs, ident, zero=True),
        baseline=unigram_baseline(seqs), sequences=len(seqs),
        cached_prefix_sequences=sum(1 for s in seqs if s.first_position > 0), candidates=cands,
        dropped_captures=manifest.skipped,
    )
    if training is not None:
        train_seqs, train_nonfinite, _ = D.finite_only(D.load_training(training, k, h, max_tokens))
        nonfinite += train_nonfinite
        result.training, result.training_path = agreement(draft, train_seqs, ident), training
        result.rule = training_level(result.training.by_sequence, result.as_served.result.total)
    # Rows with NaN/Inf were left out of every agreement above; say so instead of averaging them in.
    from hs_tracer.diagnosis.matcher import nonfinite_finding

    result.findings = nonfinite_finding(nonfinite, values)
    acc = acceptance_of(accept) if accept.size else None
    result.acceptance = None if acc is None else acc.to_json()
    result.fix = fix_for(result, manifest)
    return result


def human(result: ReplayResult) -> str:
    d = result.to_json()
    cap = d["capture"]
    lines = [f"capture: {cap['path']}: {cap['sequences']} prefill sequences, {cap['tokens']} scored tokens"
             + (f" ({cap['cached_prefix_sequences']} after a cached prefix)" if cap["cached_prefix_sequences"]
                else "")
             + (f"; {cap['dropped_captures']} captured steps were dropped (the writer fell behind or a shard "
                "exceeded the size bound)" if cap["dropped_captures"] else "")]
    for j, (src, ev) in enumerate(zip(cap["slot_sources"], cap["slot_evidence"], strict=True)):
        lines.append(f"  slot {j}: {src:<10} ({ev})")
    lines.append(f"trained on: {', '.join(d['trained_sources']) or '?'} ({d['trained_sources_from']})")
    a = d["acceptance"]
    if a:
        lines.append(f"live acceptance: mean accept length {a['mean_accept_length']:.2f} over {a['steps']} "
                     "request-steps")
    lines.append("next-token top-1 agreement of the draft:")
    if d["training"]:
        rule = d["training_level_rule"]
        lines.append(f"  on its training data          {d['training']['agreement']:.3f}  "
                     f"({d['training']['tokens']} tokens)")
        lines.append(f"  training level for {rule['tokens']} live tokens >= {rule['value']:.3f}  "
                     f"(calibrated rule: {rule['allowance']:.0%} allowance, {rule['z']:g} x spread "
                     f"{rule['spread']:.3f}; docs/replay.md)")
        if rule["too_few_tokens"]:
            lines.append(f"  note: fewer than {MIN_TOKENS} scored tokens: agreement scatters too much here "
                         "for a firm verdict; capture more prefill steps")
    lines.append(f"  on the live features, served  {cap['agreement']:.3f}")
    lines.append(f"  tokens only (features zeroed) {d['baselines']['tokens_only']:.3f}; most frequent token "
                 f"{d['baselines']['most_frequent_token']:.3f}")
    lines.append("rewirings of the live features:")
    for c in d["alternatives"][:6]:
        mark = "  (training level)" if c["at_training_level"] else ""
        lines.append(f"  {c['agreement']:.3f}  {c['name']:<14} {', '.join(c['wiring'])}{mark}")
    rec = d["recovered_by"]
    lines.append(f"status: {d['status']}")
    if rec and rec["name"] != "as served":
        lines.append(f"training level recovered by: {rec['name']}: {', '.join(rec['wiring'])} -> "
                     f"{rec['agreement']:.3f}")
    if d["fix"]:
        lines.append(f"fix: {d['fix']['message']}")
    lines.extend(f.one_line() for f in result.findings)
    if result.cause is not None:
        lines.append(result.cause.one_line())
    return "\n".join(lines)


def to_json_text(result: ReplayResult) -> str:
    return json.dumps(result.to_json(), indent=2, default=lambda o: o.tolist() if isinstance(o, np.ndarray)
                      else str(o))
