"""The SGLang releases hs_tracer supports: one adapter module per release family, and the lookups.

This is the one place that knows SGLang releases by number. Each module ``v0_5_<n>.py`` describes one
family (releases whose internals agree, :class:`~.adapter.SGLangFamily`): its hooks with the phase
each runs in, its layer-id rules, its draft classes' layouts, its scheduler entry. It is data: nothing
here imports SGLang, so the checks and the diagnosis read layer-id rules and release labels here, and
the SGLang integration builds its version guard and hook table from the same families.

Adding a release: list it in its family's ``releases``; a release whose internals differ gets a
new module (start from the nearest family's) placed in :data:`FAMILIES`, and a row in
tests/test_sglang_releases.py (docs/versions.md).
"""

from __future__ import annotations

import re

from hs_tracer.errors import InputError
from hs_tracer.integrations.sglang.releases import v0_5_11, v0_5_12, v0_5_13, v0_5_16, v0_5_17, v0_5_22
from hs_tracer.integrations.sglang.releases.adapter import LayerIdRules, SGLangFamily

# Newest first: FAMILIES[0] is the newest family, and a release newer than every family's is checked
# against it (``untested``).
FAMILIES: tuple[SGLangFamily, ...] = (
    v0_5_22.FAMILY, v0_5_17.FAMILY, v0_5_16.FAMILY, v0_5_13.FAMILY, v0_5_12.FAMILY, v0_5_11.FAMILY,
)

SUPPORTED_VERSIONS = tuple(r for f in FAMILIES for r in f.releases)
# Where every family starts a scheduler process (the plugin looks for this frame before registering).
SCHEDULER_ENTRIES = frozenset(f.scheduler_entry for f in FAMILIES)

_POST_RE = re.compile(r"\.post\d+$")
_FINAL_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?$")


def release_of(version: str) -> str:
    """``0.5.23.post2`` -> ``0.5.23``: a post release keeps its release's internals."""
    return _POST_RE.sub("", version.strip())


def release_key(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a final release or its ``.postN``; None for anything else (rc, dev)."""
    m = _FINAL_RE.match(version.strip())
    return (int(m.group(1)), int(m.group(2)), int(m.group(3))) if m else None


def _oldest_first(releases: tuple[str, ...]) -> list[str]:
    return sorted(releases, key=lambda r: release_key(r) or (0, 0, 0))


NEWEST_RELEASE = _oldest_first(SUPPORTED_VERSIONS)[-1]


def is_untested(version: str | None) -> bool:
    """A final release newer than every release in the table: checked against the newest family
    (targets, parameters, reads and layer-id rule) instead of refused."""
    key = release_key(version) if version else None
    newest = release_key(NEWEST_RELEASE)
    return key is not None and newest is not None and key > newest


def family_for(version: str | None) -> SGLangFamily | None:
    """The family of an SGLang version: the one listing its release; for a release newer than the
    newest listed one the newest family (:func:`is_untested`); None when hs_tracer does not support it."""
    if version is None:
        return None
    release = release_of(version)
    listed = next((f for f in FAMILIES if release in f.releases), None)
    if listed is None and is_untested(version):
        return FAMILIES[0]
    return listed


def supported_text() -> str:
    """The supported releases, oldest to newest, for messages."""
    ordered = _oldest_first(SUPPORTED_VERSIONS)
    return f"{ordered[0]} to {ordered[-1]} and their .postN; newer releases when their internals match"


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


def rules_release(version: str | None) -> str | None:
    """The release whose layer-id rules apply to ``version``: itself, or for an untested release
    the newest listed one (its guard checked that the rule is unchanged)."""
    return NEWEST_RELEASE if is_untested(version) else version


def layer_id_rules(sglang_version: str | None = None) -> LayerIdRules:
    """The layer-id rules of an SGLang release (``.postN`` counts as its release; None: the newest).
    A release whose source hs_tracer has not read is refused rather than guessed."""
    if sglang_version is None:
        return FAMILIES[0].rules_of(None)
    if release_key(sglang_version) is None:
        raise InputError(f"not an SGLang release number: {sglang_version!r} "
                         f"(expected e.g. {FAMILIES[-2].releases[0]} or {NEWEST_RELEASE}.post1)")
    release = release_of(sglang_version)
    for family in FAMILIES:
        if release in family.releases or release in family.check_only:
            return family.rules_of(release)
    known = _oldest_first(tuple(r for f in FAMILIES for r in (*f.releases, *f.check_only)))
    raise InputError(f"hs_tracer has not read SGLang {sglang_version}'s layer-id rules "
                     f"(known: {known[0]} to {known[-1]})")


def rules_label(sglang_version: str | None = None) -> str:
    """The releases that share ``sglang_version``'s layer-id rules (None: the newest release's), as
    messages name them: ``0.5.17-0.5.23``."""
    rules = layer_id_rules(sglang_version)
    same = _oldest_first(tuple(r for f in FAMILIES for r in (*f.releases, *f.check_only)
                               if f.rules_of(r) == rules))
    return same[0] if len(same) == 1 else f"{same[0]}-{same[-1]}"


def layer_0_fixed_in(sglang_version: str | None) -> str | None:
    """The oldest release newer than ``sglang_version`` whose DeepSeek loop captures layer 0 without
    raising (None: no newer release does, or ``sglang_version`` itself does not raise)."""
    if sglang_version is None or not layer_id_rules(sglang_version).deepseek_layer_0_raises:
        return None
    key = release_key(sglang_version) or (0, 0, 0)  # a release number: layer_id_rules refuses others
    return next((r for r in _oldest_first(SUPPORTED_VERSIONS)
                 if (release_key(r) or (0, 0, 0)) > key and not layer_id_rules(r).deepseek_layer_0_raises),
                None)
