"""Same-token identity: a slot's rows are named by the candidate they equal, ties and misses said so."""

from __future__ import annotations

import pytest
import torch

from hs_tracer.diagnosis.same_token import identify, split_slots, tolerance_for


def _stream(n: int = 64, h: int = 32, layers: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    """A residual stream: each block adds an update of a tenth of the stream's size."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g)
    out = {"embedding": x.clone()}
    for j in range(layers):
        x = x + 0.1 * x.norm(dim=1, keepdim=True) / h**0.5 * torch.randn(n, h, generator=g)
        out[f"block:{j}"] = x.clone()
    return out


def test_each_slot_is_named_by_the_candidate_its_rows_equal_after_bf16_rounding():
    cands = _stream()
    fed = ["embedding", "block:2", "block:3"]
    rows = torch.stack([cands[s].bfloat16() for s in fed], dim=1)
    got = identify(rows, cands, tolerance_for(torch.bfloat16))
    assert [m.source for m in got] == fed
    assert got[1].runner_up in ("block:1", "block:3")


def test_a_neighbour_one_layer_late_is_told_apart_exactly():
    cands = _stream()
    rows = torch.stack([cands["block:4"], cands["block:5"]], dim=1)
    got = identify(rows, cands, tolerance_for(torch.float32))
    assert [m.source for m in got] == ["block:4", "block:5"]


def test_two_candidates_with_equal_values_are_named_together_never_one_picked():
    cands = _stream()
    cands["block:5"] = cands["block:4"].clone()  # a layer that adds nothing
    got = identify(cands["block:4"][:, None], cands, tolerance_for(torch.float32))[0]
    assert got.source is None and got.sources == ("block:4", "block:5")


def test_rows_from_no_candidate_are_not_named():
    cands = _stream()
    other = torch.randn(64, 1, 32)
    got = identify(other, cands, tolerance_for(torch.float32))[0]
    assert got.sources == () and got.fed_none and "none of the target's layers" in got.describe()
    assert got.runner_up != got.nearest


def test_shapes_are_checked():
    cands = _stream()
    with pytest.raises(ValueError):
        identify(torch.zeros(64, 1, 16), cands, 0.02)
    with pytest.raises(ValueError):
        split_slots(torch.zeros(4, 10), 3)


def test_a_slot_fed_none_of_the_layers_is_tested_for_the_channel_transforms():
    """Rows that equal no candidate are named by the transform of one that explains them: a channel
    value (the residual left out, a norm: given as computed), a shard of the hidden size, a scale."""
    from hs_tracer.diagnosis.same_token import explain

    cands = _stream()
    tol = tolerance_for(torch.float32)
    normed = cands["block:3"] / cands["block:3"].norm(dim=1, keepdim=True)
    half = torch.cat([cands["block:2"][:, :16], torch.randn(64, 16)], dim=1)
    cases = {"input_norm": normed, "shard": half, "scale": 3.0 * cands["block:4"]}
    for want, rows in cases.items():
        m = identify(rows[:, None], cands, tol)[0]
        assert m.fed_none and m.source is None
        got = explain(m, rows, cands, {"input_norm": {"block:3": normed}})
        assert got.transform is not None and got.transform["transform"] == want, (want, got.transform)
        assert want.replace("_", " ") in " ".join(got.tested).replace("_", " ")
        assert "none of the target's layers" in got.describe() and got.transform["words"] in got.describe()
    assert explain(m, rows, cands, shards=False).tested == ("scale",)
    noise = torch.randn(64, 32)
    m = explain(identify(noise[:, None], cands, tol)[0], noise, cands)
    assert m.transform is None and "no tested transform" in m.describe()
    named = identify(cands["block:1"][:, None], cands, tol)[0]
    assert explain(named, cands["block:1"], cands) is named  # a named slot is left as it is
