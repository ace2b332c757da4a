"""The capture sink without an engine: sampling, shard layout, permissions, rotation, the size bound.

The end-to-end path (real engine, real hooks) is in tests/test_replay_engine.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from hs_tracer.export.capture import CaptureSink, Sampler
from hs_tracer.profile.capture_format import iter_shards, read_manifest
from hs_tracer.records import Ranks, WiringRecord

K, H = 3, 16


def _wiring() -> WiringRecord:
    return WiringRecord(model="tiny", target_arch="DeepseekV3ForCausalLM", num_layers=8, hidden_size=H,
                        layers_to_capture=[2, 4, 5], sources=["block:1", "block:3", "block:4"],
                        configured_layer_ids=[1, 3, 4], engine_version="0.5.23")


def _prefill(extend: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = sum(extend)
    return (torch.randn(n, K * H, generator=g).to(torch.bfloat16),
            torch.randint(0, 100, (n,), generator=g), torch.randint(0, 100, (len(extend),), generator=g))


@pytest.mark.parametrize("rate,taken", [(0.0, 0), (0.25, 25), (0.1, 10), (1.0, 100)])
def test_sampler_takes_the_fraction_deterministically(rate: float, taken: int) -> None:
    s = Sampler(rate)
    picks = [s.take() for _ in range(100)]
    assert sum(picks) == taken
    if taken:
        assert picks[0], "the first step is taken so short runs capture something"


def test_prefill_shard_layout_and_permissions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "cap"
    with caplog.at_level(logging.WARNING, logger="hs_tracer"):
        sink = CaptureSink(root, _wiring(), rate=1.0, max_bytes=1 << 20, target_path="/models/t")
    warnings = [r.getMessage() for r in caplog.records if "user data" in r.getMessage()]
    assert len(warnings) == 1 and str(root) in warnings[0]

    feats, ids, nxt = _prefill([5, 7])
    sink.offer_prefill(feats, ids, nxt, prefix_lens=[0, 3], extend_lens=[5, 7])
    assert not any(root.glob("*.safetensors")), "nothing is written on the scheduler thread"
    sink.note_accept_lengths([2, 3])
    assert sink.poll() == 1

    m = read_manifest(root)
    assert (m.model, m.sources, m.sample_rate, m.rows) == ("tiny", ["block:1", "block:3", "block:4"], 1.0,
                                                           "prefill_draft_extend")
    assert m.wiring["configured_layer_ids"] == [1, 3, 4] and m.sglang_version == "0.5.23"
    assert m.target_path == "/models/t" and m.dtype == "bfloat16"
    ((_name, shard),) = list(iter_shards(root, m))
    assert np.array_equal(shard.features, feats.float().numpy())
    assert np.array_equal(shard.input_ids, ids.numpy())
    assert shard.positions.tolist() == [0, 1, 2, 3, 4, 3, 4, 5, 6, 7, 8, 9]
    assert shard.extras["extend_lens"].tolist() == [5, 7]
    assert shard.extras["next_token_ids"].tolist() == nxt.tolist()
    assert shard.accept_lengths.tolist() == [2, 3]

    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for f in root.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_copy_is_taken_at_offer_time(tmp_path: Path) -> None:
    """SGLang reuses its buffers: the sink must hold its own copy, not a view."""
    sink = CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=1 << 20)
    feats, ids, nxt = _prefill([4])
    expected = feats.float().clone()
    sink.offer_prefill(feats, ids, nxt, [0], [4])
    feats.zero_()
    sink.poll()
    ((_n, shard),) = list(iter_shards(tmp_path))
    assert np.array_equal(shard.features, expected.numpy())


def test_rotation_keeps_the_directory_under_the_bound(tmp_path: Path) -> None:
    one = 64 * K * H * 2  # bytes of one 64-row bf16 shard's features
    bound = 3 * one + 8192
    sink = CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=bound)
    for i in range(8):
        feats, ids, nxt = _prefill([64], seed=i)
        sink.offer_prefill(feats, ids, nxt, [0], [64])
        sink.poll()
        assert sink.disk_bytes() <= bound
    m = read_manifest(tmp_path)
    names = [s["file"] for s in m.shards]
    assert 1 <= len(names) < 8
    assert names[-1] == "capture_00007.safetensors", "the newest shard is kept, names are not reused"
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted(names)
    last = list(iter_shards(tmp_path, m))[-1][1]
    assert np.array_equal(last.features, _prefill([64], seed=7)[0].float().numpy())


def test_oversized_capture_is_skipped_and_counted(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=4096 + 100)
    feats, ids, nxt = _prefill([256])
    sink.offer_prefill(feats, ids, nxt, [0], [256])
    sink.poll()
    assert not list(tmp_path.glob("*.safetensors"))
    assert read_manifest(tmp_path).skipped == 1 and sink.dropped == 1


def test_rate_zero_writes_no_shard_and_pending_is_bounded(tmp_path: Path) -> None:
    off = CaptureSink(tmp_path / "off", _wiring(), rate=0.0, max_bytes=1 << 20)
    feats, ids, nxt = _prefill([8])
    off.offer_prefill(feats, ids, nxt, [0], [8])
    off.flush()
    assert not list((tmp_path / "off").glob("*.safetensors"))

    busy = CaptureSink(tmp_path / "busy", _wiring(), rate=1.0, max_bytes=1 << 20)
    for _ in range(10):  # the recorder never polls: at most MAX_PENDING copies are held
        busy.offer_prefill(feats, ids, nxt, [0], [8])
    assert len(busy.pending) < 10 and busy.dropped == 10 - len(busy.pending)


def test_accept_lengths_alone_are_flushed_and_diagnose_reads_them(tmp_path: Path) -> None:
    from hs_tracer.diagnosis.live import read_live

    sink = CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=1 << 20, ranks=Ranks())
    feats, ids, nxt = _prefill([40])
    sink.offer_prefill(feats, ids, nxt, [0], [40])
    sink.poll()
    sink.note_accept_lengths([1, 2, 4])
    sink.flush()
    m = read_manifest(tmp_path)
    assert [s["tokens"] for s in m.shards] == [40, 0]
    live = read_live(tmp_path, H)
    assert live.tokens == 39  # position 0 is skipped, as in the profile
    assert live.acceptance.steps == 3 and live.acceptance.mean_accept_length == pytest.approx(7 / 3)


def test_other_pp_dp_ranks_write_their_own_subdirectory(tmp_path: Path) -> None:
    sink = CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=1 << 20, ranks=Ranks(pp=1, dp=2))
    assert sink.path == tmp_path / "pp1-dp2"


def test_an_incompatible_existing_capture_is_not_mixed_in(tmp_path: Path) -> None:
    CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=1 << 20)
    CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=1 << 20)  # same wiring: continued
    for change in ({"hidden_size": 32}, {"sources": ["embedding", "block:1", "block:2"]}):
        other = _wiring()
        for key, value in change.items():
            setattr(other, key, value)
        with pytest.raises(ValueError, match="empty directory"):
            CaptureSink(tmp_path, other, rate=1.0, max_bytes=1 << 20)


def test_accept_lengths_are_written_once_steps_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hs_tracer.export import capture

    clock = [100.0]
    monkeypatch.setattr(capture.time, "monotonic", lambda: clock[0])
    sink = CaptureSink(tmp_path, _wiring(), rate=1.0, max_bytes=1 << 20)
    sink.note_accept_lengths([2, 3])
    assert sink.poll() == 0  # steps are still arriving
    clock[0] += capture.ACCEPT_IDLE_S
    assert sink.poll() == 1
    ((_n, shard),) = list(iter_shards(tmp_path))
    assert shard.features.shape[0] == 0 and shard.accept_lengths.tolist() == [2, 3]


def test_an_oversized_prefill_is_refused_before_any_host_copy(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is decided from the shape: no copy, no pinned buffer for a prefill that cannot fit."""
    from hs_tracer.export import capture as capture_mod

    sink = CaptureSink(tmp_path / "cap", _wiring(), rate=1.0, max_bytes=64 * 1024)
    copies: list[object] = []
    monkeypatch.setattr(capture_mod, "_host_copy", lambda t: copies.append(t) or (t.clone(), False))
    big = torch.zeros(4096, 3 * H)
    sink.offer_prefill(big, torch.zeros(4096, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                       [0], [4096])
    assert copies == [] and sink.dropped == 1 and not sink.pending
    sink.poll()
    assert read_manifest(sink.path).skipped == 1


def test_the_manifest_names_the_engine_that_served(tmp_path: Path) -> None:
    """The producer and the engine keys name the real engine; ``sglang_version`` stays for SGLang only."""
    sglang = read_manifest(CaptureSink(tmp_path / "s", _wiring(), rate=1.0, max_bytes=1 << 20).path)
    assert (sglang.engine, sglang.engine_version, sglang.sglang_version) == ("sglang", "0.5.23", "0.5.23")
    assert sglang.producer.endswith(" / sglang 0.5.23")
    vllm = dataclasses.replace(_wiring(), engine="vllm", engine_version="0.11.0", layer_id_source="default")
    m = read_manifest(CaptureSink(tmp_path / "v", vllm, rate=1.0, max_bytes=1 << 20).path)
    assert (m.engine, m.engine_version, m.sglang_version) == ("vllm", "0.11.0", "")
    assert m.producer.endswith(" / vllm 0.11.0") and "sglang" not in m.producer
    assert m.wiring is not None and WiringRecord.from_json(m.wiring) == vllm
    written = json.loads((sink_path := tmp_path / "v" / "manifest.json").read_text())
    assert (written["engine_version"], written["sglang_version"]) == ("0.11.0", "")
    old = json.loads((tmp_path / "s" / "manifest.json").read_text())
    del old["engine"], old["engine_version"]  # a manifest written before the engine keys
    sink_path.write_text(json.dumps(old))
    assert (read_manifest(sink_path.parent).engine_version, read_manifest(sink_path.parent).engine) == \
        ("0.5.23", None)
