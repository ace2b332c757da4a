"""Per-process tracer state inside SGLang, over the engine-neutral one (:mod:`hs_tracer.core.state`),
and the guard SGLang's hooks run under.

One :class:`TracerState` per scheduler process. The hooks hand it what they read from SGLang; it
keeps the wiring, owns the fingerprint probes (built before SGLang captures its graphs), builds the
step path (:mod:`hs_tracer.core.steps`) and starts the background
:class:`~hs_tracer.core.recorder.Recorder` that exports and diagnoses off the scheduler thread.

A hook that raises is counted, logged once and switches the tracer off; SGLang's own call then
proceeds exactly as if hs_tracer were not there. Under torch.compile the hooks fold away
(:func:`guarded`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from hs_tracer import sources
from hs_tracer.config import TracerConfig
from hs_tracer.core import state as core
from hs_tracer.core.recorder import Recorder
from hs_tracer.core.steps import StepPath
from hs_tracer.export.capture import make_sink
from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.integrations.sglang import NAME, versions
from hs_tracer.integrations.sglang.releases import FAMILIES, family_for, rules_release
from hs_tracer.records import Ranks, WiringRecord
from hs_tracer.static_checks import wiring as static

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.identity import IdentitySampler

logger = logging.getLogger("hs_tracer")

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class TracerState(core.TracerState):
    """SGLang's scheduler process: what its startup hooks read, its probes, capture and identity sampling."""

    target_logits_processor: Any = None
    target_device: Any = "cpu"  # torch.device of the target's outputs
    target_dtype: Any = None  # torch dtype the target computes in (the probe is warmed for it)
    captured_layers: list[list[int]] = field(default_factory=list)  # per sampled target forward
    capture_widths: list[int] = field(default_factory=list)
    handoff_widths: list[int] = field(default_factory=list)
    identity: IdentitySampler | None = None  # HS_TRACER_IDENTITY_EVERY: layer identity (identity.py)
    _probes: tuple[FingerprintProbe | None, FingerprintProbe | None] | None = None  # (decode, prefill)
    # Facts of the installed SGLang, read once by install(): reading a distribution's metadata
    # scans sys.path (~1 ms a call), far too slow for status(), which the recorder thread calls
    # every few seconds in the scheduler process while holding its GIL.
    sglang_version: str = ""
    own_targets: frozenset[str] = frozenset()  # the targets of the installed family's hooks

    CAPTURE_SAMPLES: ClassVar[int] = 8  # capture-metadata calls recorded (then the hook returns at once)

    @property
    def max_accept_length(self) -> int | None:
        steps = self.spec_args.get("speculative_num_steps")
        return steps + 1 if steps else None

    @property
    def capture_seen(self) -> int:
        return len(self.capture_widths)

    @property
    def handoff_widths_seen(self) -> int:
        return len(self.handoff_widths)

    # ---- failure -----------------------------------------------------------------------------------
    def tp_rank(self) -> int:
        """This process's TP rank, for a fault that names one: the ranks read at startup (SGLang's
        runtime context read later, inside a step, can be another scope's), or read now by a
        startup hook that runs before they are."""
        return (self.ranks or _ranks()[0]).tp

    # ---- startup -----------------------------------------------------------------------------------
    def note_capture(self, layers: list[int], width: int) -> None:
        self.captured_layers.append(layers)
        self.capture_widths.append(width)

    def note_handoff_width(self, width: int) -> None:
        self.handoff_widths.append(width)

    def finish_startup(self) -> None:
        """All startup hooks have run: build the wiring record, run the static checks, start
        the recorder."""
        was_emitting = self._probes is not None and self.emitting
        self.ranks, self.emitting = _ranks()
        self.role = _role()
        t = self.target
        self.wiring = wiring_record(t, self.aux, self.draft, self.spec_args, self.sglang_version)
        live = static.wiring_from_record(self.wiring)
        live = static.with_draft_config(live, self.draft_config)
        trained, unfit = None, None
        if self.config.profile is not None:
            trained, unfit = self.trained_sources()
        self.static_findings = static.check_wiring(live, trained)
        if unfit is not None:  # first: nothing was compared with training, so nothing blames the draft
            self.static_findings.insert(0, unfit)
        self.log_startup_findings()
        if self.emitting:
            # the line that proves the startup hooks ran (docs/deploy.md quotes it)
            r = self.ranks
            logger.info("hs_tracer: tracing on (tp %d, pp %d, dp %d): %s feeds the draft %s; %d startup "
                        "finding(s)", r.tp, r.pp, r.dp, self.wiring.target_arch,
                        ", ".join(self.wiring.sources) or "no aux hidden states", len(self.static_findings))
            decode, prefill = self._probes if self._probes is not None else self._make_probes()
            self.steps = StepPath(decode, prefill, self.config.window_tokens, self.ranks,
                                  self.config.queue_size)
            if self.config.capture_dir is not None:
                self.capture = make_sink(self.config.capture_dir, self.wiring, self.config.capture_rate,
                                         self.config.capture_max_bytes, self.ranks, t.get("model_path"))
            self.recorder = Recorder(self)
            self.recorder.start()
        elif was_emitting and self._probes[0] is not None:  # built on a rank that turned out not to emit
            self._probes[0].stop_in_graph("this rank does not emit")
        self.write_report()

    def prepare_probes(self) -> None:
        """Build the probes as soon as the target is known: before SGLang captures the target's CUDA
        graphs, which the decode probe records its kernel into (:meth:`record_in_graph`). Only where
        the target captures aux hidden states for an EAGLE-3 draft: any other server builds them, if
        it has a draft at all, when startup finishes."""
        if self._probes is not None or not self.target or not self.aux.get("use_aux_hidden_state"):
            return
        self.ranks, self.emitting = _ranks()
        self.role = _role()
        self._probes = self._make_probes() if self.emitting else (None, None)

    def record_in_graph(self, logits: Any, batch: Any) -> None:
        """The target's logits processor returned ``logits`` for ``batch`` (SGLang's ForwardBatch):
        if SGLang is capturing a target-verify graph, record the decode probe's kernel into it, over
        the draft input it hands over, reading the rows whose KV-cache slot is non-zero."""
        probe = self._probes[0] if self._probes is not None else None
        if probe is None or not self.config.in_graph:
            return
        # A tree (topk > 1) hands the draft the accepted path's rows, gathered into a new tensor: not
        # this graph's output. (The drain would notice and switch the recorded kernel off.)
        if int(self.spec_args.get("speculative_eagle_topk") or 1) > 1:
            return
        mode = getattr(batch, "forward_mode", None)
        if mode is None or not mode.is_target_verify():
            return
        hidden, slots = getattr(logits, "hidden_states", None), getattr(batch, "out_cache_loc", None)
        if isinstance(hidden, torch.Tensor) and isinstance(slots, torch.Tensor):
            probe.record_in_graph(hidden, slots)

    def _make_probes(self) -> tuple[FingerprintProbe | None, FingerprintProbe | None]:
        """The decode and prefill probe (one and the same on a combined instance), built and
        warmed now (the Triton kernel compiled for the model's dtype, buffers allocated) so the
        first request compiles and synchronises nothing. Sized for the width the target hands
        over: K*H with aux states, else H."""
        wiring = self.wiring or wiring_record(self.target, self.aux, {}, {}, self.sglang_version)
        hidden = wiring.hidden_size
        slots = len(wiring.sources) if self.aux.get("use_aux_hidden_state", True) else 1
        if hidden <= 0 or slots <= 0:
            return None, None
        device, dtype = self.target_device, self.target_dtype
        probe = FingerprintProbe(slots, hidden, device, ring_size=self.RING_SIZE, warmup_dtype=dtype)
        if self.role == "prefill":
            return None, probe
        if self.role == "decode":
            return probe, None
        return probe, probe  # combined instance: one window stream (core/steps.py says which rows)

    def capture_prefill(self, batch: Any, features: Any, next_token_ids: Any, prefix_lens: Any = None,
                        extend_lens: Any = None) -> None:
        """Offer a prefill's draft input to the capture sink (sampling + async host copy only). The
        lengths default to the batch's ``prefix_lens``/``extend_lens``."""
        if self.capture is None or features is None:
            return
        self.capture.offer_prefill(features, batch.input_ids, next_token_ids,
                                   batch.prefix_lens if prefix_lens is None else prefix_lens,
                                   batch.extend_lens if extend_lens is None else extend_lens,
                                   tail_tokens=lambda: _tail_tokens(batch, next_token_ids))

    # ---- reporting ---------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        from sglang.srt.plugins.hook_registry import HookRegistry

        out: dict[str, Any] = {
            "pid": os.getpid(),
            "enabled": self.enabled,
            "emitting": self.emitting,
            "hook_errors": self.hook_errors,
            "disabled_reason": self.disabled_reason,
            "dropped_records": self.dropped,
            "hooks_applied": sorted(t for t in HookRegistry._patched if t in self.own_targets),
            "target": self.target,
            "draft": self.draft,
            "capture": {
                "layers_in_order": self.captured_layers[-1] if self.captured_layers else None,
                "aux_widths": sorted(set(self.capture_widths)),
                "handoff_widths": sorted(set(self.handoff_widths)),
            },
            "wiring": self.wiring_json(),
            "ranks": core.asdict_or_none(self.ranks),
            "role": self.role,
            "probes": None if self.steps is None else {
                "decode": self.steps.decode is not None, "prefill": self.steps.prefill is not None,
                "decode_steps": self.steps.decode_steps, "prefill_steps": self.steps.prefill_steps,
                "launches": self.steps.launch_counts()},
            "export": None if self.recorder is None else self.recorder.where(),
            "recorder_thread_cpu_s": None if self.recorder is None else self.recorder.cpu_json(),
            "capture_sink": None if self.capture is None else {
                "path": str(self.capture.path), "written": self.capture.written,
                "dropped": self.capture.dropped, "stopped": self.capture.stopped},
            "identity": None if self.identity is None else self.identity.status(),
        }
        return self.with_diagnosis(out)


def wiring_record(target: dict[str, Any], aux: dict[str, Any], draft: dict[str, Any],
                  spec_args: dict[str, Any], sglang_version: str) -> WiringRecord:
    """The wiring record from what the startup hooks read (a pure function of its arguments):
    ``target`` from the target model runner, ``aux`` the resolved capture config, ``draft`` what
    the loaded draft expects, ``spec_args`` the speculative settings, ``sglang_version`` the
    installed release (recorded; the diagnosis applies its layer-id rules)."""
    family = sources.family_of(target["architecture"])
    rules = rules_release(sglang_version or None)
    captured = sources.sglang_capture(target["layers_to_capture"], target["num_layers"], family,
                                      engine_version=rules)
    return WiringRecord(
        model=os.path.basename(str(target.get("model_path", "")).rstrip("/")) or target["architecture"],
        target_arch=target["architecture"],
        num_layers=target["num_layers"],
        hidden_size=target["hidden_size"],
        layers_to_capture=target["layers_to_capture"],
        sources=list(captured.sources),
        configured_layer_ids=aux.get("layer_ids"),
        draft_fc_in_features=draft.get("fc_in_features"),
        draft_num_aux_states=draft.get("num_aux_hidden_states"),
        draft_graph_width=draft.get("graph_width"),
        use_aux_hidden_state=aux.get("use_aux_hidden_state"),
        spec_args=dict(spec_args),
        engine=NAME,
        engine_version=sglang_version,
        layer_id_rules=rules if rules and rules != sglang_version else "",
    )


def _ranks() -> tuple[Ranks, bool]:
    """This process's ranks, and whether it emits (attention-TP rank 0 only: TP ranks see the same
    tensors). Read lazily: SGLang publishes them after the plugin loads. ``dp_rank`` is None
    without a DP controller."""
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # releases before SGLang's runtime context
        return _ranks_before_runtime_context()

    try:
        par = get_parallel()
    except ValueError:  # not published (yet) in this process: a single rank
        return Ranks(), True

    def rank(name: str) -> int:
        try:
            return int(getattr(par, name) or 0)
        # not published in this configuration; the first releases with a runtime context read
        # parallel_state, which asserts
        # when a group is not initialised
        except (AssertionError, AttributeError, KeyError, RuntimeError):
            return 0

    ranks = Ranks(tp=rank("tp_rank"), pp=rank("pp_rank"), dp=rank("dp_rank"), attn_dp=rank("attn_dp_rank"))
    return ranks, rank("attn_tp_rank") == 0


def _ranks_before_runtime_context() -> tuple[Ranks, bool]:
    """:func:`_ranks` on releases whose ranks live in ``parallel_state`` / ``dp_attention``;
    their scheduler keeps the replica index in its ``dp_rank`` argument only, so it reads as 0."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention as dpa

    def rank(read: Any) -> int:
        try:
            return int(read() or 0)
        except (AssertionError, AttributeError, RuntimeError):  # not initialised in this configuration
            return 0

    ranks = Ranks(tp=rank(ps.get_tensor_model_parallel_rank), pp=rank(ps.get_pipeline_model_parallel_rank),
                  dp=0, attn_dp=rank(dpa.get_attention_dp_rank))
    return ranks, rank(dpa.get_attention_tp_rank) == 0


def _tail_tokens(batch: Any, next_token_ids: Any) -> Any:
    """The token SGLang's draft extend appends after each request's prompt rows (for a non-final
    chunk of a chunked prefill: the next prompt token), computed by SGLang's own helper. Releases
    without that helper append the sampled next token to every request, as done here."""
    if next_token_ids is None:
        return None
    try:
        from sglang.srt.speculative.eagle_utils import _eagle_prefill_tail_tokens
    except ImportError:
        return next_token_ids
    return _eagle_prefill_tail_tokens(batch, next_token_ids)


def _role() -> str:
    """This instance's role under prefill/decode disaggregation (``--disaggregation-mode``)."""
    try:
        from sglang.srt.runtime_context import get_disagg
    except ImportError:  # releases before SGLang's runtime context: the server args
        from sglang.srt.server_args import get_global_server_args

        return str(getattr(get_global_server_args(), "disaggregation_mode", None) or "null")
    try:
        disagg = get_disagg()
    except ValueError:  # not published in this process: no disaggregation
        return "null"
    return str(getattr(disagg, "disaggregation_mode", None) or "null")


SLOT: core.Slot[TracerState] = core.Slot()


def install(cfg: TracerConfig) -> TracerState:
    """The process's tracer state, with the installed SGLang's version and its family's hook
    targets read here, once (never on a periodic path: see :attr:`TracerState.own_targets`)."""
    version = versions.installed_version()
    family = family_for(version) or FAMILIES[0]  # the newest family's without a supported release
    return SLOT.install(TracerState(cfg, sglang_version=version or "",
                                    own_targets=frozenset(h.target for h in family.hooks)))


def current() -> TracerState | None:
    return SLOT.state


def _compiling() -> bool:
    """True while torch.compile's Dynamo traces the code calling a hook.

    SGLang's piecewise compiled prefill (``--enable-piecewise-cuda-graph``, torch.compile of the
    model body) traces ``DeepseekV2Model.forward`` and with it the HookRegistry wrapper around it.
    Dynamo evaluates ``torch.compiler.is_compiling()`` as the constant True, so the hook folds away
    before it reads any tracer state: no graph break, no guard on that state (a guard would
    recompile the body every time the state changes), nothing recorded from inside the graph. The
    capture metadata then comes from the eager forwards (graph capture, warmup, decode)."""
    return torch.compiler.is_compiling()


def guarded(where: str, traceable: bool = True) -> Callable[[F], F]:
    """Run a hook only while tracing is on; turn any exception into :meth:`TracerState.fail`.

    The wrapped hook returns ``None`` on every path: SGLang's HookRegistry treats that as "no
    change", so a hook can never alter SGLang's arguments or results. ``traceable=False`` for the
    per-step hooks, which run in the scheduler's own Python and never under torch.compile: they
    skip that check (no extra call on every step).
    """

    def decorate(fn: F) -> F:
        guard = SLOT.guarded(where)(fn)
        if not traceable:
            return guard

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            if _compiling():  # traced by torch.compile (piecewise prefill): invisible to Dynamo
                return None
            return guard(*args, **kwargs)

        wrapper.__hs_tracer_where__ = where  # type: ignore[attr-defined]  # the name faults are injected by
        return wrapper  # type: ignore[return-value]

    return decorate
