"""An exception inside any of hs_tracer's hooks never reaches SGLang: every hook of ``hooks.hook_table()``,
registered on its real SGLang target through SGLang's real ``HookRegistry`` (as the plugin does, and as
SGLang's own HookRegistry tests exercise it), with ``HS_TRACER_FAULT_INJECT`` naming that hook.

No engine: ``HookRegistry.apply_hooks()`` patches the real classes and module of SGLang 0.5.23 in this
process; the original bodies need a loaded model, so a REPLACE hook (which SGLang's registry puts
innermost) stands in for each and records what it was called with. The call through the patched
attribute must return the body's result, the body must get its arguments unchanged, and the tracer
must switch itself off naming the hook. One fault per hook kind also runs on the real engine
(test_engine_eagle.py; the kinds are checked here).
"""

from __future__ import annotations

import pkgutil
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import state
from hs_tracer.integrations.sglang.hooks import hook_table
from tests.engine_runs import FAMILY, FAULT_ENGINES, OLDER_RELEASE

HOOKS = hook_table()
WHERE = {hook.__hs_tracer_where__: (target, hook, ty) for target, hook, ty in HOOKS}


@pytest.fixture
def registry() -> Iterator[None]:
    """SGLang's registry, empty, and every hook target restored afterwards (also in the modules that
    imported it by name, where the registry propagates its patch)."""
    saved = ({k: list(v) for k, v in HookRegistry._hooks.items()}, set(HookRegistry._patched))
    HookRegistry.reset()
    originals = []
    for target, _hook, _ty in HOOKS:
        owner_path, attr = target.rsplit(".", 1)
        owner = pkgutil.resolve_name(owner_path)
        raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        originals.append((owner, attr, raw, getattr(owner, attr)))
    yield
    for owner, attr, raw, plain in originals:
        patched = getattr(owner, attr)
        setattr(owner, attr, raw)
        if patched is not plain:
            for mod in list(sys.modules.values()):
                for name, value in list(getattr(mod, "__dict__", {}).items()):
                    if value is patched:
                        setattr(mod, name, plain)
    HookRegistry.reset()
    HookRegistry._hooks.update(saved[0])
    HookRegistry._patched.update(saved[1])
    state.install(TracerConfig()).enabled = False


@pytest.mark.parametrize("where", sorted(WHERE))
def test_fault_in_a_hook_never_reaches_sglang(registry, where: str) -> None:
    target, hook, hook_type = WHERE[where]
    owner_path, attr = target.rsplit(".", 1)
    owner = pkgutil.resolve_name(owner_path)
    calls: list[tuple[Any, ...]] = []
    result = object()

    def body(*args: Any, **kwargs: Any) -> object:  # stands in for SGLang's own code
        calls.append((args, kwargs))
        return result

    st = state.install(TracerConfig(fault_inject=where))
    HookRegistry.register(target, body, HookType.REPLACE)
    HookRegistry.register(target, hook, hook_type)
    HookRegistry.apply_hooks()
    patched = getattr(owner, attr)
    assert patched.__wrapped__.__wrapped__ is not None  # hs_tracer's hook around the stand-in body

    args: tuple[Any, ...] = (SimpleNamespace(name="batch"), SimpleNamespace(name="result"))
    kwargs = {"is_draft_worker": False}
    instance = (SimpleNamespace(),) if isinstance(owner, type) else ()
    assert patched(*instance, *args, **kwargs) is result  # no exception, SGLang's result unchanged
    assert calls == [((*instance, *args), kwargs)]  # the body got exactly its arguments
    assert st.enabled is False and st.hook_errors == 1
    assert st.disabled_reason.startswith(f"{where}: RuntimeError")

    assert patched(*instance, *args, **kwargs) is result  # off from now on: the hook does nothing
    assert st.hook_errors == 1 and len(calls) == 2


def test_every_hook_is_faulted_and_each_kind_runs_on_the_engine() -> None:
    assert len(WHERE) == len(HOOKS)  # a hook without its own fault name could not be tested here
    wheres = {kind: where for kind, (where, _shape) in FAULT_ENGINES.items()}
    assert WHERE[wheres["startup"]][2] is HookType.AFTER
    assert WHERE[wheres["per-step before"]][2] is HookType.BEFORE
    assert WHERE[wheres["per-step after"]][2] is HookType.AFTER
    if OLDER_RELEASE and "V1" in FAMILY.workers:  # its V1 worker's own hooks (tests/engine_runs.py)
        assert set(wheres) == {"startup", "per-step before", "per-step after"}
        assert all(where.startswith("EAGLEWorker.") for where in wheres.values())
    elif OLDER_RELEASE:
        assert set(wheres) == {"startup", "per-step before", "per-step after"}
    else:
        assert wheres["recorder"] == "recorder"


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_a_fault_naming_a_tp_rank_fires_on_that_rank_only(registry, monkeypatch, tp_rank: int) -> None:
    """``HS_TRACER_FAULT_INJECT=<hook>@tp1``: the scheduler of TP rank 1 faults, every other rank traces
    on (tests/test_engine_multirank.py runs it on a real two-rank engine)."""
    from hs_tracer.config import load
    from hs_tracer.records import Ranks

    where = "EagleDraftWorker._draft_extend_for_decode"
    target, hook, hook_type = WHERE[where]
    owner = pkgutil.resolve_name(target.rsplit(".", 1)[0])
    cfg, errors = load({"HS_TRACER_FAULT_INJECT": f"{where}@tp1"})
    assert errors == [] and (cfg.fault_inject, cfg.fault_tp_rank) == (where, 1)
    st = state.install(cfg)
    monkeypatch.setattr(st, "ranks", Ranks(tp=tp_rank))
    HookRegistry.register(target, lambda *a, **k: None, HookType.REPLACE)
    HookRegistry.register(target, hook, hook_type)
    HookRegistry.apply_hooks()
    # the hook body itself fails on these stand-in arguments once it runs, so a rank that is not
    # faulted still switches off, but naming the body's own error, not the injected fault
    getattr(owner, target.rsplit(".", 1)[1])(SimpleNamespace(), SimpleNamespace(), SimpleNamespace())
    injected = st.disabled_reason is not None and "fault injected" in st.disabled_reason
    assert injected is (tp_rank == 1)


@pytest.mark.parametrize("raw", ["recorder@1", "recorder@rank1", "recorder@tp"])
def test_a_fault_with_a_malformed_rank_is_refused(raw: str) -> None:
    from hs_tracer.config import load

    _cfg, errors = load({"HS_TRACER_FAULT_INJECT": raw})
    assert len(errors) == 1 and "HS_TRACER_FAULT_INJECT" in errors[0]
