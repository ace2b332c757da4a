"""Static wiring checks for vLLM: from the ids vLLM resolves to what the draft gets, and whether the
draft can take it.

The same functions serve the preflight (``hs-tracer check --engine vllm``, wiring predicted from the
files) and the vLLM plugin at engine startup (wiring read from the live engine). What vLLM reads and
captures comes from :mod:`.layer_ids` (its rules, per release): it takes the draft's ids
from the top-level key, else DFlash's ``target_layer_ids`` plus one, else the nested ``eagle_config``;
without any it falls back to ``(2, N//2, N-3)``. It captures each id once in layer order, and the
draft's ``fc`` expects its own count of states (:func:`.layer_ids.vllm_draft_aux_states`,
which never looks at the top-level ids for most draft classes): when the two differ, vLLM fails at
the first request with a shape error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hs_tracer import sources as src
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.integrations.vllm import NAME
from hs_tracer.integrations.vllm import layer_ids as vl
from hs_tracer.records import WiringRecord


def wiring_record(target: Mapping[str, Any], capture: vl.VLLMCapture | None, draft: Mapping[str, Any],
                  spec_args: Mapping[str, Any], vllm_version: str) -> WiringRecord:
    """The wiring record of a vLLM engine (a pure function of what its startup hook read)."""
    return WiringRecord(
        model=os.path.basename(str(target.get("model_path", "")).rstrip("/")) or str(target["architecture"]),
        target_arch=str(target["architecture"]),
        num_layers=int(target["num_layers"]),
        hidden_size=int(target["hidden_size"]),
        layers_to_capture=list(capture.captured) if capture else [],
        sources=list(capture.sources) if capture else [src.FINAL_NORM],
        configured_layer_ids=list(capture.layer_ids) if capture and capture.key != vl.VLLM_DEFAULT else None,
        draft_fc_in_features=draft.get("fc_in_features"),
        draft_num_aux_states=draft.get("num_aux_hidden_states"),
        use_aux_hidden_state=capture is not None,
        spec_args=dict(spec_args),
        engine=NAME,
        engine_version=vllm_version,
        layer_id_source=capture.key if capture else "",
    )


def _fmt(sources: Sequence[str]) -> str:
    return ", ".join(sources) if sources else "nothing"


def _ids_fix(trained_ids: Sequence[int] | None) -> str:
    ids = f"[{', '.join(str(i) for i in trained_ids)}]" if trained_ids else "the ids the draft was trained on"
    return (f"set \"{vl.VLLM_TOP_LEVEL}\": {ids} at the top level of the draft's config.json (vLLM's "
            "convention: id k = input of layer k, 0 = embedding, N = last layer's output before the "
            "final norm)")


def _stray_ids(draft_config: Mapping[str, Any], used_key: str) -> list[tuple[str, Any]]:
    """Layer-id lists the draft config carries where vLLM did not take them from."""
    out = []
    for key, path in ((vl.VLLM_TOP_LEVEL, (vl.VLLM_TOP_LEVEL,)),
                      (vl.VLLM_NESTED, ("eagle_config", "eagle_aux_hidden_state_layer_ids")),
                      (vl.VLLM_DFLASH, ("dflash_config", "target_layer_ids"))):
        value: Any = draft_config
        for part in path:
            value = value.get(part) if isinstance(value, Mapping) else None
        if value and key != used_key:
            out.append((key, value))
    return out


def check_vllm_wiring(w: WiringRecord, capture: vl.VLLMCapture | None, draft_config: Mapping[str, Any],
                      trained_sources: Sequence[str] | None = None) -> list[Finding]:
    """Findings for one vLLM wiring: the width the draft's fc takes vs what vLLM feeds, ids vLLM
    skipped or fell back on, and (with the draft's training sources) every slot that differs."""
    findings: list[Finding] = []
    n, h = w.num_layers, w.hidden_size
    trained_ids = None
    if trained_sources:
        try:
            trained_ids = src.from_sources(trained_sources, src.Convention.VLLM, n)
        except ValueError:
            trained_ids = None
    if capture is None:
        return findings
    fed = len(capture.captured) * h
    if w.draft_fc_in_features is not None and fed != w.draft_fc_in_features:
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"vLLM feeds the draft {len(capture.captured)} target states ({_fmt(capture.sources)}: {fed} "
            f"wide) from ids {capture.layer_ids} ({capture.key}); the draft's fc takes "
            f"{w.draft_fc_in_features} ({w.draft_fc_in_features // max(h, 1)} states): vLLM fails at the "
            "first request with a shape error",
            fix=_ids_fix(trained_ids) if trained_ids else
            f"give the draft as many distinct ids in 0..{n} as its fc takes states: " + _ids_fix(None),
            expected=str(w.draft_fc_in_features), observed=str(fed),
            details={"layer_ids": capture.layer_ids, "captured": capture.captured, "key": capture.key}))
    stray = _stray_ids(draft_config, capture.key)
    if stray:
        where = "; ".join(f"{k} = {v}" for k, v in stray)
        taken = "its default (2, N//2, N-3)" if capture.key == vl.VLLM_DEFAULT else capture.key
        findings.append(Finding(
            Code.LAYER_IDS_IGNORED, Severity.WARNING if not trained_sources else Severity.CRITICAL
            if list(capture.sources) != list(trained_sources) else Severity.WARNING,
            f"the draft config names layer ids vLLM does not use ({where}); vLLM took {taken}: "
            f"ids {capture.layer_ids}, {_fmt(capture.sources)}",
            fix=_ids_fix(trained_ids or (list(stray[0][1]) if capture.key == vl.VLLM_DEFAULT else None)),
            details={"used": capture.key, "ignored": dict(stray)}))
    elif capture.key == vl.VLLM_DEFAULT:
        findings.append(Finding(
            Code.LAYER_IDS_IGNORED, Severity.INFO,
            f"the draft config names no layer ids: vLLM feeds its default {capture.layer_ids} "
            f"({_fmt(capture.sources)}); right only if the draft was trained on these",
            fix=_ids_fix(trained_ids), details={"used": capture.key}))
    if capture.key == vl.VLLM_DFLASH:
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.INFO,
            f"vLLM read dflash_config.target_layer_ids and added one to each: ids {capture.layer_ids} = "
            f"{_fmt(capture.sources)}", details={"used": capture.key}))
    if capture.key == vl.VLLM_NESTED and not trained_sources:
        sglang = src.sglang_sources(capture.layer_ids, src.family_of(w.target_arch), n).sources
        if sglang != list(capture.sources):
            findings.append(Finding(
                Code.LAYER_ID_CONVENTION, Severity.WARNING,
                f"vLLM reads the eagle_config ids {capture.layer_ids} as layer inputs "
                f"({_fmt(capture.sources)}); "
                f"SGLang, whose place for them this is, feeds {_fmt(sglang)} on this target: a draft "
                "trained with SpecForge (ids = block outputs) gets every slot one block early in vLLM",
                fix="check which layers the draft was trained on (hs-tracer check --profile P decides it) "
                    "and, if SGLang's reading is the right one, " + _ids_fix(
                        src.from_sources(sglang, src.Convention.VLLM, n)),
                details={"vllm_sources": list(capture.sources), "sglang_sources": sglang}))
    if capture.unreachable or capture.duplicates:
        parts = []
        if capture.unreachable:
            parts.append(f"ids {capture.unreachable} are outside 0..{n} and never captured")
        if capture.duplicates:
            parts.append(f"ids {capture.duplicates} repeat and are captured once")
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.WARNING, "; ".join(parts) + f" (ids {capture.layer_ids})",
            fix=_ids_fix(trained_ids), details={"layer_ids": capture.layer_ids}))
    if trained_sources and list(trained_sources) != list(capture.sources):
        fed_sources = list(capture.sources)
        for i, want in enumerate(trained_sources):
            got = fed_sources[i] if i < len(fed_sources) else "nothing"
            if got != want:
                findings.append(Finding(
                    Code.SLOT_SOURCE_MISMATCH, Severity.CRITICAL,
                    f"slot {i} is fed {got}; the draft was trained on {want}",
                    fix=_ids_fix(trained_ids), slot=i, expected=want, observed=got))
    return findings
