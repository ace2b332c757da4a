"""The hooks hs_tracer wraps into vLLM (the 0.32 family in :mod:`.versions`), one function per concern.

Startup (once, in the worker, after vLLM set the target's aux layers and loaded the drafter): what
the target captures (the ids vLLM resolved and where it found them), what the draft's ``fc`` expects,
the speculative settings -> a WiringRecord, the static findings, the probe and the recorder.

Per step, all in Python that vLLM runs outside its compiled graphs:

* ``GPUModelRunner.propose_draft_token_ids`` (before): notes the step's ``SchedulerOutput``; the
  draft-input hook stamps the step number on it (the step path's own attribute), and the scheduler
  later hands that object to ``update_from_output`` with the step's result (in one process with the
  worker: vLLM's single-process executor, ``distributed_executor_backend="uni"``);
* ``combine_hidden_states`` of the draft class (before): the ``[tokens, K*H]`` states the draft's
  ``fc`` is about to read -> one probe launch (no host sync);
* ``Scheduler.make_spec_decoding_stats`` (after): vLLM's own per-request accounting of drafted and
  accepted tokens, called once per request that verified drafts this step;
* ``Scheduler.update_from_output`` (after): the step's accept lengths (accepted + the bonus token)
  go to the step log with the step number.

With a multi-process executor (tensor parallelism; vLLM's default on CPU) the scheduler runs in the
engine core's process and the model in worker processes, so the accept lengths and the fingerprints
are in different tracers. They meet over the ``SchedulerOutput`` the core already sends to every
worker (pickled, its attributes with it):

* ``Scheduler.schedule`` (after, core): numbers the step on its ``SchedulerOutput`` and attaches
  the accept lengths the core accounted since the last step, each under its step's number;
* ``GPUModelRunner.execute_model`` (before, worker): the emitting rank notes the step's object under
  its number and logs the attached accept lengths against the objects of their steps, whose draft
  input it fingerprinted, as the single-process path does. The last step of a burst reaches the
  report with the next scheduled step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from hs_tracer.integrations.vllm import layer_ids as vl
from hs_tracer.integrations.vllm import state, versions
from hs_tracer.integrations.vllm.state import RequestRef, TracerState
from hs_tracer.integrations.vllm.wiring import check_vllm_wiring, wiring_record

STEP_SEQ = "_hs_tracer_seq"  # the core's step number on a SchedulerOutput (multi-process executor)
ACCOUNTED = "_hs_tracer_accounted"  # [(step number, [(request id, accept length)])] riding on it
RECEIVED = 64  # the worker keeps this many steps' SchedulerOutputs waiting for their accept lengths

F = TypeVar("F", bound=Callable[..., Any])


def hook(fn: F) -> F:
    """Guard ``fn`` under the name the version table gives the hook it runs as."""
    return state.guarded(versions.hook_name(f"{fn.__module__}:{fn.__name__}"))(fn)


# ---- startup ---------------------------------------------------------------------------------------
@hook
def after_setup_aux_layers(st: TracerState, _result: Any, runner: Any) -> None:
    """The target, the layers vLLM set it to capture, the loaded draft: the wiring, then the step path."""
    spec = runner.speculative_config
    if spec is None or st.wiring is not None:
        return
    mc = runner.model_config
    num_layers = int(mc.get_total_num_hidden_layers())
    hidden = int(mc.get_hidden_size())
    st.draft_config = _config_dict(spec.draft_model_config.hf_config)
    use_aux = bool(runner.use_aux_hidden_state_outputs)
    resolved = _resolved_layers(runner.model) if use_aux else None
    configured = runner._get_eagle3_aux_layers_from_config() if use_aux else None
    ids, key = vl.vllm_configured_ids(st.draft_config)
    if configured is not None and list(configured) != ids:
        key = "unknown"  # vLLM found ids where this release's rules say it does not look
    elif configured is None:
        key = vl.VLLM_DEFAULT
    version = versions.installed_version() or ""
    capture = vl.vllm_capture(resolved or [], num_layers, key, vllm_version=version) if use_aux else None
    st.aux = {"use_aux_hidden_state": use_aux, "layer_ids": list(resolved) if resolved is not None else None,
              "configured_layer_ids": list(configured) if configured else None, "key": key}
    st.target = {"architecture": str((mc.architectures or [type(runner.model).__name__])[0]),
                 "model_path": str(mc.model), "num_layers": num_layers, "hidden_size": hidden,
                 "device": runner.device, "dtype": mc.dtype}
    st.draft = _read_draft(runner.drafter.model)
    steps = int(spec.num_speculative_tokens)
    # a chain of ``steps`` drafts per verify: SGLang's speculative_num_steps, the name the exporters read
    st.spec_args = {"method": str(spec.method), "num_speculative_tokens": steps,
                    "speculative_num_steps": steps}
    profile_sources, unfit = st.trained_sources()
    wiring = wiring_record(st.target, capture, st.draft, st.spec_args, version)
    findings = check_vllm_wiring(wiring, capture, st.draft_config, profile_sources)
    if unfit is not None:  # first: nothing was compared with training, so nothing blames the draft
        findings.insert(0, unfit)
    from hs_tracer.integrations.vllm import identity

    if use_aux and identity.graphs_note(runner.compilation_config, runner.device):
        st.identity_off = "cuda_graphs"  # replayed forwards are never sampled: the check reports it off
    st.finish_startup(wiring, findings)
    if use_aux and st.steps is not None:  # the emitting rank's tracer is running: measure the slots
        st.identity = identity.install(st, _body(runner.model), runner.compilation_config, runner.model)
        st.write_report()


def _body(model: Any) -> Any:
    """The model body that holds the aux layer ids (``EagleModelMixin``), found as vLLM's
    ``set_aux_hidden_state_layers`` finds it."""
    parent = model
    if hasattr(model, "get_language_model"):
        parent = model.get_language_model()
    elif hasattr(model, "language_model"):
        parent = model.language_model
    return getattr(parent, "model", parent)


def _resolved_layers(model: Any) -> list[int] | None:
    """The aux layer ids the target model holds (``EagleModelMixin.aux_hidden_state_layers``)."""
    layers = getattr(_body(model), "aux_hidden_state_layers", None)
    return None if layers is None else [int(v) for v in layers]


def _read_draft(draft: Any) -> dict[str, Any]:
    """What the loaded draft's input side expects: its class, the fc input width and aux-state count."""
    inner = getattr(draft, "model", draft)
    fc = getattr(inner, "fc", None)
    fc_in = getattr(fc, "input_size", None)
    if fc_in is None and getattr(fc, "weight", None) is not None:
        fc_in = int(fc.weight.shape[1])
    k = getattr(inner, "num_aux_hidden_states", getattr(inner, "num_aux_layers", None))
    return {"architecture": type(draft).__name__,
            "use_aux_hidden_state": bool(getattr(inner, "use_aux_hidden_state", True)),
            "fc_in_features": int(fc_in) if fc_in is not None else None,
            "num_aux_hidden_states": int(k) if k is not None else None,
            "norm_before_fc": bool(getattr(inner, "norm_before_fc", False))}


def _config_dict(hf_config: Any) -> dict[str, Any]:
    out = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
    out.pop("model", None)  # vLLM's EAGLE config wraps the draft's own config; its keys are copied up
    return out


# ---- per step --------------------------------------------------------------------------------------
@hook
def before_propose(st: TracerState, runner: Any, scheduler_output: Any, *_a: Any, **_k: Any) -> None:
    """The step whose drafts are proposed now: its SchedulerOutput carries the step number that the
    draft-input hook assigns to the scheduler's result processing; the rows at position 0 (the
    first row of each new request with nothing computed yet) are found on the host."""
    st.proposing = scheduler_output
    st.first_rows = _first_rows(runner, scheduler_output)


def _first_rows(runner: Any, scheduler_output: Any) -> list[int]:
    """Rows of this step's batch at position 0 (host lists only: the batch's request order and its
    query start offsets)."""
    new = [r.req_id for r in scheduler_output.scheduled_new_reqs if r.num_computed_tokens == 0]
    if not new:
        return []
    index, starts = runner.input_batch.req_id_to_index, runner.query_start_loc.np
    return sorted(int(starts[index[rid]]) for rid in new if rid in index)


def segments_without(rows: list[int], total: int) -> list[tuple[int, int]]:
    """``[0, total)`` without ``rows`` (sorted), as row ranges."""
    out, start = [], 0
    for row in rows:
        if row > start:
            out.append((start, min(row, total)))
        start = row + 1
    if start < total:
        out.append((start, total))
    return [(a, b) for a, b in out if a < b]


@hook
def before_combine_hidden_states(st: TracerState, _draft: Any, hidden_states: Any) -> None:
    """The ``[tokens, K*H]`` target states the draft's fc reads this step (prefill and decode rows
    of the batch): probe launches, numbered on the step's SchedulerOutput. The windows leave out the
    rows at position 0, as SGLang's and the profiles do (their statistics differ)."""
    steps, carrier = st.steps, st.proposing
    if steps is not None and carrier is not None:
        st.proposing = None  # one observation per step
        rows, st.first_rows = st.first_rows, []
        segments = segments_without(rows, int(hidden_states.shape[0])) if rows else None
        steps.observe_decode(hidden_states, carrier, segments=segments)


@hook
def after_spec_decoding_stats(st: TracerState, _result: Any, _scheduler: Any, _stats: Any = None,
                              num_draft_tokens: int = 0, num_accepted_tokens: int = 0,
                              num_invalid_spec_tokens: Any = None, request_id: str = "") -> None:
    """One request's verification this step, as vLLM counts it: accept length = accepted + 1."""
    if num_draft_tokens:
        st.pending.append((request_id, int(num_accepted_tokens) + 1))


@hook
def after_update_from_output(st: TracerState, _result: Any, _scheduler: Any, scheduler_output: Any,
                             *_a: Any, **_k: Any) -> None:
    """The step's accounting is complete: log its accept lengths under the step's number (here, or
    in the emitting worker's process: :func:`after_schedule`)."""
    pending = st.pending
    if not pending:
        return
    st.pending = []
    if st.steps is not None:
        _record(st, scheduler_output, pending)
    elif (seq := getattr(scheduler_output, STEP_SEQ, None)) is not None:  # the model runs elsewhere
        st.accounted.append((seq, pending))


@hook
def after_schedule(st: TracerState, scheduler_output: Any, _scheduler: Any, *_a: Any, **_k: Any) -> None:
    """A step leaves the core for the workers: its number, and the accept lengths accounted since
    the last step, ride on its ``SchedulerOutput`` (only where no model runs in this process)."""
    if st.steps is not None:
        return
    st.seq += 1
    setattr(scheduler_output, STEP_SEQ, st.seq)
    if st.accounted:
        setattr(scheduler_output, ACCOUNTED, list(st.accounted))
        st.accounted.clear()


@hook
def before_execute_model(st: TracerState, _runner: Any, scheduler_output: Any, *_a: Any, **_k: Any) -> None:
    """A worker receives a step: the emitting rank logs the accept lengths the core attached, each
    against its own step's ``SchedulerOutput`` (the object its draft-input hook numbered)."""
    if st.steps is None:
        return
    seq = getattr(scheduler_output, STEP_SEQ, None)
    if seq is not None:
        st.received[seq] = scheduler_output
        while len(st.received) > RECEIVED:
            st.received.pop(next(iter(st.received)))
    for step, pending in getattr(scheduler_output, ACCOUNTED, ()):
        carrier = st.received.pop(step, None)
        if carrier is not None:
            _record(st, carrier, pending)
        else:
            st.unjoined += 1


def _record(st: TracerState, carrier: Any, pending: list[tuple[str, int]]) -> None:
    steps = st.steps
    assert steps is not None
    reqs = [RequestRef(rid) for rid, _n in pending]
    lengths = [n for _rid, n in pending]
    num_draft = int(st.spec_args.get("num_speculative_tokens") or 0) + 1
    steps.record(carrier, reqs, lengths, num_draft, st.max_accept_length, settled=None)
