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

import importlib
import importlib.metadata
import inspect
import pkgutil
import re
import sys
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
    # A model body's hook: where its class is not importable (a kernel this machine lacks, a release
    # without that model) none of its models can be served, so the hook is left out instead of
    # switching tracing off.
    optional: bool = False

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

    def hooks_here(self, worker: str | None = None) -> tuple[Hook, ...]:
        """The hooks that register in this process (the worker's, or every worker's): a model body
        whose module cannot be imported here is left out, as none of its models can be served."""
        hooks = self.hooks if worker is None else self.hooks_for(worker)
        return tuple(h for h in hooks if not h.optional or importable(h.target))


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
# The prefill's draft extend when its batch is a ScheduleBatch (0.5.13 on).
_V2_PREFILL_HOOK = Hook(f"{_V2}._draft_extend_for_prefill", "before",
                        f"{_HOOKS}:before_draft_extend_for_prefill", _V2_PREFILL_PARAMS,
                        ("batch.input_ids", "batch.prefix_lens", "batch.extend_lens"),
                        worker="V2")
# The target's aux-capture config resolved once per runner (0.5.16 on), and the runner right after
# SGLang set the target's layers_to_capture (init_attention_backends, 0.5.14 on).
_RESOLVE_AUX = ("sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"
                ".resolve_spec_aux_hidden_state_config")
# Before 0.5.22 the resolved config does not carry the draft's model config: the draft runner's own
# call has it (its model_config argument).
_RESOLVE_AUX_EACH_RUNNER = Hook(_RESOLVE_AUX, "after", f"{_HOOKS}:after_resolve_aux_config_of_each_runner",
                                ("is_draft_worker", "model_config"),
                                ("result.eagle_use_aux_hidden_state",
                                 "result.eagle_aux_hidden_state_layer_ids", "model_config.hf_config"))
_ATTENTION_BACKENDS_HOOK = Hook(f"{_RUNNER}.init_attention_backends", "after",
                                f"{_HOOKS}:after_init_attention_backends",
                                reads=("model", "model_config", "model.model.layers_to_capture", "device",
                                       "gpu_id"))
# Before 0.5.16 ModelRunner.init_aux_hidden_state_capture sets the target's layers_to_capture, in
# the target's runner and in the draft's.
_AUX_CAPTURE_HOOK = Hook(f"{_RUNNER}.init_aux_hidden_state_capture", "after",
                         f"{_HOOKS_V1}:after_init_aux_capture",
                         reads=("is_draft_worker", "eagle_use_aux_hidden_state",
                                "eagle_aux_hidden_state_layer_ids", "model", "model_config", "device",
                                "gpu_id"))
# DeepseekV2Model.forward returns the aux states as a list up to 0.5.16, packed in one tensor after.
_TARGET_FORWARD_TENSOR = Hook(_TARGET_MODEL, "after", f"{_HOOKS}:after_target_forward",
                              reads=("layers_to_capture", "start_layer", "end_layer"))
_TARGET_FORWARD_LIST = Hook(_TARGET_MODEL, "after", f"{_HOOKS_V1}:after_target_forward_list",
                            reads=("layers_to_capture", "start_layer", "end_layer"))
_RESULT_PROCESSOR = ("sglang.srt.managers.scheduler_components.batch_result_processor"
                     ".SchedulerBatchResultProcessor")
_RESOLVE_V2_TOKENS = Hook(f"{_RESULT_PROCESSOR}._resolve_spec_v2_tokens", "after",
                          f"{_HOOKS}:after_resolve_spec_v2_tokens", ("result", "batch"),
                          ("result.accept_lens", "result.speculative_num_draft_tokens", "batch.reqs"),
                          worker="V2")
_OUTPUT_MIXIN = "sglang.srt.managers.scheduler_output_processor_mixin.SchedulerOutputProcessorMixin"
_SCHEDULER_ENTRY = ("sglang.srt.managers.scheduler", "run_scheduler_process")

# Every model body of 0.5.23 whose forward returns the aux hidden states it captured (the loop over
# its layers reads ``layers_to_capture``): the target of every EAGLE-3 pairing (Llama, Qwen2/3,
# DeepSeek, GLM, Gemma, MiniMax, gpt-oss, ...) and of DFlash/DSpark ones. Defined by the class itself,
# not inherited (tests/test_plugin.py re-derives the list from the installed release's source).
_CAPTURE_BODIES_0_5_23 = (
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
_CAPTURE_HOOKS_0_5_23 = tuple(
    Hook(f"sglang.srt.models.{body}.forward", "after", f"{_HOOKS}:after_target_forward",
         reads=("layers_to_capture", "start_layer", "end_layer"), optional=True)
    for body in _CAPTURE_BODIES_0_5_23
)

_LOGITS_HOOK = Hook(_LOGITS, "after", f"{_HOOKS}:after_logits_forward", ("logits_metadata",),
                    ("result.hidden_states", "logits_metadata.forward_mode", "logits_metadata.out_cache_loc"))

# The V1 worker's own hooks (0.5.11 and 0.5.12; gone from 0.5.13). Its accept lengths are
# num_correct_drafts_per_req_cpu in 0.5.12 and num_accepted_drafts_per_req_cpu in 0.5.11.
_V1_STARTUP_AND_INPUT_HOOKS = (
    Hook(f"{_V1}.init_cuda_graphs", "after", f"{_HOOKS_V1}:after_v1_init_cuda_graphs",
         reads=("draft_model_runner.model", "speculative_algorithm", "speculative_num_steps", "topk",
                "speculative_num_draft_tokens", "cuda_graph_runner_for_draft_extend"), worker="V1"),
    Hook(f"{_V1}.forward_draft_extend_after_decode", "before",
         f"{_HOOKS_V1}:before_v1_draft_extend_after_decode", ("batch",),
         ("batch.spec_info.hidden_states",), worker="V1"),
    Hook(f"{_V1}.forward_draft_extend", "before", f"{_HOOKS_V1}:before_v1_draft_extend",
         ("batch", "hidden_states", "next_token_ids"),
         ("batch.input_ids", "batch.prefix_lens", "batch.extend_lens"), worker="V1"),
)
# 0.5.11 and 0.5.12's V2 prefill: a ModelWorkerBatch, whose lengths have other names.
_V2_PREFILL_WORKER_BATCH = Hook(f"{_V2}._draft_extend_for_prefill", "before",
                                f"{_HOOKS_V1}:before_v2_draft_extend_for_prefill", _V2_PREFILL_PARAMS,
                                ("batch.input_ids", "batch.extend_prefix_lens", "batch.extend_seq_lens"),
                                worker="V2")

# Newest first: FAMILIES[0] is the newest family, and a release newer than every family's is checked
# against it (``untested``).
FAMILIES: tuple[ReleaseFamily, ...] = (
    ReleaseFamily(
        name="0.5.22",
        releases=("0.5.22", "0.5.23"),
        workers=("V2",),
        scheduler_entry=_SCHEDULER_ENTRY,
        hooks=(
            Hook(_RESOLVE_AUX, "after", f"{_HOOKS}:after_resolve_aux_config",
                 ("is_draft_worker",), ("result.eagle_use_aux_hidden_state",
                                        "result.eagle_aux_hidden_state_layer_ids",
                                        "result.draft_model_config.hf_config")),
            _ATTENTION_BACKENDS_HOOK,
            *_V2_WORKER_HOOKS,
            _V2_PREFILL_HOOK,
            *_CAPTURE_HOOKS_0_5_23,
            _LOGITS_HOOK,
            _RESOLVE_V2_TOKENS,
        ),
    ),
    ReleaseFamily(
        name="0.5.17",
        releases=("0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21"),
        workers=("V2",),
        scheduler_entry=_SCHEDULER_ENTRY,
        hooks=(
            _RESOLVE_AUX_EACH_RUNNER,
            _ATTENTION_BACKENDS_HOOK,
            *_V2_WORKER_HOOKS,
            _V2_PREFILL_HOOK,
            _TARGET_FORWARD_TENSOR,
            _LOGITS_HOOK,
            _RESOLVE_V2_TOKENS,
        ),
    ),
    ReleaseFamily(
        name="0.5.16",
        releases=("0.5.16",),
        workers=("V2",),
        scheduler_entry=_SCHEDULER_ENTRY,
        hooks=(
            _RESOLVE_AUX_EACH_RUNNER,
            _ATTENTION_BACKENDS_HOOK,
            *_V2_WORKER_HOOKS,
            _V2_PREFILL_HOOK,
            _TARGET_FORWARD_LIST,
            _LOGITS_HOOK,
            _RESOLVE_V2_TOKENS,
        ),
    ),
    # V2 only (the V1 worker is gone); the capture config still set in init_aux_hidden_state_capture.
    ReleaseFamily(
        name="0.5.13",
        releases=("0.5.13", "0.5.14", "0.5.15"),
        workers=("V2",),
        scheduler_entry=_SCHEDULER_ENTRY,
        hooks=(
            _AUX_CAPTURE_HOOK,
            *_V2_WORKER_HOOKS,
            _V2_PREFILL_HOOK,
            _TARGET_FORWARD_LIST,
            _LOGITS_HOOK,
            _RESOLVE_V2_TOKENS,
        ),
    ),
    ReleaseFamily(
        name="0.5.12",
        releases=("0.5.12",),
        workers=("V2", "V1"),
        scheduler_entry=_SCHEDULER_ENTRY,
        hooks=(
            _AUX_CAPTURE_HOOK,
            *_V2_WORKER_HOOKS,
            _V2_PREFILL_WORKER_BATCH,
            *_V1_STARTUP_AND_INPUT_HOOKS,
            Hook(f"{_V1}.forward_batch_generation", "after", f"{_HOOKS_V1}:after_v1_forward_batch_generation",
                 ("batch",), ("result.num_correct_drafts_per_req_cpu", "batch.reqs"), worker="V1"),
            _TARGET_FORWARD_LIST,
            _LOGITS_HOOK,
            Hook(f"{_OUTPUT_MIXIN}._resolve_spec_overlap_tokens", "after",
                 f"{_HOOKS}:after_resolve_spec_v2_tokens", ("result", "batch"),
                 ("result.accept_lens", "result.speculative_num_draft_tokens", "batch.reqs"), worker="V2"),
        ),
        # SGLANG_ENABLE_SPEC_V2=0 (or --disable-overlap-schedule, or topk > 1) falls back to V1.
        worker_env={"V1": {"SGLANG_ENABLE_SPEC_V2": "0"}},
    ),
    # 0.5.11's results carry no draft-token count and name the accepted drafts num_accepted_drafts_*.
    ReleaseFamily(
        name="0.5.11",
        releases=("0.5.11",),
        workers=("V2", "V1"),
        scheduler_entry=_SCHEDULER_ENTRY,
        hooks=(
            _AUX_CAPTURE_HOOK,
            *_V2_WORKER_HOOKS,
            _V2_PREFILL_WORKER_BATCH,
            *_V1_STARTUP_AND_INPUT_HOOKS,
            Hook(f"{_V1}.forward_batch_generation", "after",
                 f"{_HOOKS_V1}:after_v1_forward_batch_generation_accepted_drafts", ("batch",),
                 ("result.num_accepted_drafts_per_req_cpu", "batch.reqs"), worker="V1"),
            _TARGET_FORWARD_LIST,
            _LOGITS_HOOK,
            Hook(f"{_OUTPUT_MIXIN}._resolve_spec_overlap_token_ids", "after",
                 f"{_HOOKS_V1}:after_resolve_spec_overlap_token_ids", ("result", "batch"),
                 ("result.accept_lens", "batch.reqs"), worker="V2"),
        ),
        worker_env={"V1": {"SGLANG_ENABLE_SPEC_V2": "0"}},
    ),
)

SUPPORTED_VERSIONS = tuple(r for f in FAMILIES for r in f.releases)
# Where every family starts a scheduler process (the plugin looks for this frame before registering).
SCHEDULER_ENTRIES = frozenset(f.scheduler_entry for f in FAMILIES)

_POST_RE = re.compile(r"\.post\d+$")
_FINAL_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?$")


def release_of(version: str) -> str:
    """``0.5.23.post2`` -> ``0.5.23``: a post release keeps its release's internals."""
    return _POST_RE.sub("", version.strip())


def _release_key(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a final release or its ``.postN``; None for anything else (rc, dev)."""
    m = _FINAL_RE.match(version.strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


NEWEST_RELEASE = max(SUPPORTED_VERSIONS, key=lambda r: _release_key(r) or (0, 0, 0))


def is_untested(version: str | None) -> bool:
    """A final release newer than every release in the table: checked against the newest family
    (targets, parameters, reads and layer-id rule) instead of refused."""
    key = _release_key(version) if version else None
    newest = _release_key(NEWEST_RELEASE)
    return key is not None and newest is not None and key > newest


def family_for(version: str | None) -> ReleaseFamily | None:
    """The family of an SGLang version: the one listing its release; for a release newer than the
    newest listed one the newest family (:func:`is_untested`); None when hs_tracer does not support it."""
    if version is None:
        return None
    release = release_of(version)
    listed = next((f for f in FAMILIES if release in f.releases), None)
    if listed is None and is_untested(version):
        return FAMILIES[0]
    return listed


def support(version: str | None) -> str:
    """The support status of an SGLang version, in words (``hs-tracer check`` and the plugin's
    startup line print it)."""
    if version is None:
        return "sglang is not installed"
    family = family_for(version)
    if family is None:
        return f"sglang {version}: not supported (supported: {supported_text()})"
    if is_untested(version):
        return (f"sglang {version}: untested release, newer than {NEWEST_RELEASE}; traced only when its "
                f"hook targets, parameters, reads and layer-id rule match the {family.name} family's")
    return f"sglang {version}: supported, tested (release family {family.name})"


def supported_text() -> str:
    """The supported releases, oldest to newest, for messages."""
    ordered = sorted(SUPPORTED_VERSIONS, key=lambda r: _release_key(r) or (0, 0, 0))
    return f"{ordered[0]} to {ordered[-1]} and their .postN; newer releases when their internals match"


def hook_name(handler: str) -> str:
    """The name a handler (``module:function``) runs under: its hook's in the installed release's
    family, else in the first family that lists it."""
    for family in (installed_family(), *FAMILIES):
        for hook in family.hooks if family is not None else ():
            if hook.handler == handler:
                return hook.name
    raise KeyError(f"{handler} is no hook's handler in the version table")


def importable(target: str) -> bool:
    """Whether a model body's hook target (``module.Class.method``) exists in this process: a module
    that needs a kernel this machine lacks does not import (and then none of its models can be served
    here either), and a release may not have every body of the table."""
    module, cls, method = target.rsplit(".", 2)
    try:
        return hasattr(getattr(importlib.import_module(module), cls), method)
    except Exception:  # whatever a model module raises at import, it cannot be served here
        return False


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_family() -> ReleaseFamily | None:
    return family_for(installed_version())


def problems(family: ReleaseFamily | None = None, *, check_reads: bool | None = None) -> list[str]:
    """What is missing or changed in the installed SGLang, as short phrases (empty: supported).

    ``family`` overrides the family chosen by the installed version (tests check one family's targets
    against another release this way). ``check_reads`` (default: only for an untested release) also
    checks that every attribute the hooks read is still named in SGLang's source and that the
    DeepSeek and gpt-oss layer-id rules are still the family's.
    """
    version = installed_version()
    if version is None:
        return ["sglang is not installed"]
    if family is None:
        family = family_for(version)
        if family is None:
            return [f"sglang {version} is not a supported release ({supported_text()})"]
    if check_reads is None:
        check_reads = is_untested(version)
    # Outside a scheduler process the first import of SGLang's modules can stop inside one of its own
    # import cycles (0.5.14's scheduler module, imported first): a second pass sees them imported.
    found = _missing(family) or _missing(family)
    if check_reads and not found:
        found += _changed_reads(family) + _changed_layer_id_rules()
    return found


_WORD_RE = re.compile(r"\b\w+\b")


def _changed_reads(family: ReleaseFamily) -> list[str]:
    """Each attribute a hook reads must still be there. Where the read starts at a parameter (or the
    result) whose annotation names a class, its first attribute must be one of that class's fields or
    attributes; every other name must still occur in the target's module or, failing that, in an
    SGLang module imported so far (a rename removes the old name)."""
    package: set[str] | None = None
    found = []
    for hook in family.hooks_here():
        fn = pkgutil.resolve_name(hook.target)
        module = sys.modules.get(fn.__module__)
        try:
            words = set(_WORD_RE.findall(inspect.getsource(module))) if module else set()
        except (OSError, TypeError):
            words = set()
        for read in hook.reads:
            parts = read.split(".")
            rooted = parts[0] in (*hook.params, "result")
            names = parts[1:] if rooted else parts
            cls = _annotated_class(fn, parts[0]) if rooted else None
            if cls is not None and names:
                if not _has_attribute(cls, names[0]):
                    found.append(f"{hook.name} reads {read}, but {cls.__name__} has no {names[0]}")
                    continue
                names = names[1:]
            gone = [n for n in names if n not in words]
            if gone and package is None:
                package = _srt_words()
            gone = [n for n in gone if n not in (package or set())]
            if gone:
                found.append(f"{hook.name} reads {read}, but SGLang no longer names {', '.join(gone)}")
    return found


def _annotated_class(fn: object, name: str) -> type | None:
    """The class a parameter (``result``: the return value) of ``fn`` is annotated with, if any."""
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if name == "result":
        annotation = sig.return_annotation
    else:
        param = sig.parameters.get(name)
        annotation = param.annotation if param is not None else inspect.Signature.empty
    if isinstance(annotation, str):
        annotation = getattr(fn, "__globals__", {}).get(annotation.strip("'\""))
    return annotation if isinstance(annotation, type) else None


def _has_attribute(cls: type, name: str) -> bool:
    """A field (dataclass, msgspec struct, annotation), a class attribute, or an instance attribute
    the class's own source sets (``self.name``)."""
    fields = set(getattr(cls, "__struct_fields__", ()))  # msgspec structs
    for klass in cls.__mro__:
        fields.update(getattr(klass, "__annotations__", {}))
    if name in fields or hasattr(cls, name):
        return True
    try:
        return f"self.{name}" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def _srt_words() -> set[str]:
    """The names in every SGLang module imported so far (the hook targets' and what they import)."""
    words: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith("sglang.srt") else None
        if path and path.endswith(".py"):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    words.update(_WORD_RE.findall(f.read()))
            except OSError:
                continue
    return words


# (module, class, layer-id family) whose set_eagle3_layers_to_capture changed between releases.
_RULE_CLASSES = (("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", "deepseek"),
                 ("sglang.srt.models.gpt_oss", "GptOssForCausalLM", "gpt_oss"))
_RULE_CASES = ((61, (None, (1, 29, 57), (2, 30, 58), (0, 3, 31))), (36, ((24, 30, 36), (1, 17, 33))))


def _changed_layer_id_rules() -> list[str]:
    """Run the installed release's own ``set_eagle3_layers_to_capture`` (on a stand-in ``self``; no
    weights) and compare with the rule hs_tracer applies to it (:func:`rules_release`)."""
    from types import SimpleNamespace

    from hs_tracer import sources

    release = rules_release(installed_version())
    found = []
    for module, name, family in _RULE_CLASSES:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            found.append(f"{module}.{name} is missing ({type(exc).__name__})")
            continue
        for n, cases in _RULE_CASES:
            for ids in cases:
                inner = SimpleNamespace(layers_to_capture=[])
                inner.set_eagle3_layers_to_capture = lambda got, inner=inner: setattr(
                    inner, "layers_to_capture", list(got))
                fake = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                                       config=SimpleNamespace(num_hidden_layers=n), model=inner,
                                       capture_aux_hidden_states=False)
                want = sources.sglang_layers_to_capture(list(ids) if ids else None, sources.Family(family), n,
                                                        sglang_version=release)
                try:
                    cls.set_eagle3_layers_to_capture(fake, list(ids) if ids else None)
                    got = list(inner.layers_to_capture)
                except Exception as exc:  # any failure means the rule changed
                    got = f"{type(exc).__name__}"
                if got != want:
                    found.append(f"{name}.set_eagle3_layers_to_capture({list(ids) if ids else None}) with "
                                 f"{n} layers gives {got}, {release}'s rule {want}")
    return found


def rules_release(version: str | None) -> str | None:
    """The release whose layer-id rules apply to ``version``: itself, or for an untested release
    the newest listed one (its guard checked that the rule is unchanged)."""
    return NEWEST_RELEASE if is_untested(version) else version


def _missing(family: ReleaseFamily) -> list[str]:
    """The family's scheduler entry, targets and parameters that the installed SGLang lacks."""
    found: list[str] = []
    module, function = family.scheduler_entry
    try:
        pkgutil.resolve_name(f"{module}:{function}")
    except (ImportError, AttributeError) as exc:
        found.append(f"the scheduler process entry {module}.{function} is missing ({type(exc).__name__}): "
                     "SGLang starts schedulers elsewhere now")
    for target in sorted({h.target for h in family.hooks_here()}):
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
