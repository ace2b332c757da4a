"""What hs_tracer reads from a loaded EAGLE-3 draft model, for each SGLang draft class.

SGLang 0.5.23 has two EAGLE-3 draft classes and they are built differently:

* ``LlamaForCausalLMEagle3`` (``models/llama_eagle3.py``): ``model.fc`` is a ``torch.nn.Linear``
  (``in_features``); optional ``model.input_norm`` (RMSNorm over K*H) and ``model.fc_norm``.
* ``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``, Kimi-K2.5's MLA draft):
  ``model.fc`` is SGLang's ``ColumnParallelLinear`` (``input_size``, no ``in_features``); it has
  ``model.fc_norm`` but no ``input_norm`` at all.

Each attribute a layout names is read strictly (a missing one raises, and the hook's guard turns
tracing off with the name in the log), so a layout that drifts from SGLang's class is caught by
the tests that build every supported class for real, not by a silent ``None`` in production. A
draft class not listed here is read leniently: what is missing is reported as unknown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DraftLayout:
    """Where one draft class keeps what the startup hook reads (attribute names on ``.model``)."""

    fc_width: str  # the fc's input-width attribute
    norms: tuple[str, ...]  # optional norm modules the class defines (None when disabled)


LAYOUTS: dict[str, DraftLayout] = {
    "LlamaForCausalLMEagle3": DraftLayout(fc_width="in_features", norms=("input_norm", "fc_norm")),
    "Eagle3DeepseekV2ForCausalLM": DraftLayout(fc_width="input_size", norms=("fc_norm",)),
}

# Older releases' classes differ, and on other releases than the hook families do (the layouts of
# the newest release at or before the installed one apply): LlamaForCausalLMEagle3 has fc_norm but
# no input_norm attribute at all before 0.5.17, and 0.5.11's has neither norm nor
# num_aux_hidden_states; 0.5.12's Eagle3DeepseekV2ForCausalLM (an nn.Linear fc, no fc_norm, no
# num_aux_hidden_states) is read leniently; in 0.5.13 and 0.5.14 that class has fc_norm and
# num_aux_hidden_states with an nn.Linear fc (in_features), from 0.5.15 on a ColumnParallelLinear.
_LLAMA_FC_NORM_ONLY = DraftLayout(fc_width="in_features", norms=("fc_norm",))
LAYOUTS_SINCE: tuple[tuple[str, dict[str, DraftLayout]], ...] = (
    ("0.5.17", LAYOUTS),
    ("0.5.15", {**LAYOUTS, "LlamaForCausalLMEagle3": _LLAMA_FC_NORM_ONLY}),
    ("0.5.13", {"LlamaForCausalLMEagle3": _LLAMA_FC_NORM_ONLY,
                "Eagle3DeepseekV2ForCausalLM": DraftLayout(fc_width="in_features", norms=("fc_norm",))}),
    ("0.5.12", {"LlamaForCausalLMEagle3": _LLAMA_FC_NORM_ONLY}),
    ("0.5.11", {}),
)


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))


def installed_layouts() -> dict[str, DraftLayout]:
    """The draft classes' layouts of the installed SGLang release (a release newer than every known
    one: the newest layouts, as its version guard checks it against the newest family)."""
    from hs_tracer.integrations.sglang.versions import installed_family, installed_version, release_of

    version = installed_version()
    if version is None or installed_family() is None:
        return LAYOUTS
    release = _key(release_of(version))
    return next((layouts for since, layouts in LAYOUTS_SINCE if _key(since) <= release), LAYOUTS)


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
