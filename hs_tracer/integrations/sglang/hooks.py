"""The hooks hs_tracer registers in SGLang's V2 EAGLE worker (every release family; beside the V1
worker of the families that have one: :mod:`.hooks_v1`), one small function per concern.

Startup (run once): what the target captures and what the draft expects -> a WiringRecord and the
static findings. Capture metadata (graph capture / eager prefill only): which aux states the target
actually produced and how wide. Per step (Python, outside CUDA graphs): the fingerprint probe on the
draft's input before the draft extend, and the accept lengths after SGLang resolved them on the CPU.
docs/architecture.md says why each target was chosen.

Which SGLang target runs which function, and in which phase, is the release family's
(:mod:`hs_tracer.integrations.sglang.releases`); :func:`hook_table` builds the installed family's
table when the plugin registers. Every hook runs under :func:`.state.guarded` with its name from
that table: an exception inside hs_tracer switches tracing off instead of propagating into SGLang.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any, TypeVar

from sglang.srt.plugins.hook_registry import HookType

from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import state, versions
from hs_tracer.integrations.sglang.draft_layout import read_draft
from hs_tracer.integrations.sglang.releases import FAMILIES
from hs_tracer.integrations.sglang.releases.adapter import SGLangFamily
from hs_tracer.integrations.sglang.state import TracerState
from hs_tracer.release_table import Hook

F = TypeVar("F", bound=Callable[..., Any])


def install_state(cfg: TracerConfig) -> None:
    state.install(cfg)


def hook(fn: F) -> F:
    """Guard ``fn`` under the name the version table gives the hook it runs as."""
    return state.guarded(versions.hook_name(f"{fn.__module__}:{fn.__name__}"))(fn)


def step_hook(fn: F) -> F:
    """:func:`hook` for a hook that runs every decode step, outside any torch.compile'd code."""
    return state.guarded(versions.hook_name(f"{fn.__module__}:{fn.__name__}"), traceable=False)(fn)


# ---- startup ---------------------------------------------------------------------------------------
@hook
def after_resolve_aux_config(st: TracerState, result: Any, *_args: Any, **kwargs: Any) -> None:
    """The target's resolved capture config, and the draft's config.json as SGLang read it."""
    if kwargs.get("is_draft_worker"):
        return
    st.aux = {
        "use_aux_hidden_state": bool(result.eagle_use_aux_hidden_state),
        "layer_ids": int_list(result.eagle_aux_hidden_state_layer_ids),
    }
    draft_cfg = getattr(result, "draft_model_config", None)
    if draft_cfg is not None:
        st.draft_config = draft_cfg.hf_config.to_dict()


@hook
def after_resolve_aux_config_of_each_runner(st: TracerState, result: Any, *_args: Any, **kwargs: Any) -> None:
    """:func:`after_resolve_aux_config` on releases whose resolved config has no draft model config
    (the older families): the draft runner's own call brings the draft's config.json as its model_config."""
    if kwargs.get("is_draft_worker"):
        st.draft_config = kwargs["model_config"].hf_config.to_dict()
        return
    st.aux = {
        "use_aux_hidden_state": bool(result.eagle_use_aux_hidden_state),
        "layer_ids": int_list(result.eagle_aux_hidden_state_layer_ids),
    }


@hook
def after_init_attention_backends(st: TracerState, _result: Any, runner: Any) -> None:
    """The target model and the layers it captures (set just before, by SGLang)."""
    if getattr(runner, "is_draft_worker", False):
        return
    read_target(st, runner)


def read_target(st: TracerState, runner: Any) -> None:
    """The target model and the layers it captures, once SGLang has set them."""
    model = runner.model
    inner = getattr(model, "language_model", model)  # Kimi-K2.5 wraps the DeepSeek text model
    body = getattr(inner, "model", inner)
    st.target = {
        "architecture": type(model).__name__,
        "model_path": str(runner.model_config.model_path),
        "num_layers": int(runner.model_config.num_hidden_layers),
        "hidden_size": int(runner.model_config.hidden_size),
        "layers_to_capture": int_list(getattr(body, "layers_to_capture", None)) or [],
        "capture_aux_hidden_states": bool(getattr(inner, "capture_aux_hidden_states", False)),
    }
    st.target_logits_processor = getattr(inner, "logits_processor", None)
    st.target_device = _device(runner)
    st.target_dtype = getattr(runner.model_config, "dtype", None)
    st.prepare_probes()  # before SGLang captures the target's graphs
    if st.identity is None:
        from hs_tracer.integrations.sglang import identity

        st.identity = identity.install(st, body, runner)
    st.write_report()


@hook
def after_init_lm_head(st: TracerState, _result: Any, worker: Any) -> None:
    """What the loaded draft expects: fc input width, number of aux states, norms, vocab map
    (read per draft class: draft_layout.py)."""
    st.draft = read_draft(worker.draft_runner.model)
    read_spec_args(st, worker)


def read_spec_args(st: TracerState, worker: Any) -> None:
    """The worker's speculative settings (the same attributes on the V1 and V2 workers)."""
    st.spec_args = {
        "speculative_algorithm": str(worker.speculative_algorithm.name),
        "speculative_num_steps": int(worker.speculative_num_steps),
        "speculative_eagle_topk": int(worker.topk),
        "speculative_num_draft_tokens": int(worker.speculative_num_draft_tokens),
    }


@hook
def after_init_draft_cuda_graphs(st: TracerState, _result: Any, worker: Any, *_a: Any, **_k: Any) -> None:
    """Last startup step: the draft-extend graph width exists now; build the wiring record."""
    finish_startup(st, worker)


def finish_startup(st: TracerState, worker: Any) -> None:
    """The draft-extend graph's input width (None without CUDA graphs), then the wiring record."""
    runner = getattr(worker, "cuda_graph_runner_for_draft_extend", None)
    buffers = getattr(runner, "buffers", None)
    hidden = getattr(buffers, "hidden_states", None)
    st.draft["graph_width"] = int(hidden.shape[1]) if hidden is not None else None
    st.finish_startup()


# ---- capture metadata (graph capture and eager prefill; not per step under CUDA graphs) ------------
def after_target_forward(st: TracerState, result: Any, model: Any, *_args: Any, **_kwargs: Any) -> None:
    """Which layers the target's model body captured, in the order its loop appended them, and their
    total width. The aux states come last in the tuple it returns, packed into one tensor
    (DeepSeek-V2/V3) or as a list of tensors (Llama, Qwen, ...); a body that captured nothing
    returns its hidden states alone. Registered on every model body of the release, each under its
    own guard name (:func:`hook_table`). On a forward the identity sampler samples, its rows of the
    final norm and the slots are taken here (identity.py)."""
    sampler = st.identity
    if sampler is not None and sampler.active is not None and model is sampler.body:
        sampler.finish(result)
    if st.capture_seen >= st.CAPTURE_SAMPLES or not isinstance(result, tuple):
        return
    aux = result[-1]
    width = int(aux.shape[-1]) if hasattr(aux, "shape") else sum(int(t.shape[-1]) for t in aux)
    wanted = set(getattr(model, "layers_to_capture", ()) or ())
    start = getattr(model, "start_layer", 0)
    end = getattr(model, "end_layer", None)
    if end is None:
        end = len(getattr(model, "layers", ())) or max(wanted, default=-1) + 1
    st.note_capture([i for i in range(start, end) if i in wanted], width)  # loop order


@hook
def after_logits_forward(st: TracerState, result: Any, processor: Any, _input_ids: Any = None,
                         _hidden_states: Any = None, _lm_head: Any = None, logits_metadata: Any = None,
                         *_a: Any, **_k: Any) -> None:
    """The width of the features the target's logits processor hands on to the draft; during startup
    (SGLang captures the target's CUDA graphs then) the fingerprint kernel goes into each
    target-verify graph (state.py: ``record_in_graph``). The parameters after ``processor`` are
    ``LogitsProcessor.forward``'s."""
    if processor is not st.target_logits_processor:
        return
    if st.wiring is None:
        st.record_in_graph(result, logits_metadata)
    if st.handoff_widths_seen >= st.CAPTURE_SAMPLES:
        return
    hidden = getattr(result, "hidden_states", None)
    if hidden is not None and hidden.dim() == 2:
        st.note_handoff_width(int(hidden.shape[1]))


# ---- per step --------------------------------------------------------------------------------------
@step_hook
def before_draft_extend_for_decode(st: TracerState, _worker: Any, batch: Any, batch_result: Any,
                                   *_a: Any, **_k: Any) -> None:
    """The [bs * draft_tokens, K*H] features the draft extend is about to read (verify window);
    the step number goes onto ``batch_result``, which SGLang hands to the result hook later, and
    the batch's request list is noted (:func:`request_settled`: which requests SGLang skips)."""
    steps = st.steps
    if steps is not None:
        steps.observe_decode(batch_result.logits_output.hidden_states, batch_result,
                             getattr(batch, "reqs", None))


@hook
def before_draft_extend_for_prefill(st: TracerState, _worker: Any, batch: Any,
                                    target_hidden_states: Any, next_token_ids: Any = None,
                                    *_a: Any, **_k: Any) -> None:
    """The [extend_tokens, K*H] features of a prefill (and, when capturing, a sampled copy). An idle
    DP-attention rank runs this too while another rank prefills: its batch has no requests (and no
    ``prefix_lens``), so there is nothing to observe."""
    if st.steps is None or batch.prefix_lens is None:
        return
    st.steps.observe_prefill(target_hidden_states, batch.prefix_lens, batch.extend_lens)
    st.capture_prefill(batch, target_hidden_states, next_token_ids)


@step_hook
def after_resolve_spec_v2_tokens(st: TracerState, _tokens: Any, processor: Any, result: Any,
                                 batch: Any) -> None:
    """Accept lengths are on the CPU here (SGLang synchronised its own copy): record the step that
    ``result`` belongs to, for the requests SGLang committed."""
    steps = st.steps
    if steps is not None:
        steps.record(result, batch.reqs, result.accept_lens, result.speculative_num_draft_tokens or 0,
                     st.max_accept_length, settled=request_settled, processor=processor)


def request_settled(req: Any) -> bool:
    """Whether SGLang's ``_resolve_spec_v2_tokens`` commits this request's accept length this step
    (``req.finished()`` is ``finished_reason is not None``; the attribute is read directly).

    Requests SGLang already finished or retracted in a step are skipped exactly as its own
    ``_resolve_spec_v2_tokens`` skips them (``req.is_retracted or req.finished()``), and that test must
    read request state as it is at this step, on the scheduler thread. It is run only where it can be
    true, so the step costs the same at any batch size:

    - Without the overlap scheduler nothing is ever skipped: SGLang filters finished requests out of the
      running batch and retracts requests before it builds the next batch, and nothing changes a
      request between building a batch and resolving its result (SGLang's own decode loop checks
      ``finished() or is_retracted`` only under overlap for that reason).
    - A request that is still in the *next* decode batch was neither finished nor retracted when this
      step resolved (finishing is permanent; SGLang filters finished requests and removes retracted
      ones whenever it builds a decode batch, and retracts nowhere else). Under overlap the next decode
      batch is built and launched before this step's result is resolved, so when its launch was seen
      first, only the requests that left between the two lists (the *departed*) can be skipped, and
      only they are tested. The lists compare in C: unchanged (the running batch's list object, which
      SGLang rebinds and never mutates), extended at the end, or shortened in order; a departed
      request can never match a slot of the next list, so the walk always finds every one of them.
    - Otherwise (a prefill was launched in between, or SGLang processed this result before launching
      the next batch) every request is tested, as SGLang does.
    """
    return not (req.is_retracted or req.finished_reason is not None)


# ---- helpers ---------------------------------------------------------------------------------------
def _device(runner: Any) -> Any:
    """The device the target's outputs (and so the draft's input) live on."""
    import torch

    device = torch.device(str(runner.device))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(runner.gpu_id))
    return device


def int_list(values: Any) -> list[int] | None:
    return None if values is None else [int(v) for v in values]


Wrap = Callable[[Hook, Callable[..., Any]], Callable[..., Any]]


def hook_table(family: SGLangFamily | None = None,
               wrap: Wrap | None = None) -> list[tuple[str, Any, HookType]]:
    """(target, guarded hook, type) for each hook of ``family`` (default: the installed release's
    family, the newest without one) that registers in this process: a model body whose module cannot
    be imported here is left out (none of its models can be served). Built when the plugin
    registers, not at import.

    ``wrap(hook, fn)`` returns what registers in place of the guarded ``fn``; it sees the hook's table
    entry, its phase among it. Production passes none; the GPU testbed's runtime arms a debugging
    wrapper around the hooks that run while serving."""
    family = family or versions.installed_family() or FAMILIES[0]
    table = []
    for h in versions.hooks_here(family):
        fn = _guarded(h)
        table.append((h.target, wrap(h, fn) if wrap is not None else fn, HookType(h.type)))
    return table


def _guarded(h: Hook) -> Any:
    """The hook's handler, guarded under the hook's name: a handler several targets share (the
    model bodies') gets one guard per target, so each can be named, faulted and reported alone."""
    fn = pkgutil.resolve_name(h.handler)
    return fn if hasattr(fn, "__hs_tracer_where__") else state.guarded(h.name)(fn)
