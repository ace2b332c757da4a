"""SGLang 0.5.11: as 0.5.12, but its results carry no draft-token count and name the accepted drafts
``num_accepted_drafts_*`` (its responses' counters too: ``meta_counters``); its Llama draft has
neither norm nor ``num_aux_hidden_states``. Its layer-id rules are also those of 0.5.9 and 0.5.10,
which have no plugin system."""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases import shared as s
from hs_tracer.integrations.sglang.releases.adapter import LayerIdRules, MetaCounters, SGLangFamily
from hs_tracer.release_table import Hook, Phase

FAMILY = SGLangFamily(
    name="0.5.11",
    releases=("0.5.11",),
    workers=("V2", "V1"),
    scheduler_entry=s.SCHEDULER_ENTRY,
    hooks=(
        s.AUX_CAPTURE_HOOK,
        *s.V2_WORKER_HOOKS,
        s.V2_PREFILL_WORKER_BATCH,
        *s.V1_STARTUP_AND_INPUT_HOOKS,
        Hook(f"{s.V1}.forward_batch_generation", "after",
             f"{s.HOOKS_V1}:after_v1_forward_batch_generation_accepted_drafts", Phase.STEP, ("batch",),
             ("result.num_accepted_drafts_per_req_cpu", "batch.reqs"), worker="V1"),
        s.TARGET_FORWARD_LIST,
        s.LOGITS_HOOK,
        Hook(f"{s.OUTPUT_MIXIN}._resolve_spec_overlap_token_ids", "after",
             f"{s.HOOKS_V1}:after_resolve_spec_overlap_token_ids", Phase.STEP, ("result", "batch"),
             ("result.accept_lens", "batch.reqs"), worker="V2"),
    ),
    layer_id_rules=LayerIdRules(deepseek_first_id_rule=False, gpt_oss_final_boundary=False,
                                deepseek_packer=False, deepseek_layer_0_raises=True),
    draft_layouts={},  # every draft class read leniently
    worker_env=s.V1_ENV,
    check_only=("0.5.9", "0.5.10"),
    meta_counters=MetaCounters(accepted_drafts="spec_accepted_drafts",
                               accept_histogram="spec_accept_histogram"),
)
