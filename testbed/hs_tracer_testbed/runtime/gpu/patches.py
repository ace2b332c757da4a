"""The GPU testbed's changes to SGLang 0.5.23 (and one debugging wrapper around hs_tracer's hooks),
applied in every process the GPU launcher starts through ``pythonpath/sitecustomize.py``. Never
applied by the production plugin.

* ``sglang.srt.layers.dual_gemm``: the Llama MLP of an EAGLE-3 draft picks SGLang's CuTe-DSL dual
  GEMM on CUDA, which needs ``nvidia-cutlass-dsl`` (not installable next to another torch). Its mode
  selector returns None, the plain GEMM path SGLang uses when the dual GEMM does not apply.
* ``sglang.srt.distributed.device_communicators.triton_symm_mem_ag``: the logits processor's
  all-gather would try NVLink multicast (symmetric memory) on its first eager call. Multicast must
  never run on shared GPU hosts, so every ``MultimemAllGatherer`` is built with ``enabled=False``,
  its own NCCL fallback, instead of trusting it to discover that multicast is absent.
* ``sglang.kernels.ops.attention.decode_attention``: for MLA the grouped decode kernel reuses the K
  tile (``next_pow2(Lk)`` wide) as V (``next_pow2(Lv)``), which only compiles when both pad to the
  same width. DeepSeek-V3 (576/512) does; the tiny testbed target (40/32) does not, and plain
  decoding failed to compile. For such shapes only, the kernel is told the cache is not MLA, so it
  loads V from the value view of the same buffer (same values, one more load).
* ``sglang.kernels.ops.attention.extend_attention`` (``--enable-deterministic-inference``): the
  unified one-stage extend kernel that deterministic mode uses for every prefill, target verify and
  draft extend tiles Q·K with ``next_pow2(Lq)`` and P·V with ``next_pow2(Lv)``. With the tiny
  target's absorbed MLA (Lq 40 -> 64, Lv 32 -> 32) the P·V dot that Triton 3.6 emits on Hopper
  reads past the kernel's shared memory (compute-sanitizer: "Invalid __shared__ read of size 1024
  bytes" at the P·V ``tl.dot``; in a serving engine "an illegal memory access"); equal tiles
  (32/32, 16/16, DeepSeek-V3's 512+64/512) read cleanly. For unequal tiles only, the kernel gets a V
  tile as wide as the Q·K tile: the V load and the output store stay masked to ``Lv``, so the extra
  columns are zeros that are never stored, and the tile is fixed per shape, so the kernel stays
  batch-invariant.
* ``hs_tracer.integrations.sglang.plugin`` (only with ``HS_TRACER_TESTBED_SYNC_DEBUG=1``): through
  the entry point's ``wrap`` parameter, each hook that runs while serving (per step, or per forward)
  runs with ``torch.cuda.set_sync_debug_mode("error")`` armed around its own body and restored after, so a
  host-device synchronisation inside hs_tracer raises there (the hook's guard counts it as a hook
  error and switches tracing off) while SGLang's own code runs unchecked. The startup hooks (run once,
  before serving) are left unarmed: building the fingerprint probe compiles its kernel and waits
  for it there, by design.
* hs_tracer's per-step functions (only with ``HS_TRACER_TESTBED_HOST_BREAKDOWN=DIR``): each timed
  with ``perf_counter_ns`` around its call, per batch size (the latest step's), and, before every
  decode hook, a fixed canary workload timed the same way: how much slower the same Python runs
  inside the engine than in a hot loop. Summaries (count, median, p90, mean in µs) go to
  ``DIR/host-breakdown-<pid>.json`` every 2 s. The wrappers add their own ~0.2 µs per call; the
  figure is for finding which part of the engine's per-step host time is large, not a cost.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from hs_tracer_testbed.runtime.patches import PostImportHook

logger = logging.getLogger("hs_tracer_testbed")

SYNC_DEBUG_FLAG = "HS_TRACER_TESTBED_SYNC_DEBUG"
BREAKDOWN_FLAG = "HS_TRACER_TESTBED_HOST_BREAKDOWN"
DUAL_GEMM_MODULE = "sglang.srt.layers.dual_gemm"
DECODE_ATTENTION_MODULE = "sglang.kernels.ops.attention.decode_attention"
EXTEND_ATTENTION_MODULE = "sglang.kernels.ops.attention.extend_attention"
SYMM_MEM_AG_MODULE = "sglang.srt.distributed.device_communicators.triton_symm_mem_ag"
PLUGIN_MODULE = "hs_tracer.integrations.sglang.plugin"


def no_dual_gemm(module: ModuleType) -> None:
    module.DualGemm._select_mode = lambda self, *args, **kwargs: None


def multimem_off(module: ModuleType) -> None:
    cls = module.MultimemAllGatherer
    if getattr(cls, "_hs_tracer_multimem_off", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, max_tokens: int, *, enabled: bool = True, **kwargs: Any) -> None:
        original(self, max_tokens, enabled=False, **kwargs)

    cls.__init__ = init
    cls._hs_tracer_multimem_off = True
    # To stderr directly: this runs at import, before SGLang configures logging, and the line is the
    # run's evidence that no multicast path is taken.
    print("hs_tracer GPU testbed: MultimemAllGatherer forced to its NCCL fallback (no multicast)",
          file=sys.stderr, flush=True)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def narrow_mla_decode(module: Any) -> None:
    original = module._decode_grouped_att_m_fwd

    @functools.wraps(original)
    def grouped(q: Any, k_buffer: Any, v_buffer: Any, *args: Any, has_mla: bool = False,
                **kwargs: Any) -> Any:
        lk, lv = int(k_buffer.shape[-1]), int(v_buffer.shape[-1])
        if has_mla and lk not in (576, 288) and _pow2(lk) != _pow2(lv):
            has_mla = False
        return original(q, k_buffer, v_buffer, *args, has_mla=has_mla, **kwargs)

    module._decode_grouped_att_m_fwd = grouped


def even_unified_extend_tiles(module: Any) -> None:
    original = module.extend_attention_fwd_unified
    sizes = module._get_block_sizes_for_extend_attention

    def even(lq: int, lv: int) -> tuple[int, ...]:
        dmodel, dpe, dv, *rest = sizes(lq, lv)
        return (dmodel, dpe, dmodel if dpe == 0 and dv < dmodel else dv, *rest)

    @functools.wraps(original)
    def unified(q: Any, o: Any, k_buffer: Any, v_buffer: Any, *args: Any, **kwargs: Any) -> Any:
        # the kernel's launcher looks the tile sizes up in its module at each call; the scheduler
        # thread is the only caller, so the lookup is pointed at ``even`` for this call only
        module._get_block_sizes_for_extend_attention = even
        try:
            return original(q, o, k_buffer, v_buffer, *args, **kwargs)
        finally:
            module._get_block_sizes_for_extend_attention = sizes

    module.extend_attention_fwd_unified = unified


def sync_checked(hook: Callable[..., Any],
                 set_mode: Callable[[str], None] | None = None) -> Callable[..., Any]:
    """``hook`` with CUDA sync-debug mode "error" armed around its call, "default" after."""
    if set_mode is None:
        import torch

        set_mode = torch.cuda.set_sync_debug_mode

    @functools.wraps(hook)
    def checked(*args: Any, **kwargs: Any) -> Any:
        set_mode("error")
        try:
            return hook(*args, **kwargs)
        finally:
            set_mode("default")

    checked.__hs_tracer_sync_checked__ = True  # type: ignore[attr-defined]
    return checked


def arm_serving_hooks(hook: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """The plugin's ``wrap`` parameter: every hook that runs while serving (the capture and per-step
    phases) armed; the startup hooks, run once before serving, left as they are."""
    from hs_tracer.release_table import Phase

    return fn if hook.phase is Phase.STARTUP else sync_checked(fn)


def arm_sync_debug(module: ModuleType) -> None:
    """Bind :func:`arm_serving_hooks` as the wrap of the plugin's entry point, which SGLang calls."""
    module.register = functools.partial(module.register, wrap=arm_serving_hooks)
    logger.info("hs_tracer GPU testbed: sync debug mode 'error' armed around the serving-time hooks")


class HostBreakdown:
    """Durations of hs_tracer's per-step functions inside a serving engine (module docstring)."""

    KEEP = 50_000  # durations kept per (function, batch size)

    def __init__(self, directory: str) -> None:
        import collections
        import time

        self.path = Path(directory) / f"host-breakdown-{os.getpid()}.json"
        self.samples: dict[tuple[str, int], collections.deque[int]] = collections.defaultdict(
            lambda: collections.deque(maxlen=self.KEEP))
        self.batch = 0
        self.clock = time.perf_counter_ns
        self.written_at = 0

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, samples = self.clock, self.samples

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                samples[name, self.batch].append(clock() - t0)

        return wrapper

    def canary(self) -> None:
        """A fixed few µs of attribute reads, calls and tuple building, like the hooks' own Python."""
        t0 = self.clock()
        acc = 0
        for i in range(16):
            acc += len((i, self.batch, self.path))
        self.samples["canary", self.batch].append(self.clock() - t0)

    def note_batch(self, reqs: Any) -> None:
        self.batch = len(reqs)
        now = self.clock()
        if now - self.written_at > 2_000_000_000:
            self.written_at = now
            self.write()

    def write(self) -> None:
        import json
        import statistics

        out = {}
        for (name, bs), values in sorted(self.samples.items()):
            v = sorted(values)
            out.setdefault(str(bs), {})[name] = {
                "count": len(v), "median_us": v[len(v) // 2] / 1e3, "p90_us": v[int(len(v) * 0.9)] / 1e3,
                "mean_us": statistics.fmean(v) / 1e3}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, self.path)


_breakdown: HostBreakdown | None = None


def breakdown_steps(module: ModuleType) -> None:
    b = _breakdown
    assert b is not None
    cls = module.StepPath
    observe = b.timed("observe_decode", cls.observe_decode)

    def observe_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        b.canary()
        return observe(self, *args, **kwargs)

    record = b.timed("record", cls.record)

    def record_step(self: Any, result: Any, reqs: Any, *args: Any, **kwargs: Any) -> Any:
        b.note_batch(reqs)
        return record(self, result, reqs, *args, **kwargs)

    cls.observe_decode, cls.record = observe_decode, record_step
    cls.observe_prefill = b.timed("observe_prefill", cls.observe_prefill)
    cls._skipped = b.timed("skipped", cls._skipped)
    module._Windowed.close = b.timed("window_close", module._Windowed.close)


def breakdown_probe(module: ModuleType) -> None:
    b = _breakdown
    assert b is not None
    cls = module.FingerprintProbe
    cls.observe_rows = b.timed("probe_observe_rows", cls.observe_rows)
    cls.end_window = b.timed("probe_end_window", cls.end_window)


def breakdown_launch(module: ModuleType) -> None:
    b = _breakdown
    assert b is not None
    init = module.GraphLaunch.__init__

    def graph_launch_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.replay = b.timed(f"graph_replay_{self.way}", self.replay)

    module.GraphLaunch.__init__ = graph_launch_init
    module.StepLauncher.launch = b.timed("direct_launch_or_capture", module.StepLauncher.launch)


def breakdown_log(module: ModuleType) -> None:
    b = _breakdown
    assert b is not None
    module.StepLog.append = b.timed("step_log_append", module.StepLog.append)


def patches(environ: Mapping[str, str] = os.environ) -> dict[str, Callable[[ModuleType], None]]:
    out: dict[str, Callable[[ModuleType], None]] = {DUAL_GEMM_MODULE: no_dual_gemm,
                                                    SYMM_MEM_AG_MODULE: multimem_off,
                                                    DECODE_ATTENTION_MODULE: narrow_mla_decode,
                                                    EXTEND_ATTENTION_MODULE: even_unified_extend_tiles}
    if environ.get(SYNC_DEBUG_FLAG) == "1":
        out[PLUGIN_MODULE] = arm_sync_debug
    if environ.get(BREAKDOWN_FLAG):
        global _breakdown
        _breakdown = HostBreakdown(environ[BREAKDOWN_FLAG])
        out.update({"hs_tracer.core.steps": breakdown_steps,
                    "hs_tracer.fingerprint.probe": breakdown_probe,
                    "hs_tracer.fingerprint.launch": breakdown_launch,
                    "hs_tracer.export.step_log": breakdown_log})
    return out


_hook = PostImportHook()


def install() -> None:
    """Apply every patch now (module already imported) or right after its first import."""
    _hook.install(patches())
