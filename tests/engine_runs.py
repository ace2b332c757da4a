"""The one harness of the engine tests: each real SGLang CPU engine starts once per test session and
serves every workload the tests read from it.

Why: an engine start costs tens of seconds on a 2-core machine, and most behaviours only need some
engine of the right configuration, not one of their own. :data:`ENGINES` lists every engine the suite
starts, with the workloads it serves in order; tests ask the session's :class:`Engines` (fixture
``engines`` in tests/conftest.py) for an engine by name and read its results. An engine starts the
first time a test asks for it, so ``pytest -k`` starts only the engines the selected tests need.

Each engine runs in a fresh interpreter (``python -m tests.engine_runs``): the CPU runtime must be
prepared before SGLang is first imported, and the pytest process imports SGLang's GPU-path modules
in other tests. Comparisons of tokens between engines use each engine's first workload, served on an
empty radix cache, so a cached prefix never changes what is compared.

Programs that start engines themselves (``hs-tracer demo``, ``benchmarks/soak.py``) run through
:func:`run_tool`. Every engine start, whoever makes it, is counted (the testbed launcher appends a
line to the file ``TESTBED_ENGINE_START_LOG`` names) and the count is printed at the end of the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_tracer.integrations.sglang import releases as sglang_releases
from hs_tracer.integrations.sglang import versions

REPO = Path(__file__).resolve().parents[1]
TRACED_ENV = {"HS_TRACER": "1", "HS_TRACER_WINDOW_TOKENS": "128"}  # windows close often on short runs
SETTLE_S = 2.0  # the recorder refreshes the report every 0.5 s while steps arrive


# ---- workloads -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """One greedy ``generate`` call with all prompts batched; prompts are texts or token-id lists."""

    name: str
    prompts: tuple[Any, ...]
    max_new_tokens: int
    ignore_eos: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "prompts": list(self.prompts), "max_new_tokens": self.max_new_tokens,
                "ignore_eos": self.ignore_eos}


def workload(name: str) -> Workload:
    """The named workload (deterministic: built from the testbed corpus each time); ``NAME#2`` is
    NAME sent again."""
    from dataclasses import replace

    from hs_tracer_testbed.corpus import documents, prompts

    if "#" in name:
        return replace(workload(name.split("#")[0]), name=name)

    if name == "lossless":  # many prompts, every output the same length: the lossless oracle's batch
        return Workload(name, tuple(prompts(seed=4242, n=24)), 24)
    if name == "diagnosis":  # the demo's workload: what every verdict on the engine was calibrated on
        return Workload(name, tuple(prompts(seed=1234, n=8)), 24, ignore_eos=False)
    if name == "replay":  # ~2,000 scored tokens: replay's calibrated level needs that many for a firm verdict
        return Workload(name, tuple(prompts(seed=1234, n=160)), 12, ignore_eos=False)
    if name == "transformers":  # token ids, compared with Hugging Face transformers' greedy decoding
        from hs_tracer_testbed.target import encode

        return Workload(name, tuple(map(list, encode(prompts(seed=99, n=6), add_eos=False))), 12)
    if name == "real":  # held-out real text, for the real-model pair (SmolLM2-135M-Instruct)
        from hs_tracer_testbed.smollm import prompts as real_prompts

        return Workload(name, tuple(real_prompts(12)), 24)
    if name == "prefix_reuse":  # long prompts sharing a long prefix (send it twice: radix-cache hits)
        shared = " ".join(documents(seed=2024, n=4))
        return Workload(name, tuple(f"{shared} {p}" for p in prompts(seed=2025, n=6)), 16)
    raise KeyError(name)


# ---- the engines of the suite ----------------------------------------------------------------------
@dataclass(frozen=True)
class EngineSpec:
    """One engine: its draft (``None``: plain decoding; ``"testbed"``: the trained draft; else a
    miswiring of :mod:`hs_tracer_testbed.miswire` applied to it), EAGLE-3 shape, tracing settings and
    the workloads it serves, in order."""

    draft: str | None
    workloads: tuple[str, ...]
    traced: bool = True
    spec_steps: int = 3
    topk: int = 1
    num_draft_tokens: int | None = None
    profile: bool = True  # HS_TRACER_PROFILE: the testbed's reference profile
    capture: bool = False  # HS_TRACER_CAPTURE_DIR (rate 1) inside the engine's work dir
    scraped: bool = False  # a real Prometheus scrapes it and a real OTLP receiver gets its spans
    env: tuple[tuple[str, str], ...] = ()
    linger_s: float = 0.0  # stay up after the last workload (a few more scrapes)
    # sgl.Engine arguments of a multi-rank engine, e.g. (("tp_size", 2),) (tests/test_engine_multirank.py)
    parallel: tuple[tuple[str, Any], ...] = ()
    # hs_tracer's own /metrics on a free base port; after each workload the engine process reads the
    # port of every TP rank 0-1 and DP replica 0-1 (``None`` where nothing serves)
    rank_ports: bool = False


# The installed SGLang release's family (docs/versions.md): an older release (a layer venv beside
# .venv, which holds the newest) runs fewer, smaller engines.
FAMILY = versions.installed_family()
OLDER_RELEASE = FAMILY is not None and sglang_releases.release_of(versions.installed_version() or "") != \
    sglang_releases.NEWEST_RELEASE
# The keys of SGLang's per-request speculative counters in meta_info (renamed after 0.5.11).
COUNTERS = versions.installed_meta_counters()
_TREE = {"spec_steps": 3, "topk": 2, "num_draft_tokens": 6}

# The fault-injection engines: one real-engine fault per hook kind (every hook is faulted in-process on
# SGLang's real classes in test_hook_faults.py). With tracing switched off by the fault they also serve
# the lossless oracle's chain (1 step) and tree (topk 2) shapes. On an older release with a V1 worker
# the faults go into its V1 worker's own hooks (its V2 worker's per-step hooks are mostly the newest
# family's); on the others into the V2 worker's and the family's accept-length hook.
if OLDER_RELEASE and "V1" in FAMILY.workers:
    _V1 = tuple(FAMILY.worker_env["V1"].items())
    FAULT_ENGINES: dict[str, tuple[str, dict[str, Any]]] = {
        "startup": ("EAGLEWorker.init_cuda_graphs", {"spec_steps": 1, "env": _V1}),
        "per-step before": ("EAGLEWorker.forward_draft_extend_after_decode", {**_TREE, "env": _V1}),
        "per-step after": ("EAGLEWorker.forward_batch_generation", {"env": _V1}),
    }
else:
    _ACCEPT_HOOK = next(h.name for h in (FAMILY or sglang_releases.FAMILIES[0]).hooks
                        if h.type == "after" and h.params == ("result", "batch"))
    FAULT_ENGINES = {
        "startup": ("EagleDraftWorker.init_lm_head", {"spec_steps": 1}),
        "per-step before": ("EagleDraftWorker._draft_extend_for_decode", _TREE),
        "per-step after": (_ACCEPT_HOOK, {}),
        **({} if OLDER_RELEASE else {"recorder": ("recorder", {})}),
    }

ENGINES: dict[str, EngineSpec] = {
    "plain": EngineSpec(None, ("lossless", "transformers", "transformers#2"), profile=False),
    "untraced": EngineSpec("testbed", ("lossless",), traced=False),
    "correct": EngineSpec("testbed", ("lossless", "diagnosis", "replay", "prefix_reuse",
                                         "prefix_reuse#2"), capture=True,
                          scraped=True, linger_s=3.0),
    "aux_off": EngineSpec("aux_off", ("diagnosis",)),
    "ids_top_level": EngineSpec("ids_top_level", ("diagnosis",)),
    # exporters in their own process (HS_TRACER_EXPORT=process): scraped, spans, diagnosis, capture
    "ids_shifted": EngineSpec("ids_shifted", ("diagnosis", "replay"), capture=True, scraped=True,
                              linger_s=3.0, env=(("HS_TRACER_EXPORT", "process"),)),
    "d2t_regenerated": EngineSpec("d2t_regenerated", ("diagnosis",)),
    **{f"fault:{kind}": EngineSpec("testbed", ("lossless",),
                                   env=(("HS_TRACER_FAULT_INJECT", where), *shape.get("env", ())),
                                   **{k: v for k, v in shape.items() if k != "env"})
       for kind, (where, shape) in FAULT_ENGINES.items()},
}
# Multi-rank serving on the CPU (tests/test_engine_multirank.py): TP 2 over gloo, and attention DP 2
# inside it; the fault names one TP rank (HS_TRACER_FAULT_INJECT=<hook>@tp<N>).
TP2 = (("tp_size", 2),)
DP_ATTENTION = (("tp_size", 2), ("dp_size", 2), ("enable_dp_attention", True))
FAULT_ONE_RANK = "EagleDraftWorker._draft_extend_for_decode@tp1"
ENGINES.update({
    "tp2": EngineSpec("testbed", ("lossless", "diagnosis"), parallel=TP2, rank_ports=True),
    "dp_attention": EngineSpec("testbed", ("lossless", "diagnosis"), parallel=DP_ATTENTION, rank_ports=True),
    "dp_attention:ids_shifted": EngineSpec("ids_shifted", ("diagnosis", "lossless"), parallel=DP_ATTENTION),
    "tp2:tree": EngineSpec("testbed", ("lossless",), parallel=TP2, **_TREE),
    "dp_attention:fault": EngineSpec("testbed", ("lossless",), parallel=DP_ATTENTION,
                                     env=(("HS_TRACER_FAULT_INJECT", FAULT_ONE_RANK),)),
})
if OLDER_RELEASE:  # tests/test_release_engine.py: each EAGLE-3 worker traced, and the layer-id rule
    ENGINES.update({f"correct:{worker}": EngineSpec("testbed", ("lossless", "diagnosis"),
                                                    env=tuple(FAMILY.worker_env.get(worker, {}).items()))
                    for worker in FAMILY.workers})
    ENGINES["ids_shifted"] = EngineSpec("ids_shifted", ("diagnosis",))


@dataclass
class EngineResult:
    """What one engine produced: per workload the outputs, SGLang's per-request meta info and the
    tracer's report right after it; the reports after the last workload; the engine's log."""

    name: str
    spec: EngineSpec
    work: Path
    workloads: dict[str, dict[str, Any]]
    schedulers: list[dict[str, Any]]
    engine_pid: int  # the process that started the engine (SGLang's schedulers are its children)
    log: str = field(repr=False)

    def output_ids(self, workload: str) -> list[list[int]]:
        return self.workloads[workload]["output_ids"]

    def meta(self, workload: str) -> list[dict[str, Any]]:
        return self.workloads[workload]["meta"]

    @property
    def diagnosis(self) -> dict[str, Any]:
        """The report of the emitting scheduler after the last workload (``hs-tracer demo --json`` keys)."""
        return _diagnosis(self.schedulers)

    def diagnosis_after(self, workload: str) -> dict[str, Any]:
        return _diagnosis(self.workloads[workload]["schedulers"])

    @property
    def report(self) -> dict[str, Any]:
        (report,) = self.schedulers  # tp=1: exactly one scheduler process
        return report


def _diagnosis(schedulers: list[dict[str, Any]]) -> dict[str, Any]:
    from hs_tracer_testbed.demo import Run

    return Run("", Path(), None, [], [], [], schedulers).to_json()


class Engines:
    """The session's engines: started on first request, each once."""

    def __init__(self, testbed: Any, profile: Path, root: Path) -> None:
        self.testbed, self.profile, self.root = testbed, profile, root
        self._results: dict[str, EngineResult] = {}
        self._observers: tuple[Any, Any] | None = None
        self.ports: dict[str, int] = {}

    def __getitem__(self, name: str) -> EngineResult:
        return self.run(name, ENGINES[name])

    def run(self, name: str, spec: EngineSpec) -> EngineResult:
        """The engine ``name``: one of :data:`ENGINES`, or an engine a test module needs beyond them
        (e.g. an SGLang release's other EAGLE worker, chosen by ``spec.env``). Each name starts once;
        a name always means the same spec."""
        if ENGINES.get(name, spec) != spec:
            raise ValueError(f"engine {name!r} is in ENGINES with another spec")
        if name not in self._results:
            self._results[name] = self._run(name, spec)
        elif self._results[name].spec != spec:
            raise ValueError(f"engine {name!r} already ran with another spec")
        return self._results[name]

    @property
    def observers(self) -> tuple[Any, Any]:
        """(Prometheus, OTLP receiver) of the scraped engines, started before the first of them."""
        if self._observers is None:
            from tests.infra.net import free_port
            from tests.infra.otlp import OtlpReceiver
            from tests.infra.prom import PrometheusServer, ensure_prometheus

            self.ports = {n: free_port() for n, s in ENGINES.items() if s.scraped}
            prom = PrometheusServer([f"127.0.0.1:{p}" for p in self.ports.values()], self.root / "prometheus",
                                    binary=ensure_prometheus()).start()
            self._observers = (prom, OtlpReceiver().start())
        return self._observers

    def close(self) -> None:
        if self._observers is not None:
            for server in self._observers:
                server.stop()

    def _draft(self, name: str, work: Path) -> Path | None:
        from hs_tracer_testbed.miswire import SCENARIOS, regenerated_d2t, write_variant, write_vocab_variant

        if name is None:
            return None
        if name == "testbed":
            return Path(self.testbed.draft)
        if name in SCENARIOS:
            return write_variant(self.testbed.draft, work / "draft", name)
        if name == "d2t_regenerated":
            return write_vocab_variant(self.testbed.draft, work / "draft", regenerated_d2t(self.testbed))
        raise KeyError(name)

    def _run(self, name: str, spec: EngineSpec) -> EngineResult:
        work = self.root / name.replace(":", "-").replace(" ", "-")
        work.mkdir(parents=True)
        env: dict[str, str] = {}
        if spec.traced:
            env.update(TRACED_ENV, HS_TRACER_REPORT_DIR=str(work / "reports"))
            if spec.profile:
                env["HS_TRACER_PROFILE"] = str(self.profile)
            if spec.capture:
                env.update(HS_TRACER_CAPTURE_DIR=str(work / "capture"), HS_TRACER_CAPTURE_RATE="1")
            if spec.scraped:
                _prom, otlp = self.observers
                env.update(HS_TRACER_METRICS_PORT=str(self.ports[name]), HS_TRACER_SPAN_SAMPLE="1",
                           OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=otlp.endpoint, OTEL_BSP_SCHEDULE_DELAY="200")
        env.update(spec.env)
        ports: list[int] = []
        if spec.rank_ports:
            from tests.infra.net import free_port

            base = next(p for p in iter(free_port, None) if p < 65000)  # room for the ranks' ports above
            env["HS_TRACER_METRICS_PORT"] = str(base)
            ports = [base + tp + 64 * dp for dp in (0, 1) for tp in (0, 1)]
        draft = self._draft(spec.draft, work)
        job = {"target": str(self.testbed.target), "draft": str(draft) if draft else None,
               "engine": {"spec_steps": spec.spec_steps, "topk": spec.topk,
                          "num_draft_tokens": spec.num_draft_tokens},
               "parallel": dict(spec.parallel), "env": env, "traced": spec.traced,
               "linger_s": spec.linger_s, "work": str(work), "metrics_ports": ports,
               "workloads": [workload(w).to_json() for w in spec.workloads]}
        (work / "job.json").write_text(json.dumps(job))
        began = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "tests.engine_runs", str(work / "job.json")],
                              env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=1500)
        log = (work / "engine.log").read_text(errors="replace") if (work / "engine.log").exists() else ""
        assert proc.returncode == 0, f"engine {name} failed:\n{proc.stderr[-4000:]}\n{log[-6000:]}"
        out = json.loads((work / "result.json").read_text())
        COSTS.append(EngineCost(name, time.monotonic() - began, out["seconds"]))
        return EngineResult(name, spec, work, out["workloads"], out["schedulers"], out["pid"], log)


def child_env() -> dict[str, str]:
    """This process's environment without hs_tracer's settings (where the testbed is built stays):
    each engine gets only its own."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith("HS_TRACER") or k == "HS_TRACER_TESTBED_DIR"}


def run_tool(args: list[str], *, timeout_s: int = 1700, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """A program that starts engines itself (``hs-tracer demo``, a benchmark), in a fresh interpreter
    with the same environment as the harness's engines; fails the test when it exits non-zero."""
    began = time.monotonic()
    proc = subprocess.run([sys.executable, *args], env=child_env(), cwd=cwd, capture_output=True, text=True,
                          timeout=timeout_s)
    COSTS.append(EngineCost(" ".join(args[:3]), time.monotonic() - began, {}))
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-6000:])
    return proc


@dataclass(frozen=True)
class EngineCost:
    """What one engine (or a program that starts its own) cost this session, in wall seconds: in all,
    and inside the engine process its start, its workloads and its shutdown."""

    name: str
    wall_s: float
    parts_s: dict[str, float]

    def line(self) -> str:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in self.parts_s.items())
        return f"{self.name} {self.wall_s:.0f} s" + (f" ({parts})" if parts else "")


COSTS: list[EngineCost] = []  # printed at the end of the session (tests/conftest.py), to see where time goes


def count_starts(log: Path) -> dict[str, int]:
    """Engine starts per test file, from the launcher's log (one line per start: the test running)."""
    counts: dict[str, int] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            key = line.split("::")[0] or "(outside a test)"
            counts[key] = counts.get(key, 0) + 1
    return counts


# ---- the engine process ----------------------------------------------------------------------------
def _scrape(port: int) -> str | None:
    """hs_tracer's ``/metrics`` text on ``port`` of this machine, or ``None`` where nothing serves."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return None


def _serve(job: dict[str, Any]) -> dict[str, Any]:
    from hs_tracer_testbed.demo import output_to, read_reports, settled_reports
    from hs_tracer_testbed.runtime.launcher import engine

    work = Path(job["work"])
    os.chdir(work)  # anything written relative to the working directory lands in the engine's work dir
    report_dir = Path(job["env"].get("HS_TRACER_REPORT_DIR", work / "reports"))
    shape = {k: v for k, v in job["engine"].items() if v is not None} if job["draft"] else {}
    shape.update(job.get("parallel", {}))
    workloads: dict[str, dict[str, Any]] = {}
    verified = 0  # request-steps SGLang counted over the workloads so far (the report is cumulative)
    began = time.monotonic()
    with output_to(work / "engine.log"), engine(job["target"], job["draft"], env=job["env"], **shape) as eng:
        started_s = time.monotonic() - began
        for wl in job["workloads"]:
            key = "prompt" if isinstance(wl["prompts"][0], str) else "input_ids"
            sampling = {"temperature": 0.0, "max_new_tokens": wl["max_new_tokens"],
                        "ignore_eos": wl["ignore_eos"]}
            outs = eng.generate(**{key: wl["prompts"]}, sampling_params=sampling)
            verified += sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            reports = settled_reports(report_dir, verified) if job["traced"] else read_reports(report_dir)
            workloads[wl["name"]] = {
                "prompts": wl["prompts"], "outputs": [o["text"] for o in outs],
                "output_ids": [list(o["output_ids"]) for o in outs],
                "meta": [o["meta_info"] for o in outs],
                "schedulers": reports,
                "metrics": {str(port): _scrape(port) for port in job.get("metrics_ports", [])}}
        time.sleep(job["linger_s"])
        schedulers = settled_reports(report_dir, verified) if job["traced"] else read_reports(report_dir)
        served_s = time.monotonic() - began - started_s
    return {"workloads": workloads, "schedulers": schedulers, "pid": os.getpid(),
            "seconds": {"start": started_s, "serve": served_s, "stop": time.monotonic() - began - started_s
                        - served_s}}


if __name__ == "__main__":
    job_file = Path(sys.argv[1])
    result = _serve(json.loads(job_file.read_text()))
    (job_file.parent / "result.json").write_text(json.dumps(result, default=str))
