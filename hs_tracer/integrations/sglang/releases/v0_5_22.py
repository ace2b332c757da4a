"""SGLang 0.5.22 and 0.5.23: the resolved aux-capture config carries the draft's model config, and
the capture hook is on every model body that returns the aux states it captured."""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases import shared as s
from hs_tracer.integrations.sglang.releases.adapter import LayerIdRules, SGLangFamily
from hs_tracer.release_table import Hook, Phase

# Every model body of 0.5.23 whose forward returns the aux hidden states it captured (the loop over
# its layers reads ``layers_to_capture``): the target of every EAGLE-3 pairing (Llama, Qwen2/3,
# DeepSeek, GLM, Gemma, MiniMax, gpt-oss, ...) and of DFlash/DSpark ones. Defined by the class itself,
# not inherited (tests/test_capture_bodies.py re-derives the list from the installed release's source).
CAPTURE_BODIES = (
    "apertus.ApertusModel", "arcee.ArceeModel", "bailing_moe.BailingMoEModel",
    "bailing_moe_v3.BailingMoELinearModel", "beam.BeamModel", "deepseek_v2.DeepseekV2Model",
    "exaone_moe.ExaoneMoEModel", "gemma3_causal.Gemma3TextModel", "gemma4_causal.Gemma4TextModel",
    "glm4.Glm4Model", "glm4_moe.Glm4MoeModel", "glm4_moe_lite.Glm4MoeLiteModel", "glm5_next.Glm5NextModel",
    "gpt_oss.GptOssModel", "granitemoehybrid.GraniteMoeHybridModel", "inkling.InklingCausalLLM",
    "interns2_mobius.InternS2MobiusForCausalLM", "kimi_k3.KimiK3LinearModel", "kimi_linear.KimiLinearModel",
    "laguna.LagunaModel", "lfm2.Lfm2Model", "lfm2_moe.Lfm2MoeModel", "llama.LlamaModel", "llama4.Llama4Model",
    "longcat_flash.LongcatFlashModel", "mimo_v2.MiMoV2Model", "minimax_m2.MiniMaxM2Model",
    "minimax_m3.MiniMaxM3Model", "muse_glimmer.MuseGlimmerModel", "muse_spark.MuseSpark1xModel",
    "nanbeige.NanbeigeModel", "nemotron_h.NemotronHModel", "qwen2.Qwen2Model", "qwen2_moe.Qwen2MoeModel",
    "qwen3.Qwen3Model", "qwen3_5.Qwen3_5ForCausalLM", "qwen3_next.Qwen3NextModel", "qwen3_vl.Qwen3LLMModel",
    "qwen3_vl_moe.Qwen3MoeLLMModel", "qwen4_exp.Qwen4ExpModel",
)

FAMILY = SGLangFamily(
    name="0.5.22",
    releases=("0.5.22", "0.5.23"),
    workers=("V2",),
    scheduler_entry=s.SCHEDULER_ENTRY,
    hooks=(
        Hook(s.RESOLVE_AUX, "after", f"{s.HOOKS}:after_resolve_aux_config", Phase.STARTUP,
             ("is_draft_worker",), ("result.eagle_use_aux_hidden_state",
                                    "result.eagle_aux_hidden_state_layer_ids",
                                    "result.draft_model_config.hf_config")),
        s.ATTENTION_BACKENDS_HOOK,
        *s.V2_WORKER_HOOKS,
        s.V2_PREFILL_HOOK,
        *(Hook(f"sglang.srt.models.{body}.forward", "after", f"{s.HOOKS}:after_target_forward",
               Phase.CAPTURE, reads=("layers_to_capture", "start_layer", "end_layer"), optional=True)
          for body in CAPTURE_BODIES),
        s.LOGITS_HOOK,
        s.RESOLVE_V2_TOKENS,
    ),
    layer_id_rules=LayerIdRules(deepseek_first_id_rule=True, gpt_oss_final_boundary=True,
                                deepseek_packer=True, deepseek_layer_0_raises=False),
    draft_layouts={"LlamaForCausalLMEagle3": s.LLAMA_BOTH_NORMS,
                   "Eagle3DeepseekV2ForCausalLM": s.MLA_COLUMN_PARALLEL},
)
