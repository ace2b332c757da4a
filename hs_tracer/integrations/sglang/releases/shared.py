"""Hooks, draft layouts and names that several release families share, each defined once.

A family module takes what it shares from here and defines what is its own; a hook here names the
families that use it.
"""

from __future__ import annotations

from hs_tracer.integrations.sglang.releases.adapter import DraftLayout
from hs_tracer.release_table import Hook, Phase

RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
V2 = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
V1 = "sglang.srt.speculative.eagle_worker.EAGLEWorker"
TARGET_MODEL = "sglang.srt.models.deepseek_v2.DeepseekV2Model.forward"
OUTPUT_MIXIN = "sglang.srt.managers.scheduler_output_processor_mixin.SchedulerOutputProcessorMixin"
SCHEDULER_ENTRY = ("sglang.srt.managers.scheduler", "run_scheduler_process")  # every family's
HOOKS = "hs_tracer.integrations.sglang.hooks"
HOOKS_V1 = "hs_tracer.integrations.sglang.hooks_v1"

# The V2 worker's startup and decode hooks: every family.
V2_WORKER_HOOKS = (
    Hook(f"{V2}.init_lm_head", "after", f"{HOOKS}:after_init_lm_head", Phase.STARTUP,
         reads=("draft_runner.model", "speculative_algorithm", "speculative_num_steps", "topk",
                "speculative_num_draft_tokens"), worker="V2"),
    Hook(f"{V2}.init_cuda_graphs", "after", f"{HOOKS}:after_init_draft_cuda_graphs", Phase.STARTUP,
         reads=("cuda_graph_runner_for_draft_extend.buffers.hidden_states",), worker="V2"),
    Hook(f"{V2}._draft_extend_for_decode", "before", f"{HOOKS}:before_draft_extend_for_decode",
         Phase.STEP, ("batch", "batch_result"), ("batch_result.logits_output.hidden_states",), worker="V2"),
)
V2_PREFILL_PARAMS = ("batch", "target_hidden_states", "next_token_ids")
# The prefill's draft extend when its batch is a ScheduleBatch: 0.5.13 on.
V2_PREFILL_HOOK = Hook(f"{V2}._draft_extend_for_prefill", "before",
                       f"{HOOKS}:before_draft_extend_for_prefill", Phase.STEP, V2_PREFILL_PARAMS,
                       ("batch.input_ids", "batch.prefix_lens", "batch.extend_lens"), worker="V2")
# The target's aux-capture config resolved once per runner: 0.5.16 on.
RESOLVE_AUX = ("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"
               ".resolve_spec_aux_hidden_state_config")
# The runner right after SGLang set the target's layers_to_capture: 0.5.16 on (0.5.14 has the
# method, but the capture config is still set in init_aux_hidden_state_capture).
ATTENTION_BACKENDS_HOOK = Hook(f"{RUNNER}.init_attention_backends", "after",
                               f"{HOOKS}:after_init_attention_backends", Phase.STARTUP,
                               reads=("model", "model_config", "model.model.layers_to_capture", "device",
                                      "gpu_id"))
# 0.5.16 to 0.5.21: the resolved config does not carry the draft's model config; the draft runner's
# own call has it (its model_config argument).
RESOLVE_AUX_EACH_RUNNER = Hook(RESOLVE_AUX, "after", f"{HOOKS}:after_resolve_aux_config_of_each_runner",
                               Phase.STARTUP, ("is_draft_worker", "model_config"),
                               ("result.eagle_use_aux_hidden_state",
                                "result.eagle_aux_hidden_state_layer_ids", "model_config.hf_config"))
# Before 0.5.16 ModelRunner.init_aux_hidden_state_capture sets the target's layers_to_capture, in
# the target's runner and in the draft's.
AUX_CAPTURE_HOOK = Hook(f"{RUNNER}.init_aux_hidden_state_capture", "after",
                        f"{HOOKS_V1}:after_init_aux_capture", Phase.STARTUP,
                        reads=("is_draft_worker", "eagle_use_aux_hidden_state",
                               "eagle_aux_hidden_state_layer_ids", "model", "model_config", "device",
                               "gpu_id"))
# DeepseekV2Model.forward returns the aux states as a list up to 0.5.16.
TARGET_FORWARD_LIST = Hook(TARGET_MODEL, "after", f"{HOOKS_V1}:after_target_forward_list", Phase.CAPTURE,
                           reads=("layers_to_capture", "start_layer", "end_layer"))
# The accept lengths of the V2 worker, on the host: 0.5.13 on.
RESOLVE_V2_TOKENS = Hook("sglang.srt.managers.scheduler_components.batch_result_processor"
                         ".SchedulerBatchResultProcessor._resolve_spec_v2_tokens", "after",
                         f"{HOOKS}:after_resolve_spec_v2_tokens", Phase.STEP, ("result", "batch"),
                         ("result.accept_lens", "result.speculative_num_draft_tokens", "batch.reqs"),
                         worker="V2")
# Every family.
LOGITS_HOOK = Hook("sglang.srt.layers.logits_processor.LogitsProcessor.forward", "after",
                   f"{HOOKS}:after_logits_forward", Phase.CAPTURE, ("logits_metadata",),
                   ("result.hidden_states", "logits_metadata.forward_mode", "logits_metadata.out_cache_loc"))

# The V1 worker's own startup and input hooks (0.5.11 and 0.5.12; the worker is gone from 0.5.13).
V1_STARTUP_AND_INPUT_HOOKS = (
    Hook(f"{V1}.init_cuda_graphs", "after", f"{HOOKS_V1}:after_v1_init_cuda_graphs", Phase.STARTUP,
         reads=("draft_model_runner.model", "speculative_algorithm", "speculative_num_steps", "topk",
                "speculative_num_draft_tokens", "cuda_graph_runner_for_draft_extend"), worker="V1"),
    Hook(f"{V1}.forward_draft_extend_after_decode", "before",
         f"{HOOKS_V1}:before_v1_draft_extend_after_decode", Phase.STEP, ("batch",),
         ("batch.spec_info.hidden_states",), worker="V1"),
    Hook(f"{V1}.forward_draft_extend", "before", f"{HOOKS_V1}:before_v1_draft_extend", Phase.STEP,
         ("batch", "hidden_states", "next_token_ids"),
         ("batch.input_ids", "batch.prefix_lens", "batch.extend_lens"), worker="V1"),
)
# 0.5.11 and 0.5.12's V2 prefill: a ModelWorkerBatch, whose lengths have other names.
V2_PREFILL_WORKER_BATCH = Hook(f"{V2}._draft_extend_for_prefill", "before",
                               f"{HOOKS_V1}:before_v2_draft_extend_for_prefill", Phase.STEP,
                               V2_PREFILL_PARAMS,
                               ("batch.input_ids", "batch.extend_prefix_lens", "batch.extend_seq_lens"),
                               worker="V2")
V1_ENV = {"V1": {"SGLANG_ENABLE_SPEC_V2": "0"}}  # 0.5.11 and 0.5.12: the V1 worker instead of V2

# Draft classes (models/llama_eagle3.py, models/kimi_k25_eagle3.py).
LLAMA_BOTH_NORMS = DraftLayout(fc_width="in_features", norms=("input_norm", "fc_norm"))  # 0.5.17 on
LLAMA_FC_NORM_ONLY = DraftLayout(fc_width="in_features", norms=("fc_norm",))  # 0.5.12 to 0.5.16
# Kimi-K2.5's MLA draft: a ColumnParallelLinear fc (input_size, no in_features): 0.5.15 on.
MLA_COLUMN_PARALLEL = DraftLayout(fc_width="input_size", norms=("fc_norm",))
