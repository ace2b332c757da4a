"""Records passed from the engine hooks to the background recorder and the exporters.

They are plain data (no tensors, no references to engine objects) so they can cross a queue, be
exported, or be written to disk without keeping GPU memory alive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hs_tracer import engines
from hs_tracer.fingerprint.stats import StepDigest

# The one engine before records named theirs: JSON without an ``engine`` key, and the deprecated
# ``sglang_version`` key, are its.
_LEGACY_ENGINE = engines.DEFAULT


@dataclass(frozen=True)
class Ranks:
    """One scheduler's place: ``dp`` is the data-parallel replica (SGLang's ``dp_rank``, 0 without a
    DP controller), ``attn_dp`` the attention-DP rank inside the replica (``--enable-dp-attention``).
    With ``--dp-size N`` and no DP attention every replica has attention-DP rank 0: only ``dp``
    tells them apart."""

    tp: int = 0
    pp: int = 0
    dp: int = 0
    attn_dp: int = 0

    def labels(self) -> dict[str, str]:
        return {"tp_rank": str(self.tp), "pp_rank": str(self.pp), "dp_rank": str(self.dp),
                "attn_dp_rank": str(self.attn_dp)}


@dataclass
class WiringRecord:
    """How the target's hidden states are wired into the draft in this process, read at startup.

    ``sources`` are canonical (``embedding``, ``block:<j>``, ``final_norm``) per slot, in slot order.
    """

    model: str
    target_arch: str
    num_layers: int
    hidden_size: int
    layers_to_capture: list[int]
    sources: list[str]
    configured_layer_ids: list[int] | None = None
    draft_fc_in_features: int | None = None
    draft_num_aux_states: int | None = None
    draft_graph_width: int | None = None
    use_aux_hidden_state: bool | None = None
    spec_args: dict[str, Any] = field(default_factory=dict)
    # The serving engine (its registry name, hs_tracer.engines) and its release; ``layers_to_capture``
    # is the engine's own capture list in the C_in convention (SGLang's layers_to_capture, vLLM's aux
    # layer ids).
    engine: str = engines.DEFAULT
    engine_version: str = ""
    # Where the engine read the layer ids it captures (vLLM: the config key, its adapter's layer_ids.VLLM_*;
    # "" for an engine that reads them from one fixed place).
    layer_id_source: str = ""
    # The engine release whose layer-id rules apply: engine_version, or for a release newer than
    # every one hs_tracer lists, the newest listed one (its guard checked the rule is the same);
    # "": engine_version.
    layer_id_rules: str = ""

    @property
    def sglang_version(self) -> str:
        """Deprecated alias of ``engine_version`` under SGLang ("" under any other engine): the
        status file, capture manifests and the ``wiring_info`` metric still carry it."""
        return self.engine_version if self.engine == _LEGACY_ENGINE else ""

    def to_json(self) -> dict[str, Any]:
        """The record as JSON, with the deprecated keys ``sglang_version`` and ``layer_ids_key``
        beside the neutral ones so readers of the old keys keep working."""
        return {**dataclasses.asdict(self), "sglang_version": self.sglang_version,
                "layer_ids_key": self.layer_id_source}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WiringRecord:
        """A record from :meth:`to_json`'s output, or from JSON written before the engine-neutral
        keys (``sglang_version`` without ``engine_version``, ``layer_ids_key``)."""
        d = dict(data)
        old_version = d.pop("sglang_version", "")
        old_source = d.pop("layer_ids_key", "")
        if old_version and not d.get("engine_version") and d.get("engine", _LEGACY_ENGINE) == _LEGACY_ENGINE:
            d["engine_version"] = old_version
        if old_source and not d.get("layer_id_source"):
            d["layer_id_source"] = old_source
        return cls(**d)

    @property
    def expected_width(self) -> int:
        return len(self.sources) * self.hidden_size


@dataclass
class StepRecord:
    """One verify step of one scheduler: accept lengths (incl. the bonus token) and the step digest."""

    step: int
    time_unix_ns: int
    ranks: Ranks
    request_ids: list[str]
    accept_lengths: list[int]
    num_draft_tokens: int
    digest: StepDigest | None = None
    input_width: int | None = None
    # SGLang's per-request trace contexts (aligned with accept_lengths), for request-trace events.
    # Engine objects: the recorder hands them to the OTel exporter and never exports them itself.
    trace_ctxs: list[Any] = field(default_factory=list, repr=False, compare=False)
    # The longest accept length this step can have (speculative_num_steps + 1): with topk > 1 the
    # tree holds more draft tokens than positions that can be accepted.
    max_accept_length: int | None = None
    host_overhead_s: float = 0.0  # host time in the per-step hooks since the previous record
