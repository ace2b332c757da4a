"""SGLang 0.5.13 to 0.5.15: V2 only (the V1 worker is gone), the capture config still set in
``init_aux_hidden_state_capture``, the prefill's batch a ``ScheduleBatch``; the DeepSeek rule adds 1
only when the first id is 1, and on 0.5.13 a captured layer 0 of a DeepSeek target raises."""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases import shared as s
from hs_tracer.integrations.sglang.releases.adapter import DraftLayout, LayerIdRules, SGLangFamily

FAMILY = SGLangFamily(
    name="0.5.13",
    releases=("0.5.13", "0.5.14", "0.5.15"),
    workers=("V2",),
    scheduler_entry=s.SCHEDULER_ENTRY,
    hooks=(
        s.AUX_CAPTURE_HOOK,
        *s.V2_WORKER_HOOKS,
        s.V2_PREFILL_HOOK,
        s.TARGET_FORWARD_LIST,
        s.LOGITS_HOOK,
        s.RESOLVE_V2_TOKENS,
    ),
    # 0.5.13's DeepSeek loop still captures before each layer (a captured layer 0 raises); 0.5.14
    # moved the capture into the layer.
    layer_id_rules=LayerIdRules(deepseek_first_id_rule=True, gpt_oss_final_boundary=False,
                                deepseek_packer=False, deepseek_layer_0_raises=True),
    layer_id_rules_from=(("0.5.14", LayerIdRules(deepseek_first_id_rule=True, gpt_oss_final_boundary=False,
                                                 deepseek_packer=False, deepseek_layer_0_raises=False)),),
    # Kimi-K2.5's MLA draft: fc_norm and num_aux_hidden_states, with an nn.Linear fc (in_features);
    # from 0.5.15 on a ColumnParallelLinear (input_size), as in 0.5.16.
    draft_layouts={"LlamaForCausalLMEagle3": s.LLAMA_FC_NORM_ONLY,
                   "Eagle3DeepseekV2ForCausalLM": DraftLayout(fc_width="in_features", norms=("fc_norm",))},
    draft_layouts_from=(("0.5.15", {"LlamaForCausalLMEagle3": s.LLAMA_FC_NORM_ONLY,
                                    "Eagle3DeepseekV2ForCausalLM": s.MLA_COLUMN_PARALLEL}),),
)
