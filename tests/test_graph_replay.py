"""The probe's per-step graph replay without a GPU: the C helper compiled and called for real, with
ctypes callbacks standing in for the driver's two entry points, and the launch wrapper around it.

On a GPU the same helper is called with the driver's own ``cuGraphLaunch`` and ``cuStreamIsCapturing``
(benchmarks/graph_launch_gpu.py times it; benchmarks/gpu_check_fingerprint.py checks the digests of
replayed launches)."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from hs_tracer.fingerprint import launch, native
from hs_tracer.fingerprint.ring import DigestRing
from tests.ring_rows import land

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
IS_CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))


class FakeDriver:
    """The two driver calls as C function pointers that record what they were given."""

    def __init__(self) -> None:
        self.launches: list[tuple[int, int]] = []
        self.capture_status = 0
        self.launch_error = 0
        self.capture_error = 0

        def graph_launch(graph_exec: int, stream: int) -> int:
            self.launches.append((graph_exec, stream))
            return self.launch_error

        def stream_is_capturing(_stream: int, status: ctypes._Pointer) -> int:
            status[0] = self.capture_status
            return self.capture_error

        self._fns = (LAUNCH(graph_launch), IS_CAPTURING(stream_is_capturing))  # kept alive
        self.entry = tuple(ctypes.cast(f, ctypes.c_void_p).value for f in self._fns)


@pytest.fixture(scope="module")
def helper(tmp_path_factory: pytest.TempPathFactory):
    module = native.load(tmp_path_factory.mktemp("native"))
    assert module is not None, "the C helper must build wherever the tests run (cc and Python headers)"
    return module


def test_helper_launches_only_outside_a_capture(helper) -> None:
    driver = FakeDriver()
    assert helper.replay(*driver.entry, 0x1234, 0x99) == 0
    assert driver.launches == [(0x1234, 0x99)]
    driver.capture_status = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
    assert helper.replay(*driver.entry, 0x1234, 0x99) == -1
    driver.capture_status = 2  # an invalidated capture: launching would still be wrong
    assert helper.replay(*driver.entry, 0x1234, 0x99) == -1
    assert len(driver.launches) == 1
    driver.capture_status, driver.capture_error = 0, 709
    assert helper.replay(*driver.entry, 0x1234, 0x99) == 709  # the driver's error, nothing launched
    driver.capture_error, driver.launch_error = 0, 400
    assert helper.replay(*driver.entry, 0x1234, 0x99) == 400
    with pytest.raises(ValueError, match="NULL"):
        helper.replay(0, driver.entry[1], 1, 2)
    with pytest.raises(TypeError):
        helper.replay(*driver.entry, 1)


def test_helper_is_built_once_and_kept(tmp_path: Path) -> None:
    first = native.load(tmp_path)
    built = sorted(p.name for p in tmp_path.iterdir())
    assert first is not None and built == [native.built_path(tmp_path).name]
    assert native.load(tmp_path) is first


def test_without_a_compiler_the_helper_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.INFO, logger="hs_tracer"):
        assert native.load(tmp_path / "nowhere") is None
    assert "through ctypes" in caplog.text
    assert list((tmp_path / "nowhere").iterdir()) == []  # the failed build's temporary file is gone


class FakeGraph:
    """What GraphLaunch reads of a torch CUDAGraph."""

    def __init__(self) -> None:
        self.replays = 0

    def raw_cuda_graph_exec(self) -> int:
        return 0xE0

    def replay(self) -> None:
        self.replays += 1


def test_graph_launch_uses_the_helper(helper, monkeypatch: pytest.MonkeyPatch) -> None:
    driver = FakeDriver()
    monkeypatch.setattr(launch, "_driver_entry_points", lambda: driver.entry)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0x500 + index, raising=False)
    monkeypatch.setattr(native, "load", lambda: helper)
    graph = FakeGraph()
    g = launch.GraphLaunch(graph, device_index=3)
    assert g.way == "native"
    assert g.replay() is True and driver.launches == [(0xE0, 0x503)]
    driver.capture_status = 1
    assert g.replay() is False and len(driver.launches) == 1
    driver.capture_status, driver.launch_error = 0, 1
    with pytest.raises(RuntimeError, match="CUresult 1"):
        g.replay()
    assert graph.replays == 0


def test_graph_launch_falls_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_driver_entry_points", lambda: None)
    monkeypatch.setattr(launch, "_driver_graph_launch", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    capturing = [False]
    monkeypatch.setattr(launch, "stream_capturing", lambda: capturing[0])
    graph = FakeGraph()
    g = launch.GraphLaunch(graph, device_index=0)
    assert g.way == "torch"
    assert g.replay() is True and graph.replays == 1
    capturing[0] = True
    assert g.replay() is False and graph.replays == 1


def test_ring_takes_back_a_note_whose_launch_did_not_happen() -> None:
    """The step path notes a launch before it replays; a replay refused (the stream was capturing)
    takes the note back, and the next launch gets that launch number and row."""
    ring = DigestRing(1, 8, 4, torch.device("cpu"), pinned=False, programs=1)
    ring.note(10, 6)
    ring.note(11, 6)
    ring.unnote()
    ring.note(12, 5)
    assert ring.launched == 2
    for seq, tokens in ((1, 6), (2, 5)):  # what the kernel writes for launches 1 and 2
        land(ring, seq, 0.0, rows=tokens)
    steps, counted, _raws = ring.drain_block()
    assert steps.tolist() == [10, 12] and counted.tolist() == [6, 5] and ring.dropped == 0
    assert np.array_equal(ring.drain_block()[0], [])
