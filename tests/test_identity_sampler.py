"""The in-engine identity sampler (hs_tracer/integrations/sglang/identity.py) on model bodies that
capture the way SGLang 0.5.23's loops do, with SGLang's own ``ForwardMode``, ``AuxHiddenStateList``
(the Llama loop's collector) and ``AuxHiddenStatePacker`` (the DeepSeek loop's), and the real decoder
layer classes' signatures. The real engine runs it in tests/test_engine_identity.py."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from hs_tracer.diagnosis.same_token import EXACT_TOLERANCE, identify, measured_sources
from hs_tracer.integrations.sglang.identity import IdentitySampler, layer_style, sample_rows

pytest.importorskip("sglang")

from sglang.srt.layers.aux_hidden_states import AuxHiddenStateList, AuxHiddenStatePacker
from sglang.srt.model_executor.forward_batch_info import ForwardMode

H, LAYERS = 96, 5  # wider than the projection (64 dims)


class CallbackLayer(nn.Module):
    """Takes a capture callback as SGLang's LlamaDecoderLayer does (the residual stream entering the
    layer, borrowed), and changes the stream by a layer's worth."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        torch.nn.init.normal_(self.lin.weight, std=0.3, generator=torch.Generator().manual_seed(i))

    def forward(self, positions: Any, hidden_states: torch.Tensor, forward_batch: Any,
                capture_output: Any = None) -> torch.Tensor:
        if capture_output is not None:
            capture_output(hidden_states)
        return hidden_states + torch.tanh(self.lin(hidden_states))


class CollectorLayer(CallbackLayer):
    """Takes the aux collector as SGLang's DeepseekV2DecoderLayer does."""

    def forward(self, positions: Any, hidden_states: torch.Tensor, forward_batch: Any,  # type: ignore[override]
                captured_last_layer_outputs: Any = None) -> torch.Tensor:
        if captured_last_layer_outputs is not None:
            captured_last_layer_outputs.capture(hidden_states, owned=False)
        return hidden_states + torch.tanh(self.lin(hidden_states))


class Body(nn.Module):
    """A model body whose loop captures ``shift(layers_to_capture)`` (the identity: as recorded)."""

    def __init__(self, layer: type, layers_to_capture: list[int], shift: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, H)
        self.layers = nn.ModuleList(layer(i) for i in range(LAYERS))
        self.norm = nn.LayerNorm(H)
        self.layers_to_capture = layers_to_capture
        self.shift = shift or (lambda ls: ls)
        self.collector = layer is CollectorLayer

    def forward(self, input_ids: torch.Tensor, positions: Any, forward_batch: Any) -> Any:
        h = self.embed(input_ids)
        capture = self.shift(self.layers_to_capture)
        if self.collector:
            aux: Any = AuxHiddenStatePacker(len(capture))
            for i, layer in enumerate(self.layers):
                taken = aux if i in capture else None
                h = layer(positions, h, forward_batch, captured_last_layer_outputs=taken)
            return self.norm(h), aux.finalize()
        aux = AuxHiddenStateList()
        for i, layer in enumerate(self.layers):
            h = layer(positions, h, forward_batch, capture_output=aux.capture if i in capture else None)
        return self.norm(h), aux


class ResidualLayer(CallbackLayer):
    """A layer of the loops before SGLang's layer boundaries: it takes and returns
    ``(hidden_states, residual)``; the loop captures ``hidden_states + residual`` before calling it."""

    def forward(self, positions: Any, hidden_states: torch.Tensor, forward_batch: Any,  # type: ignore[override]
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden_states if residual is None else hidden_states + residual
        return torch.tanh(self.lin(residual)), residual


class ResidualBody(Body):
    def forward(self, input_ids: torch.Tensor, positions: Any, forward_batch: Any) -> Any:
        h, residual, aux = self.embed(input_ids), None, []
        for i, layer in enumerate(self.layers):
            if i in self.shift(self.layers_to_capture):
                aux.append(h if residual is None else h + residual)
            h, residual = layer(positions, h, forward_batch, residual)
        return self.norm(h + residual), aux


def _batch(mode: ForwardMode = ForwardMode.EXTEND, prefix: tuple[int, ...] = (0, 0),
           lens: tuple[int, ...] = (7, 6)) -> Any:
    return SimpleNamespace(forward_mode=mode, extend_prefix_lens_cpu=list(prefix),
                           extend_seq_lens_cpu=list(lens), residual_stream=None)


def _sampler(body: Body, every: int = 1, errors: list[BaseException] | None = None,
             tracing: Callable[[], bool] = lambda: True) -> IdentitySampler:
    sampler = IdentitySampler(body, every, LAYERS, H, len(body.layers_to_capture), "cpu", torch.float32,
                              record=True, fail=(errors if errors is not None else []).append,
                              tracing=tracing)
    assert sampler.install()
    return sampler


def _forward(body: Body, sampler: IdentitySampler | None, fb: Any, seed: int = 0) -> Any:
    """One forward as SGLang runs it with hs_tracer: the body's after-hook hands the result over."""
    n = sum(fb.extend_seq_lens_cpu)
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out = body(ids, None, fb)
    if sampler is not None and sampler.active is not None:
        sampler.finish(out)
    return out


def _measure(sampler: IdentitySampler) -> tuple[list[str], list[str | None]]:
    (sample,) = sampler.landed()
    cands = {n: torch.from_numpy(sample.candidates[i]) for i, n in enumerate(sample.sources)}
    return sample.sources, measured_sources(identify(torch.from_numpy(sample.slots), cands, EXACT_TOLERANCE))


def test_rows_spread_over_the_batch_never_at_position_0() -> None:
    assert sample_rows([0, 0], [5, 3]) == [1, 2, 3, 4, 6, 7]
    assert sample_rows([0], [1]) == []  # a one-token prompt has nothing past position 0
    assert sample_rows([0, 2], [1, 3]) == [1, 2, 3]  # a cached prefix: its first extend row counts
    rows = sample_rows([0, 0, 0], [100, 50, 70])
    assert len(rows) == 8 and rows == sorted(set(rows)) and not {0, 100, 150} & set(rows)
    assert rows[0] < 100 and rows[-1] >= 150  # spread over the requests


@pytest.mark.parametrize("layer", [CallbackLayer, CollectorLayer])
def test_every_candidate_and_the_slots_of_the_same_rows_name_the_fed_layers(layer: type) -> None:
    body, reference = Body(layer, [1, 3, 4]), Body(layer, [1, 3, 4])
    reference.load_state_dict(body.state_dict())
    plain = _forward(reference, None, _batch())
    sampler = _sampler(body)
    out = _forward(body, sampler, _batch())
    names, measured = _measure(sampler)
    assert names == ["embedding", "block:0", "block:1", "block:2", "block:3", "final_norm"]
    assert measured == ["block:0", "block:2", "block:3"]  # inputs of layers 1, 3, 4
    # the loop's own captures are unchanged by the taps
    assert torch.equal(out[0], plain[0])
    aux = out[1] if isinstance(out[1], torch.Tensor) else torch.cat(list(out[1]), -1)
    plain_aux = plain[1] if isinstance(plain[1], torch.Tensor) else torch.cat(list(plain[1]), -1)
    assert torch.equal(aux, plain_aux)


@pytest.mark.parametrize(("shift", "fed"), [
    (lambda ls: [lay + 1 for lay in ls], ["block:0", "block:1", "block:2"]),  # every slot one layer late
    (lambda ls: ls[:1] + [lay + 1 for lay in ls[1:]], ["embedding", "block:1", "block:2"]),  # deep slots late
])
def test_a_loop_capturing_other_layers_than_recorded_is_measured_as_fed(shift: Any, fed: list[str]) -> None:
    body = Body(CallbackLayer, [0, 1, 2], shift)  # recorded: embedding, block:0, block:1
    sampler = _sampler(body)
    _forward(body, sampler, _batch())
    assert _measure(sampler)[1] == fed


class SpyLayer(CallbackLayer):
    """Notes whether it was handed a capture channel, and whether its ``forward`` was wrapped."""

    seen: ClassVar[list[tuple[int, bool, bool]]] = []

    def forward(self, positions: Any, hidden_states: torch.Tensor, forward_batch: Any,
                capture_output: Any = None) -> torch.Tensor:
        SpyLayer.seen.append((self.index, capture_output is not None, "forward" in self.__dict__))
        return super().forward(positions, hidden_states, forward_batch, capture_output)

    def __init__(self, i: int) -> None:
        super().__init__(i)
        self.index = i


def test_one_in_every_extend_forward_is_sampled_and_nothing_else() -> None:
    body = Body(SpyLayer, [1, 3, 4])
    sampler = _sampler(body, every=3)
    SpyLayer.seen.clear()

    def layer_2() -> list[tuple[bool, bool]]:
        out = [(taps, wrapped) for i, taps, wrapped in SpyLayer.seen if i == 2]
        SpyLayer.seen.clear()
        return out

    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):  # never sampled, never counted
        _forward(body, sampler, _batch(mode))
    _forward(body, sampler, _batch(prefix=(0,), lens=(1,)))  # only position 0: looked past, not counted
    assert sampler.sampled == 0
    assert layer_2() == [(False, False)] * 3  # unsampled: layer 2 carries no wrapper at all
    got = []
    for i in range(7):
        _forward(body, sampler, _batch(), seed=i)
        got += layer_2()
    assert sampler.sampled == 3  # forwards 1, 4 and 7
    # sampled: a capture channel (layer 2 is not captured by the loop) and a wrapper, removed after
    assert [taps for taps, _ in got] == [True, False, False, True, False, False, True]
    assert "forward" not in body.layers[2].__dict__
    # two samples in flight at most: the third sampled forward is passed the taps but not recorded
    assert (sampler.recorded, sampler.missed) == (2, 1)
    assert len(sampler.landed()) == 2 and sampler.landed() == []


class GraphRunner:
    """A target model runner with a prefill graph runner, shaped like SGLang 0.5.23's ``ModelRunner``:
    a prefill replays its captured graph (none of the layers' Python runs) while
    ``prefill_cuda_graph_runner`` is set, else runs the body eagerly."""

    def __init__(self, body: Body) -> None:
        self.body = body
        self.prefill_cuda_graph_runner: Any = object()
        self.graphs = self.prefill_cuda_graph_runner
        self.replays = self.eager = 0

    def forward(self, forward_batch: Any, skip_attn_backend_init: bool = False) -> Any:
        if self.prefill_cuda_graph_runner is not None:
            self.replays += 1
            return None
        self.eager += 1
        ids = torch.randint(0, 100, (sum(forward_batch.extend_seq_lens_cpu),),
                            generator=torch.Generator().manual_seed(self.eager))
        with torch.no_grad():
            return self.body(ids, None, forward_batch)


def test_under_prefill_graphs_the_runner_counts_every_prefill_and_runs_the_sampled_one_eagerly() -> None:
    """A replayed graph runs no layer Python, so the runner's forward counts the prefills and sets the
    graph runner aside for the sampled one; a graph's warm-up or capture (the body called directly,
    as SGLang's graph runners do) is never sampled."""
    body = Body(CallbackLayer, [1, 3, 4], lambda ls: [lay - 1 for lay in ls])  # fed one layer early
    sampler = _sampler(body, every=4)
    runner = GraphRunner(body)
    sampler.install_runner(runner)
    _forward(body, sampler, _batch())  # a capture's warm-up: not through the runner's forward
    assert sampler.sampled == 0
    for _ in range(8):
        out = runner.forward(_batch())
        if sampler.active is not None:
            sampler.finish(out)
    assert (runner.replays, runner.eager, sampler.sampled, sampler.eager) == (6, 2, 2, 2)
    assert runner.prefill_cuda_graph_runner is runner.graphs  # put back after each sampled forward
    runner.forward(_batch(ForwardMode.DECODE))  # never sampled, never counted
    assert sampler.status()["eager_prefills"] == 2
    for sample in sampler.landed():
        cands = {n: torch.from_numpy(sample.candidates[i]) for i, n in enumerate(sample.sources)}
        measured = identify(torch.from_numpy(sample.slots), cands, EXACT_TOLERANCE)
        assert measured_sources(measured) == ["embedding", "block:1", "block:2"]


def test_the_runner_puts_its_graphs_back_when_the_sampled_forward_raises() -> None:
    def broken(*_args: Any) -> Any:
        raise RuntimeError("out of memory")

    sampler = _sampler(Body(CallbackLayer, [1, 3, 4]), every=1)
    runner = GraphRunner(broken)  # type: ignore[arg-type]
    sampler.install_runner(runner)
    with pytest.raises(RuntimeError, match="out of memory"):  # SGLang's error, unchanged
        runner.forward(_batch())
    assert runner.prefill_cuda_graph_runner is runner.graphs and sampler.failed is None


def test_nothing_is_sampled_once_another_hooks_failure_switched_tracing_off() -> None:
    """The runner's and the layers' wrappers run outside the hooks' guard: once tracing is off no
    prefill runs eagerly for a sample and no layer is armed."""
    state = {"enabled": True}
    body = Body(CallbackLayer, [1, 3, 4])
    sampler = _sampler(body, every=2, tracing=lambda: state["enabled"])
    runner = GraphRunner(body)
    sampler.install_runner(runner)
    for _ in range(2):
        out = runner.forward(_batch())
        if sampler.active is not None:
            sampler.finish(out)
    assert (sampler.sampled, runner.eager) == (1, 1)
    state["enabled"] = False
    for _ in range(4):
        assert runner.forward(_batch()) is None  # the graph replays
        assert all("forward" not in layer.__dict__ for layer in body.layers[1:])
    _forward(body, sampler, _batch())  # a body called directly decides in its first layer: nothing
    assert (sampler.sampled, runner.eager, runner.replays) == (1, 1, 5)
    assert runner.prefill_cuda_graph_runner is runner.graphs


def test_a_failure_inside_the_sampler_stops_it_and_leaves_the_forward_alone() -> None:
    errors: list[BaseException] = []
    body = Body(CallbackLayer, [1, 3, 4])
    sampler = _sampler(body, errors=errors)
    sampler._slots[0].rows = torch.zeros(1)  # the next index_select into it raises
    sampler._slots[1].rows = torch.zeros(1)
    reference = Body(CallbackLayer, [1, 3, 4])
    reference.load_state_dict(body.state_dict())
    out, want = _forward(body, sampler, _batch()), _forward(reference, None, _batch())
    assert torch.equal(out[0], want[0])
    assert torch.equal(torch.cat(list(out[1]), -1), torch.cat(list(want[1]), -1))
    assert len(errors) == 1 and sampler.failed is not None
    _forward(body, sampler, _batch())
    assert sampler.sampled == 1 and len(errors) == 1  # off from there on


def test_the_real_decoder_layers_take_a_capture_the_sampler_knows() -> None:
    from sglang.srt.models.deepseek_v2 import DeepseekV2DecoderLayer
    from sglang.srt.models.glm4_moe import Glm4MoeDecoderLayer
    from sglang.srt.models.gpt_oss import GptOssDecoderLayer
    from sglang.srt.models.llama import LlamaDecoderLayer
    from sglang.srt.models.qwen2 import Qwen2DecoderLayer
    from sglang.srt.models.qwen3 import Qwen3DecoderLayer

    assert layer_style(DeepseekV2DecoderLayer.forward) == "collector"
    for cls in (LlamaDecoderLayer, Qwen2DecoderLayer, Qwen3DecoderLayer, GptOssDecoderLayer,
                Glm4MoeDecoderLayer):
        assert layer_style(cls.forward) == "callback", cls


def _analysis() -> Any:
    from hs_tracer.export.analysis import Analysis, ExportSetup
    from hs_tracer.records import Ranks, WiringRecord

    wiring = WiringRecord("m", "LlamaForCausalLM", LAYERS, H, [1, 3, 4], ["block:0", "block:2", "block:3"])
    return Analysis(ExportSetup(wiring, Ranks(), [], {}, None, 0.0, None, "127.0.0.1"))


def test_samples_travel_to_the_export_process_and_pool_into_the_measurement() -> None:
    """A sample as the recorder queues it, read by the export process's worker: the report's
    ``measured_identity`` names each slot; later samples pool (up to 64 rows)."""
    from hs_tracer.export import channel
    from hs_tracer.export.process import _Worker

    body = Body(CallbackLayer, [1, 3, 4])
    sampler = _sampler(body)
    worker = _Worker.__new__(_Worker)
    worker.analysis = _analysis()
    reader = channel.Reader()
    for seed in range(10):
        _forward(body, sampler, _batch(), seed=seed)
        (sample,) = sampler.landed()
        data = b"".join(bytes(p) for p in channel.frame("identity", {"sources": sample.sources},
                                                         [sample.candidates, sample.slots]))
        for kind, meta, arrays in reader.feed(data):
            worker.take(kind, meta, arrays)
    out = worker.analysis.report_json()["measured_identity"]
    assert out["samples"] == 10
    assert [s["sources"] for s in out["slots"]] == [["block:0"], ["block:2"], ["block:3"]]
    assert all(s["rows"] == 64 and s["error"] <= EXACT_TOLERANCE for s in out["slots"])
    assert all(s["runner_up_error"] > 0.05 for s in out["slots"])


def test_no_measurement_is_reported_as_none() -> None:
    assert _analysis().report_json()["measured_identity"] is None


def test_loops_that_capture_the_inputs_sum_before_the_call_are_measured_too() -> None:
    """The older loops (SGLang up to 0.5.13's DeepSeek loop, for one): the candidate of layer ``i``
    is ``hidden_states + residual`` of its inputs, and the last block's output (``block:4``) is read
    from what the last layer returns."""
    body = ResidualBody(ResidualLayer, [1, 3, 4])
    sampler = _sampler(body)
    _forward(body, sampler, _batch())
    names, measured = _measure(sampler)
    assert names == ["embedding", "block:0", "block:1", "block:2", "block:3", "block:4", "final_norm"]
    assert measured == ["block:0", "block:2", "block:3"]
    late = ResidualBody(ResidualLayer, [0, 1, 3], lambda ls: [lay + 1 for lay in ls])
    sampler = _sampler(late)
    _forward(late, sampler, _batch())
    assert _measure(sampler)[1] == ["block:0", "block:1", "block:3"]  # recorded: embedding, block:0, block:2


def test_the_rate_is_validated_like_every_other_setting() -> None:
    from hs_tracer import config

    assert config.load({})[0].identity_every == 32  # on by default, 1 in 32 prefill forwards
    assert config.load({"HS_TRACER_IDENTITY_EVERY": "0"})[0].identity_every == 0  # off
    _cfg, errors = config.load({"HS_TRACER_IDENTITY_EVERY": "-1"})
    assert errors == ["HS_TRACER_IDENTITY_EVERY='-1' is out of range; give a whole number between 0 and "
                      "1048576"]
    _cfg, errors = config.load({"HS_TRACER_IDENTITY_EVERY": "often"})
    assert len(errors) == 1 and "HS_TRACER_IDENTITY_EVERY='often' is not an integer" in errors[0]
