"""The tracer state SGLang's startup hooks leave behind for a tiny DeepSeek-V3 target (8 layers, hidden
size ``H``) and a ``K``-slot EAGLE-3 draft verifying ``NDT`` draft tokens: where the step-path tests'
child scripts (real SGLang objects, no engine) start from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hs_tracer.config import TracerConfig
    from hs_tracer.integrations.sglang.state import TracerState

K, H, NDT = 3, 8, 4


def started(config: TracerConfig, finish: bool = True) -> TracerState:
    """Install a tracer with ``config`` and fill in what the startup hooks read; ``finish``: also
    finish startup (wiring record, probes, recorder thread)."""
    import torch

    from hs_tracer.integrations.sglang import state

    st = state.install(config)
    st.target = {"architecture": "DeepseekV3ForCausalLM", "model_path": "/m/tiny", "num_layers": 8,
                 "hidden_size": H, "layers_to_capture": [2, 4, 5], "capture_aux_hidden_states": True}
    st.target_dtype = torch.float32
    st.aux = {"use_aux_hidden_state": True, "layer_ids": [1, 3, 4]}
    st.draft = {"architecture": "LlamaForCausalLMEagle3", "fc_in_features": K * H,
                "num_aux_hidden_states": K, "graph_width": None}
    st.spec_args = {"speculative_num_steps": 3, "speculative_eagle_topk": 1,
                    "speculative_num_draft_tokens": NDT}
    if finish:
        st.finish_startup()
    return st
