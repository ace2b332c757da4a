"""Greedy generation with several engine configurations (plain decoding and EAGLE-3 variants) of
the same target, one engine after the other in one process, with SGLang's acceptance counters.

Why: the lossless oracle and the accept-length measurement both compare engine configurations on
the same prompts; each engine start costs tens of seconds on a small CPU machine, so a run batches
all prompts into one ``generate`` call per configuration. Runs as a module in a fresh process
(SGLang must be imported after the testbed runtime is prepared)::

    python -m hs_tracer_testbed.runtime.runs --target T [--draft D] --prompts P.json \\
        --config plain --config chain3:3:1 --max-new-tokens 24 --out result.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineConfig:
    """One engine configuration: plain decoding (spec_steps 0) or EAGLE-3."""

    name: str
    spec_steps: int = 0
    topk: int = 1
    num_draft_tokens: int | None = None

    @classmethod
    def parse(cls, text: str) -> EngineConfig:
        """``plain`` or ``NAME:STEPS:TOPK[:DRAFT_TOKENS]``."""
        if text == "plain":
            return cls("plain")
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"engine config {text!r}: expected 'plain' or NAME:STEPS:TOPK[:DRAFT_TOKENS]")
        ndt = int(parts[3]) if len(parts) == 4 else None
        return cls(parts[0], int(parts[1]), int(parts[2]), ndt)


@dataclass
class RunResult:
    """What one configuration produced for every prompt, plus SGLang's per-request spec counters."""

    config: EngineConfig
    output_ids: list[list[int]]
    verify_steps: list[int] = field(default_factory=list)
    correct_drafts: list[int] = field(default_factory=list)
    # verify steps by number of accepted drafts (index), summed over requests
    correct_drafts_histogram: list[int] = field(default_factory=list)
    startup_s: float = 0.0
    generate_s: float = 0.0

    @property
    def mean_accept_length(self) -> float | None:
        """Tokens committed per verify step (accepted drafts + the bonus token), over all
        requests: 1 + sum(correct drafts) / sum(verify steps). None for plain decoding."""
        steps = sum(self.verify_steps)
        if not steps:
            return None
        return 1.0 + sum(self.correct_drafts) / steps

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mean_accept_length": self.mean_accept_length}


def run_configs(
    target: Path | str,
    draft: Path | str | None,
    prompts: list[str] | list[list[int]],
    configs: list[EngineConfig],
    max_new_tokens: int,
    *,
    ignore_eos: bool = True,
    **engine_overrides: Any,
) -> list[RunResult]:
    """Start one engine per config (sequentially), greedy-generate ``prompts`` (texts or token
    ids) in one batch, shut it down. Must run in a process where SGLang was not imported yet.
    ``ignore_eos`` (default) makes every output exactly ``max_new_tokens`` long."""
    from hs_tracer.integrations.sglang.versions import installed_meta_counters
    from hs_tracer_testbed.runtime.launcher import engine

    counters = installed_meta_counters()
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos}
    key = "input_ids" if prompts and not isinstance(prompts[0], str) else "prompt"
    results = []
    for cfg in configs:
        spec = {}
        if cfg.spec_steps:
            if draft is None:
                raise ValueError(f"engine config {cfg.name!r} is speculative but no draft was given")
            spec = {"draft": draft, "spec_steps": cfg.spec_steps, "topk": cfg.topk}
            spec["num_draft_tokens"] = cfg.num_draft_tokens
        start = time.perf_counter()
        with engine(target, **spec, **engine_overrides) as eng:
            up = time.perf_counter()
            outs = eng.generate(**{key: prompts}, sampling_params=sampling)
            done = time.perf_counter()
        meta = [o["meta_info"] for o in outs]
        histogram: list[int] = []
        for m in meta:
            for n, count in enumerate(m.get(counters.accept_histogram) or []):
                histogram.extend([0] * (n + 1 - len(histogram)))
                histogram[n] += count
        results.append(
            RunResult(
                config=cfg,
                output_ids=[o["output_ids"] for o in outs],
                verify_steps=[m.get("spec_verify_ct", 0) for m in meta] if cfg.spec_steps else [],
                correct_drafts=[m.get(counters.accepted_drafts, 0) for m in meta] if cfg.spec_steps else [],
                correct_drafts_histogram=histogram,
                startup_s=up - start,
                generate_s=done - up,
            )
        )
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--draft", type=Path)
    parser.add_argument("--prompts", required=True, type=Path, help="JSON list of texts or of token-id lists")
    parser.add_argument("--config", action="append", required=True, type=EngineConfig.parse)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--stop-at-eos", action="store_true", help="end a request at EOS (default: ignore EOS)"
    )
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    prompts = json.loads(args.prompts.read_text())
    results = run_configs(
        args.target,
        args.draft,
        prompts,
        args.config,
        args.max_new_tokens,
        ignore_eos=not args.stop_at_eos,
        dtype=args.dtype,
    )
    args.out.write_text(json.dumps([r.to_json() for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
