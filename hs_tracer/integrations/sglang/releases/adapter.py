"""What one SGLang release family's adapter says about it: data only, no SGLang import.

A family is a group of releases whose internals agree. Its adapter module (``v0_5_22.py``, ...)
builds one :class:`SGLangFamily`, an :class:`~hs_tracer.release_table.ReleaseFamily`: the hooks
(target, handler, phase, what they read), the layer-id rules its ``set_eagle3_layers_to_capture``
applies, the layout of its EAGLE-3 draft classes, the scheduler entry that loads plugins and the
keys of its per-request speculative counters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from hs_tracer import release_table


@dataclass(frozen=True)
class LayerIdRules:
    """How a family's ``set_eagle3_layers_to_capture`` and model loops turn draft-config ids into
    what the target captures, where they differ between releases (the other rules never did)."""

    deepseek_first_id_rule: bool  # DeepSeek family: +1 only when ids[0] == 1 (else +1 to every id)
    gpt_oss_final_boundary: bool  # gpt-oss: ids kept when max(ids) == N, id N captured at the final norm
    deepseek_packer: bool  # DeepSeek family: fewer captures than ids raise at the first forward
    # DeepSeek family: the model loop captures a layer's input as ``hidden_states + residual`` before
    # the layer runs, and before layer 0 the residual is still None: a captured layer 0 raises a
    # TypeError at the first forward (later releases capture inside the layer).
    deepseek_layer_0_raises: bool


@dataclass(frozen=True)
class DraftLayout:
    """Where one draft class keeps what the startup hook reads (attribute names on ``.model``)."""

    fc_width: str  # the fc's input-width attribute
    norms: tuple[str, ...]  # optional norm modules the class defines (None when disabled)


@dataclass(frozen=True)
class MetaCounters:
    """The keys of SGLang's own per-request speculative counters in a response's ``meta_info``: the
    tests and benchmarks compare hs_tracer's counts with them, and a release renamed them."""

    accepted_drafts: str = "spec_num_correct_drafts"  # accepted draft tokens over the request
    accept_histogram: str = "spec_correct_drafts_histogram"  # verify steps per accepted-draft count


@dataclass(frozen=True)
class SGLangFamily(release_table.ReleaseFamily):
    """Releases whose hook targets, signatures, scheduler entry, layer-id rules and draft classes agree."""

    workers: tuple[str, ...]  # EAGLE-3 workers the release ships, default first
    scheduler_entry: tuple[str, str]  # (module, function) that starts a scheduler and loads plugins
    layer_id_rules: LayerIdRules
    # Draft class name -> layout; a class not listed is read leniently (what is missing is unknown).
    draft_layouts: Mapping[str, DraftLayout]
    # The environment that makes an EAGLE-3 engine of this release run a worker other than its
    # default (topk 1); the default worker needs none.
    worker_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # Older releases without a plugin system whose layer-id rules are this family's: ``hs-tracer
    # check --sglang-version`` accepts them; nothing traces them.
    check_only: tuple[str, ...] = ()
    # Where a release inside the family changed a draft class (its hooks did not change):
    # (first release, the layouts from it on), newest first.
    draft_layouts_from: tuple[tuple[str, Mapping[str, DraftLayout]], ...] = ()
    # Where a release inside the family changed a model loop (its hooks did not change):
    # (first release, the layer-id rules from it on), newest first.
    layer_id_rules_from: tuple[tuple[str, LayerIdRules], ...] = ()
    # Its responses' counter keys (the defaults: 0.5.12 on).
    meta_counters: MetaCounters = MetaCounters()

    def hooks_for(self, worker: str) -> tuple[release_table.Hook, ...]:
        return tuple(h for h in self.hooks if h.worker in ("", worker))

    def layouts_of(self, release: str | None) -> Mapping[str, DraftLayout]:
        """The draft layouts of one of the family's releases (``.postN`` stripped; None: its newest)."""
        for first, layouts in self.draft_layouts_from:
            if release is None or _key(first) <= _key(release):
                return layouts
        return self.draft_layouts

    def rules_of(self, release: str | None) -> LayerIdRules:
        """The layer-id rules of one of the family's releases, or of an older release it covers
        (``check_only``; ``.postN`` stripped; None: its newest)."""
        for first, rules in self.layer_id_rules_from:
            if release is None or _key(first) <= _key(release):
                return rules
        return self.layer_id_rules


def _key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split("."))
