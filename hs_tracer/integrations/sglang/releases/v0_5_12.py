"""SGLang 0.5.12: the V2 worker by default, the V1 ``EAGLEWorker`` as fallback; V2's accept lengths
after ``_resolve_spec_overlap_tokens``, V1's in ``num_correct_drafts_per_req_cpu``."""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases import shared as s
from hs_tracer.integrations.sglang.releases.adapter import LayerIdRules, SGLangFamily
from hs_tracer.release_table import Hook, Phase

FAMILY = SGLangFamily(
    name="0.5.12",
    releases=("0.5.12",),
    workers=("V2", "V1"),
    scheduler_entry=s.SCHEDULER_ENTRY,
    hooks=(
        s.AUX_CAPTURE_HOOK,
        *s.V2_WORKER_HOOKS,
        s.V2_PREFILL_WORKER_BATCH,
        *s.V1_STARTUP_AND_INPUT_HOOKS,
        Hook(f"{s.V1}.forward_batch_generation", "after",
             f"{s.HOOKS_V1}:after_v1_forward_batch_generation", Phase.STEP, ("batch",),
             ("result.num_correct_drafts_per_req_cpu", "batch.reqs"), worker="V1"),
        s.TARGET_FORWARD_LIST,
        s.LOGITS_HOOK,
        Hook(f"{s.OUTPUT_MIXIN}._resolve_spec_overlap_tokens", "after",
             f"{s.HOOKS}:after_resolve_spec_v2_tokens", Phase.STEP, ("result", "batch"),
             ("result.accept_lens", "result.speculative_num_draft_tokens", "batch.reqs"), worker="V2"),
    ),
    layer_id_rules=LayerIdRules(deepseek_first_id_rule=False, gpt_oss_final_boundary=False,
                                deepseek_packer=False, deepseek_layer_0_raises=True),
    # Its Eagle3DeepseekV2ForCausalLM (an nn.Linear fc, no fc_norm, no num_aux_hidden_states) is read
    # leniently.
    draft_layouts={"LlamaForCausalLMEagle3": s.LLAMA_FC_NORM_ONLY},
    # SGLANG_ENABLE_SPEC_V2=0 (or --disable-overlap-schedule, or topk > 1) falls back to V1.
    worker_env=s.V1_ENV,
)
