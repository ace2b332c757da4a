"""Findings about the draft's weights: what SGLang (its newest supported release) will drop, leave
random, reject or replace."""

from __future__ import annotations

from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.preflight.checkpoint import Checkpoint
from hs_tracer.preflight.config import DraftConfig
from hs_tracer.preflight.weight_map import (
    LoadPlan,
    embed_replaced_by_target,
    fc_input_hidden,
    load_lm_head_from_target,
    num_aux_states,
    plan_load,
)

_LIST = 6  # names shown in a message; all of them go to details


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:_LIST])
    return shown + (f" (+{len(names) - _LIST} more)" if len(names) > _LIST else "")


def check_weights(draft: DraftConfig, ckpt: Checkpoint) -> tuple[list[Finding], LoadPlan]:
    """Route every checkpoint key as ``LlamaForCausalLMEagle3.load_weights`` does and judge the result."""
    plan = plan_load(draft, ckpt.shapes)
    findings: list[Finding] = []

    replaced = set()
    if embed_replaced_by_target(draft):
        replaced.add("model.embed_tokens.weight")
    if load_lm_head_from_target(draft) or draft.tie_word_embeddings:
        replaced.add("lm_head.weight")

    for key, param, got, want in plan.shape_errors:
        if param == "model.fc.weight":
            h_in = fc_input_hidden(draft) or draft.hidden_size
            states = got[1] / h_in if len(got) == 2 and h_in else "?"
            findings.append(Finding(
                Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
                f"{key} is {list(got)} ({states} states of {h_in}), SGLang builds fc as {list(want)} "
                f"({num_aux_states(draft)} states, counted from the config's layer ids or "
                "num_aux_hidden_states, default 3); loading fails with a shape assertion (vllm issue "
                "#54526 for the same 4-vs-3 case)",
                "make eagle_config.eagle_aux_hidden_state_layer_ids (or num_aux_hidden_states) list as many "
                "layers as the fc was trained on", expected=str(list(want)), observed=str(list(got)),
                details={"key": key}))
        elif param == "lm_head.weight":
            findings.append(Finding(
                Code.DRAFT_SHAPE_MISMATCH, Severity.CRITICAL,
                f"{key} has {got[0]} rows, SGLang builds the draft head with "
                f"{'draft_vocab_size' if draft.draft_vocab_size else 'vocab_size (no draft_vocab_size)'} = "
                f"{want[0]} rows: loading fails",
                "set draft_vocab_size to the lm_head's row count (= len(d2t))",
                expected=str(list(want)), observed=str(list(got)), details={"key": key}))
        else:
            findings.append(Finding(
                Code.DRAFT_SHAPE_MISMATCH, Severity.CRITICAL,
                f"{key} is {list(got)}, SGLang expects {list(want)} for {param}: loading fails"
                + (" (layer 0's q/k/v read [embedding, fc output], 2 x hidden_size wide)"
                   if "qkv_proj" in param and param.startswith("model.layers.0.") else ""),
                "check hidden_size / heads / head_dim / intermediate_size in the draft config against "
                "the weights", expected=str(list(want)), observed=str(list(got)), details={"key": key}))

    dropped = plan.dropped
    if dropped:
        network = [k for k in dropped if not k.startswith("verifier_")]
        verifier = [k for k in dropped if k.startswith("verifier_")]
        if network:
            findings.append(Finding(
                Code.DRAFT_WEIGHTS_UNUSED, Severity.CRITICAL,
                f"SGLang drops {len(network)} checkpoint tensor(s) without a word: {_names(network)}; the "
                "trained weights they hold play no part in serving",
                "rename them to SGLang's names (fc, layers.0./midlayer., norm, lm_head, fc_norm.i, "
                "input_norm) or set the config flag that creates the module (fc_norm, norm_before_fc)",
                details={"keys": network}))
        if verifier:
            findings.append(Finding(
                Code.DRAFT_WEIGHTS_UNUSED, Severity.INFO,
                f"{len(verifier)} verifier tensor(s) are ignored (the target's own head is used): "
                f"{_names(verifier)}", "", details={"keys": verifier}))

    # a weight that exists but has the wrong shape is reported once, as the shape error above (the
    # loader fails on it): it is not also "missing"
    missing = plan.missing(replaced | {param for _key, param, _got, _want in plan.shape_errors})
    if missing:
        head = "lm_head.weight" in missing
        msg = (f"{len(missing)} draft parameter(s) get no weights and stay at random init: {_names(missing)}")
        if head:
            msg += (f". The config declares draft_vocab_size={draft.draft_vocab_size} but ships no lm_head, "
                    "so the draft head is random (sglang PR #27908: accept length 1.00, server healthy)")
        findings.append(Finding(
            Code.DRAFT_WEIGHTS_MISSING, Severity.CRITICAL, msg,
            "export the full draft state dict (fc, layers.0/midlayer, norm, lm_head, d2t) into "
            "model.safetensors", details={"params": missing}))

    embed_keys = [k for k, r in plan.routes.items() if r.param == "model.embed_tokens.weight"]
    if embed_keys and "model.embed_tokens.weight" in replaced:
        trained = bool(draft.raw.get("embed_requires_grad"))
        findings.append(Finding(
            Code.DRAFT_WEIGHTS_UNUSED, Severity.WARNING if trained else Severity.INFO,
            f"the draft ships {embed_keys[0]}, which SGLang replaces with the target's embedding at startup"
            + (" although the draft trained its own (embed_requires_grad: true)" if trained else
               " (as in training, where the embedding comes from the target); vLLM may use the draft's "
               "own copy when it differs (vllm PR #28549, TorchSpec issue #38)"),
            "nothing to do for SGLang when it is the target's embedding; drop it from the export to be safe"
            if not trained else "serve with an engine that keeps the draft embedding, or retrain frozen",
            details={"key": embed_keys[0]}))
    head_keys = [k for k, r in plan.routes.items() if r.param == "lm_head.weight"]
    if head_keys and load_lm_head_from_target(draft):
        findings.append(Finding(
            Code.DRAFT_WEIGHTS_UNUSED, Severity.WARNING,
            f"the draft ships its own {head_keys[0]} but declares no draft_vocab_size: SGLang replaces it "
            "with the target's lm_head (load_lm_head_from_target)",
            "set draft_vocab_size when the head is the draft's own (its row count)",
            details={"key": head_keys[0]}))
    return findings, plan
