"""The hooks hs_tracer registers in SGLang 0.5.23, one small function per concern.

Each hook is registered through SGLang's ``HookRegistry`` (see :mod:`.plugin`) and runs under
:func:`.state.guarded`, so an exception inside hs_tracer switches tracing off instead of
propagating into SGLang.
"""

from __future__ import annotations

from typing import Any

from sglang.srt.plugins.hook_registry import HookType

from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import state
from hs_tracer.integrations.sglang.versions import installed_version


def install_state(cfg: TracerConfig) -> None:
    state.install(cfg)


@state.guarded("ModelRunner.init_attention_backends")
def after_init_attention_backends(st: state.TracerState, _result: Any, runner: Any) -> None:
    """Startup: what the target model looks like and which layers it captures for the draft."""
    if getattr(runner, "is_draft_worker", False):
        return
    model = runner.model
    inner = getattr(model, "language_model", model)  # Kimi-K2.5 wraps the DeepSeek text model
    body = getattr(inner, "model", inner)
    st.target = {
        "architecture": type(model).__name__,
        "num_layers": int(runner.model_config.num_hidden_layers),
        "hidden_size": int(runner.model_config.hidden_size),
        "layers_to_capture": list(getattr(body, "layers_to_capture", []) or []),
        "capture_aux_hidden_states": bool(getattr(inner, "capture_aux_hidden_states", False)),
        "sglang_version": installed_version(),
    }
    st.write_report()


_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"

# (target, hook, type): the full set registered by the plugin.
HOOKS: list[tuple[str, Any, HookType]] = [
    (f"{_RUNNER}.init_attention_backends", after_init_attention_backends, HookType.AFTER),
]
