"""The main job on a machine without a GPU: real SGLang on CPU with tracing on, then what it saw.

Starts ``sgl.Engine`` through the CPU testbed runtime with ``HS_TRACER=1``, sends a workload, and
collects the live reports the plugin wrote from inside the scheduler processes.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DemoResult:
    target: Path
    draft: Path | None
    prompts: list[str]
    outputs: list[str]
    schedulers: list[dict[str, Any]] = field(default_factory=list)  # one live report per process

    def to_json(self) -> dict[str, Any]:
        return {
            "target": str(self.target),
            "draft": str(self.draft) if self.draft else None,
            "requests": len(self.prompts),
            "schedulers": self.schedulers,
        }


def read_reports(report_dir: Path) -> list[dict[str, Any]]:
    """The reports the scheduler processes wrote (``HS_TRACER_REPORT_DIR``), one per process."""
    return [json.loads(p.read_text()) for p in sorted(report_dir.glob("scheduler-*.json"))]


def default_target(cache: Path) -> Path:
    """The testbed's tiny DeepSeek-V3 target, built once into ``cache``."""
    from hs_tracer.testbed.target import build_target

    out = cache / "target-untrained"
    if not (out / "config.json").exists():
        build_target(out, train_steps=0, progress=False)
    return out


def run(
    target: Path | None = None,
    draft: Path | None = None,
    *,
    prompts: list[str] | None = None,
    max_new_tokens: int = 16,
    extra_env: dict[str, str] | None = None,
) -> DemoResult:
    """Run the workload through a real engine with tracing on. Must run in a process that has not
    imported SGLang yet (the CPU runtime decides the device at import)."""
    from hs_tracer.testbed.corpus import prompts as corpus_prompts
    from hs_tracer.testbed.runtime.launcher import engine

    cache = Path(os.environ.get("HS_TRACER_CACHE", Path.cwd() / ".cache"))
    target = target or default_target(cache)
    prompts = prompts or corpus_prompts(seed=1234, n=8)
    with tempfile.TemporaryDirectory(prefix="hs-tracer-demo-") as tmp:
        report_dir = Path(tmp)
        env = {"HS_TRACER": "1", "HS_TRACER_REPORT_DIR": str(report_dir), **(extra_env or {})}
        with engine(target, draft, env=env) as eng:
            outs = eng.generate(prompts, {"temperature": 0.0, "max_new_tokens": max_new_tokens})
        return DemoResult(target, draft, prompts, [o["text"] for o in outs], read_reports(report_dir))


def human(result: DemoResult) -> str:
    lines = [f"target: {result.target}", f"draft:  {result.draft or '(none: plain decoding)'}",
             f"requests: {len(result.prompts)}"]
    for prompt, out in list(zip(result.prompts, result.outputs, strict=True))[:3]:
        lines.append(f"  {prompt!r} -> {out.strip()!r}")
    if not result.schedulers:
        lines.append("hs_tracer: no scheduler reported (was the plugin installed in SGLang's environment?)")
    for rep in result.schedulers:
        t = rep.get("target", {})
        state = "on" if rep["enabled"] else f"off ({rep['disabled_reason']})"
        lines.append(
            f"scheduler pid {rep['pid']}: tracing {state}; target {t.get('architecture')} with "
            f"{t.get('num_layers')} layers, hidden size {t.get('hidden_size')}, "
            f"layers_to_capture {t.get('layers_to_capture')}; hooks applied: {len(rep['hooks_applied'])}"
        )
    return "\n".join(lines)
