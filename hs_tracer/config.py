"""TracerConfig: every ``HS_TRACER_*`` environment variable, parsed in one place.

Invalid values never crash serving: :func:`load` returns the config together with the errors, and
the plugin logs them in one line and stays off. The variables are documented in docs/interfaces.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

TRUE_VALUES = {"1", "true", "yes", "on"}
FALSE_VALUES = {"", "0", "false", "no", "off"}


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``HS_TRACER`` asks for tracing. Cheap: the entry point calls it in every process."""
    return environ.get("HS_TRACER", "").strip().lower() in TRUE_VALUES


@dataclass(frozen=True)
class TracerConfig:
    profile: Path | None = None  # HS_TRACER_PROFILE: reference profile for online diagnosis
    report_dir: Path | None = None  # HS_TRACER_REPORT_DIR: each scheduler writes its live report here
    capture_dir: Path | None = None  # HS_TRACER_CAPTURE_DIR: sampled draft inputs (user data, 0600)
    capture_rate: float = 0.01  # HS_TRACER_CAPTURE_RATE: fraction of steps captured
    capture_max_bytes: int = 1 << 30  # HS_TRACER_CAPTURE_MAX_BYTES: rotation bound on disk
    span_sample: float = 0.01  # HS_TRACER_SPAN_SAMPLE: fraction of steps exported as OTel spans
    window_tokens: int = 2048  # HS_TRACER_WINDOW_TOKENS: tokens per diagnosis window
    queue_size: int = 4096  # HS_TRACER_QUEUE_SIZE: step records buffered for the recorder thread
    metrics_port: int | None = None  # HS_TRACER_METRICS_PORT: own /metrics when SGLang's are off
    metrics_addr: str = "0.0.0.0"  # HS_TRACER_METRICS_ADDR: address that /metrics binds to
    log_level: str = "INFO"  # HS_TRACER_LOG_LEVEL
    export: str = "process"  # HS_TRACER_EXPORT: exporters in a process of their own, or "thread"
    in_graph: bool = True  # HS_TRACER_IN_GRAPH: record the fingerprint kernel into the target's CUDA graphs
    identity_every: int = 32  # HS_TRACER_IDENTITY_EVERY: 1 in N prefill forwards measures identity; 0 off
    fault_inject: str | None = None  # HS_TRACER_FAULT_INJECT: raise inside this hook (fail-safe tests)
    fault_tp_rank: int | None = None  # HS_TRACER_FAULT_INJECT=<hook>@tp<N>: only the scheduler of TP rank N

    def fault_here(self, where: str, tp_rank: Callable[[], int]) -> bool:
        """Whether a fault is injected into ``where`` in this process; ``tp_rank`` is asked only when
        the fault names a rank (a multi-rank test faults one rank and reads the others intact)."""
        return self.fault_inject == where and (self.fault_tp_rank is None or self.fault_tp_rank == tp_rank())


def _fraction(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value <= 1.0:  # NaN fails too
        raise ValueError(f"{name}={raw!r} must be a fraction between 0 and 1, e.g. 0.01")
    return value


def _int_in(low: int, high: int):
    """An integer in ``[low, high]``: the bounds keep memory and disk bounded and ports real."""

    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer; give a whole number between {low} and "
                             f"{high}") from None
        if not low <= value <= high:
            raise ValueError(f"{name}={raw!r} is out of range; give a whole number between {low} and {high}")
        return value

    return parse


def _existing_file(name: str, raw: str) -> Path:
    path = Path(raw).expanduser()
    if not path.is_file():
        raise ValueError(f"{name}={raw!r}: no such file (build one with `hs-tracer profile build`)")
    return path


def _export(name: str, raw: str) -> str:
    mode = raw.strip().lower()
    if mode not in ("process", "thread"):
        raise ValueError(f"{name}={raw!r} must be process (exporters in a process of their own, the "
                         "default) or thread (in the scheduler process's recorder thread)")
    return mode


def _switch(name: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value not in TRUE_VALUES | FALSE_VALUES:
        raise ValueError(f"{name}={raw!r} must be 1 (on) or 0 (off)")
    return value in TRUE_VALUES


def _fault(name: str, raw: str) -> tuple[str, int | None]:
    hook, sep, rank = raw.partition("@")
    if not sep:
        return raw, None
    if not (rank.startswith("tp") and rank[2:].isdigit()):
        raise ValueError(f"{name}={raw!r}: after '@' give the TP rank that faults, e.g. {hook}@tp1")
    return hook, int(rank[2:])


def _log_level(name: str, raw: str) -> str:
    level = raw.upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"{name}={raw!r} must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


_PARSERS = {
    "HS_TRACER_PROFILE": ("profile", _existing_file),
    "HS_TRACER_REPORT_DIR": ("report_dir", lambda _n, raw: Path(raw).expanduser()),
    "HS_TRACER_CAPTURE_DIR": ("capture_dir", lambda _n, raw: Path(raw).expanduser()),
    "HS_TRACER_CAPTURE_RATE": ("capture_rate", _fraction),
    "HS_TRACER_CAPTURE_MAX_BYTES": ("capture_max_bytes", _int_in(4096, 1 << 50)),
    "HS_TRACER_SPAN_SAMPLE": ("span_sample", _fraction),
    "HS_TRACER_WINDOW_TOKENS": ("window_tokens", _int_in(1, 1 << 24)),
    "HS_TRACER_QUEUE_SIZE": ("queue_size", _int_in(1, 1 << 20)),
    "HS_TRACER_METRICS_PORT": ("metrics_port", _int_in(1, 65535)),
    "HS_TRACER_METRICS_ADDR": ("metrics_addr", lambda _n, raw: raw.strip()),
    "HS_TRACER_LOG_LEVEL": ("log_level", lambda name, raw: _log_level(name, raw)),
    "HS_TRACER_EXPORT": ("export", _export),
    "HS_TRACER_IN_GRAPH": ("in_graph", _switch),
    "HS_TRACER_IDENTITY_EVERY": ("identity_every", _int_in(0, 1 << 20)),
    "HS_TRACER_FAULT_INJECT": (("fault_inject", "fault_tp_rank"), _fault),
}


VARIABLES = ("HS_TRACER", *_PARSERS)


def load(environ: Mapping[str, str] = os.environ) -> tuple[TracerConfig, list[str]]:
    """Parse the environment. Returns the config and a list of errors (empty when all is valid)."""
    values: dict[str, object] = {}
    errors: list[str] = []
    for name, (field_name, parse) in _PARSERS.items():
        raw = environ.get(name)
        if raw is None or raw == "":
            continue
        try:
            value = parse(name, raw)
            if isinstance(field_name, tuple):  # one variable, several fields
                values.update(zip(field_name, value, strict=True))
            else:
                values[field_name] = value
        except ValueError as exc:
            msg = str(exc)
            errors.append(msg if name in msg else f"{name}={raw!r}: {msg}")
    return TracerConfig(**values), errors
