"""Static wiring checks: from what the engine is configured to capture to what the draft gets.

The same functions serve the preflight ``hs-tracer check`` (wiring read from files) and the SGLang
plugin at engine startup (wiring read from the live engine, :class:`~hs_tracer.records.WiringRecord`,
through :func:`wiring_from_record`). Layer-id conventions come from :mod:`hs_tracer.sources` only.

Facts about SGLang (the newest supported release's source, read for these checks; the layer-id
rules of each release are its adapter's, read through :mod:`hs_tracer.engines`): it reads the draft's
layer ids only from the nested ``eagle_config`` dict (a bare ``except`` falls back to the default
``[2, N//2, N-3]`` for anything else), turns them into ``layers_to_capture`` by a per-family rule,
captures each reachable layer once in ascending order, and feeds the draft ``len(captured) x H``
features; the draft's ``fc`` runs only when that width differs from ``H`` — an H-wide input skips it
without an error.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hs_tracer import engines
from hs_tracer import sources as src
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.records import WiringRecord


class IdsLocation(str, enum.Enum):
    """Where the draft config keeps ``eagle_aux_hidden_state_layer_ids``."""

    NESTED = "eagle_config"  # SpecForge / SGLang: the only place SGLang reads
    TOP_LEVEL = "top_level"  # speculators / vLLM
    BOTH = "both"
    NONE = "none"


@dataclass(frozen=True)
class Wiring:
    """One description of the target -> draft wiring, from files or from a live engine.

    ``engine_layer_ids`` is what the engine reads (nested ``eagle_config`` ids; None = absent, so the
    default is used). ``layers_to_capture`` is the live value when known; otherwise it is derived
    from ``engine_layer_ids`` with SGLang's rule for ``target_arch``.
    """

    target_arch: str
    num_layers: int
    target_hidden_size: int
    engine_layer_ids: list[int] | None = None
    ids_location: IdsLocation = IdsLocation.NONE
    top_level_layer_ids: list[int] | None = None
    eagle_config_is_dict: bool = True
    use_aux_hidden_state: bool = True
    spec_algorithm: str | None = "EAGLE3"
    draft_is_eagle3: bool = True
    fc_in_features: int | None = None
    draft_num_aux_states: int | None = None
    draft_input_hidden: int | None = None  # the draft's target_hidden_size (fc chunk width)
    graph_width: int | None = None  # get_draft_input_from_target_hidden_dim: static draft-extend buffer
    layers_to_capture: list[int] | None = None
    engine: str = engines.DEFAULT  # the checks below are SGLang's layer-id rules
    engine_version: str | None = None  # the release whose layer-id rules apply (None: the newest)

    @property
    def release(self) -> str:
        """The release whose rules apply, for messages (the engine's newest when none is pinned)."""
        return self.engine_version or engines.get(self.engine).newest_release()

    @property
    def family(self) -> src.Family:
        return src.family_of(self.target_arch)

    @property
    def aux_enabled(self) -> bool:
        """The target captures aux states only for EAGLE3 with ``use_aux_hidden_state`` true."""
        return (self.spec_algorithm or "").upper() == "EAGLE3" and self.use_aux_hidden_state


def capture(w: Wiring) -> src.SGLangCapture:
    """What the target really feeds the draft, in slot order."""
    if w.layers_to_capture is not None:
        return src.sglang_capture(w.layers_to_capture, w.num_layers, w.family, **_pin(w))
    return src.sglang_sources(w.engine_layer_ids, w.family, w.num_layers, **_pin(w))


def _pin(w: Wiring) -> dict[str, Any]:
    """The engine and release whose layer-id rules :mod:`hs_tracer.sources` applies to ``w``."""
    return {"engine": w.engine, "engine_version": w.engine_version}


def fed_width(w: Wiring) -> int:
    """Width of the features the draft's input receives at draft extend."""
    if not w.aux_enabled:
        return w.target_hidden_size
    return len(capture(w).sources) * w.target_hidden_size


def wiring_from_record(record: WiringRecord, *, eagle3_draft: bool = True) -> Wiring:
    """The live engine's wiring as the plugin records it at startup."""
    algo = str(record.spec_args.get("speculative_algorithm", "EAGLE3") or "EAGLE3")
    return Wiring(
        target_arch=record.target_arch,
        num_layers=record.num_layers,
        target_hidden_size=record.hidden_size,
        engine_layer_ids=list(record.configured_layer_ids) if record.configured_layer_ids is not None
        else None,
        ids_location=IdsLocation.NESTED if record.configured_layer_ids is not None else IdsLocation.NONE,
        use_aux_hidden_state=True if record.use_aux_hidden_state is None else record.use_aux_hidden_state,
        spec_algorithm=algo,
        draft_is_eagle3=eagle3_draft,
        fc_in_features=record.draft_fc_in_features,
        draft_num_aux_states=record.draft_num_aux_states,
        graph_width=record.draft_graph_width,
        layers_to_capture=list(record.layers_to_capture) if record.layers_to_capture else None,
        engine=record.engine,
        engine_version=record.layer_id_rules or record.engine_version or None,
    )


def ids_location(draft_config: Mapping[str, Any]) -> tuple[IdsLocation, list[int] | None, bool]:
    """Where a draft config.json keeps its ids: (location, top-level ids, eagle_config readable).

    A nested ``null`` counts as absent: SGLang then captures its default.
    """
    eagle = draft_config.get("eagle_config")
    nested = isinstance(eagle, dict) and eagle.get("eagle_aux_hidden_state_layer_ids") is not None
    top = draft_config.get("eagle_aux_hidden_state_layer_ids")
    top_ids = [int(v) for v in top] if isinstance(top, (list, tuple)) else None
    if nested and top_ids is not None:
        location = IdsLocation.BOTH
    elif nested:
        location = IdsLocation.NESTED
    else:
        location = IdsLocation.TOP_LEVEL if top_ids is not None else IdsLocation.NONE
    return location, top_ids, eagle is None or isinstance(eagle, dict)


def with_draft_config(w: Wiring, draft_config: Mapping[str, Any]) -> Wiring:
    """Add what only the draft's config.json tells (for the live plugin, which reads it at startup)."""
    location, top_ids, readable = ids_location(draft_config)
    return replace(w, ids_location=location, top_level_layer_ids=top_ids, eagle_config_is_dict=readable)


def _fmt(sources: Sequence[str]) -> str:
    return "[" + ", ".join(sources) + "]"


# ---------------------------------------------------------------------------------------------
# The checks. Each returns a list of findings and never raises on odd input.
# ---------------------------------------------------------------------------------------------

def check_algorithm(w: Wiring) -> list[Finding]:
    """EAGLE (or NEXTN) with an EAGLE-3 draft: no aux capture, fc skipped, accept length ~1."""
    algo = (w.spec_algorithm or "").upper()
    if w.draft_is_eagle3 and algo in ("EAGLE", "NEXTN"):
        return [Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"--speculative-algorithm {algo} with an EAGLE-3 draft: the target captures no aux hidden "
            f"states, the draft gets one {w.target_hidden_size}-wide state and silently skips its fc "
            "(sglang PR #21272: accept length 1.00)",
            "serve with --speculative-algorithm EAGLE3",
            expected="EAGLE3", observed=algo)]
    if not w.draft_is_eagle3 and algo == "EAGLE3":
        return [Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            "--speculative-algorithm EAGLE3 with a draft that is not an EAGLE-3 draft class",
            "use an EAGLE-3 draft (architectures: LlamaForCausalLMEagle3) or --speculative-algorithm EAGLE",
            expected="EAGLE", observed=algo)]
    return []


def check_layer_id_location(w: Wiring, trained: Sequence[str] | None = None) -> list[Finding]:
    """Ids the engine never reads (top level, or an unreadable ``eagle_config``) or none at all;
    ``trained`` (the profile's sources, when known) says which ids a moved key must carry."""
    if not w.aux_enabled:
        return []
    default = src.sglang_sources(None, w.family, w.num_layers, **_pin(w)).sources
    if w.ids_location is IdsLocation.TOP_LEVEL or (w.ids_location is IdsLocation.BOTH
                                                   and not w.eagle_config_is_dict):
        ids = w.top_level_layer_ids or []
        meant = _sources_or_none(ids, src.Convention.SPECULATORS, w.num_layers)
        severity = Severity.CRITICAL if meant != default else Severity.WARNING
        shift = ""
        if ids and ids[0] == 1:
            shift = (" Its first id is 1, the SpecForge (C_out) spelling copied to the top level unchanged: "
                     "vLLM reads it one layer early.")
        return [Finding(
            Code.LAYER_IDS_IGNORED, severity,
            f"eagle_aux_hidden_state_layer_ids {ids} sit at the top level of the draft config; SGLang "
            f"reads only eagle_config.eagle_aux_hidden_state_layer_ids and captures its default "
            f"{_fmt(default)} instead (read as speculators/vLLM ids they mean {_fmt(meant or [])}).{shift}",
            _move_fix(w, ids, trained),
            expected=_fmt(meant) if meant else None, observed=_fmt(default),
            details={"top_level_ids": ids, "misplaced": True})]
    if not w.eagle_config_is_dict:
        return [Finding(
            Code.LAYER_IDS_IGNORED, Severity.WARNING,
            "eagle_config is present but not an object: SGLang's .get() raises, the error is swallowed and "
            f"the default layers {_fmt(default)} are captured",
            "make eagle_config a JSON object with eagle_aux_hidden_state_layer_ids",
            observed=_fmt(default))]
    if w.ids_location is IdsLocation.NONE:
        return [Finding(
            Code.LAYER_IDS_IGNORED, Severity.WARNING,
            f"the draft config names no aux layer ids, so each side uses its own default. {_defaults(w)} "
            "A draft trained on other layers gets the wrong features with no error (vllm PR #50170: "
            "acceptance 1.2% instead of 59%)",
            "write the training layer ids into eagle_config.eagle_aux_hidden_state_layer_ids, or compare "
            "with the training profile (--profile)",
            observed=_fmt(default), details={"confirmable": True})]
    if w.ids_location is IdsLocation.BOTH and w.top_level_layer_ids != w.engine_layer_ids:
        return [Finding(
            Code.LAYER_IDS_IGNORED, Severity.WARNING,
            f"top-level ids {w.top_level_layer_ids} differ from eagle_config ids {w.engine_layer_ids}: "
            "SGLang uses the nested ones, vLLM the top-level ones, so the two engines feed different layers",
            "keep one list (nested for SGLang) or make both name the same layers",
            details={"top_level_ids": w.top_level_layer_ids, "nested_ids": w.engine_layer_ids})]
    return []


def _move_fix(w: Wiring, ids: list[int], trained: Sequence[str] | None) -> str:
    """The fix for ids at the top level: move the key under ``eagle_config`` (the only place SGLang
    reads for the target's capture), with the ids that feed the training layers when they are known."""
    move = ("move eagle_aux_hidden_state_layer_ids from the top level of config.json into eagle_config, "
            "the only place SGLang reads the target's capture layers from")
    if trained is not None:
        want = ids_for_sources(w, trained)
        if want is None:
            return f"{move}; {_ids_fix(w, trained)}"
        if want == list(ids):
            return (f"{move}; unchanged, {ids} make SGLang feed {_fmt(trained)}, the layers the draft was "
                    "trained on")
        return (f"{move}, as {want}: SGLang then feeds {_fmt(trained)}, the layers the draft was trained "
                f"on ({ids} count layers another way)")
    try:
        as_is = src.sglang_sources(ids, w.family, w.num_layers, **_pin(w)).sources
    except ValueError:
        as_is = None
    meant = _sources_or_none(ids, src.Convention.SPECULATORS, w.num_layers)
    converted = ids_for_sources(w, meant) if meant else None
    if converted is None or converted == list(ids):
        then = f"; SGLang then feeds {_fmt(as_is)}" if as_is else ""
        return f"{move}{then}"
    return (f"{move}; unchanged if they are SGLang/SpecForge ids (SGLang then feeds {_fmt(as_is or [])}), or "
            f"as {converted} if they were written for vLLM (speculators' convention: {_fmt(meant or [])}); "
            "--profile tells which")


def _defaults(w: Wiring) -> str:
    """What SGLang and the trainers use when a draft config names no ids, on this target, said out."""
    n = w.num_layers
    served = src.sglang_sources(None, w.family, n, **_pin(w))
    parts = [f"SGLang {w.release} captures layers_to_capture "
             f"{served.layers_to_capture} (its [2, N//2, N-3]"
             f"{' + 1' if w.family is src.Family.PLUS_ONE_ALWAYS else ''}, N = {n}) = {_fmt(served.sources)}"]
    for name, conv in (("SpecForge", src.Convention.SPECFORGE), ("speculators", src.Convention.SPECULATORS)):
        ids = src.default_ids(conv, n)
        trained = _sources_or_none(ids, conv, n) or []
        same = "the same layers" if trained == served.sources else "OTHER layers"
        parts.append(f"the {name} trainer's default ids {ids} ({conv.value}) = {_fmt(trained)}: {same}")
    return "; ".join(parts) + "."


def _sources_or_none(ids: Sequence[int], convention: src.Convention, num_layers: int) -> list[str] | None:
    try:
        return src.to_sources(list(ids), convention, num_layers)
    except ValueError:
        return None


def check_layer_ids(w: Wiring) -> list[Finding]:
    """Configured ids: unique, sorted, reachable, no embedding slot, the DeepSeek first-id rule."""
    if not w.aux_enabled:
        return []
    cap = capture(w)
    ids = w.engine_layer_ids
    findings: list[Finding] = []
    details = {"configured_ids": ids, "layers_to_capture": cap.layers_to_capture, "sources": cap.sources}
    if cap.raises_at_layer_0:
        findings.append(_layer_0_raises(w, details))
    if cap.duplicates:
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.CRITICAL,
            f"layers_to_capture {cap.layers_to_capture} repeats {cap.duplicates}: each layer is captured "
            f"once, so the draft gets {len(cap.sources)} states instead of {len(cap.layers_to_capture)}",
            "use distinct layer ids (the default formula degenerates on targets with few layers)",
            details=details))
    if cap.unreachable:
        outcome = ("DeepSeek's capture packer raises at the first forward" if cap.fails_at_forward
                   else "they are silently not captured and the draft gets fewer states")
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.CRITICAL,
            f"layers_to_capture {cap.layers_to_capture} has ids {cap.unreachable} outside the "
            f"{w.num_layers}-layer target's loop; {outcome}.{_boundary(w)}",
            f"use ids within 0..{w.num_layers - 1} in SGLang's draft-config convention; the output of the "
            "last block is capturable only on gpt-oss (id N at its final norm)",
            details=details))
    if ids is not None and list(ids) != sorted(ids):
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.WARNING,
            f"layer ids {ids} are not ascending: SGLang concatenates slots in layer order "
            f"({_fmt(cap.sources)}), training backends that follow list order saw another slot order",
            "write the ids in ascending order and check the slot order the draft was trained with",
            details=details))
    if src.EMBEDDING in cap.sources:
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.WARNING,
            f"slot {cap.sources.index(src.EMBEDDING)} is fed the token embedding: SpecForge never trains on "
            "it, so this is usually a layer-id convention error (ids that count the embedding as layer 0 "
            "read as block outputs, or the reverse)",
            "check the convention of the ids against the training provenance (--profile)",
            slot=cap.sources.index(src.EMBEDDING), observed=src.EMBEDDING, details=details))
    engine = engines.get(w.engine)
    rules = engine.layer_id_rules(w.engine_version)
    if w.family is src.Family.DEEPSEEK and rules.deepseek_first_id_rule and ids and ids[0] != 1:
        llama_rule = src.sglang_sources(ids, src.Family.LLAMA, w.num_layers).sources
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.WARNING,
            f"on a DeepSeek-family target SGLang {engine.rules_label(w.engine_version)} adds 1 "
            f"only when the first id is 1; {ids} "
            f"are taken as-is and feed {_fmt(cap.sources)}. SpecForge training capture (older SGLang, "
            f"+1 always) fed {_fmt(llama_rule)} for the same config (SGLang changed the rule in its pull "
            "request 25454)",
            "confirm which layers the draft was trained on (--profile); rewrite the ids so both sides agree",
            observed=_fmt(cap.sources), details={**details, "confirmable": True}))
    return findings


def _layer_0_raises(w: Wiring, details: dict[str, Any]) -> Finding:
    """The DeepSeek loop of an older release adds the residual to a captured layer's input before the
    layer runs; before layer 0 there is none, so serving this config fails at the first request."""
    fixed = engines.get(w.engine).layer_0_fixed_in(w.engine_version)
    upgrade = f", or serve on SGLang {fixed} or newer (it captures inside the layer)" if fixed else ""
    return Finding(
        Code.CAPTURE_RAISES, Severity.CRITICAL,
        f"SGLang {w.engine_version} will crash at the first forward: layers_to_capture "
        f"{details['layers_to_capture']} includes layer 0, and its DeepSeek-family model loop captures a "
        "layer's input as hidden_states + residual before the layer runs, while before layer 0 the "
        "residual is still None (TypeError; the server starts, its first request kills it)",
        "write draft ids that do not make SGLang capture layer 0 (e.g. ids starting at 1, which it "
        f"shifts by one: no embedding slot){upgrade}",
        observed=f"layers_to_capture {details['layers_to_capture']}", details=details)


def _boundary(w: Wiring) -> str:
    """Why an out-of-range id was written, and what other engines do with it."""
    ids = list(w.engine_layer_ids or [])
    n = w.num_layers
    notes = []
    if any(v >= n for v in ids):
        notes.append(f" An id >= {n} (the layer count) is usually a \"boundary\" index meant as the last "
                     "block's "
                     "output or the final state: engines differ (SGLang DeepSeek fails at the first forward, "
                     "SGLang Llama captures nothing for it, gpt-oss captures the pre-norm final state, "
                     "trainers may have fed the final norm's output).")
    if any(v < 0 for v in ids):
        notes.append(" A negative id is SpecForge's C_out spelling of the embedding (-1); SGLang never "
                     "captures a negative layer.")
    return "".join(notes)


def check_against_training(w: Wiring, trained_sources: Sequence[str], origin: str = "") -> list[Finding]:
    """The engine's sources per slot vs the sources the draft was trained on (the profile, or the
    draft's own ids read in their producer's convention: ``origin`` says which)."""
    if not w.aux_enabled:
        return []
    fed = capture(w).sources
    trained = list(trained_sources)
    details = {"fed": list(fed), "trained": trained, "ids": w.engine_layer_ids}
    if len(fed) != len(trained):
        return [Finding(
            Code.LAYER_ID_CONVENTION, Severity.CRITICAL,
            f"the engine feeds {len(fed)} slots {_fmt(fed)}, the draft was trained on {len(trained)} "
            f"{_fmt(trained)}{origin}",
            _ids_fix(w, trained) if ids_for_sources(w, trained) is not None
            else "make eagle_config.eagle_aux_hidden_state_layer_ids name the training layers",
            expected=_fmt(trained), observed=_fmt(fed), details=details)]
    findings = []
    ids_fix = _ids_fix(w, trained)
    for slot, (want, got) in enumerate(zip(trained, fed, strict=True)):
        if want == got:
            continue
        findings.append(Finding(
            Code.LAYER_ID_CONVENTION, Severity.CRITICAL,
            f"slot {slot} will be fed {got}; the draft was trained on {want}{origin}",
            ids_fix, slot=slot, expected=want, observed=got, details=details))
    return findings


def inferred_training(w: Wiring) -> list[str] | None:
    """Without a profile: the trained sources as the draft's nested ids mean them in their producer's
    convention (SpecForge writes eagle_config ids as block outputs, C_out)."""
    if w.engine_layer_ids is None or w.ids_location not in (IdsLocation.NESTED, IdsLocation.BOTH):
        return None
    return _sources_or_none(w.engine_layer_ids, src.Convention.SPECFORGE, w.num_layers)


def ids_for_sources(w: Wiring, trained: Sequence[str]) -> list[int] | None:
    """The draft-config ids that make SGLang feed ``trained`` on this target, if any list does."""
    try:
        c_in = src.from_sources(trained, src.Convention.SGLANG_CAPTURE, w.num_layers)
    except ValueError:
        return None
    for candidate in ([v - 1 for v in c_in], c_in):
        try:
            fed = src.sglang_sources(candidate, w.family, w.num_layers, **_pin(w))
            if fed.sources == list(trained) and not fed.raises_at_layer_0:
                return candidate
        except ValueError:
            continue
    return None


def _ids_fix(w: Wiring, trained: Sequence[str]) -> str:
    ids = ids_for_sources(w, trained)
    fixed = engines.get(w.engine).layer_0_fixed_in(w.engine_version)
    if ids is None and src.EMBEDDING in trained and fixed and w.family is src.Family.DEEPSEEK:
        return (f"SGLang {w.engine_version} cannot feed the embedding on a DeepSeek-family target (a "
                f"captured layer 0 crashes at the first forward): serve on SGLang {fixed} or newer")
    if ids is None:
        return (f"SGLang {w.release} cannot capture {_fmt(trained)} on a "
                f"{w.family.value}-family target (the "
                "output of the last block is never captured); retrain the draft on capturable layers")
    return f"set eagle_config.eagle_aux_hidden_state_layer_ids to {ids}"


def check_widths(w: Wiring) -> list[Finding]:
    """Fed width vs the draft's fc and the static draft-extend buffer; use_aux vs fc."""
    findings: list[Finding] = []
    h = w.target_hidden_size
    if w.draft_input_hidden is not None and w.draft_input_hidden != h:
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"the draft expects {w.draft_input_hidden}-wide target states (target_hidden_size/hidden_size), "
            f"the target's hidden size is {h}",
            "serve the draft with the target it was trained for, or set target_hidden_size correctly",
            expected=str(h), observed=str(w.draft_input_hidden)))
    if w.fc_in_features is None:
        return findings
    fed = fed_width(w)
    if not w.use_aux_hidden_state and w.fc_in_features != h:
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"eagle_config.use_aux_hidden_state is false, so the target sends one {h}-wide state, but the "
            f"draft's fc takes {w.fc_in_features}: SGLang skips the fc (width equals the embedding) and the "
            "draft runs on features it was never trained on",
            "remove use_aux_hidden_state: false (the draft was trained on aux states)",
            expected=str(w.fc_in_features), observed=str(h)))
        return findings
    if w.aux_enabled and w.fc_in_features == h * 1 and len(capture(w).sources) != 1:
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"the draft's fc takes {h} (one state: a last-layer-only head), but SGLang sends {fed} "
            "(aux states) to it (vllm PR #27688)",
            "set eagle_config.use_aux_hidden_state: false for a head trained on the last hidden state only",
            expected=str(w.fc_in_features), observed=str(fed)))
        return findings
    if w.aux_enabled and fed != w.fc_in_features:
        n = len(capture(w).sources)
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"the target sends {n} x {h} = {fed} features, the draft's fc takes {w.fc_in_features} "
            f"({w.fc_in_features // h if h else '?'} states): the fc GEMM fails, or under CUDA graphs the "
            "draft-extend copy is skipped silently",
            "make the number of ids in eagle_config.eagle_aux_hidden_state_layer_ids (or "
            "num_aux_hidden_states) equal the fc's input states",
            expected=str(w.fc_in_features), observed=str(fed)))
    if w.aux_enabled and w.graph_width is not None and w.graph_width != fed:
        findings.append(Finding(
            Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
            f"the draft-extend graph buffer is {w.graph_width} wide but the target sends {fed}: "
            "SGLang sizes it from num_aux_hidden_states / nested ids / top-level ids, the capture from "
            "nested ids only",
            "put the ids in eagle_config only (and drop a conflicting num_aux_hidden_states)",
            expected=str(fed), observed=str(w.graph_width)))
    return findings


_CONFIG_CODES = (Code.LAYER_IDS_IGNORED, Code.LAYER_ID_CONVENTION)
BITES = ("What SGLang feeds on this target matches the training profile, so it does not bite today; it bites "
         "on a target with another layer count or an engine release that reads the ids another way.")


def served_right(findings: list[Finding], why: str) -> list[Finding]:
    """Config findings that do not change what is served: critical -> warning naming when they bite."""
    return [replace(f, severity=Severity.WARNING, message=f"{f.message} {why}",
                    details={**f.details, "served_matches_training": True})
            if f.code in _CONFIG_CODES and f.severity is Severity.CRITICAL else f for f in findings]


def check_wiring(w: Wiring, trained_sources: Sequence[str] | None = None) -> list[Finding]:
    """All static wiring checks; ``trained_sources`` (canonical, per slot) from the profile when known.

    Severity follows what is served: with a profile, a config fault whose served sources still equal
    the trained ones is a warning; without one, the draft's nested ids read in SpecForge's convention
    stand in for the training provenance.
    """
    findings = check_algorithm(w)
    findings += check_layer_id_location(w, trained_sources)
    findings += check_layer_ids(w)
    if trained_sources is not None:
        against = check_against_training(w, trained_sources)
        if not against and w.aux_enabled:
            # the profile shows the engine feeds the trained layers: "maybe wrong" warnings are settled
            settled = " The training profile confirms these are the layers the draft was trained on."
            findings = [replace(f, severity=Severity.INFO, fix="", message=f.message + settled)
                        if f.details.get("confirmable") else f for f in findings]
            findings = served_right(findings, BITES)
        findings += against
    else:
        inferred = inferred_training(w)
        if inferred is not None and w.aux_enabled and not capture(w).unreachable:
            findings += check_against_training(
                w, inferred, " (the draft's eagle_config ids read as SpecForge block outputs; confirm with "
                "--profile)")
    findings += check_widths(w)
    return findings
