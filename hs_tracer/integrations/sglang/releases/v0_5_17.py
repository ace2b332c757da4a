"""SGLang 0.5.17 to 0.5.21: ``DeepseekV2Model.forward`` packs the aux states into one tensor
(``AuxHiddenStatePacker``), gpt-oss gets its final-boundary rule, the Llama draft its ``input_norm``."""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases import shared as s
from hs_tracer.integrations.sglang.releases.adapter import LayerIdRules, SGLangFamily
from hs_tracer.release_table import Hook, Phase

FAMILY = SGLangFamily(
    name="0.5.17",
    releases=("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21"),
    workers=("V2",),
    scheduler_entry=s.SCHEDULER_ENTRY,
    hooks=(
        s.RESOLVE_AUX_EACH_RUNNER,
        s.ATTENTION_BACKENDS_HOOK,
        *s.V2_WORKER_HOOKS,
        s.V2_PREFILL_HOOK,
        Hook(s.TARGET_MODEL, "after", f"{s.HOOKS}:after_target_forward", Phase.CAPTURE,
             reads=("layers_to_capture", "start_layer", "end_layer")),
        s.LOGITS_HOOK,
        s.RESOLVE_V2_TOKENS,
    ),
    layer_id_rules=LayerIdRules(deepseek_first_id_rule=True, gpt_oss_final_boundary=True,
                                deepseek_packer=True, deepseek_layer_0_raises=False),
    draft_layouts={"LlamaForCausalLMEagle3": s.LLAMA_BOTH_NORMS,
                   "Eagle3DeepseekV2ForCausalLM": s.MLA_COLUMN_PARALLEL},
)
