"""SGLang 0.5.16: the capture config is resolved once per runner
(``resolve_spec_aux_hidden_state_config``) and the target read after ``init_attention_backends``."""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases import shared as s
from hs_tracer.integrations.sglang.releases.adapter import LayerIdRules, SGLangFamily

FAMILY = SGLangFamily(
    name="0.5.16",
    releases=("0.5.16",),
    workers=("V2",),
    scheduler_entry=s.SCHEDULER_ENTRY,
    hooks=(
        s.RESOLVE_AUX_EACH_RUNNER,
        s.ATTENTION_BACKENDS_HOOK,
        *s.V2_WORKER_HOOKS,
        s.V2_PREFILL_HOOK,
        s.TARGET_FORWARD_LIST,
        s.LOGITS_HOOK,
        s.RESOLVE_V2_TOKENS,
    ),
    layer_id_rules=LayerIdRules(deepseek_first_id_rule=True, gpt_oss_final_boundary=False,
                                deepseek_packer=False, deepseek_layer_0_raises=False),
    draft_layouts={"LlamaForCausalLMEagle3": s.LLAMA_FC_NORM_ONLY,
                   "Eagle3DeepseekV2ForCausalLM": s.MLA_COLUMN_PARALLEL},
)
