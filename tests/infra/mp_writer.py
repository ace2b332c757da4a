"""A scheduler stand-in for multiprocess-mode tests: runs in a spawned process, like SGLang's
schedulers, with ``PROMETHEUS_MULTIPROC_DIR`` inherited from the parent."""

from __future__ import annotations

from typing import Any

from hs_tracer.records import Ranks, WiringRecord


def write_steps(model: str, tp_rank: int, wiring: WiringRecord, seed: int, n_steps: int, p_accept: float,
                ready: Any, go: Any) -> None:
    """Create the exporter (all series at 0), signal ``ready``, wait for ``go``, record the steps."""
    from hs_tracer.export.prometheus import PrometheusExporter

    from .steps import make_steps

    exporter = PrometheusExporter(model, Ranks(tp=tp_rank))
    if not exporter.multiprocess:
        raise RuntimeError("expected prometheus_client multiprocess mode in the child")
    exporter.record_wiring(wiring)
    ready.set()
    if not go.wait(120):
        raise RuntimeError("parent never said go")
    for rec in make_steps(n_steps, seed=seed, ranks=Ranks(tp=tp_rank), p_accept=p_accept):
        exporter.record_step(rec)
    exporter.record_health(dropped=tp_rank + 1, hook_errors=0, enabled=True, host_overhead_s=1e-5)
    exporter.close()  # flushes the summed steps
