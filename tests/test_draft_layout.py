"""The startup hook reads every supported SGLang EAGLE-3 draft class as SGLang really builds it.

One child process (SGLang picks its CPU/GPU code path at import) builds the real
``LlamaForCausalLMEagle3`` and ``Eagle3DeepseekV2ForCausalLM`` (Kimi-K2.5's MLA draft, whose
``fc`` is a ``ColumnParallelLinear``) from the testbed draft's weights, loads them with SGLang's
``load_weights``, and runs hs_tracer's ``EagleDraftWorker.init_lm_head`` hook on each. A layout
attribute that a class does not have raises inside the hook, which switches tracing off: these
tests then fail, naming the class.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hs_tracer.integrations.sglang.releases import FAMILIES
from hs_tracer_testbed import kimi
from hs_tracer_testbed.build import ASSETS

LAYOUTS = FAMILIES[0].draft_layouts  # the newest family's, which this module builds

CHILD = r"""
import json, sys
from types import SimpleNamespace
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from safetensors.torch import load_file
from transformers import AutoConfig
from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
from hs_tracer.config import TracerConfig
from hs_tracer.integrations.sglang import hooks, state
CLASSES = {c.__name__: c for c in (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM)}

out = {}
for name, draft_dir in json.loads(sys.stdin.read()).items():
    config = AutoConfig.from_pretrained(draft_dir)
    model = CLASSES[config.architectures[0]](config)
    model.load_weights(list(load_file(draft_dir + "/model.safetensors").items()))
    worker = SimpleNamespace(
        draft_runner=SimpleNamespace(model=model),
        speculative_algorithm=SimpleNamespace(name="EAGLE3"), speculative_num_steps=3, topk=1,
        speculative_num_draft_tokens=4)
    st = state.install(TracerConfig())
    hooks.after_init_lm_head(None, worker)
    out[name] = {"enabled": st.enabled, "reason": st.disabled_reason, "draft": st.draft,
                 "fc_type": type(model.model.fc).__name__}
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def read(tmp_path_factory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("drafts")
    llama = ASSETS / "draft"
    mla = kimi.write_draft(llama, ASSETS / "target", tmp / "mla")
    mla_norm = tmp / "mla_fc_norm"
    mla_norm.mkdir()
    cfg = json.loads((mla / "config.json").read_text())
    cfg["fc_norm"] = True
    (mla_norm / "config.json").write_text(json.dumps(cfg))
    (mla_norm / "model.safetensors").symlink_to(mla / "model.safetensors")
    dirs = {"llama": str(llama), "mla": str(mla), "mla_fc_norm": str(mla_norm)}
    proc = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(dirs), capture_output=True,
                          text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("name", ["llama", "mla", "mla_fc_norm"])
def test_startup_read_keeps_tracing_on(read, name: str) -> None:
    rec = read[name]
    assert rec["enabled"], rec["reason"]
    assert LAYOUTS[rec["draft"]["architecture"]]  # every class built here has a strict layout


def test_llama_draft_fields(read) -> None:
    d = read["llama"]["draft"]
    assert read["llama"]["fc_type"] == "Linear"
    assert (d["fc_in_features"], d["num_aux_hidden_states"], d["draft_vocab_size"]) == (192, 3, 256)
    assert (d["fc_norm"], d["input_norm"]) == (False, False)


def test_kimi_mla_draft_fields(read) -> None:
    """The MLA draft's fc is a ColumnParallelLinear: its width comes from ``input_size``."""
    d = read["mla"]["draft"]
    assert read["mla"]["fc_type"] == "ColumnParallelLinear"
    assert d["architecture"] == "Eagle3DeepseekV2ForCausalLM"
    assert (d["fc_in_features"], d["num_aux_hidden_states"], d["draft_vocab_size"]) == (192, 3, 256)
    assert (d["fc_norm"], d["input_norm"]) == (False, False)
    assert read["mla_fc_norm"]["draft"]["fc_norm"] is True


def test_layouts_cover_sglangs_eagle3_draft_classes() -> None:
    """SGLang 0.5.23's EAGLE-3 draft classes (``models/llama_eagle3.py``, ``models/kimi_k25_eagle3.py``)."""
    assert set(LAYOUTS) == {"LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"}
