"""Draft format, architecture and config flags that SGLang cannot serve as written.

Read from the newest supported SGLang release (the release the findings name,
:func:`hs_tracer.engines.newest_release`): it registers ``LlamaForCausalLMEagle3`` and
``Eagle3DeepseekV2ForCausalLM`` as EAGLE-3 drafts and has no speculators reader;
``models/llama_eagle3.py`` reads ``norm_before_fc`` nested or top level, ``fc_norm`` /
``use_aux_norm`` / ``norm_output`` only at the top level, and has no ``norm_before_residual`` branch
(its residual is the raw fc output, i.e. ``False``).
"""

from __future__ import annotations

from hs_tracer import engines
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.preflight.config import DraftConfig, DraftFormat

_TOP_LEVEL_ONLY_FLAGS = ("fc_norm", "use_aux_norm", "norm_output")


def _release() -> str:
    """The SGLang release the rules below were read from."""
    return engines.newest_release()


def check_format(draft: DraftConfig) -> list[Finding]:
    """Which tool wrote the draft and whether SGLang can load it as an EAGLE-3 draft."""
    fmt = draft.format
    if fmt is DraftFormat.SGLANG:
        return []
    if fmt is DraftFormat.SPECULATORS:
        return [Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            f"speculators-format draft (architectures {draft.architectures}): SGLang {_release()} has no "
            "speculators reader and will refuse the architecture",
            "convert for SGLang: architectures [\"LlamaForCausalLMEagle3\"], model dims from "
            "transformer_layer_config at the top level, draft_vocab_size, and the layer ids moved into "
            "eagle_config.eagle_aux_hidden_state_layer_ids converted from speculators (input-of-layer) "
            "ids to SGLang draft-config ids (docs/preflight.md); layers.0.* weight names load as they are",
            observed=draft.arch)]
    if fmt is DraftFormat.EAGLE:
        return [Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            "original EAGLE draft config (architectures [\"LlamaForCausalLM\"]): SGLang builds a plain Llama "
            "model from it, drops fc/midlayer weights and never feeds it the target's aux states",
            "set architectures to [\"LlamaForCausalLMEagle3\"] (the weight names fc.*, midlayer.*, d2t, "
            "t2d already match)", expected="LlamaForCausalLMEagle3", observed=draft.arch)]
    if fmt is DraftFormat.EAGLE1:
        return [Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            f"{draft.arch} is an EAGLE-1/2 draft class: it takes one hidden state, not EAGLE-3 aux states",
            "serve it with --speculative-algorithm EAGLE, or use an EAGLE-3 draft", observed=draft.arch)]
    # an EAGLE-3 config (eagle_config present) whose class name alone is wrong: rename it, nothing else
    fix = ("set architectures to [\"LlamaForCausalLMEagle3\"] ([\"Eagle3DeepseekV2ForCausalLM\"] for an MLA "
           "draft): the rest of the config is an EAGLE-3 draft's") if isinstance(draft.eagle_config, dict) \
        else "point --draft at an EAGLE-3 draft exported for SGLang"
    return [Finding(
        Code.DRAFT_FORMAT, Severity.CRITICAL,
        f"architectures {draft.architectures or '(missing)'} is not an EAGLE-3 draft class SGLang "
        f"{_release()} knows (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM)", fix,
        observed=draft.arch or None)]


def check_flags(draft: DraftConfig) -> list[Finding]:
    """Config flags that change the draft's math and that this SGLang release ignores."""
    findings: list[Finding] = []
    # speculators writes "target_hidden_size": null by default; its conversion rewrites the config
    if draft.arch == "LlamaForCausalLMEagle3" and draft.has_target_hidden_size \
            and draft.target_hidden_size is None:
        findings.append(Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            "target_hidden_size is null: SGLang takes any present key as the fc input width and fails "
            "building fc (None x num_aux)",
            "drop target_hidden_size or set it to the target's hidden size"))
    if draft.format is DraftFormat.SGLANG and draft.arch == "LlamaForCausalLMEagle3" \
            and not draft.has_draft_vocab_size:
        findings.append(Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            f"config.json has no draft_vocab_size: SGLang {_release()} fails building the draft "
            "(AttributeError: 'LlamaConfig' object has no attribute 'draft_vocab_size')",
            "add \"draft_vocab_size\": <lm_head rows> (or null to use the target's head and vocabulary)"))
    if draft.flag("norm_before_residual"):
        findings.append(Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            "norm_before_residual is true: the draft was trained with the residual taken after "
            f"hidden_norm; SGLang {_release()} has no such branch and uses the raw fc output as residual",
            "serve with an engine that honours norm_before_residual, or retrain with it false",
            expected="norm_before_residual=true honoured", observed="ignored"))
    if draft.arch == "Eagle3DeepseekV2ForCausalLM" and draft.flag("norm_before_fc"):
        findings.append(Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            f"norm_before_fc is set, but SGLang {_release()}'s MLA draft (Eagle3DeepseekV2ForCausalLM) "
            "has no input norm: the aux states reach the fc unnormalised",
            "serve with an engine that honours norm_before_fc for MLA drafts, or retrain without it"))
    nested = draft.eagle_config if isinstance(draft.eagle_config, dict) else {}
    for name in _TOP_LEVEL_ONLY_FLAGS:
        if nested.get(name) and not draft.raw.get(name):
            findings.append(Finding(
                Code.DRAFT_FORMAT, Severity.CRITICAL,
                f"{name} is set inside eagle_config; SGLang {_release()} reads it only at the top level "
                "of the config, so the draft runs without it",
                f"move \"{name}\": true to the top level of config.json"))
    if draft.tie_word_embeddings and draft.draft_vocab_size is not None and draft.vocab_size is not None \
            and draft.draft_vocab_size < draft.vocab_size:
        findings.append(Finding(
            Code.DRAFT_FORMAT, Severity.CRITICAL,
            "tie_word_embeddings is true with a reduced draft vocabulary: SGLang uses the (target's) "
            f"{draft.vocab_size}-row embedding as the head while the logits processor expects "
            f"{draft.draft_vocab_size} rows",
            "set tie_word_embeddings: false and ship lm_head.weight [draft_vocab_size, hidden_size]"))
    return findings
