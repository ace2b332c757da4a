"""The SGLang releases hs_tracer supports, and for each release family the internals its hooks use.

This is the one place that knows SGLang's internals by name: one :class:`ReleaseFamily` per group of
releases whose internals agree, listing every hook (target, type, the handler in hs_tracer, the
parameters and attributes it reads) and where the release starts a scheduler process. The plugin's
version guard, its registration, the hook names (guard labels and ``HS_TRACER_FAULT_INJECT`` values),
the tests and the support matrix in docs/versions.md all come from :data:`FAMILIES`.

The plugin checks every target of the installed release's family before registering anything: if one
is missing or its signature changed, it logs one line naming it and stays off, so an SGLang upgrade
can never break serving through hs_tracer.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_V2 = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker"
_V1 = "sglang.srt.speculative.eagle_worker.EAGLEWorker"
_TARGET_MODEL = "sglang.srt.models.deepseek_v2.DeepseekV2Model.forward"
_LOGITS = "sglang.srt.layers.logits_processor.LogitsProcessor.forward"
_HOOKS = "hs_tracer.integrations.sglang.hooks"
_HOOKS_V1 = "hs_tracer.integrations.sglang.hooks_v1"


@dataclass(frozen=True)
class Hook:
    """One hook: SGLang's ``target`` (dotted path), when it runs, and the hs_tracer function it runs.

    ``params`` are the target's parameters (after self) the handler reads; the guard checks them
    against the installed signature. ``reads`` are the attributes it reads from them (documented in
    the support matrix; a missing one switches tracing off at the first call, never serving).
    """

    target: str
    type: str  # "before" or "after" (SGLang's HookType values)
    handler: str  # "module:function"
    params: tuple[str, ...] = ()
    reads: tuple[str, ...] = ()
    worker: str = ""  # "V1" or "V2" for the speculative worker's own hooks; "" for the shared ones

    @property
    def name(self) -> str:
        """``Class.method`` (or the function's name): guard label and fault-injection name."""
        parts = self.target.split(".")
        return ".".join(parts[-2:]) if parts[-2][:1].isupper() else parts[-1]


@dataclass(frozen=True)
class ReleaseFamily:
    """Releases whose hook targets, signatures and scheduler entry are the same."""

    name: str
    releases: tuple[str, ...]  # exact releases (their .postN builds count as them)
    workers: tuple[str, ...]  # EAGLE-3 workers the release ships, default first
    scheduler_entry: tuple[str, str]  # (module, function) that starts a scheduler and loads plugins
    hooks: tuple[Hook, ...]
    # The environment that makes an EAGLE-3 engine of this release run a worker other than its
    # default (topk 1); the default worker needs none.
    worker_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def hooks_for(self, worker: str) -> tuple[Hook, ...]:
        return tuple(h for h in self.hooks if h.worker in ("", worker))


_V2_WORKER_HOOKS = (
    Hook(f"{_V2}.init_lm_head", "after", f"{_HOOKS}:after_init_lm_head",
         reads=("draft_runner.model", "speculative_algorithm", "speculative_num_steps", "topk",
                "speculative_num_draft_tokens"), worker="V2"),
    Hook(f"{_V2}.init_cuda_graphs", "after", f"{_HOOKS}:after_init_draft_cuda_graphs",
         reads=("cuda_graph_runner_for_draft_extend.buffers.hidden_states",), worker="V2"),
    Hook(f"{_V2}._draft_extend_for_decode", "before", f"{_HOOKS}:before_draft_extend_for_decode",
         ("batch", "batch_result"), ("batch_result.logits_output.hidden_states",), worker="V2"),
)
_V2_PREFILL_PARAMS = ("batch", "target_hidden_states", "next_token_ids")

_LOGITS_HOOK = Hook(_LOGITS, "after", f"{_HOOKS}:after_logits_forward", ("logits_metadata",),
                    ("hidden_states", "logits_metadata.forward_mode", "logits_metadata.out_cache_loc"))

FAMILIES: tuple[ReleaseFamily, ...] = (
    ReleaseFamily(
        name="0.5.23",
        releases=("0.5.23",),
        workers=("V2",),
        scheduler_entry=("sglang.srt.managers.scheduler", "run_scheduler_process"),
        hooks=(
            Hook("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"
                 ".resolve_spec_aux_hidden_state_config", "after", f"{_HOOKS}:after_resolve_aux_config",
                 ("is_draft_worker",), ("eagle_use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids",
                                        "draft_model_config.hf_config")),
            Hook(f"{_RUNNER}.init_attention_backends", "after", f"{_HOOKS}:after_init_attention_backends",
                 reads=("model", "model_config", "model.model.layers_to_capture", "device", "gpu_id")),
            *_V2_WORKER_HOOKS,
            Hook(f"{_V2}._draft_extend_for_prefill", "before", f"{_HOOKS}:before_draft_extend_for_prefill",
                 _V2_PREFILL_PARAMS, ("batch.input_ids", "batch.prefix_lens", "batch.extend_lens"),
                 worker="V2"),
            Hook(_TARGET_MODEL, "after", f"{_HOOKS}:after_target_forward",
                 reads=("layers_to_capture", "start_layer", "end_layer")),
            _LOGITS_HOOK,
            Hook("sglang.srt.managers.scheduler_components.batch_result_processor"
                 ".SchedulerBatchResultProcessor._resolve_spec_v2_tokens", "after",
                 f"{_HOOKS}:after_resolve_spec_v2_tokens", ("result", "batch"),
                 ("result.accept_lens", "batch.reqs"), worker="V2"),
        ),
    ),
    ReleaseFamily(
        name="0.5.12",
        releases=("0.5.12",),
        workers=("V2", "V1"),
        scheduler_entry=("sglang.srt.managers.scheduler", "run_scheduler_process"),
        hooks=(
            Hook(f"{_RUNNER}.init_aux_hidden_state_capture", "after", f"{_HOOKS_V1}:after_init_aux_capture",
                 reads=("is_draft_worker", "eagle_use_aux_hidden_state", "eagle_aux_hidden_state_layer_ids",
                        "model", "model_config", "device", "gpu_id")),
            *_V2_WORKER_HOOKS,
            Hook(f"{_V2}._draft_extend_for_prefill", "before",
                 f"{_HOOKS_V1}:before_v2_draft_extend_for_prefill", _V2_PREFILL_PARAMS,
                 ("batch.input_ids", "batch.extend_prefix_lens", "batch.extend_seq_lens"), worker="V2"),
            Hook(f"{_V1}.init_cuda_graphs", "after", f"{_HOOKS_V1}:after_v1_init_cuda_graphs",
                 reads=("draft_model_runner.model", "speculative_algorithm", "speculative_num_steps", "topk",
                        "speculative_num_draft_tokens", "cuda_graph_runner_for_draft_extend"), worker="V1"),
            Hook(f"{_V1}.forward_draft_extend_after_decode", "before",
                 f"{_HOOKS_V1}:before_v1_draft_extend_after_decode", ("batch",),
                 ("batch.spec_info.hidden_states",), worker="V1"),
            Hook(f"{_V1}.forward_draft_extend", "before", f"{_HOOKS_V1}:before_v1_draft_extend",
                 ("batch", "hidden_states", "next_token_ids"),
                 ("batch.input_ids", "batch.prefix_lens", "batch.extend_lens"), worker="V1"),
            Hook(f"{_V1}.forward_batch_generation", "after", f"{_HOOKS_V1}:after_v1_forward_batch_generation",
                 ("batch",), ("result.num_correct_drafts_per_req_cpu", "batch.reqs"), worker="V1"),
            Hook(_TARGET_MODEL, "after", f"{_HOOKS_V1}:after_target_forward_list",
                 reads=("layers_to_capture", "start_layer", "end_layer")),
            _LOGITS_HOOK,
            Hook("sglang.srt.managers.scheduler_output_processor_mixin"
                 ".SchedulerOutputProcessorMixin._resolve_spec_overlap_tokens", "after",
                 f"{_HOOKS}:after_resolve_spec_v2_tokens", ("result", "batch"),
                 ("result.accept_lens", "batch.reqs"), worker="V2"),
        ),
        # SGLANG_ENABLE_SPEC_V2=0 (or --disable-overlap-schedule, or topk > 1) falls back to V1.
        worker_env={"V1": {"SGLANG_ENABLE_SPEC_V2": "0"}},
    ),
)

SUPPORTED_VERSIONS = tuple(r for f in FAMILIES for r in f.releases)
# Where every family starts a scheduler process (the plugin looks for this frame before registering).
SCHEDULER_ENTRIES = frozenset(f.scheduler_entry for f in FAMILIES)

_POST_RE = re.compile(r"\.post\d+$")


def release_of(version: str) -> str:
    """``0.5.23.post2`` -> ``0.5.23``: a post release keeps its release's internals."""
    return _POST_RE.sub("", version.strip())


def family_for(version: str | None) -> ReleaseFamily | None:
    """The family of an SGLang version, or None when hs_tracer does not support it."""
    if version is None:
        return None
    release = release_of(version)
    return next((f for f in FAMILIES if release in f.releases), None)


def hook_name(handler: str) -> str:
    """The name a handler (``module:function``) runs under: its hook's in the installed release's
    family, else in the first family that lists it."""
    for family in (installed_family(), *FAMILIES):
        for hook in family.hooks if family is not None else ():
            if hook.handler == handler:
                return hook.name
    raise KeyError(f"{handler} is no hook's handler in the version table")


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_family() -> ReleaseFamily | None:
    return family_for(installed_version())


def problems(family: ReleaseFamily | None = None) -> list[str]:
    """What is missing or changed in the installed SGLang, as short phrases (empty: supported).

    ``family`` overrides the family chosen by the installed version (tests check one family's targets
    against another release this way).
    """
    version = installed_version()
    if version is None:
        return ["sglang is not installed"]
    found: list[str] = []
    if family is None:
        family = family_for(version)
        if family is None:
            return [f"sglang {version} is not a supported release ({', '.join(SUPPORTED_VERSIONS)})"]
    module, function = family.scheduler_entry
    try:
        pkgutil.resolve_name(f"{module}:{function}")
    except (ImportError, AttributeError) as exc:
        found.append(f"the scheduler process entry {module}.{function} is missing ({type(exc).__name__}): "
                     "SGLang starts schedulers elsewhere now")
    for target in sorted({h.target for h in family.hooks}):
        params = {p for h in family.hooks if h.target == target for p in h.params}
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
        missing = sorted(p for p in params if p not in names)
        if missing:
            found.append(f"{target} no longer takes {', '.join(missing)}")
    return found
