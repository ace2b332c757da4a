"""Static wiring checks (hs_tracer.static_checks.wiring), from a description and from a live WiringRecord."""

from __future__ import annotations

from dataclasses import replace as dc_replace

from hs_tracer import sources as src
from hs_tracer.findings import Code, Severity
from hs_tracer.records import WiringRecord
from hs_tracer.static_checks.wiring import (
    IdsLocation,
    Wiring,
    capture,
    check_against_training,
    check_algorithm,
    check_layer_id_location,
    check_layer_ids,
    check_widths,
    check_wiring,
    ids_for_sources,
    ids_location,
    wiring_from_record,
    with_draft_config,
)

KIMI = "KimiK25ForConditionalGeneration"  # DeepSeek-V3 language model, 61 layers, hidden 7168


def llama(ids: list[int] | None = None, **kw: object) -> Wiring:
    base = dict(
        target_arch="LlamaForCausalLM",
        num_layers=32,
        target_hidden_size=4096,
        engine_layer_ids=ids,
        ids_location=IdsLocation.NESTED if ids is not None else IdsLocation.NONE,
        fc_in_features=3 * 4096,
    )
    base.update(kw)
    return Wiring(**base)  # type: ignore[arg-type]


def kimi(ids: list[int] | None, **kw: object) -> Wiring:
    base = dict(
        target_arch=KIMI,
        num_layers=61,
        target_hidden_size=7168,
        engine_layer_ids=ids,
        ids_location=IdsLocation.NESTED if ids is not None else IdsLocation.NONE,
        fc_in_features=3 * 7168,
    )
    base.update(kw)
    return Wiring(**base)  # type: ignore[arg-type]


def sev(findings: list, code: Code) -> list[str]:
    return [f.severity.value for f in findings if f.code is code]


def test_healthy_llama_wiring_is_clean() -> None:
    w = llama([1, 15, 28])
    assert capture(w).sources == ["block:1", "block:15", "block:28"]
    assert check_wiring(w, ["block:1", "block:15", "block:28"]) == []


def test_eagle_instead_of_eagle3() -> None:
    """F1 (sglang PR #21272): EAGLE with an EAGLE-3 draft -> H-wide input, fc skipped."""
    bad = check_algorithm(llama([1, 15, 28], spec_algorithm="EAGLE"))
    assert [(f.code, f.severity) for f in bad] == [(Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL)]
    assert check_algorithm(llama([1, 15, 28], spec_algorithm="NEXTN"))
    assert check_algorithm(llama([1, 15, 28])) == []
    assert check_algorithm(llama([1, 15, 28], draft_is_eagle3=False))  # EAGLE3 with an EAGLE-1 head
    # without aux capture the other layer checks have nothing to say
    assert check_layer_ids(llama([1, 1, 28], spec_algorithm="EAGLE")) == []


def test_ids_location() -> None:
    # speculators-style top-level ids are ignored; they name other layers than the default
    top = check_layer_id_location(
        llama(None, ids_location=IdsLocation.TOP_LEVEL, top_level_layer_ids=[3, 17, 30])
    )
    assert sev(top, Code.LAYER_IDS_IGNORED) == ["critical"]
    # the fix moves the key; ids meant for vLLM get SGLang's draft-config ids for the same layers
    assert top[0].fix.startswith("move eagle_aux_hidden_state_layer_ids from the top level")
    assert "unchanged if they are SGLang/SpecForge ids" in top[0].fix and "as [2, 16, 29]" in top[0].fix
    # top-level ids that happen to be the default: still ignored, but harmless
    same = check_layer_id_location(
        llama(None, ids_location=IdsLocation.TOP_LEVEL, top_level_layer_ids=[2, 16, 29])
    )
    assert sev(same, Code.LAYER_IDS_IGNORED) == ["warning"]
    # C_out ids copied to the top level unchanged
    f29 = check_layer_id_location(
        llama(None, ids_location=IdsLocation.TOP_LEVEL, top_level_layer_ids=[1, 15, 28])
    )
    assert "one layer early" in f29[0].message
    # no ids at all
    assert sev(check_layer_id_location(llama(None)), Code.LAYER_IDS_IGNORED) == ["warning"]
    # unreadable eagle_config
    assert sev(check_layer_id_location(llama(None, eagle_config_is_dict=False)), Code.LAYER_IDS_IGNORED) == [
        "warning"
    ]
    # both places, disagreeing
    both = llama([1, 15, 28], ids_location=IdsLocation.BOTH, top_level_layer_ids=[1, 15, 28, 32])
    assert sev(check_layer_id_location(both), Code.LAYER_IDS_IGNORED) == ["warning"]
    assert check_layer_id_location(llama([1, 15, 28])) == []


def test_layer_id_sanity() -> None:
    # duplicates capture once
    dup = check_layer_ids(llama([1, 1, 28]))
    assert "critical" in sev(dup, Code.LAYER_ID_CONVENTION) and "repeats" in dup[0].message
    # unreachable on Llama: silently not captured
    out = check_layer_ids(llama([1, 15, 40]))
    assert "critical" in sev(out, Code.LAYER_ID_CONVENTION) and "silently" in out[0].message
    # unreachable on DeepSeek: the packer raises
    out_ds = check_layer_ids(kimi([1, 29, 70]))
    assert any("raises" in f.message for f in out_ds)
    # unsorted: SGLang concatenates in layer order
    assert sev(check_layer_ids(llama([28, 15, 1])), Code.LAYER_ID_CONVENTION) == ["warning"]
    # an embedding slot ([-1, ...] on Llama -> layers_to_capture 0)
    emb = check_layer_ids(llama([-1, 15, 28]))
    assert any(f.observed == "embedding" and f.slot == 0 for f in emb)


def test_deepseek_first_id_rule() -> None:
    """Kimi-K2 drafts ship [2,30,58]: SGLang 0.5.23 (PR #25454) takes them as-is on DeepSeek targets."""
    w = kimi([2, 30, 58])
    assert capture(w).sources == ["block:1", "block:29", "block:57"]
    warn = check_layer_ids(w)
    assert sev(warn, Code.LAYER_ID_CONVENTION) == ["warning"]
    assert "block:2, block:30, block:58" in warn[0].message  # what the +1-always training capture fed
    assert check_layer_ids(kimi([1, 29, 57])) == []


def test_profile_settles_maybe_warnings() -> None:
    """Warnings that only say 'these may not be the trained layers' become info when the profile agrees."""
    ds = check_wiring(kimi([2, 30, 58]), ["block:1", "block:29", "block:57"])
    assert [f.severity for f in ds if f.code is Code.LAYER_ID_CONVENTION] == [Severity.INFO]
    none = check_wiring(llama(None), src.to_sources(None, src.Convention.SPECFORGE, 32))
    assert [f.severity for f in none] == [Severity.INFO]
    # ...but stay warnings when the profile disagrees (and the slots are then critical)
    bad = check_wiring(kimi([2, 30, 58]), ["block:2", "block:30", "block:58"])
    assert Severity.WARNING in [f.severity for f in bad] and Severity.CRITICAL in [f.severity for f in bad]


def test_against_training_per_slot() -> None:
    # trained with SpecForge (+1 always) on [2,30,58] -> blocks 2, 30, 58; served on 0.5.23 -> 1, 29, 57
    trained = src.to_sources([2, 30, 58], src.Convention.SPECFORGE, 61)
    found = check_against_training(kimi([2, 30, 58]), trained)
    assert [(f.slot, f.expected, f.observed) for f in found] == [
        (0, "block:2", "block:1"),
        (1, "block:30", "block:29"),
        (2, "block:58", "block:57"),
    ]
    assert all(f.severity is Severity.CRITICAL and f.code is Code.LAYER_ID_CONVENTION for f in found)
    assert "[3, 31, 59]" in found[0].fix  # +1 because the first id is no longer 1 -> as-is
    assert src.sglang_sources([3, 31, 59], src.Family.DEEPSEEK, 61).sources == trained
    assert check_against_training(kimi([3, 31, 59]), trained) == []
    # slot count differs
    assert sev(
        check_against_training(llama([1, 15, 28]), ["block:1", "block:15"]), Code.LAYER_ID_CONVENTION
    ) == ["critical"]


def test_ids_for_sources_round_trip() -> None:
    for arch, n in (("LlamaForCausalLM", 32), (KIMI, 61), ("GptOssForCausalLM", 36)):
        w = Wiring(target_arch=arch, num_layers=n, target_hidden_size=8)
        for want in (["block:1", "block:15", "block:28"], ["block:3", "block:7", "block:20"]):
            ids = ids_for_sources(w, want)
            assert ids is not None and src.sglang_sources(ids, src.family_of(arch), n).sources == want
    # the last block's output cannot be captured on a Llama target
    assert ids_for_sources(llama([1]), ["block:31"]) is None


def test_widths() -> None:
    assert check_widths(llama([1, 15, 28])) == []
    # use_aux_hidden_state false but the head has a 3H fc
    assert sev(
        check_widths(llama([1, 15, 28], use_aux_hidden_state=False)), Code.DRAFT_INPUT_WIDTH_MISMATCH
    ) == ["critical"]
    # a last-layer-only head (fc H wide) served with aux states
    assert sev(check_widths(llama([1, 15, 28], fc_in_features=4096)), Code.DRAFT_INPUT_WIDTH_MISMATCH) == [
        "critical"
    ]
    # ...and served correctly without them
    assert check_widths(llama(None, use_aux_hidden_state=False, fc_in_features=4096)) == []
    # fc trained on 4 states, 3 captured
    assert sev(
        check_widths(llama([1, 15, 28], fc_in_features=4 * 4096)), Code.DRAFT_INPUT_WIDTH_MISMATCH
    ) == ["critical"]
    # static draft-extend buffer sized from other ids than the capture
    assert sev(check_widths(llama([1, 15, 28], graph_width=4 * 4096)), Code.DRAFT_INPUT_WIDTH_MISMATCH) == [
        "critical"
    ]
    # draft trained for another target width
    assert (
        sev(
            check_widths(llama([1, 15, 28], draft_input_hidden=5120, fc_in_features=3 * 5120)),
            Code.DRAFT_INPUT_WIDTH_MISMATCH,
        )[0]
        == "critical"
    )


def test_live_record_reuse() -> None:
    """The plugin's WiringRecord goes through the same checks."""
    fed = src.sglang_sources([2, 30, 58], src.Family.DEEPSEEK, 61)
    record = WiringRecord(
        model="kimi",
        target_arch=KIMI,
        num_layers=61,
        hidden_size=7168,
        layers_to_capture=fed.layers_to_capture,
        sources=fed.sources,
        configured_layer_ids=[2, 30, 58],
        draft_fc_in_features=3 * 7168,
        draft_num_aux_states=3,
        draft_graph_width=3 * 7168,
        use_aux_hidden_state=True,
        spec_args={"speculative_algorithm": "EAGLE3"},
        engine_version="0.5.23",
    )
    w = wiring_from_record(record)
    assert capture(w).sources == record.sources
    trained = src.to_sources([2, 30, 58], src.Convention.SPECFORGE, 61)
    found = check_wiring(w, trained)
    assert {f.slot for f in found if f.code is Code.LAYER_ID_CONVENTION and f.slot is not None} == {0, 1, 2}
    # live: EAGLE recorded, aux off, 7168-wide input
    eagle = WiringRecord(
        model="kimi",
        target_arch=KIMI,
        num_layers=61,
        hidden_size=7168,
        layers_to_capture=[],
        sources=[],
        draft_fc_in_features=3 * 7168,
        spec_args={"speculative_algorithm": "EAGLE"},
    )
    assert sev(check_wiring(wiring_from_record(eagle)), Code.DRAFT_INPUT_WIDTH_MISMATCH) == ["critical"]


def test_ids_location_from_a_draft_config() -> None:
    assert ids_location({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}) == (
        IdsLocation.NESTED,
        None,
        True,
    )
    assert ids_location({"eagle_config": {"eagle_aux_hidden_state_layer_ids": None}}) == (
        IdsLocation.NONE,
        None,
        True,
    )  # null = absent: SGLang uses its default
    assert ids_location({"eagle_aux_hidden_state_layer_ids": [2, 16, 29]}) == (
        IdsLocation.TOP_LEVEL,
        [2, 16, 29],
        True,
    )
    assert ids_location({"eagle_config": "x", "eagle_aux_hidden_state_layer_ids": [2]})[2] is False
    w = with_draft_config(llama(None), {"eagle_aux_hidden_state_layer_ids": [3, 17, 30]})
    assert sev(check_layer_id_location(w), Code.LAYER_IDS_IGNORED) == ["critical"]


def test_the_startup_check_refuses_a_captured_layer_0_where_the_release_crashes_on_it() -> None:
    """The plugin's record of a DeepSeek target capturing layer 0 (first id 0, taken as-is): 0.5.13's
    loop adds the residual, still None there, at the first forward; 0.5.14 captures inside the layer."""
    def record(version: str) -> WiringRecord:
        return WiringRecord(model="ds", target_arch="DeepseekV3ForCausalLM", num_layers=8, hidden_size=32,
                            layers_to_capture=[0, 2, 3], sources=["embedding", "block:1", "block:2"],
                            configured_layer_ids=[0, 2, 3], draft_fc_in_features=96, draft_num_aux_states=3,
                            use_aux_hidden_state=True, spec_args={"speculative_algorithm": "EAGLE3"},
                            engine_version=version)

    trained = ["embedding", "block:1", "block:2"]  # the layers it feeds: nothing but the crash is wrong
    for version in ("0.5.13", "0.5.13.post1"):
        found = check_wiring(wiring_from_record(record(version)), trained)
        crash = [f for f in found if f.code is Code.CAPTURE_RAISES]
        assert [f.severity for f in crash] == [Severity.CRITICAL]
        assert f"SGLang {version} will crash at the first forward" in crash[0].message
        assert "0.5.14" in crash[0].fix
        assert all(f.severity is not Severity.CRITICAL for f in found if f.code is not Code.CAPTURE_RAISES)
    found = check_wiring(wiring_from_record(record("0.5.14")), trained)
    assert [f for f in found if f.severity is Severity.CRITICAL] == []
    # no id list feeds the embedding on 0.5.13 without the crash, so none is offered as the fix
    w13 = wiring_from_record(record("0.5.13"))
    assert ids_for_sources(w13, trained) is None
    assert ids_for_sources(wiring_from_record(record("0.5.14")), trained) == [0, 2, 3]


def test_the_wiring_record_is_engine_neutral_and_reads_its_old_json() -> None:
    """The status file and the export process's setup keep the deprecated keys (``sglang_version``,
    ``layer_ids_key``) beside the neutral ones, and JSON written before the neutral keys reads back."""
    sglang = WiringRecord(model="m", target_arch="LlamaForCausalLM", num_layers=8, hidden_size=32,
                          layers_to_capture=[2, 4, 5], sources=["block:1", "block:3", "block:4"],
                          engine_version="0.5.23")
    vllm = dc_replace(sglang, engine="vllm", engine_version="0.11.0", layer_id_source="default")
    assert (sglang.sglang_version, vllm.sglang_version) == ("0.5.23", "")
    out = vllm.to_json()
    assert (out["engine"], out["engine_version"], out["sglang_version"]) == ("vllm", "0.11.0", "")
    assert out["layer_id_source"] == out["layer_ids_key"] == "default"
    assert WiringRecord.from_json(out) == vllm and WiringRecord.from_json(sglang.to_json()) == sglang
    old = {k: v for k, v in sglang.to_json().items() if k not in ("engine_version", "layer_id_source")}
    assert WiringRecord.from_json(old) == sglang
    old_vllm = {k: v for k, v in out.items() if k != "layer_id_source"}
    assert WiringRecord.from_json(old_vllm) == vllm
