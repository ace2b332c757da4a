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


# Importing every hook target needs an sgl_kernel, which this CPU machine lacks (some releases,
# e.g. 0.5.12, import it at module level): the CPU testbed's stand-in provides it.
WITH_STAND_IN = """
    from hs_tracer_testbed.runtime import launcher
    launcher.prepare_process()
"""


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
    out = run_python(WITH_STAND_IN + """
    import dataclasses
    from hs_tracer.integrations.sglang import versions

    family = versions.installed_family()
    assert family is not None and versions.problems() == [], versions.problems()
    logits = next(h for h in family.hooks if h.target.endswith("LogitsProcessor.forward"))
    bad = dataclasses.replace(family, hooks=(dataclasses.replace(logits, target=logits.target + "_gone"),))
    assert "missing" in versions.problems(bad)[0]
    changed = dataclasses.replace(family, hooks=(dataclasses.replace(logits, params=("no_such_arg",)),))
    assert "no longer takes no_such_arg" in versions.problems(changed)[0]
    renamed = dataclasses.replace(family, scheduler_entry=(family.scheduler_entry[0], "run_scheduler_v2"),
                                  hooks=())
    assert "scheduler process entry" in versions.problems(renamed)[0]
    print("ok", family.name)
    """)
    assert out.startswith("ok ")


def test_a_renamed_scheduler_entry_is_reported_outside_the_scheduler(monkeypatch) -> None:
    # Without the entry the plugin is never called in a scheduler process: it must say so where it
    # does run (launcher, tokenizer), reading SGLang's source without importing it.
    import dataclasses

    from hs_tracer.integrations.sglang import plugin, versions

    family = versions.installed_family()
    assert plugin._entry_problem() is None
    renamed = dataclasses.replace(family, scheduler_entry=(family.scheduler_entry[0], "run_scheduler_v2"))
    monkeypatch.setattr(versions, "family_for", lambda _v: renamed)
    assert "no scheduler entry sglang.srt.managers.scheduler.run_scheduler_v2" in plugin._entry_problem()
    monkeypatch.setattr(versions, "family_for", lambda _v: None)
    assert "not a supported release" in plugin._entry_problem()


@pytest.mark.parametrize(("version", "family"), [
    ("0.5.23", "0.5.23"), ("0.5.23.post1", "0.5.23"), ("0.5.12", "0.5.12"), ("0.5.12.post3", "0.5.12"),
    ("0.5.22", None), ("0.5.230", None), ("0.5.23rc1", None), (None, None),
])
def test_release_families_accept_post_releases_only(version: str | None, family: str | None) -> None:
    from hs_tracer.integrations.sglang import versions

    found = versions.family_for(version)
    assert (found.name if found else None) == family


def test_every_hook_of_every_family_resolves_and_is_named_once() -> None:
    import inspect
    import pkgutil

    from hs_tracer.integrations.sglang import versions

    for family in versions.FAMILIES:
        assert len({h.name for h in family.hooks}) == len(family.hooks), family.name
        for hook in family.hooks:
            handler = pkgutil.resolve_name(hook.handler)
            assert inspect.isfunction(handler) and next(iter(inspect.signature(handler).parameters)) == "st"
            assert hook.type in ("before", "after") and hook.worker in ("", *family.workers)


def test_registered_hooks_are_the_installed_familys_under_their_names() -> None:
    out = run_python(WITH_STAND_IN + """
    from sglang.srt.plugins.hook_registry import HookRegistry
    from hs_tracer.integrations.sglang import plugin, versions
    plugin._in_scheduler_process = lambda: True
    plugin.register()
    family = versions.installed_family()
    assert sorted(HookRegistry._hooks) == sorted({h.target for h in family.hooks})
    names = sorted(fn.__hs_tracer_where__ for hooks in HookRegistry._hooks.values()
                   for _type, fn, _src in hooks)
    assert names == sorted(h.name for h in family.hooks), names
    print("ok", len(names))
    """, HS_TRACER="1")
    assert out.startswith("ok ")


def test_a_post_release_passes_the_version_guard() -> None:
    # V.post1 keeps V's internals: the guard checks that family's real targets and passes.
    out = run_python(WITH_STAND_IN + """
    from hs_tracer.integrations.sglang import versions
    release = versions.installed_version()
    versions.installed_version = lambda: release + ".post1"
    assert versions.installed_family() is versions.family_for(release)
    assert versions.problems() == [], versions.problems()
    versions.installed_version = lambda: release + "rc1"
    assert "not a supported release" in versions.problems()[0]
    print("ok", release)
    """)
    assert out.startswith("ok ")


def test_draft_layouts_name_only_attributes_the_installed_release_sets() -> None:
    # A norm the layout names but the release's draft class never sets would switch tracing off at
    # startup (0.5.12's LlamaForCausalLMEagle3 has no input_norm); read from the real classes' source.
    out = run_python(WITH_STAND_IN + """
    import inspect, pkgutil
    from hs_tracer.integrations.sglang import draft_layout, versions
    layouts = draft_layout.RELEASE_LAYOUTS.get(versions.release_of(versions.installed_version()),
                                               draft_layout.LAYOUTS)
    modules = {"LlamaForCausalLMEagle3": "sglang.srt.models.llama_eagle3",
               "Eagle3DeepseekV2ForCausalLM": "sglang.srt.models.kimi_k25_eagle3"}
    for arch, layout in layouts.items():
        try:
            source = inspect.getsource(pkgutil.resolve_name(modules[arch]))
        except ImportError:  # the release does not ship this draft class
            continue
        for name in (*layout.norms, "num_aux_hidden_states"):
            assert f"self.{name} =" in source, (arch, name)
    print("ok", sorted(layouts))
    """)
    assert out.startswith("ok ")


def test_ranks_and_role_where_sglang_has_no_runtime_context() -> None:
    # 0.5.12 has no sglang.srt.runtime_context: the ranks come from parallel_state/dp_attention and
    # the role from the server args (a failure here would switch tracing off at startup).
    out = run_python(WITH_STAND_IN + """
    import importlib.util
    from hs_tracer.integrations.sglang import state
    from hs_tracer.records import Ranks
    if importlib.util.find_spec("sglang.srt.runtime_context") is not None:
        print("ok runtime context")
    else:
        from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
        set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", device="cpu",
                                                        disaggregation_mode="prefill"))
        assert state._role() == "prefill", state._role()
        assert state._ranks() == (Ranks(), True), state._ranks()  # no parallel groups: rank 0
        print("ok parallel_state")
    """)
    assert out.startswith("ok ")
