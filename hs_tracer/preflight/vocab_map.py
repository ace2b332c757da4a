"""d2t / t2d: the draft-to-target vocabulary mapping, checked the way SGLang uses it (its newest
supported release).

SGLang (models/llama_eagle3.py ``load_weights``) takes any tensor whose name contains ``d2t`` as
*diffs* and builds ``hot_token_id = d2t + arange(len(d2t))`` (absolute target ids); it skips
``t2d``; with no ``d2t`` it leaves ``hot_token_id`` unset and a draft id is used as the target id.
SpecForge, speculators and EAGLE all write diffs: ``d2t[i] = used[i] - i`` over the sorted used
target ids, and ``t2d`` the bool mask of those ids.
"""

from __future__ import annotations

import numpy as np

from hs_tracer.findings import Code, Finding, Severity


def _bad(message: str, fix: str, **details: object) -> Finding:
    return Finding(Code.D2T_INVALID, Severity.CRITICAL, message, fix, details=dict(details))


def check_vocab_mapping(
    d2t: np.ndarray | None,
    t2d: np.ndarray | None,
    draft_vocab: int | None,
    target_vocab: int | None,
) -> list[Finding]:
    """Findings for the mapping SGLang will build; ``draft_vocab`` is the draft head's row count."""
    findings: list[Finding] = []
    reduced = draft_vocab is not None and target_vocab is not None and draft_vocab < target_vocab
    if d2t is None:
        if reduced:
            findings.append(_bad(
                f"draft vocabulary {draft_vocab} < target vocabulary {target_vocab} but the checkpoint "
                "has no d2t: SGLang leaves hot_token_id unset and emits draft id i as target id i, so "
                f"the draft can only propose the first {draft_vocab} target tokens",
                "save d2t (int64 diffs, len = draft_vocab_size) into model.safetensors next to the "
                "weights; side files such as vocab_mapping.pt or eagle_meta.pt are never read",
                draft_vocab=draft_vocab, target_vocab=target_vocab))
        if t2d is not None and reduced:
            findings.append(Finding(
                Code.D2T_INVALID, Severity.INFO,
                "the checkpoint has t2d but no d2t; SGLang ignores t2d", "save d2t as well"))
        return findings

    d2t = np.asarray(d2t)
    if d2t.ndim != 1:
        return [_bad(f"d2t has shape {list(d2t.shape)}, expected 1-D [draft_vocab]",
                     "save d2t as a 1-D int64 tensor")]
    if not np.issubdtype(d2t.dtype, np.integer):
        return [_bad(f"d2t has dtype {d2t.dtype}; SGLang indexes with it and needs integers",
                     "save d2t as int64 diffs (target_id - draft_id)")]
    d2t = d2t.astype(np.int64)
    n = d2t.shape[0]
    if draft_vocab is not None and n != draft_vocab:
        findings.append(_bad(
            f"len(d2t) = {n} but the draft head has {draft_vocab} rows: draft ids past {min(n, draft_vocab)} "
            "have no target id",
            "rebuild d2t for this draft head (len(d2t) must equal draft_vocab_size)",
            len_d2t=n, draft_vocab=draft_vocab))
    targets = d2t + np.arange(n, dtype=np.int64)
    t2d_ids = None
    if t2d is not None:
        t2d = np.asarray(t2d).reshape(-1)
        t2d_ids = np.flatnonzero(t2d.astype(bool)) if t2d.dtype == np.bool_ or set(np.unique(t2d)) <= {0, 1} \
            else None

    # Absolute ids saved where diffs are expected (the FR-Spec token-map format, or a hand export).
    looks_absolute = (
        (t2d_ids is not None and t2d_ids.shape[0] == n and n > 1 and np.array_equal(t2d_ids, d2t)
         and not np.array_equal(t2d_ids, targets))
        or (n > 1 and bool(np.all(np.diff(d2t) > 0)) and target_vocab is not None
            and int(targets.max()) >= target_vocab and int(d2t.max()) < target_vocab)
    )
    if n > 1 and np.array_equal(d2t, np.arange(n)):
        findings.append(_bad(
            "d2t equals arange(len): these are absolute ids of the first tokens, not diffs; SGLang adds "
            "arange again and maps draft id i to target id 2*i",
            "store diffs: d2t[i] = target_id[i] - i (all zeros for an identity mapping)"))
        return findings
    if looks_absolute:
        findings.append(_bad(
            "d2t holds absolute target ids, not diffs: SGLang computes d2t + arange and every proposed "
            "token is wrong (or out of range)",
            "store diffs: d2t = target_ids - arange(len(target_ids))",
            max_target=int(targets.max()), target_vocab=target_vocab))
        return findings
    if reduced and not d2t.any():
        findings.append(_bad(
            f"d2t is all zeros with a reduced draft vocabulary ({n} < {target_vocab}): the draft can only "
            f"propose the first {n} target tokens",
            "rebuild d2t from the token frequencies of the training data (SpecForge/speculators vocab "
            "mapping) and save it in model.safetensors"))
        return findings
    if target_vocab is not None and (int(targets.min()) < 0 or int(targets.max()) >= target_vocab):
        findings.append(_bad(
            f"d2t maps draft ids to target ids {int(targets.min())}..{int(targets.max())}, outside the "
            f"target vocabulary [0, {target_vocab})",
            "rebuild d2t for this target's tokenizer", target_vocab=target_vocab))
        return findings
    if np.unique(targets).shape[0] != n:
        findings.append(Finding(
            Code.D2T_INVALID, Severity.WARNING,
            "d2t maps several draft ids to the same target id; SpecForge/speculators never write that",
            "rebuild d2t from sorted unique target ids"))
    elif n > 1 and not bool(np.all(np.diff(d2t) >= 0)):
        findings.append(Finding(
            Code.D2T_INVALID, Severity.WARNING,
            "d2t diffs are not non-decreasing: the draft vocabulary is not in target-id order as "
            "SpecForge/speculators write it", "check how d2t was produced"))

    if t2d is not None:
        if target_vocab is not None and t2d.shape[0] != target_vocab:
            findings.append(_bad(
                f"len(t2d) = {t2d.shape[0]} but the target vocabulary is {target_vocab}: the mapping was "
                "built for another tokenizer",
                "rebuild d2t/t2d with this target's tokenizer", len_t2d=int(t2d.shape[0]),
                target_vocab=target_vocab))
        elif t2d_ids is not None and not np.array_equal(t2d_ids, np.sort(targets)):
            findings.append(_bad(
                "t2d and d2t disagree: the target ids marked in t2d are not arange + d2t; SGLang uses d2t",
                "rebuild both from the same token list (t2d = mask of arange(len(d2t)) + d2t)",
                t2d_count=int(t2d_ids.shape[0]), d2t_count=n))
    return findings


def check_against_training_map(d2t: np.ndarray | None, profile_meta: dict) -> list[Finding]:
    """The checkpoint's d2t vs the vocabulary map of the draft's training data (kept by ``profile
    build`` as a digest): a d2t regenerated after training maps every lm_head row to another token."""
    from hs_tracer.profile.expectation import digest

    trained = (profile_meta or {}).get("training_vocab_map")
    if not trained or d2t is None:
        return []
    d2t = np.asarray(d2t)
    if d2t.ndim != 1 or not np.issubdtype(d2t.dtype, np.integer) or digest(d2t) == trained["d2t_sha256"]:
        return []
    return [_bad(
        f"d2t differs from the vocabulary map of the draft's training data ({trained['path']}, "
        f"{trained['draft_vocab']} tokens): the lm_head rows were trained for the tokens of that map, so "
        "this d2t (regenerated after training, e.g. on new data) turns the draft's right predictions into "
        "wrong tokens and acceptance collapses while the features stay right",
        "ship the d2t (and t2d) the draft was trained with (the training run's vocab_mapping), or retrain "
        "the lm_head for the new map", training_map=trained["path"])]
