"""The main job on a machine without a GPU: real SGLang on CPU with tracing on, then its diagnosis.

``hs-tracer demo`` starts ``sgl.Engine`` (EAGLE-3) through the CPU testbed runtime with
``HS_TRACER=1`` and a reference profile built from the draft's training data, sends a workload, and
prints the live diagnosis the plugin computed inside the scheduler process. With the testbed models
it runs the correct draft and then a miswired copy of it (config.json edited, as in real incidents).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hs_tracer.errors import InputError
from hs_tracer.profile_builder import BuildRequest, build_profile_file
from hs_tracer_testbed.build import _locked
from hs_tracer_testbed.miswire import DEFAULT_SCENARIOS
from hs_tracer_testbed.realtext import question_of

if TYPE_CHECKING:
    from hs_tracer_testbed.build import TestbedPaths
    from hs_tracer_testbed.smollm import PairPaths

DEMO_ENV = {
    "HS_TRACER": "1",
    "HS_TRACER_WINDOW_TOKENS": "128",  # a short workload (decode rows only): let windows close often
}
SETTLE_S = 2.0  # the recorder refreshes the report every 0.5 s while steps arrive


@dataclass
class Run:
    """One engine run: which models, what was generated, and what the scheduler(s) reported."""

    name: str
    target: Path
    draft: Path | None
    prompts: list[str]
    outputs: list[str]
    output_ids: list[list[int]] = field(default_factory=list)
    schedulers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def diagnosis(self) -> dict[str, Any]:
        """The emitting scheduler's diagnosis (attention-TP rank 0), the report keys of docs/interfaces.md."""
        for rep in self.schedulers:
            if rep.get("emitting") and rep.get("diagnosis"):
                return rep["diagnosis"]
        return {"status": "unknown", "slots": [], "acceptance": None,
                "findings": [], "note": "no scheduler reported a diagnosis"}

    def to_json(self) -> dict[str, Any]:
        diag = self.diagnosis
        return {
            "name": self.name,
            "status": diag.get("status", "unknown"),
            "slots": diag.get("slots", []),
            "acceptance": diag.get("acceptance"),
            "findings": diag.get("findings", []),
            "root_causes": diag.get("root_causes", []),
            "measured_identity": diag.get("measured_identity"),
            "target": str(self.target),
            "draft": str(self.draft) if self.draft else None,
            "wiring": next((r.get("wiring") for r in self.schedulers if r.get("wiring")), None),
        }


def read_reports(report_dir: Path) -> list[dict[str, Any]]:
    """The reports the scheduler processes wrote (``HS_TRACER_REPORT_DIR``), one per process."""
    return [json.loads(p.read_text()) for p in sorted(report_dir.glob("scheduler-*.json"))]


def settled_reports(report_dir: Path, steps: int | None = None) -> list[dict[str, Any]]:
    """Wait until the recorder has caught up, then read the reports: they stopped changing and, with
    ``steps`` (the request-steps the engine itself counted), the reports' acceptance counts that
    many together (each attention-DP rank verifies its own requests) or tracing is off in one of
    them. Why both: a diagnosis of a real model's window can take longer than the settling time, and
    the report holds still while the last steps are being judged. After 60 s, whatever is there."""
    last, stable_since = None, time.monotonic()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        snapshot = [p.read_bytes() for p in sorted(report_dir.glob("scheduler-*.json"))]
        if snapshot != last:
            last, stable_since = snapshot, time.monotonic()
        elif snapshot and time.monotonic() - stable_since >= SETTLE_S:
            reports = read_reports(report_dir)
            # with attention DP each emitting rank verifies its own share of the requests
            off = any(not r.get("enabled", True) for r in reports)
            if not steps or off or sum(map(_acceptance_steps, reports)) >= steps:
                return reports
        time.sleep(0.25)
    return read_reports(report_dir)


def _acceptance_steps(report: dict[str, Any]) -> int:
    return ((report.get("diagnosis") or {}).get("acceptance") or {}).get("steps") or 0


def run_engine(name: str, target: Path, draft: Path | None, prompts: list[str], *,
               profile: Path | None = None, max_new_tokens: int = 32,
               extra_env: dict[str, str] | None = None, traced: bool = True,
               linger_s: float = 0.0) -> Run:
    """One engine run (traced unless ``traced=False``; kept up ``linger_s`` after the workload, e.g.
    for a metrics scrape). Must run in a process that has not imported
    SGLang's GPU path (the CPU runtime decides the device at import); the launcher checks."""
    from hs_tracer_testbed.runtime.launcher import engine

    with tempfile.TemporaryDirectory(prefix="hs-tracer-demo-") as tmp:
        report_dir = Path(tmp)
        env = {**DEMO_ENV, "HS_TRACER_REPORT_DIR": str(report_dir), **(extra_env or {})}
        if profile is not None:
            env["HS_TRACER_PROFILE"] = str(profile)
        if not traced:
            env = {k: v for k, v in (extra_env or {}).items() if not k.startswith("HS_TRACER")}
        with engine(target, draft, env=env) as eng:
            outs = eng.generate(prompts, {"temperature": 0.0, "max_new_tokens": max_new_tokens})
            reports = settled_reports(report_dir) if traced else []
            time.sleep(linger_s)
        return Run(name, target, draft, prompts, [o["text"] for o in outs],
                   [list(o["output_ids"]) for o in outs], reports)


def testbed_profile(tb: TestbedPaths) -> Path:
    """The reference profile of the testbed draft's training data, with the all-layer atlas (built
    once next to the testbed build, then reused)."""
    return build_profile(tb.root.parent / f"{tb.root.name}.profile.safetensors", tb.specforge_data, tb.draft,
                         tb.target, tb.atlas_data)


def real_pair_profile(pair: PairPaths) -> Path:
    """The same for the real-model pair (SmolLM2-135M-Instruct and its draft), its expected
    acceptance measured on the held-out prompts of the training domain (kept inside the pair: a
    rebuilt pair rebuilds it)."""
    return build_profile(pair.root / "profile.safetensors", pair.specforge_data, pair.draft, pair.target,
                         pair.atlas_data, expected_data=pair.heldout_data)


def build_profile(out: Path, specforge_data: Path, draft: Path, target: Path, atlas: Path,
                  expected_data: Path | None = None) -> Path:
    """``hs-tracer profile build`` of a draft's SpecForge training data with an all-layer atlas, into
    ``out`` unless it exists already (``expected_data``: where to measure the expected acceptance).
    Concurrent callers (``make test`` runs engine tests beside the suite) wait on a file lock."""
    with _locked(out.with_suffix(".lock")):
        if not out.exists():
            with redirect_stdout(sys.stderr):  # progress, not the demo's answer
                code = build_profile_file(BuildRequest(
                    [specforge_data], out, draft=draft, target=target, atlas=atlas, no_progress=True,
                    expected_data=[expected_data] if expected_data is not None else None))
            if code != 0:
                raise RuntimeError(f"building the reference profile {out} failed (exit {code})")
    return out


def check_profile_fits(profile: Path, target: Path, draft: Path | None) -> None:
    """A profile of another model, said in one line before any engine starts (an input error)."""
    from hs_tracer.inputs.profile import check_fits, load_profile
    from hs_tracer.preflight.config import read_draft_config, read_target_config

    tgt = read_target_config(target)
    vocab = None
    if draft is not None:
        d = read_draft_config(draft)
        vocab = d.draft_vocab_size or d.vocab_size
    check_fits(load_profile(profile), f"target {target}", profile, hidden_size=tgt.hidden_size,
               num_layers=tgt.num_hidden_layers, draft_vocab=vocab)


@contextmanager
def output_to(log: Path | None) -> Iterator[None]:
    """Send everything this process and the processes it starts write to stdout and stderr (SGLang's
    import warnings and logs, hs_tracer's own log lines) to ``log``; ``None`` leaves them alone.
    Works on the file descriptors, so SGLang's spawned scheduler processes inherit it."""
    if log is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)


def run(target: Path | None = None, draft: Path | None = None, *, profile: Path | None = None,
        scenarios: list[str] | None = None, num_prompts: int = 16, max_new_tokens: int = 32,
        log: Path | None = None, real: bool = False) -> list[Run]:
    """The demo: the testbed models (``real``: the real-model pair, SmolLM2-135M-Instruct and its
    trained draft, on held-out real text; else the given models or the tiny testbed), correct wiring,
    then each miswiring. With ``log``, SGLang's output goes there and only a progress line per engine
    reaches stderr."""
    from hs_tracer_testbed import ensure_testbed
    from hs_tracer_testbed.corpus import prompts as corpus_prompts
    from hs_tracer_testbed.miswire import write_variant

    if real:
        from hs_tracer_testbed import smollm

        with output_to(log):  # the pair's conversion and profile: progress bars, not the demo's answer
            pair = smollm.ensure_pair()
            profile = profile or real_pair_profile(pair)
        target, draft = target or pair.target, draft or pair.draft
        prompts = smollm.prompts(num_prompts)
    else:
        prompts = corpus_prompts(seed=1234, n=num_prompts)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hs-tracer-demo-drafts-") as tmp:
        if target is None:
            with output_to(log):
                tb = ensure_testbed()
                profile = profile or testbed_profile(tb)
            target, draft = tb.target, draft or tb.draft
        if profile is not None:
            check_profile_fits(profile, target, draft)
        plan = [("as configured", draft)]
        for scenario in scenarios or []:
            assert draft is not None
            plan.append((f"miswired: {scenario}", write_variant(draft, Path(tmp) / scenario, scenario)))
        for i, (name, run_draft) in enumerate(plan, 1):
            print(f"[{i}/{len(plan)}] SGLang with EAGLE-3 on CPU, tracing on: {name} "
                  f"({len(prompts)} prompts, about a minute)", file=sys.stderr, flush=True)
            with output_to(log):
                runs.append(run_engine(name, target, run_draft, prompts, profile=profile,
                                       max_new_tokens=max_new_tokens))
    return runs


def human(runs: list[Run], expect_miswired: bool = False, verbose: bool = False) -> str:
    """Per run: the models and wiring, two sample outputs, then the diagnosis as every hs_tracer
    command prints it (:meth:`Report.human`); last, one line saying what a person must do. Layers are
    named by canonical source; ``verbose`` adds SGLang's own numbering (layers_to_capture)."""
    from hs_tracer.diagnosis.report import Report

    lines: list[str] = []
    for i, r in enumerate(runs):
        d = r.to_json()
        deliberate = " (deliberate: its critical findings are the expected answer)" if i else ""
        lines.append(f"== {r.name}: draft {r.draft or '(none: plain decoding)'}{deliberate}")
        w = d["wiring"] or {}
        if w:
            raw = f" (layers_to_capture {w.get('layers_to_capture')})" if verbose else ""
            lines.append(f"   wiring: {w.get('target_arch')} with {w.get('num_layers')} layers, hidden "
                         f"{w.get('hidden_size')}; the draft is fed {', '.join(w.get('sources') or [])}{raw}")
        for prompt, out in list(zip(r.prompts, r.outputs, strict=True))[:2]:
            lines.append(f"   {question_of(prompt)!r} -> {out.strip()!r}")
        if d["status"] == "unknown":
            lines.append("   status: unknown (no scheduler reported a diagnosis)")
            continue
        report = Report.from_json(r.diagnosis)
        lines.extend("   " + line for line in report.human(verbose=verbose).splitlines())
    lines.append(verdict(runs, expect_miswired))
    return "\n".join(lines)


def verdict(runs: list[Run], expect_miswired: bool) -> str:
    """The demo's last line: what a person must do about the draft as configured (or that nothing is
    needed), and whether every deliberately miswired copy was caught; agrees with :func:`exit_code`."""
    from hs_tracer.diagnosis.report import Report

    first = runs[0]
    if first.to_json()["status"] == "unknown":
        return ("verdict: no diagnosis for the draft as configured (no scheduler reported one): read "
                "SGLang's log named above for the engine's error")
    configured = Report.from_json(first.diagnosis).verdict().removeprefix("verdict: ")
    missed = [r.name.removeprefix("miswired: ") for r in runs[1:]
              if r.to_json()["status"] not in ("miswired", "drift")]
    if not expect_miswired or len(runs) == 1:
        return f"verdict: {configured}"
    if missed:
        return (f"verdict: the draft as configured: {configured}; but hs_tracer missed the deliberate "
                f"miswiring {', '.join(missed)} (it reported no critical finding): that is a bug to report")
    caught = ", ".join(r.name.removeprefix("miswired: ") + _cost(r, first) for r in runs[1:])
    return f"verdict: the draft as configured: {configured}; the deliberate miswiring ({caught}) was caught"


def _cost(run: Run, configured: Run) -> str:
    """What a miswiring costs on these prompts: its accept length against the configured draft's."""
    a, b = ((r.diagnosis.get("acceptance") or {}).get("mean_accept_length") for r in (run, configured))
    if not a or not b:
        return ""
    return f": accept length {a:.2f} against {b:.2f} as configured, {100 * (a - b) / b:+.0f} %"


def exit_code(runs: list[Run], expect_miswired: bool) -> int:
    """0 when the configured run is healthy (and, in the default demo, every miswiring was caught)."""
    first, rest = runs[0].to_json(), [r.to_json() for r in runs[1:]]
    ok = first["status"] in ("ok", "warning")
    if expect_miswired:
        ok = ok and all(r["status"] in ("miswired", "drift") for r in rest)
    return 0 if ok else 1


# ``hs-tracer demo --engine NAME`` runs the harness named here ("module:function", given the parsed
# arguments after the command checked them).
HARNESSES = {"sglang": "hs_tracer_testbed.demo:cli", "vllm": "hs_tracer_testbed.vllm_demo:cli"}


def cli(args: Any) -> int:
    """``hs-tracer demo`` on SGLang: the configured draft and the miswired copies the scenarios make."""
    if args.real and (args.target is not None or args.draft is not None):
        raise InputError("--real picks its own target and draft; pass either --real or --target/--draft")
    scenarios = args.scenarios if args.scenarios is not None else (
        DEFAULT_SCENARIOS if args.target is None else [])
    log = None
    if not args.verbose:
        fd, name = tempfile.mkstemp(prefix="hs-tracer-demo-", suffix=".log")
        os.close(fd)
        log = Path(name)
        # Said first: when an engine fails, SGLang may end this process before anything else prints.
        print(f"SGLang's own output goes to {log} (--verbose shows it here instead)", file=sys.stderr)
    runs = run(args.target, args.draft, profile=args.profile, scenarios=scenarios,
               num_prompts=args.prompts, max_new_tokens=args.max_new_tokens, log=log, real=args.real)
    if args.json:
        out = [r.to_json() for r in runs]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print(human(runs, expect_miswired=bool(scenarios), verbose=args.verbose))
    return exit_code(runs, expect_miswired=bool(scenarios))
