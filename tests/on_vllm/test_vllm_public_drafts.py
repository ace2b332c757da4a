"""``hs-tracer check --engine vllm`` against the installed vLLM's own code, on the config shapes of the
public EAGLE-3 drafts of the Llama, Qwen3 and DeepSeek families (tests/fixtures/vllm_drafts, listed in
docs/vllm.md): for each, vLLM loads the draft config and wraps it as its speculative config does, its
model runner looks the ids up, the target's model class gives its default when there are none and
sets the layers it captures; what the check predicted must be what that code produced, so a vLLM
change in any of these steps fails here.

The models themselves are not built (a 70B target cannot be, here): the target class's own methods run
on a holder that has only its layer list, and the capture is read the way the model's forward reads
it (each layer index, in order, that is in the holder's ``aux_hidden_state_layers``). That the ids
mean layer inputs (id k = input of layer k) is checked on a served model by the engine tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from hs_tracer.cli import main as cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_drafts"
PUBLIC = sorted(p.name for p in FIXTURES.iterdir() if (p / "draft" / "config.json").exists())


def _predicted(capsys, name: str) -> dict:
    code = cli(["check", "--engine", "vllm", "--draft", str(FIXTURES / name / "draft"), "--target",
                str(FIXTURES / name / "target"), "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out)["preflight"]


def _served(name: str) -> dict:
    """What vLLM's code does with the fixture: the ids and where they came from, the captured layers,
    the draft's architecture."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.model_executor.models.interfaces import EagleModelMixin, supports_eagle3
    from vllm.transformers_utils.config import get_config
    from vllm.transformers_utils.configs.eagle import EAGLEConfig
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    draft = get_config(str(FIXTURES / name / "draft"), trust_remote_code=False)
    # as SpeculativeConfig does for method eagle3
    draft = EAGLEConfig(draft, method="eagle3", model_type="eagle")
    runner = SimpleNamespace(speculative_config=SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=draft)))
    configured = GPUModelRunner._get_eagle3_aux_layers_from_config(runner)  # type: ignore[arg-type]

    target = json.loads((FIXTURES / name / "target" / "config.json").read_text())
    cls = ModelRegistry._try_load_model_cls(target["architectures"][0])
    assert cls is not None and supports_eagle3(cls), target["architectures"]
    n = int(target["num_hidden_layers"])

    class Holder(EagleModelMixin):  # the target's inner model, as far as these methods look at it
        def __init__(self) -> None:
            self.layers = [None] * n

    model = SimpleNamespace(model=Holder())
    ids = configured or cls.get_eagle3_default_aux_hidden_state_layers(model)  # type: ignore[arg-type]
    cls.set_aux_hidden_state_layers(model, tuple(ids))  # type: ignore[arg-type]
    held = model.model.aux_hidden_state_layers
    return {"layer_ids": list(ids), "from_config": configured is not None,
            "captured": [i for i in range(n + 1) if i in held], "served_as": draft.architectures[0]}


@pytest.mark.parametrize("name", PUBLIC)
def test_check_predicts_what_vllms_code_feeds_each_public_draft(capsys, name: str) -> None:
    predicted, served = _predicted(capsys, name), _served(name)
    engine = predicted["engine"]
    assert engine["layer_ids"] == served["layer_ids"]
    assert (engine["layer_ids_key"] != "default") == served["from_config"]
    assert engine["captured"] == served["captured"]
    assert predicted["draft"]["served_as"] == served["served_as"]


def test_the_fixtures_cover_the_three_families() -> None:
    archs = {json.loads((FIXTURES / n / "target" / "config.json").read_text())["architectures"][0]
             for n in PUBLIC}
    assert {"LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM"} <= archs
