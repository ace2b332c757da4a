"""Fingerprint definition, torch reference and the CPU probe against a float64 numpy ground truth.

Inputs are fresh random data on every run; a failure message carries the seed
(HS_TRACER_TEST_SEED=<seed> reproduces it). The Triton kernel is tested in
test_fingerprint_triton.py (interpreter) and on the GPU by benchmarks/gpu_check_fingerprint.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hs_tracer.fingerprint.probe import FingerprintProbe
from hs_tracer.fingerprint.reference import ChannelAccumulators, fingerprint_host, fingerprint_reference
from hs_tracer.fingerprint.stats import ChannelStats, StepDigest, merge_digest_raw
from hs_tracer.fingerprint.verify import (
    RTOL,
    channel_errors,
    digest_errors,
    fingerprint_float64,
    fresh_seed,
    random_draft_input,
    within_tolerance,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (N, K, H): the full N range with narrow H, DeepSeek-V3 width with few rows.
SIZES = [(1, 1, 64), (2, 4, 64), (17, 3, 64), (256, 2, 64), (1000, 3, 64), (4096, 4, 64),
         (1, 3, 7168), (3, 2, 7168), (16, 3, 7168), (64, 1, 7168)]


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = fresh_seed()
    return np.random.default_rng(seed), seed


def _check(x: torch.Tensor, k: int, h: int, raw: np.ndarray, stats: ChannelStats, rtol: float,
           seed: int) -> None:
    ref_raw, ref_stats, abs_sum = fingerprint_float64(x.double().numpy(), k, h)
    d_err = digest_errors(raw, ref_raw, abs_sum)
    c_err = channel_errors(stats, ref_stats, abs_sum)
    assert within_tolerance(d_err, rtol), f"digest errors {d_err} over rtol {rtol} (seed {seed})"
    assert within_tolerance(c_err, rtol), f"channel errors {c_err} over rtol {rtol} (seed {seed})"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compute", ["float32", "float64"])
def test_reference_matches_float64_numpy(rng, dtype: str, compute: str) -> None:
    gen, seed = rng
    for n, k, h in SIZES:
        x = random_draft_input(gen, n, k, h, DTYPES[dtype])
        acc = ChannelAccumulators.zeros(k, h, "cpu")
        raw = fingerprint_reference(x, k, h, acc, getattr(torch, compute)).double().numpy()
        _check(x, k, h, raw, acc.to_stats(), RTOL[compute], seed)


@pytest.mark.parametrize("nonfinite", [False, True], ids=["finite", "nonfinite"])
def test_host_path_matches_float64_numpy(rng, nonfinite: bool) -> None:
    """The probe's CPU path: unmasked pass for finite input, reference on NaN/Inf."""
    gen, seed = rng
    for n, k, h in SIZES:
        x = random_draft_input(gen, n, k, h, torch.bfloat16, nonfinite=nonfinite)
        acc = ChannelAccumulators.zeros(k, h, "cpu")
        raw = fingerprint_host(x, k, h, acc).numpy()
        _check(x, k, h, raw, acc.to_stats(), RTOL["float64"], seed)
    with pytest.raises(ValueError, match="runs on CPU tensors"):
        fingerprint_host(torch.zeros((1, 8), device="meta"), 1, 8)


def test_nonfinite_values_are_counted_and_do_not_poison(rng) -> None:
    gen, seed = rng
    k, h = 2, 64
    clean = random_draft_input(gen, 8, k, h, torch.float32, nonfinite=False)
    dirty = torch.cat([clean, torch.full((2, k * h), float("nan")), torch.full((1, k * h), float("inf"))])
    dirty[0, 5] = float("-inf")
    acc = ChannelAccumulators.zeros(k, h, "cpu")
    raw = fingerprint_reference(dirty, k, h, acc, torch.float64).numpy()
    expect = clean.clone()
    expect[0, 5] = 0.0  # the lone -inf is excluded, its row's other values still count
    ref_raw, _, _ = fingerprint_float64(expect.double().numpy(), k, h)
    assert np.isfinite(raw).all()
    np.testing.assert_allclose(raw[:, 1:4], ref_raw[:, 1:4], rtol=1e-12, err_msg=f"seed {seed}")
    assert raw[:, 4].tolist() == [3 * h + 1, 3 * h]  # two NaN rows, one Inf row, one lone -inf
    assert raw[:, 0].tolist() == [8 * h - 1, 8 * h]
    assert acc.count[0, 5].item() == 7 and acc.count[0, 4].item() == 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_of_halves_equals_whole(rng, dtype: str) -> None:
    gen, seed = rng
    k, h, n = 3, 64, 301
    x = random_draft_input(gen, n, k, h, DTYPES[dtype])
    cut = int(gen.integers(1, n))
    parts = []
    for rows in (x[:cut], x[cut:], x):
        acc = ChannelAccumulators.zeros(k, h, "cpu")
        raw = fingerprint_reference(rows, k, h, acc, torch.float64).numpy()
        parts.append((rows.shape[0], raw, acc.to_stats()))
    (n1, raw1, st1), (n2, raw2, st2), (nw, raw_w, st_w) = parts
    np.testing.assert_allclose(merge_digest_raw(raw1, raw2), raw_w, rtol=1e-12, err_msg=f"seed {seed}")
    merged = st1.merge(st2)
    assert np.array_equal(merged.count, st_w.count)
    np.testing.assert_allclose(merged.sum, st_w.sum, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(merged.sumsq, st_w.sumsq, rtol=1e-12)
    d = StepDigest.from_raw(n1, raw1).merge(StepDigest.from_raw(n2, raw2))
    whole = StepDigest.from_raw(nw, raw_w)
    assert d.tokens == whole.tokens == n
    for a, b in zip(d.slots, whole.slots, strict=True):
        assert (a.count, a.nonfinite, a.absmax) == (b.count, b.nonfinite, b.absmax)
        assert a.mean == pytest.approx(b.mean, rel=1e-9, abs=1e-12)
        assert a.rms == pytest.approx(b.rms, rel=1e-9)


def test_merge_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="cannot merge raw digests"):
        merge_digest_raw(np.zeros((3, 5)), np.zeros((2, 5)))


def test_probe_cpu_steps_windows_and_ring(rng) -> None:
    gen, seed = rng
    k, h = 3, 96
    probe = FingerprintProbe(k, h, "cpu", ring_size=4)
    steps = [random_draft_input(gen, int(gen.integers(1, 40)), k, h, torch.bfloat16) for _ in range(3)]
    for i, x in enumerate(steps):
        assert probe.observe(x, step_id=100 + i)
    got = probe.drain()
    assert [s for s, _ in got] == [100, 101, 102]
    for (_, digest), x in zip(got, steps, strict=True):
        ref_raw, _, abs_sum = fingerprint_float64(x.double().numpy(), k, h)
        assert digest.tokens == x.shape[0]
        assert within_tolerance(digest_errors(digest.raw(), ref_raw, abs_sum), 1e-9), f"seed {seed}"
    assert probe.drain() == []

    assert probe.read_window() is None  # no window closed yet
    probe.end_window()
    window = probe.read_window()
    assert window is not None and probe.read_window() is None
    _, ref_stats, abs_sum = fingerprint_float64(torch.cat(steps).double().numpy(), k, h)
    assert within_tolerance(channel_errors(window, ref_stats, abs_sum), 1e-12), f"seed {seed}"

    # Handed out unmerged (the recorder's way, for the export process to add up): the same sums,
    # each window once.
    for x in steps:
        assert probe.observe(x, step_id=200)
    probe.drain()
    probe.end_window()
    (slot, landed), = probe.landed_windows()
    assert probe.landed_windows() == [] and probe.read_window() is None
    probe.release_windows([slot])
    np.testing.assert_allclose(landed.sum, window.sum, rtol=1e-12)
    np.testing.assert_array_equal(landed.count, window.count)
    acc = ChannelStats.zeros(k, h)
    acc.add(landed)
    acc.add(window)
    np.testing.assert_allclose(acc.sum, 2 * window.sum, rtol=1e-12)
    acc.clear()
    assert not acc.count.any() and not acc.sumsq.any()

    # Empty batch (idle step) and a single H-wide input (the classic width mismatch).
    assert probe.observe(torch.zeros((0, k * h), dtype=torch.bfloat16), step_id=7)
    assert not probe.observe(torch.zeros((5, h)), step_id=8)
    assert (probe.width_mismatches, probe.last_width) == (1, h)
    (step, empty), = probe.drain()
    assert step == 7 and empty.tokens == 0 and all(s.count == 0 for s in empty.slots)

    # Bounded: six steps into a ring of four drop the two oldest.
    for i in range(6):
        probe.observe(steps[0], step_id=i)
    assert [s for s, _ in probe.drain()] == [2, 3, 4, 5]
    assert probe.dropped == 2


def test_probe_cpu_window_steps_and_merge_of_windows(rng) -> None:
    gen, seed = rng
    k, h = 2, 64
    probe = FingerprintProbe(k, h, "cpu", window_steps=3)
    xs = [random_draft_input(gen, 5, k, h, torch.float32) for _ in range(6)]
    windows = []
    for i, x in enumerate(xs):
        probe.observe(x, i)
        if (i + 1) % 3 == 0:
            windows.append(probe.read_window())
    assert all(w is not None for w in windows)
    first_raw, _, _ = fingerprint_float64(torch.cat(xs[:3]).numpy(), k, h)
    assert windows[0].count.sum() == first_raw[:, 0].sum()
    _, whole, abs_sum = fingerprint_float64(torch.cat(xs).double().numpy(), k, h)
    merged = windows[0].merge(windows[1])
    assert within_tolerance(channel_errors(merged, whole, abs_sum), 1e-12), f"seed {seed}"


def test_probe_rejects_wrong_device_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        FingerprintProbe(0, 64, "cpu")
    probe = FingerprintProbe(1, 8, "cpu")
    with pytest.raises(ValueError, match="probe lives on"):
        probe.observe(torch.zeros((1, 8), device="meta"), 0)
