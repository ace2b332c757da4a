"""SGLang behind the engine interface (:class:`hs_tracer.engines.Engine`): the object the registry names.

Importing it imports no SGLang: the hooks and the tracer state are imported when
:meth:`SGLang.install` runs (inside SGLang's scheduler process), the preflight when ``hs-tracer
check`` asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hs_tracer.integrations.sglang import NAME, patching, releases, versions

if TYPE_CHECKING:
    from hs_tracer.integrations.sglang.hooks import Wrap


class SGLang:
    name = NAME
    display_name = "SGLang"
    # llama_eagle3.py of its newest supported release: no norm_before_residual branch.
    honoured_flags = frozenset({"norm_before_fc", "fc_norm", "norm_output"})

    def newest_release(self) -> str:
        return releases.NEWEST_RELEASE

    def installed_version(self) -> str | None:
        return versions.installed_version()

    def problems(self) -> list[str]:
        return versions.problems()

    def served_flags(self, draft_config: Mapping[str, Any]) -> dict[str, bool]:
        """``norm_before_fc`` nested in ``eagle_config`` or at the top level; ``fc_norm`` (or
        ``use_aux_norm``) and ``norm_output`` only at the top level; ``norm_before_residual`` never."""
        cfg = draft_config
        nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        return {
            "norm_before_fc": bool(nested.get("norm_before_fc") or cfg.get("norm_before_fc")),
            "fc_norm": bool(cfg.get("fc_norm") or cfg.get("use_aux_norm")),
            "norm_output": bool(cfg.get("norm_output")),
            "norm_before_residual": False,
        }

    def flags_release(self, engine_version: str) -> str:
        return releases.NEWEST_RELEASE  # the flags are read as the newest release reads them

    def layer_id_rules(self, engine_version: str | None) -> releases.LayerIdRules:
        return releases.layer_id_rules(engine_version)

    def rules_label(self, engine_version: str | None) -> str:
        return releases.rules_label(engine_version)

    def layer_0_fixed_in(self, engine_version: str | None) -> str | None:
        return releases.layer_0_fixed_in(engine_version)

    def preflight(self, args: Any, pinned: str) -> Any:
        from hs_tracer.integrations.sglang import preflight  # import cost: the checks' readers, CLI only

        return preflight.check(args, pinned)

    def human(self, result: Any, verbose: bool = False) -> str:
        from hs_tracer.integrations.sglang import preflight

        return preflight.human(result, verbose)

    def install(self, cfg: Any, wrap: Wrap | None = None) -> int:
        """The tracer state, then each hook of the installed release's family registered in SGLang's
        ``HookRegistry`` (which applies them before the engine starts); ``wrap`` as for
        :func:`.hooks.hook_table`."""
        from hs_tracer.integrations.sglang import hooks  # imports SGLang: its scheduler process only

        family = versions.installed_family()
        if family is None:
            raise RuntimeError("; ".join(versions.problems()) or "SGLang is not installed")
        table = hooks.hook_table(family, wrap)
        hooks.install_state(cfg)
        for target, hook, hook_type in table:
            patching.register(target, hook, hook_type)
        return len(table)

    def uninstall(self) -> None:
        from hs_tracer.integrations.sglang import state

        patching.unregister_all()
        state.SLOT.clear()


ENGINE = SGLang()
