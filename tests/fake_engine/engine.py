"""The fake engine behind the engine interface (:class:`hs_tracer.engines.Engine`)."""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping
from typing import Any

from hs_tracer.core import patching
from hs_tracer.diagnosis.report import Report
from hs_tracer.draft.norm_flags import FLAGS, written_flags
from hs_tracer.preflight.config import read_draft_config, read_target_config
from hs_tracer.preflight.runner import CheckResult
from hs_tracer.release_table import signature_problems
from tests.fake_engine import NAME, RELEASE, state, versions, wiring


class Fake:
    name = NAME
    display_name = "FakeServe"
    honoured_flags = frozenset(FLAGS)

    def newest_release(self) -> str:
        return RELEASE

    def installed_version(self) -> str | None:
        return RELEASE

    def problems(self) -> list[str]:
        return signature_problems(versions.FAMILY.hooks)

    def served_flags(self, draft_config: Mapping[str, Any]) -> dict[str, bool]:
        return written_flags(draft_config)

    def flags_release(self, engine_version: str) -> str:
        return engine_version or RELEASE

    def layer_id_rules(self, engine_version: str | None) -> None:
        return None

    def rules_label(self, engine_version: str | None) -> str:
        return engine_version or RELEASE

    def layer_0_fixed_in(self, engine_version: str | None) -> str | None:
        return None

    def preflight(self, args: Any, pinned: str) -> CheckResult:
        draft, target = read_draft_config(args.draft), read_target_config(args.target)
        n = target.num_hidden_layers
        ids = wiring.layer_ids(draft.raw, n)
        w = wiring.record(target.arch, n, target.hidden_size, ids,
                          wiring.draft_states(draft.raw, n) * target.hidden_size)
        return CheckResult(Report(findings=wiring.check(w)),
                           {"engine": {"name": f"{NAME}=={pinned or RELEASE}", "sources": w.sources}})

    def human(self, result: CheckResult, verbose: bool = False) -> str:
        return "\n".join([*result.report.causes_human(verbose),
                          f"engine: {result.summary['engine']['name']} feeds "
                          f"{', '.join(result.summary['engine']['sources'])}",
                          result.report.human(lead=False, verbose=verbose), result.report.verdict()])

    def install(self, cfg: Any) -> int:
        state.SLOT.install(state.TracerState(cfg))
        for h in versions.FAMILY.hooks:
            patching.wrap(h.target, h.type, pkgutil.resolve_name(h.handler))
        return len(versions.FAMILY.hooks)

    def uninstall(self) -> None:
        patching.unwrap_all()
        state.SLOT.clear()


ENGINE = Fake()
