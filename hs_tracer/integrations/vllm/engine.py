"""vLLM behind the engine interface (:class:`hs_tracer.engines.Engine`): the object the registry names.

Importing it imports no vLLM: the hooks and the tracer state are imported when :meth:`VLLM.install`
runs (inside vLLM's process), the preflight when ``hs-tracer check --engine vllm`` asks for it.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Mapping
from typing import Any

from hs_tracer.core import patching
from hs_tracer.draft.norm_flags import FLAGS
from hs_tracer.integrations.vllm import NAME, versions
from hs_tracer.integrations.vllm import layer_ids as vl


class VLLM:
    name = NAME
    display_name = "vLLM"
    # vLLM's llama_eagle3.py has a branch for each of the four flags.
    honoured_flags = frozenset(FLAGS)

    def newest_release(self) -> str:
        return vl.NEWEST_VLLM

    def installed_version(self) -> str | None:
        return versions.installed_version()

    def problems(self) -> list[str]:
        return versions.problems()

    def served_flags(self, draft_config: Mapping[str, Any]) -> dict[str, bool]:
        """``norm_before_fc`` nested in ``eagle_config`` first, then at the top level; ``fc_norm``,
        ``norm_output`` and ``norm_before_residual`` at the top level. Its reader of speculators'
        format writes all four there, ``norm_before_residual`` true unless the config says otherwise."""
        cfg = draft_config
        nested = cfg.get("eagle_config") if isinstance(cfg.get("eagle_config"), dict) else {}
        return {
            "norm_before_fc": bool(nested.get("norm_before_fc", cfg.get("norm_before_fc", False))),
            "fc_norm": bool(cfg.get("fc_norm")),
            "norm_output": bool(cfg.get("norm_output")),
            "norm_before_residual": bool(cfg.get("norm_before_residual", "speculators_model_type" in cfg)),
        }

    def flags_release(self, engine_version: str) -> str:
        return engine_version or vl.NEWEST_VLLM

    def layer_id_rules(self, engine_version: str | None) -> vl.VLLMLayerIdRules:
        return vl.vllm_layer_id_rules(engine_version)

    def rules_label(self, engine_version: str | None) -> str:
        return vl.vllm_layer_id_rules(engine_version).releases

    def layer_0_fixed_in(self, engine_version: str | None) -> str | None:
        return None

    def preflight(self, args: Any, pinned: str) -> Any:
        from hs_tracer.integrations.vllm import preflight  # import cost: the checks' readers, CLI only

        return preflight.check(args, pinned)

    def human(self, result: Any, verbose: bool = False) -> str:
        from hs_tracer.integrations.vllm import preflight

        return preflight.human(result, verbose)

    def install(self, cfg: Any) -> int:
        """The tracer state, then each hook of the installed release's family wrapped on its class
        (none if this process already has them: vLLM loads plugins once per process)."""
        from hs_tracer.integrations.vllm import state  # imports the core and torch: engine processes only

        family = versions.installed_family()
        if family is None:
            raise RuntimeError("; ".join(versions.problems()) or "vLLM is not installed")
        if patching.applied():
            return 0
        state.install(cfg)
        for h in family.hooks:
            patching.wrap(h.target, h.type, pkgutil.resolve_name(h.handler))
        return len(family.hooks)

    def uninstall(self) -> None:
        from hs_tracer.integrations.vllm import state

        patching.unwrap_all()
        state.SLOT.clear()


ENGINE = VLLM()
