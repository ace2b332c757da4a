"""The hooks for SGLang releases with the V1 ``EAGLEWorker`` (the families in
:mod:`hs_tracer.integrations.sglang.releases` whose workers include V1), and those of their capture-config and
target-forward hooks that some later families share.

They feed the same tracer state, StepRecords and exports as the V2 hooks (:mod:`.hooks`), so
dashboards and alerts do not depend on the worker:

* startup: ``ModelRunner.init_aux_hidden_state_capture`` runs in the target runner (capture config
  and the target) and in the draft runner (the draft's config.json); ``EAGLEWorker.init_cuda_graphs``
  is the V1 worker's last startup step (the draft and the wiring record);
* per step, all Python outside CUDA graphs: the draft's input before ``forward_draft_extend`` (prefill,
  an argument) and before ``forward_draft_extend_after_decode`` (decode: the accepted tokens' states,
  which ``verify()`` left in ``batch.spec_info``); the accept lengths after
  ``forward_batch_generation``, from ``num_correct_drafts_per_req_cpu``: a host list that
  ``EagleVerifyInput.verify()`` already synchronised for SGLang's own bookkeeping, so reading it adds
  no device sync;
* capture metadata: this family's ``DeepseekV2Model.forward`` returns the aux states as a list;
* this family's V2 worker: its prefill's draft extend gets a ``ModelWorkerBatch`` whose lengths
  have other names than the newest release's (the other V2 hooks are the newest family's).

The V1 worker runs without the overlap scheduler: a step's draft extend and its result belong to
one ``forward_batch_generation`` call, so the step number rides on the batch for that call only.
``verify()`` has already committed every request of the batch (it marks those it finishes), so all
of them count.
"""

from __future__ import annotations

from typing import Any

from hs_tracer.core.steps import STEP_ATTR
from hs_tracer.integrations.sglang import hooks
from hs_tracer.integrations.sglang.draft_layout import read_draft
from hs_tracer.integrations.sglang.state import TracerState


# ---- startup (V1 and V2 workers of this family) -----------------------------------------------------
@hooks.hook
def after_init_aux_capture(st: TracerState, _result: Any, runner: Any) -> None:
    """Target runner: what it captures and from which configured ids. Draft runner: its config."""
    if getattr(runner, "is_draft_worker", False):
        st.draft_config = runner.model_config.hf_config.to_dict()
        return
    use_aux = bool(getattr(runner, "eagle_use_aux_hidden_state", False))
    st.aux = {
        "use_aux_hidden_state": use_aux,
        "layer_ids": hooks.int_list(getattr(runner, "eagle_aux_hidden_state_layer_ids", None))
        if use_aux else None,
    }
    hooks.read_target(st, runner)


@hooks.hook
def after_v1_init_cuda_graphs(st: TracerState, _result: Any, worker: Any, *_a: Any, **_k: Any) -> None:
    """The V1 worker's last startup step: the draft, the settings, then the wiring record."""
    st.draft = read_draft(worker.draft_model_runner.model)
    hooks.read_spec_args(st, worker)
    hooks.finish_startup(st, worker)


# ---- capture metadata ---------------------------------------------------------------------------------
@hooks.hook
def after_target_forward_list(st: TracerState, result: Any, model: Any, *_args: Any, **_kwargs: Any) -> None:
    """Which layers the target captured, in loop order, and their total width (a list of states);
    on a forward the identity sampler samples, its final-norm and slot rows (identity.py)."""
    sampler = st.identity
    if sampler is not None and sampler.active is not None and model is sampler.body:
        sampler.finish(result)
    if st.capture_seen >= st.CAPTURE_SAMPLES or not isinstance(result, tuple):
        return
    wanted = set(getattr(model, "layers_to_capture", ()) or ())
    order = [i for i in range(model.start_layer, model.end_layer) if i in wanted]
    st.note_capture(order, sum(int(t.shape[-1]) for t in result[1]))


# ---- per step (V1 worker) -----------------------------------------------------------------------------
@hooks.hook
def before_v1_draft_extend(st: TracerState, _worker: Any, batch: Any, hidden_states: Any,
                           next_token_ids: Any = None, *_a: Any, **_k: Any) -> None:
    """Prefill: the [extend_tokens, K*H] features the draft extend reads (and a sampled copy)."""
    if st.steps is None:
        return
    st.steps.observe_prefill(hidden_states, batch.prefix_lens, batch.extend_lens)
    st.capture_prefill(batch, hidden_states, next_token_ids)


@hooks.hook
def before_v2_draft_extend_for_prefill(st: TracerState, _worker: Any, batch: Any, target_hidden_states: Any,
                                       next_token_ids: Any = None, *_a: Any, **_k: Any) -> None:
    """Prefill on this family's V2 worker, whose batch (a ``ModelWorkerBatch``) keeps the lengths as
    ``extend_prefix_lens``/``extend_seq_lens``; an idle DP-attention rank's batch has none."""
    if st.steps is None or batch.extend_seq_lens is None:
        return
    st.steps.observe_prefill(target_hidden_states, batch.extend_prefix_lens, batch.extend_seq_lens)
    st.capture_prefill(batch, target_hidden_states, next_token_ids, batch.extend_prefix_lens,
                       batch.extend_seq_lens)


@hooks.hook
def before_v1_draft_extend_after_decode(st: TracerState, _worker: Any, batch: Any,
                                        *_a: Any, **_k: Any) -> None:
    """Decode: the accepted tokens' [accepted, K*H] features the draft extend is about to read; the
    step number goes onto the batch until this step's result hook reads it."""
    if st.steps is not None:
        st.steps.observe_decode(batch.spec_info.hidden_states, batch)


@hooks.hook
def after_v1_forward_batch_generation(st: TracerState, result: Any, _worker: Any, batch: Any,
                                      *_a: Any, **_k: Any) -> None:
    """A decode step's accept lengths (correct drafts + the bonus token), already on the host."""
    _record_v1(st, batch, getattr(result, "num_correct_drafts_per_req_cpu", None))


@hooks.hook
def after_v1_forward_batch_generation_accepted_drafts(st: TracerState, result: Any, _worker: Any, batch: Any,
                                                      *_a: Any, **_k: Any) -> None:
    """:func:`after_v1_forward_batch_generation` where the result names them
    ``num_accepted_drafts_per_req_cpu`` (the oldest family)."""
    _record_v1(st, batch, getattr(result, "num_accepted_drafts_per_req_cpu", None))


def _record_v1(st: TracerState, batch: Any, correct: Any) -> None:
    if st.steps is None or correct is None:  # a prefill (or idle) batch: nothing was verified
        return
    try:
        st.steps.record(batch, batch.reqs, [int(c) + 1 for c in correct],
                        num_draft_tokens=_num_draft_tokens(st),
                        max_accept_length=st.max_accept_length, settled=None)  # V1 commits all it verified
    finally:
        setattr(batch, STEP_ATTR, None)  # the batch object lives on; the next step stamps its own


# ---- per step (the oldest family's V2 worker) ---------------------------------------------------
@hooks.step_hook
def after_resolve_spec_overlap_token_ids(st: TracerState, _tokens: Any, processor: Any, result: Any,
                                         batch: Any) -> None:
    """:func:`.hooks.after_resolve_spec_v2_tokens` on the oldest family, whose result carries no draft-token
    count (its scheduler reads the worker's setting, as here)."""
    steps = st.steps
    if steps is not None:
        steps.record(result, batch.reqs, result.accept_lens, _num_draft_tokens(st), st.max_accept_length,
                     settled=hooks.request_settled, processor=processor)


def _num_draft_tokens(st: TracerState) -> int:
    return int(st.spec_args.get("speculative_num_draft_tokens", 0) or 0)
