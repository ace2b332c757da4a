"""The fake engine's layer-id rule and its one static check: it captures the ids at the top level of
the draft's config (input of layer k, C_in), by default the first, middle and last layer; the draft's
``fc`` takes ``num_aux_hidden_states`` states (default: as many as the ids)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hs_tracer import sources
from hs_tracer.findings import Code, Finding, Severity
from hs_tracer.records import WiringRecord
from tests.fake_engine import NAME, RELEASE


def layer_ids(draft_config: Mapping[str, Any], num_layers: int) -> list[int]:
    return list(draft_config.get("eagle_aux_hidden_state_layer_ids") or [1, num_layers // 2, num_layers - 1])


def draft_states(draft_config: Mapping[str, Any], num_layers: int) -> int:
    return int(draft_config.get("num_aux_hidden_states") or len(layer_ids(draft_config, num_layers)))


def record(arch: str, num_layers: int, hidden: int, ids: Sequence[int], fc_in: int) -> WiringRecord:
    return WiringRecord(
        model="fake-target", target_arch=arch, num_layers=num_layers, hidden_size=hidden,
        layers_to_capture=list(ids),
        sources=[str(s) for s in sources.to_sources(ids, sources.Convention.EAGLE, num_layers)],
        configured_layer_ids=list(ids), draft_fc_in_features=fc_in, draft_num_aux_states=fc_in // hidden,
        use_aux_hidden_state=True, spec_args={"speculative_num_steps": 3, "speculative_num_draft_tokens": 4},
        engine=NAME, engine_version=RELEASE)


def check(w: WiringRecord) -> list[Finding]:
    fed = len(w.sources) * w.hidden_size
    if w.draft_fc_in_features is None or fed == w.draft_fc_in_features:
        return []
    return [Finding(Code.DRAFT_INPUT_WIDTH_MISMATCH, Severity.CRITICAL,
                    f"the engine feeds the draft {len(w.sources)} states ({fed} wide); its fc takes "
                    f"{w.draft_fc_in_features}", "list as many layer ids as the draft's fc takes states",
                    expected=str(w.draft_fc_in_features), observed=str(fed))]
