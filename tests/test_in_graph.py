"""The fingerprint kernel recorded into the target's CUDA graphs, on the CPU: the ring whose notes
follow the launch, the row count the drain checks, and when the plugin records at all.

The masked kernel itself runs in Triton's interpreter (tests/triton_interpreter_cases.py); recording
into real SGLang graphs, the switch-off on a mismatch and the verdicts it serves are checked on a GPU
(benchmarks/gpu_check_fingerprint.py check 6, benchmarks/gpu_sglang.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from hs_tracer import config
from hs_tracer.fingerprint.probe import kernel_rows
from hs_tracer.fingerprint.reference import fingerprint_host
from hs_tracer.fingerprint.ring import DigestRing, reduce_rows
from hs_tracer.integrations.sglang.state import TracerState
from tests.ring_rows import land as _land


def test_ring_with_notes_after_launches() -> None:
    """The device may run a launch before its note: a landed row waits for its note, the device's
    lead shows in ``device_ahead``, and rows within ``lead`` of reuse count as lost."""
    ring = DigestRing(1, 4, 8, torch.device("cpu"), pinned=False, programs=1, lead=2)
    _land(ring, 1, 1.0)  # launched by a graph replay, not noted yet
    assert ring.device_ahead() == 1 and ring.drain() == []
    ring.note(11, 4)
    assert ring.device_ahead() == 0
    [(step, tokens, raw)] = ring.drain()
    assert (step, tokens, float(raw[0, 1])) == (11, 4, 1.0) and ring.pending() == 0
    for seq in range(2, 12):  # ten launches, noted, the reader asleep
        _land(ring, seq, float(seq))
        ring.note(100 + seq, 1)
    got = ring.drain()
    # of the 8 rows, the 2 of the lead are treated as possibly being overwritten: 6 kept
    assert [s for s, _t, _r in got] == [106, 107, 108, 109, 110, 111] and ring.dropped == 4
    ring.note(200, 1)  # noted, never launched
    assert ring.drain() == [] and ring.pending() == 1 and ring.device_ahead() == -1
    with pytest.raises(ValueError, match="lead"):
        DigestRing(1, 4, 4, torch.device("cpu"), pinned=False, programs=1, lead=4)
    with pytest.raises(ValueError, match="power of two"):
        DigestRing(1, 4, 6, torch.device("cpu"), pinned=False, programs=1)


def test_kernel_rows_from_a_digest() -> None:
    """The row count the drain compares with the step path's: finite plus non-finite values of the
    first slot over H, whatever the data; the kernel's -1 mark stays -1."""
    hidden = 16
    x = torch.randn(5, 2 * hidden)
    x[1, 3] = float("nan")
    x[4, hidden + 2] = float("inf")
    raw = fingerprint_host(x, 2, hidden).numpy()[None]
    marked = np.zeros_like(raw)
    marked[0, :, 0] = -hidden
    assert kernel_rows(np.concatenate([raw, marked]), hidden).tolist() == [5.0, -1.0]


class _Probe:
    def __init__(self) -> None:
        self.recorded: list[tuple[torch.Size, torch.Size]] = []

    def record_in_graph(self, x: torch.Tensor, valid: torch.Tensor) -> bool:
        self.recorded.append((x.shape, valid.shape))
        return True


def _state(topk: int | None = 1, in_graph: bool = True) -> tuple[TracerState, _Probe]:
    st = TracerState(config=config.TracerConfig(in_graph=in_graph))
    probe = _Probe()
    st._probes = (probe, probe)  # type: ignore[assignment]
    if topk is not None:
        st.spec_args = {"speculative_eagle_topk": topk}
    return st, probe


@pytest.mark.parametrize(("mode", "topk", "in_graph", "recorded"), [
    (ForwardMode.TARGET_VERIFY, 1, True, True),
    (ForwardMode.TARGET_VERIFY, None, True, True),  # topk not read yet: the drain still checks
    (ForwardMode.TARGET_VERIFY, 4, True, False),  # a tree gathers the accepted rows anew
    (ForwardMode.TARGET_VERIFY, 1, False, False),  # HS_TRACER_IN_GRAPH=0
    (ForwardMode.DECODE, 1, True, False),
    (ForwardMode.EXTEND, 1, True, False),
])
def test_what_the_plugin_records_into_the_targets_graphs(mode: ForwardMode, topk: int | None,
                                                         in_graph: bool, recorded: bool) -> None:
    st, probe = _state(topk, in_graph)
    batch = SimpleNamespace(forward_mode=mode, out_cache_loc=torch.zeros(12, dtype=torch.int64))
    st.record_in_graph(SimpleNamespace(hidden_states=torch.zeros(12, 48)), batch)
    assert probe.recorded == ([(torch.Size([12, 48]), torch.Size([12]))] if recorded else [])
    st.record_in_graph(SimpleNamespace(hidden_states=None), batch)  # nothing to fingerprint
    st.record_in_graph(SimpleNamespace(hidden_states=torch.zeros(12, 48)), None)
    assert len(probe.recorded) == int(recorded)


def test_in_graph_switch_parses_and_rejects_in_one_line() -> None:
    assert config.load({"HS_TRACER_IN_GRAPH": "0"})[0].in_graph is False
    assert config.load({})[0].in_graph is True
    _cfg, errors = config.load({"HS_TRACER_IN_GRAPH": "maybe"})
    assert errors == ["HS_TRACER_IN_GRAPH='maybe' must be 1 (on) or 0 (off)"]


@pytest.mark.parametrize("use_aux", [True, False])
def test_probes_are_built_before_the_targets_graphs_only_for_eagle3(use_aux: bool) -> None:
    """Built when the target is known (SGLang captures its graphs next) where the target captures aux
    states; a server without them builds nothing then (a plain server never does)."""
    st = TracerState(config=config.TracerConfig())
    st.target = {"architecture": "DeepseekV3ForCausalLM", "model_path": "m", "num_layers": 4,
                 "hidden_size": 16, "layers_to_capture": [1, 2, 3]}
    st.aux = {"use_aux_hidden_state": use_aux, "layer_ids": [1, 2, 3] if use_aux else None}
    st.prepare_probes()
    if not use_aux:
        assert st._probes is None
        return
    decode, prefill = st._probes
    assert decode is prefill and (decode.num_slots, decode.hidden) == (3, 16)


def test_ring_rows_by_their_tags() -> None:
    """A row is complete only when every word it expects carries its launch's tag: a word from an
    older launch means still being written, one from a newer launch means overwritten; tags compare
    modulo 2**32, so the ring keeps working after four billion launches; partials add up per slot."""
    ring = DigestRing(2, 8, 4, torch.device("cpu"), pinned=False, programs=2)
    wrap = 2**32 + 1  # the device's 32-bit tag of this launch is 1
    for launch in (wrap, wrap + 1, wrap + 2):
        _land(ring, launch, float(launch % 7), rows=3)
    words = ring.records.numpy()
    words[(wrap + 1) % 4, 3] = int(words[(wrap + 1) % 4, 3]) - (1 << 32)  # a word still older
    words[(wrap + 2) % 4, 2] = int(words[(wrap + 2) % 4, 2]) + (4 << 32)  # a word of a later launch
    launches = np.array([wrap, wrap + 1, wrap + 2], dtype=np.int64)
    age, rows, raw = reduce_rows(words[launches % 4], launches, 2, 8)
    assert age.tolist() == [0, -1, 1] and rows.tolist() == [3, 3, 3]
    assert raw[0, :, 1].tolist() == [wrap % 7] * 2 and raw[0, :, 0].tolist() == [24.0, 24.0]
