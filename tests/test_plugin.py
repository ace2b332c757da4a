"""The plugin entry point against SGLang's real plugin loader (no engine: see test_engine_*.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from hs_tracer import config


def run_python(code: str, **env: str) -> str:
    """Run code in a fresh interpreter: load_plugins() is once-per-process by design."""
    import os

    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    full_env.update(env)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full_env,
                         capture_output=True, text=True, timeout=600, check=True)
    return out.stdout


LOAD = """
    import sys
    from sglang.srt.plugins import load_plugins, load_plugins_by_group, GENERAL_PLUGINS_GROUP
    from sglang.srt.plugins.hook_registry import HookRegistry
    print("discovered", sorted(load_plugins_by_group(GENERAL_PLUGINS_GROUP)))
    load_plugins()
    print("registered", sorted(HookRegistry._hooks))
    print("heavy", [m for m in ("prometheus_client", "hs_tracer.integrations.sglang.hooks")
                    if m in sys.modules])
"""


def test_entry_point_discovered_and_inert_without_env() -> None:
    out = run_python(LOAD)
    assert "discovered ['hs_tracer']" in out
    assert "registered []" in out
    assert "heavy []" in out


def test_enabled_outside_a_scheduler_registers_nothing() -> None:
    # The launcher/tokenizer process runs no model: the plugin must not import hook targets there.
    out = run_python(LOAD, HS_TRACER="1")
    assert "registered []" in out
    assert "'prometheus_client'" not in out


@pytest.mark.parametrize(("raw", "on"), [("1", True), ("true", True), ("0", False), ("", False)])
def test_enabled_values(raw: str, on: bool) -> None:
    assert config.enabled({"HS_TRACER": raw}) is on


def test_invalid_settings_are_reported_not_raised(tmp_path) -> None:
    cfg, errors = config.load({"HS_TRACER_SPAN_SAMPLE": "2", "HS_TRACER_PROFILE": str(tmp_path / "x")})
    assert len(errors) == 2
    assert any("HS_TRACER_SPAN_SAMPLE" in e for e in errors)
    assert any("profile build" in e for e in errors)
    assert cfg.span_sample == config.TracerConfig().span_sample


def test_version_guard_names_what_is_missing() -> None:
    from hs_tracer.integrations.sglang import versions

    assert versions.problems() == []
    bad = {"sglang.srt.speculative.eagle_worker.EAGLEWorker.forward": ()}
    assert "missing" in versions.problems(bad)[0]
    changed = {"sglang.srt.layers.logits_processor.LogitsProcessor.forward": ("no_such_arg",)}
    assert "no longer takes no_such_arg" in versions.problems(changed)[0]


def test_every_hook_target_is_version_checked() -> None:
    from hs_tracer.integrations.sglang import hooks, versions

    assert {target for target, _hook, _type in hooks.HOOKS} == set(versions.TARGETS)
