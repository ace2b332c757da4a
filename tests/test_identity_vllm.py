"""vLLM's identity sampler (hs_tracer/integrations/vllm/identity.py) on a model body that loops as
vLLM's ``LlamaModel`` does (layers take and return ``(hidden_states, residual)``; the aux states are
``hidden_states + residual`` entering each layer id of ``aux_hidden_state_layers``), with torch only.
The real engine runs it in tests/on_vllm/test_vllm_engine.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hs_tracer.config import TracerConfig
from hs_tracer.diagnosis.same_token import EXACT_TOLERANCE, identify, measured_sources
from hs_tracer.integrations.vllm import identity
from hs_tracer.integrations.vllm.identity import IdentitySampler
from hs_tracer.integrations.vllm.state import TracerState

H, LAYERS = 96, 5  # wider than the projection (64 dims)


class Norm(nn.Module):
    """Like vLLM's ``RMSNorm``: with a residual, it returns the normalised sum and the sum."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        s = x if residual is None else x + residual
        normed = s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        return normed if residual is None else (normed, s)


class Layer(nn.Module):
    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.input_layernorm = Norm()
        torch.nn.init.normal_(self.lin.weight, std=0.3, generator=torch.Generator().manual_seed(i))

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return torch.tanh(self.lin(hidden_states)), residual


class Body(nn.Module):
    """Captures ``shift(aux_hidden_state_layers)`` (the identity: as recorded)."""

    def __init__(self, aux: tuple[int, ...], shift: Any = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, H)
        self.layers = nn.ModuleList(Layer(i) for i in range(LAYERS))
        self.norm = Norm()
        self.aux_hidden_state_layers = aux
        self.shift = shift or (lambda ids: ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors: Any = None,
                inputs_embeds: Any = None) -> Any:
        h, residual, aux = self.embed(input_ids), None, []
        wanted = self.shift(self.aux_hidden_state_layers)
        if 0 in wanted:
            aux.append(h)
        for i, layer in enumerate(self.layers):
            h, residual = layer(positions, h, residual)
            if i + 1 in wanted:
                aux.append(h + residual)
        h, _ = self.norm(h, residual)
        return h, aux


def _sampler(body: Body, every: int = 1, errors: list[BaseException] | None = None) -> IdentitySampler:
    sampler = IdentitySampler(body, every, LAYERS, H, len(body.aux_hidden_state_layers), "cpu",
                              torch.float32, record=True, fail=(errors if errors is not None else []).append,
                              tracing=lambda: True)
    assert sampler.install()
    return sampler


def _forward(body: Body, n: int = 13, seed: int = 0) -> Any:
    ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return body(ids, torch.arange(n))


def _measure(sampler: IdentitySampler) -> list[str | None]:
    (sample,) = sampler.landed()
    cands = {n: torch.from_numpy(sample.candidates[i]) for i, n in enumerate(sample.sources)}
    return measured_sources(identify(torch.from_numpy(sample.slots), cands, EXACT_TOLERANCE))


def test_every_slot_is_named_as_fed_and_the_candidates_cover_the_body() -> None:
    body = Body((0, 2, 5))
    sampler = _sampler(body)
    _forward(body)
    (sample,) = sampler.landed()
    assert sample.sources == ["embedding", "block:0", "block:1", "block:2", "block:3", "block:4",
                              "final_norm"]
    assert sample.candidates.shape == (7, 8, 64) and sample.slots.shape == (8, 3, 64)
    _forward(body, seed=1)
    assert _measure(sampler) == ["embedding", "block:1", "block:4"]


def test_a_loop_capturing_after_the_layer_is_named_one_layer_late() -> None:
    body = Body((1, 2, 4), shift=lambda ids: [i + 1 for i in ids])
    sampler = _sampler(body)
    _forward(body)
    assert _measure(sampler) == ["block:1", "block:2", "block:4"]


def test_one_forward_in_every_is_sampled_and_others_see_no_layer_wrapper() -> None:
    body = Body((1, 2, 4))
    sampler = _sampler(body, every=3)
    for seed in range(7):
        _forward(body, seed=seed)
        assert all("forward" not in layer.__dict__ for layer in body.layers)
        sampler.landed()
    assert sampler.sampled == 3 and sampler.recorded == 3


def test_a_failure_inside_the_sampler_is_reported_once_and_the_forward_is_unchanged() -> None:
    errors: list[BaseException] = []
    body = Body((1, 2, 4))
    sampler = _sampler(body, errors=errors)
    for slot in sampler._slots:
        slot.rows = torch.zeros(1)  # the next index_select into it raises
    reference = Body((1, 2, 4))
    reference.load_state_dict(body.state_dict())
    out, want = _forward(body), _forward(reference)
    assert torch.equal(out[0], want[0])
    assert torch.equal(torch.cat(out[1], -1), torch.cat(want[1], -1))
    assert len(errors) == 1 and sampler.failed is not None
    _forward(body)
    assert sampler.sampled == 1 and len(errors) == 1  # off from there on


def test_nothing_is_sampled_once_another_hooks_failure_switched_tracing_off() -> None:
    """The body's wrapper runs outside the hooks' guard: the sampler reads the state's enabled flag."""
    body = Body((1, 2, 4))
    st = TracerState(TracerConfig(identity_every=1), aux={"layer_ids": [1, 2, 4]},
                     target={"num_layers": LAYERS, "hidden_size": H, "device": "cpu", "dtype": torch.float32})
    sampler = identity.install(st, body)
    assert sampler is not None
    _forward(body)
    assert sampler.sampled == 1 and len(sampler.landed()) == 1
    st.fail("some other hook", RuntimeError("boom"))
    reference = Body((1, 2, 4))
    reference.load_state_dict(body.state_dict())
    for seed in range(3):
        out, want = _forward(body, seed=seed), _forward(reference, seed=seed)
        assert torch.equal(out[0], want[0])
        assert all("forward" not in layer.__dict__ for layer in body.layers)
    assert sampler.sampled == 1 and sampler.landed() == [] and sampler.failed is None


def test_a_compiled_body_is_sampled_through_the_op_the_compiler_keeps() -> None:
    """vLLM's default: the body compiled (``do_not_compile`` False). The layers' input norms and the
    final norm keep wrappers that Dynamo inlines; their op survives AOTAutograd's dead-code pass
    (nothing reads its result) and
    its host side samples one forward in ``every``, as the eager path does; the compiled forward's
    results are unchanged."""
    body = Body((0, 2, 5))
    body.do_not_compile = False
    reference = Body((0, 2, 5))
    reference.load_state_dict(body.state_dict())
    sampler = _sampler(body, every=2)
    assert sampler.mode == "compiled"
    assert all("forward" in layer.input_layernorm.__dict__ for layer in body.layers)
    compiled = torch.compile(Body.forward.__get__(body), backend="aot_eager", fullgraph=True, dynamic=True)
    measured = []
    for seed, n in enumerate((13, 9, 21)):
        ids = torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            out, want = compiled(ids, torch.arange(n)), reference(ids, torch.arange(n))
        assert torch.allclose(out[0], want[0], atol=1e-5)
        if sampler.active is not None:  # what the body's wrapper does with the compiled result
            sampler.finish(out)
            measured.append(_measure(sampler))
    assert sampler.sampled == sampler.recorded == 2
    assert measured == [["embedding", "block:1", "block:4"]] * 2
