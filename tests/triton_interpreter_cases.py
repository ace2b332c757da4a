"""The fused Triton kernel itself, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Run by tests/test_fingerprint_triton.py in a fresh interpreter with TRITON_INTERPRET=1 set before
Triton is first imported: Triton decorates its own standard library (``tl.zeros``, ...) for the
interpreter only at that first import, which in the main test process happens earlier, through SGLang.

The interpreter executes the same kernel source program by program, so these tests cover its
indexing, masking, non-finite handling, the launch counter, the tagged ring rows the host adds
up, the row-count tiers and the accumulator atomics; speed and the compiled code generation are
covered on the GPU by benchmarks/gpu_check_fingerprint.py. Sizes are small because the interpreter
is slow (~50 ms per program).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np
import pytest
import torch

from hs_tracer.fingerprint.stats import merge_digest_raw
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
# The fast path adds NaN/Inf freely before falling back to the masked scan; numpy warns about that.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning",
                                        "ignore:overflow encountered:RuntimeWarning")


@pytest.fixture(scope="module")
def kernel() -> ModuleType:
    """The kernel module, (re)imported with the interpreter on: triton.jit reads the flag then."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    import hs_tracer.fingerprint.kernel as module

    module = importlib.reload(module)
    yield module
    mp.undo()
    importlib.reload(module)


@pytest.fixture
def rng() -> tuple[np.random.Generator, int]:
    seed = fresh_seed()
    return np.random.default_rng(seed), seed


def _tiers(kernel: ModuleType, *shapes: tuple[int | None, int, int]) -> tuple:
    """Row-count tiers of (most rows, block_h, block_n): small tiles, so the interpreter runs many
    programs and row loops."""
    return tuple((most, kernel.KernelConfig(block_h=bh, block_n=bn, num_warps=1)) for most, bh, bn in shapes)


def _run_and_check(kernel: ModuleType, x: torch.Tensor, k: int, h: int, tiers, seed: int) -> None:
    ws = kernel.FingerprintWorkspace(k, h, "cpu", tiers)
    kernel.fingerprint_fused(x, ws)
    rows, raw = ws.last_digest()
    ref_raw, ref_stats, abs_sum = fingerprint_float64(x.double().numpy(), k, h)
    d_err = digest_errors(raw.astype(np.float64), ref_raw, abs_sum)
    c_err = channel_errors(ws.acc.to_stats(), ref_stats, abs_sum)
    where = f"N={x.shape[0]} K={k} H={h} {x.dtype} {tiers} seed {seed}"
    assert rows == x.shape[0], where
    assert within_tolerance(d_err, RTOL["float32"]), f"digest {d_err} ({where})"
    assert within_tolerance(c_err, RTOL["float32"]), f"channels {c_err} ({where})"
    assert int(ws.own.seq) == 1 << 32, f"launch counter not closed ({where})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_matches_float64_numpy(kernel, rng, dtype: str) -> None:
    gen, seed = rng
    small = _tiers(kernel, (8, 16, 2), (None, 32, 4))  # two tiers, many programs, row loops
    for n, k, h, tiers in [(1, 1, 64, kernel.DEFAULT_TIERS), (3, 4, 64, small), (50, 2, 64, small),
                           (29, 2, 40, small), (37, 3, 48, kernel.DEFAULT_TIERS),
                           (2, 3, 7168, _tiers(kernel, (None, 1024, 2)))]:
        _run_and_check(kernel, random_draft_input(gen, n, k, h, DTYPES[dtype]), k, h, tiers, seed)


def test_kernel_default_tiers_at_deepseek_width(kernel, rng) -> None:
    gen, seed = rng
    _run_and_check(kernel, random_draft_input(gen, 2, 1, 7168, torch.bfloat16), 1, 7168,
                   kernel.DEFAULT_TIERS, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_fast_path_for_finite_rows(kernel, rng, dtype: str) -> None:
    """All-finite programs skip the masking; a lone NaN sends only its program to the masked scan."""
    gen, seed = rng
    tiers = _tiers(kernel, (None, 32, 4))
    x = random_draft_input(gen, 40, 2, 64, DTYPES[dtype], nonfinite=False)
    _run_and_check(kernel, x, 2, 64, tiers, seed)
    x[int(gen.integers(40)), int(gen.integers(128))] = float("nan")
    _run_and_check(kernel, x, 2, 64, tiers, seed)


def test_kernel_strided_rows_and_repeat_launches(kernel, rng) -> None:
    """A row-strided view (e.g. one row per request) is read in place; a second launch gets a fresh
    digest (the next launch number, no memset) while the window sums keep adding."""
    gen, seed = rng
    k, h = 2, 64
    full = random_draft_input(gen, 40, k, h, torch.float16)
    x = full[::4]
    ws = kernel.FingerprintWorkspace(k, h, "cpu", _tiers(kernel, (None, 32, 4)))
    kernel.fingerprint_fused(x, ws)
    first = ws.last_digest()[1].astype(np.float64)
    y = random_draft_input(gen, 9, k, h, torch.float16)
    kernel.fingerprint_fused(y, ws)
    second = ws.last_digest()[1].astype(np.float64)
    ref_x, stats_x, abs_x = fingerprint_float64(x.double().numpy(), k, h)
    ref_y, stats_y, abs_y = fingerprint_float64(y.double().numpy(), k, h)
    rtol = RTOL["float32"]
    assert within_tolerance(digest_errors(first, ref_x, abs_x), rtol), f"seed {seed}"
    assert within_tolerance(digest_errors(second, ref_y, abs_y), rtol), f"seed {seed}"
    both = stats_x.merge(stats_y)
    assert within_tolerance(channel_errors(ws.acc.to_stats(), both, abs_x + abs_y), rtol), f"seed {seed}"
    # The kernel's digests of the two launches merge to the digest of their union.
    merged = merge_digest_raw(first, second)
    ref_u, _, abs_u = fingerprint_float64(torch.cat([x, y]).double().numpy(), k, h)
    assert within_tolerance(digest_errors(merged, ref_u, abs_u), rtol), f"seed {seed}"


def test_kernel_rejects_empty_and_wrong_width(kernel) -> None:
    ws = kernel.FingerprintWorkspace(2, 16, "cpu")
    with pytest.raises(ValueError, match="at least one row"):
        kernel.fingerprint_fused(torch.zeros((0, 32)), ws)
    with pytest.raises(ValueError, match=r"expected x of shape \[N, 2\*16\]"):
        kernel.fingerprint_fused(torch.zeros((3, 16)), ws)


class _ReplayByRerun:
    """What a CUDA graph does on replay, on the CPU: the captured launch again, same arguments."""

    def __init__(self, launch) -> None:
        self.launch = launch

    def replay(self) -> bool:
        self.launch()
        return True  # launched (False: the stream was capturing)


def _expect_digests(got, inputs, k: int, h: int, seed: int) -> None:
    assert [(step, tokens) for step, tokens, _ in got] == [(s, x.shape[0]) for s, x in inputs]
    for (_, _, raw), (_, x) in zip(got, inputs, strict=True):
        ref_raw, _, abs_sum = fingerprint_float64(x.double().numpy(), k, h)
        assert within_tolerance(digest_errors(raw.astype(np.float64), ref_raw, abs_sum), RTOL["float32"]), \
            f"seed {seed}"


def test_step_launcher_ring_and_graph_promotion(kernel, rng) -> None:
    """The per-step launch path: direct launches until an input (address, rows, strides, dtype) has
    been seen twice, then the captured launch is replayed; every launch, direct or replayed, fills the
    next ring row (chosen on the device), tagged with its launch, and the ring maps rows back to
    step ids."""
    from hs_tracer.fingerprint.launch import StepLauncher
    from hs_tracer.fingerprint.ring import DigestRing

    gen, seed = rng
    k, h = 2, 64
    ws = kernel.FingerprintWorkspace(k, h, "cpu", _tiers(kernel, (4, 16, 2), (None, 32, 4)))
    ring = DigestRing(k, h, 4, torch.device("cpu"), pinned=False, programs=ws.programs)
    captured = []

    def capture(launch):
        captured.append(launch)
        return _ReplayByRerun(launch)

    launcher = StepLauncher(ws, kernel.RingTarget(ring.records, ring.seq), capture,
                            max_graphs=2, promote_after=2)
    static = random_draft_input(gen, 6, k, h, torch.bfloat16)  # a graph output buffer: same address
    inputs = []
    for step in range(3):
        static.copy_(random_draft_input(gen, 6, k, h, torch.bfloat16))
        ring.note(step, 6)
        launcher.launch(static, 6)
        inputs.append((step, static.clone()))
    assert (launcher.direct, launcher.captures, launcher.replays) == (2, 1, 1)
    _expect_digests(ring.drain(), inputs, k, h, seed)
    assert ring.drain() == [] and int(ring.seq) == 3 << 32

    # A fresh allocation each step (eager mode) is launched directly; rows wrap around the ring.
    inputs = []
    for step in range(3, 6):
        x = random_draft_input(gen, int(gen.integers(1, 9)), k, h, torch.float16)
        ring.note(step, x.shape[0])
        launcher.launch(x, x.shape[0])
        inputs.append((step, x))
    _expect_digests(ring.drain(), inputs, k, h, seed)
    assert ring.dropped == 0

    # Bounded: six launches into four rows without a drain lose the two oldest.
    inputs = []
    for step in range(6, 12):
        static.copy_(random_draft_input(gen, 6, k, h, torch.bfloat16))
        ring.note(step, 6)
        launcher.launch(static, 6)
        inputs.append((step, static.clone()))
    _expect_digests(ring.drain(), inputs[2:], k, h, seed)
    assert ring.dropped == 2 and launcher.graphs == 1

    # More promoted inputs than max_graphs: the oldest graph goes.
    for rows in (2, 3):
        for _ in range(2):
            ring.note(99, rows)
            launcher.launch(static[:rows], rows)
    assert launcher.captures == 3 and launcher.graphs == 2 and len(launcher.replays_by_key) == 2
    ring.drain()
    # Landed but unread rows whose reuse is already noted (the producer a whole ring ahead, those
    # launches still in flight) count as dropped; the in-flight ones are read once they land.
    dropped = ring.dropped
    for step in (200, 201):
        ring.note(step, 6)
        launcher.launch(static, 6)
    for _ in range(4):
        ring.note(300, 1)
    assert ring.drain() == [] and ring.dropped == dropped + 2


def test_masked_launch_reads_only_the_real_rows(kernel, rng) -> None:
    """The launch recorded into a padded CUDA graph: only the leading rows whose ``valid`` entry is
    non-zero (real rows; the padding after them is 0) are read and counted, a launch that reads no
    row (every entry 0, or ``enable`` off) writes no digest and does not advance the ring, real rows
    that are not a prefix are not read and the digest counts -1 rows, and window sums add only what
    was read."""
    from hs_tracer.fingerprint.ring import DigestRing

    gen, seed = rng
    k, h = 2, 64
    ws = kernel.FingerprintWorkspace(k, h, "cpu", _tiers(kernel, (8, 16, 2), (None, 32, 4)))
    ring = DigestRing(k, h, 8, torch.device("cpu"), pinned=False, programs=ws.programs)
    target = kernel.RingTarget(ring.records, ring.seq)
    padded = random_draft_input(gen, 40, k, h, torch.bfloat16)  # more rows than one valid block (32)
    valid = torch.zeros(40, dtype=torch.int64)
    enable = torch.ones(1, dtype=torch.int32)
    kept = []
    for step, n in enumerate([5, 33, 40, 1]):
        valid.zero_()
        valid[:n] = torch.arange(7, 7 + n)  # KV slots: never 0 for a real row
        padded[n:] = float("nan")  # padding: never read
        ring.note(step, n)
        kernel.fingerprint_fused(padded, ws, ring=target, valid=valid, enable=enable)
        kept.append((step, padded[:n].clone()))
        padded.copy_(random_draft_input(gen, 40, k, h, torch.bfloat16))
    valid.zero_()  # an idle replay: nothing read, nothing written
    kernel.fingerprint_fused(padded, ws, ring=target, valid=valid, enable=enable)
    valid.fill_(1)
    enable.zero_()  # switched off: the same
    kernel.fingerprint_fused(padded, ws, ring=target, valid=valid, enable=enable)
    assert int(ring.seq) == 4 << 32  # the two empty launches took themselves back
    _expect_digests(ring.drain(), kept, k, h, seed)  # the NaN padding would show in the non-finite counts
    union = torch.cat([x for _, x in kept])
    _, stats, abs_sum = fingerprint_float64(union.double().numpy(), k, h)

    def window_ok() -> bool:
        return within_tolerance(channel_errors(ws.acc.to_stats(), stats, abs_sum), RTOL["float32"])

    assert window_ok(), f"seed {seed}"
    enable.fill_(1)
    valid.zero_()
    valid[torch.tensor([0, 3, 4])] = 9  # padding between real rows: nothing read, the count says -1
    ring.note(9, 3)
    kernel.fingerprint_fused(padded, ws, ring=target, valid=valid, enable=enable)
    [(step, tokens, raw)] = ring.drain()
    assert (step, tokens) == (9, 3) and np.all(raw[:, 0] + raw[:, 4] == -h)
    assert window_ok(), f"seed {seed}"
    with pytest.raises(ValueError, match="masked launch"):
        kernel.fingerprint_fused(padded, ws, ring=target, valid=valid.int(), enable=enable)
