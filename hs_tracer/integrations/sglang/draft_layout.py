"""What hs_tracer reads from a loaded EAGLE-3 draft model, for each SGLang draft class.

SGLang's two EAGLE-3 draft classes are built differently, and differently in each release family
(their layouts are the family's ``draft_layouts`` in :mod:`hs_tracer.integrations.sglang.releases`):
``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``) has an ``nn.Linear`` fc (``in_features``)
and optional norms (``input_norm`` over K*H, ``fc_norm``); Kimi-K2.5's MLA draft
``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``) has, in the newest families,
SGLang's ``ColumnParallelLinear`` (``input_size``, no ``in_features``) and ``fc_norm`` only.

Each attribute a layout names is read strictly (a missing one raises, and the hook's guard turns
tracing off with the name in the log), so a layout that drifts from SGLang's class is caught by
the tests that build every supported class for real, not by a silent ``None`` in production. A
draft class its family does not list is read leniently: what is missing is reported as unknown.
"""

from __future__ import annotations

from typing import Any

from hs_tracer.integrations.sglang import versions
from hs_tracer.integrations.sglang.releases import FAMILIES, is_untested, release_of
from hs_tracer.integrations.sglang.releases.adapter import DraftLayout


def installed_layouts() -> dict[str, DraftLayout]:
    """The draft classes' layouts of the installed SGLang release (the newest family's newest
    without a supported one, or for a release newer than every known one, as its version guard
    checks it against the newest family)."""
    family, version = versions.installed_family(), versions.installed_version()
    if family is None or version is None or is_untested(version):
        return dict(FAMILIES[0].layouts_of(None))
    return dict(family.layouts_of(release_of(version)))


_ALL_NORMS = ("input_norm", "fc_norm")
_WIDTH_ATTRS = ("in_features", "input_size")


def read_draft(draft: Any) -> dict[str, Any]:
    """The draft's fc input width, aux-state count, norms and draft vocabulary size (the installed
    SGLang release's layout of the draft's class)."""
    arch = type(draft).__name__
    layout = installed_layouts().get(arch)
    body = draft.model
    fc = body.fc
    if layout is not None:
        width: int | None = int(getattr(fc, layout.fc_width))
        num_aux = int(body.num_aux_hidden_states)
        norms = {name: getattr(body, name) is not None for name in layout.norms}
    else:
        found = next((getattr(fc, a) for a in _WIDTH_ATTRS if hasattr(fc, a)), None)
        width = int(found) if found is not None else None
        aux = getattr(body, "num_aux_hidden_states", None)
        num_aux = int(aux) if aux is not None else None
        norms = {name: getattr(body, name, None) is not None for name in _ALL_NORMS}
    hot = draft.hot_token_id
    return {
        "architecture": arch,
        "fc_in_features": width,
        "num_aux_hidden_states": num_aux,
        "fc_norm": norms.get("fc_norm", False),
        "input_norm": norms.get("input_norm", False),
        "draft_vocab_size": int(hot.numel()) if hot is not None else None,
    }
