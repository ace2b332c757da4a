"""The SGLang releases hs_tracer's hooks are written for, and the hook targets it relies on.

This is the one place that knows SGLang's internals by name. The plugin checks every target here
before registering anything: if one is missing or its signature changed, it logs one line naming it
and stays off, so an SGLang upgrade can never break serving through hs_tracer.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil

SUPPORTED_VERSIONS = ("0.5.23",)

_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_DRAFT = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_RESULTS = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
)

# Hook target -> parameter names (after self) the hook reads. Why each target: docs/architecture.md.
TARGETS: dict[str, tuple[str, ...]] = {
    "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"
    ".resolve_spec_aux_hidden_state_config": ("is_draft_worker",),
    f"{_RUNNER}.init_attention_backends": (),
    f"{_DRAFT}.init_lm_head": (),
    f"{_DRAFT}.init_cuda_graphs": (),
    f"{_DRAFT}._draft_extend_for_decode": ("batch", "batch_result"),
    f"{_DRAFT}._draft_extend_for_prefill": ("batch", "target_hidden_states", "next_token_ids"),
    f"{_RESULTS}._resolve_spec_v2_tokens": ("result", "batch"),
    "sglang.srt.models.deepseek_v2.DeepseekV2Model.forward": (),
    "sglang.srt.layers.logits_processor.LogitsProcessor.forward": (),
}


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def problems(targets: dict[str, tuple[str, ...]] = TARGETS) -> list[str]:
    """What is missing or changed in the installed SGLang, as short phrases (empty: supported)."""
    version = installed_version()
    if version is None:
        return ["sglang is not installed"]
    found: list[str] = []
    if version not in SUPPORTED_VERSIONS:
        found.append(f"sglang {version} is not a supported release ({', '.join(SUPPORTED_VERSIONS)})")
    for target, params in targets.items():
        try:
            fn = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as exc:
            found.append(f"{target} is missing ({type(exc).__name__})")
            continue
        try:
            names = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            found.append(f"{target} has no inspectable signature")
            continue
        missing = [p for p in params if p not in names]
        if missing:
            found.append(f"{target} no longer takes {', '.join(missing)}")
    return found
