"""The preflight's mirrors of SGLang 0.5.23 against the real thing.

One child process (SGLang picks its CPU/GPU code path at import, so it gets a fresh process with the
CPU testbed runtime) builds the real ``LlamaForCausalLMEagle3`` (or, for the Kimi MLA drafts,
``Eagle3DeepseekV2ForCausalLM``) for each draft config, fills every
parameter with NaN, runs the real ``load_weights`` over the checkpoint, and reports what was loaded,
left at NaN, rejected, and the ``hot_token_id`` it built; it also runs SGLang's own server-args
resolution for a set of speculative flags through ``resolve_with_sglang``. The tests compare that
with ``plan_load`` and ``resolve_spec_args``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_check_drafts import (
    DRAFT_VOCAB,
    H,
    draft_state,
    mla_draft,
    mla_state,
    specforge_draft,
    target_config,
)

from hs_tracer.preflight.checkpoint import read_checkpoint
from hs_tracer.preflight.config import read_draft_config
from hs_tracer.preflight.spec_args import resolve_spec_args
from hs_tracer.preflight.weight_map import plan_load

CHILD = r"""
import json, os, socket, sys
from hs_tracer_testbed.runtime.inproc import init_world_of_one
init_world_of_one()
import torch
from safetensors import safe_open
from transformers import AutoConfig
from sglang.srt.models.kimi_k25_eagle3 import Eagle3DeepseekV2ForCausalLM
from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
CLASSES = {c.__name__: c for c in (LlamaForCausalLMEagle3, Eagle3DeepseekV2ForCausalLM)}

job = json.loads(sys.stdin.read())
out = {"weights": {}, "spec": []}
for name, draft_dir in job["weights"].items():
    rec = {}
    try:
        config = AutoConfig.from_pretrained(draft_dir)
        model = CLASSES[config.architectures[0]](config)
    except Exception as exc:
        rec["construct_error"] = f"{type(exc).__name__}: {exc}"
        out["weights"][name] = rec
        continue
    params = dict(model.named_parameters())
    rec["params"] = {k: list(v.shape) for k, v in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.fill_(float("nan"))
    weights = []
    with safe_open(os.path.join(draft_dir, "model.safetensors"), "pt") as fh:
        for key in fh.keys():
            weights.append((key, fh.get_tensor(key)))
    try:
        model.load_weights(weights)
    except AssertionError as exc:
        rec["load_error"] = str(exc) or "AssertionError"
    rec["nan"] = sorted(k for k, p in params.items() if torch.isnan(p.float()).any())
    hot = getattr(model, "hot_token_id", None)
    rec["hot_token_id"] = hot.tolist() if hot is not None else None
    out["weights"][name] = rec
from pathlib import Path
from hs_tracer.preflight.spec_args import resolve_with_sglang
for case in job["spec"]:
    res = resolve_with_sglang(case["requested"], Path(case["target"]), Path(case["draft"]))
    out["spec"].append({"rejected": res.rejected} if res.rejected else res.used())
print("RESULT" + json.dumps(out))
"""


def _no_lm_head() -> dict[str, torch.Tensor]:
    st = draft_state()
    del st["lm_head.weight"]
    return st


def _four_aux() -> dict[str, torch.Tensor]:
    return draft_state(n_aux=4)


def _stray_keys() -> dict[str, torch.Tensor]:
    st = draft_state(with_embed=True)
    st["fc_norm.0.weight"] = torch.ones(H)  # trained with per-slot norms, flag not set
    st["verifier_lm_head.weight"] = torch.zeros(8, H)
    st["midlayer.self_attn.q_proj.bias"] = torch.zeros(64)
    return st


def _no_k() -> dict[str, torch.Tensor]:
    st = draft_state()
    del st["midlayer.self_attn.k_proj.weight"]
    return st


# name -> (builder kwargs), all against one Llama target
WEIGHT_CASES: dict[str, dict[str, Any]] = {
    "clean": {"layer_ids": [1, 3, 4]},
    "no_lm_head": {"layer_ids": [1, 3, 4], "state": "no_lm_head"},
    "fc_4_vs_3": {"layer_ids": [1, 3, 4], "state": "four_aux"},
    "fc_4_ok": {"layer_ids": [0, 1, 3, 4], "state": "four_aux"},
    "stray": {"layer_ids": [1, 3, 4], "state": "stray"},
    "no_k_proj": {"layer_ids": [1, 3, 4], "state": "no_k"},
    "fc_norm_on": {"layer_ids": [1, 3, 4], "state": "stray", "config_extra": {"fc_norm": True}},
    "draft_vocab_null": {"layer_ids": [1, 3, 4], "draft_vocab": None},
    "lm_head_rows": {"layer_ids": [1, 3, 4], "config_extra": {"draft_vocab_size": DRAFT_VOCAB * 2}},
    "layers0_names": {"layer_ids": [1, 3, 4], "state": "layers0"},
    "draft_vocab_absent": {"layer_ids": [1, 3, 4], "drop": "draft_vocab_size"},
    # the Kimi MLA draft class (Eagle3DeepseekV2ForCausalLM)
    "mla_clean": {"mla": True},
    "mla_no_lm_head": {"mla": True, "state": "mla_no_lm_head"},
    "mla_no_kv_a": {"mla": True, "state": "mla_no_kv_a"},
    "mla_model_prefix": {"mla": True, "state": "mla_model_prefix"},
    "mla_top_level_4": {
        "mla": True,
        "layer_ids": None,
        "state": "mla_four_aux",
        "config_extra": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3, 4]},
    },
    "mla_fc_4_vs_3": {"mla": True, "state": "mla_four_aux"},
    "mla_draft_vocab_absent": {"mla": True, "drop": "draft_vocab_size"},
}


def _mla_without(*keys: str) -> dict[str, torch.Tensor]:
    st = mla_state()
    for k in keys:
        del st[k]
    return st


STATES = {
    "mla_no_lm_head": lambda: _mla_without("lm_head.weight"),
    "mla_no_kv_a": lambda: _mla_without("layers.0.self_attn.kv_a_proj_with_mqa.weight"),
    "mla_model_prefix": lambda: {
        ("model." + k if k.startswith("layers.") else k): v for k, v in mla_state().items()
    },
    "mla_four_aux": lambda: mla_state(n_aux=4),
    "no_lm_head": _no_lm_head,
    "four_aux": _four_aux,
    "stray": _stray_keys,
    "no_k": _no_k,
    "layers0": lambda: draft_state(prefix="layers.0", with_embed=True),
}  # speculators key names

# (requested flags) resolved on a Llama target; None fields are left out
SPEC_CASES: list[dict[str, Any]] = [
    {"speculative_algorithm": "EAGLE3"},
    {
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": 1,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 5,
    },
    {"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 4},
    {
        "speculative_algorithm": "NEXTN",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 6,
    },
    {
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": 2,
        "speculative_eagle_topk": 2,
        "speculative_num_draft_tokens": 4,
        "speculative_use_rejection_sampling": True,
    },
    {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3},
    {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1},
    {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 4},
]


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("real")
    target = target_config(base / "target")
    drafts = {}
    for name, spec in WEIGHT_CASES.items():
        kwargs = {k: v for k, v in spec.items() if k not in ("state", "drop", "mla")}
        if "state" in spec:
            kwargs["state"] = STATES[spec["state"]]()
        d = (mla_draft if spec.get("mla") else specforge_draft)(base / name, **kwargs)
        if "drop" in spec:
            cfg = json.loads((d / "config.json").read_text())
            del cfg[spec["drop"]]
            (d / "config.json").write_text(json.dumps(cfg, indent=2))
        drafts[name] = str(d)
    job = {
        "weights": drafts,
        "spec": [{"target": str(target), "draft": drafts["clean"], "requested": r} for r in SPEC_CASES],
    }
    proc = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(Path(__file__).resolve().parent.parent),
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT") :])
    result["dirs"] = drafts
    result["target"] = str(target)
    return result


@pytest.mark.parametrize("case", list(WEIGHT_CASES))
def test_weight_plan_matches_real_load(real: dict[str, Any], case: str) -> None:
    got = real["weights"][case]
    draft_dir = real["dirs"][case]
    draft = read_draft_config(draft_dir)
    plan = plan_load(draft, read_checkpoint(draft_dir).shapes)
    if "construct_error" in got:
        assert case == "draft_vocab_absent", got["construct_error"]  # the only case that cannot build
        return
    # the parameter set and shapes SGLang builds
    assert {k: list(p.shape) for k, p in plan.params.items()} == got["params"]
    # a shape the loader rejects <=> a predicted shape error
    assert bool(plan.shape_errors) == ("load_error" in got), (plan.shape_errors, got.get("load_error"))
    if "load_error" in got:
        return  # the real load stopped at the first bad tensor: the rest is not comparable
    assert sorted(plan.missing(set())) == got["nan"]
    # hot_token_id = d2t + arange, exactly as SGLang builds it
    d2t = read_checkpoint(draft_dir).load_small("d2t")
    assert got["hot_token_id"] == [int(v) + i for i, v in enumerate(d2t)]


def test_draft_vocab_size_key_ground_truth(real: dict[str, Any]) -> None:
    """A config without the key cannot be built; an explicit null gives a full-vocabulary head."""
    assert "draft_vocab_size" in real["weights"]["draft_vocab_absent"]["construct_error"]
    assert "construct_error" not in real["weights"]["draft_vocab_null"]
    assert real["weights"]["draft_vocab_null"]["params"]["lm_head.weight"][0] == 512


@pytest.mark.parametrize("index", range(len(SPEC_CASES)))
def test_spec_mirror_matches_sglang_resolution(real: dict[str, Any], index: int) -> None:
    want = real["spec"][index]
    mine = resolve_spec_args(SPEC_CASES[index], "LlamaForCausalLM")
    if "rejected" in want:
        assert mine.rejected, want
        return
    # SGLang's resolution accepted it: same values; the mirror may still predict a failure later
    # in startup or at the first decode, beyond what the resolution checks
    assert mine.used() == want
    assert mine.rejected is None or "startup" in mine.rejected or "first decode" in mine.rejected
