"""Throughput of ``profile build`` at production width against the read + deserialise floor.

What is measured: synthetic SpecForge and speculators dumps at DeepSeek-V3 / Kimi-K2.5 width (hidden
7168, K = 3 slots, bf16; 10 records of 512 tokens per layout, ~294 MB each; see profile_build_data.py)
are generated deterministically into a temporary directory (never committed). For each layout, with 1
and with 2 processes at once (process i builds ``--shard i/n``), each process does one of:

* ``floor``: read and deserialise every file of its shard with the producer's own loader, fully
  materialised, nothing else: SpecForge ``torch.load(path, weights_only=True)``, speculators
  ``safetensors.torch.load(file bytes)``;
* ``build``: what ``hs-tracer profile build`` does after argument parsing: open the dump, build the
  profile (slots, final-norm / verifier extra, calibration pieces), save it;
* ``build_before`` (with ``--before DIR``): the same with the code in DIR (the builder before this
  benchmark's changes), for the before/after comparison.

Every process runs with one thread (OMP_NUM_THREADS=1, torch.set_num_threads(1)), starts its clock
after its imports, and the processes of one run start together. MB/s per process = bytes of its files /
its seconds; aggregate = all bytes / the slowest process. Files are in the page cache (every run reads
the same files; the first, warm-up pass is not recorded), so the floor is the deserialise cost plus a
memory copy, not disk speed. The machine is shared: ``/proc/loadavg`` is recorded before every run, the
kinds are interleaved run by run, and the ratios build / floor are taken between neighbouring runs.

Run from the repository root:  .venv/bin/python benchmarks/profile_build.py [--reps 3] [--before DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from provenance import source_state

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
LAYOUTS = ("specforge", "speculators")
NUM_LAYERS = 61


def _env() -> dict[str, str]:
    one = {k: "1" for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    return {**os.environ, **one}


def worker(kind: str, layout: str, root: Path, shard: tuple[int, int], start_at: float) -> dict:
    """One process's work; returns bytes, tokens and seconds."""
    import torch

    torch.set_num_threads(1)
    from hs_tracer.profile import build

    dump = build.open_dump(root, target=build.TargetInfo(num_layers=NUM_LAYERS))
    files = dump.reader.files(shard)
    nbytes = sum(f.stat().st_size for f in files)
    tokens = 0
    while time.time() < start_at:
        time.sleep(0.005)
    t0 = time.perf_counter()
    if kind == "floor":
        from safetensors.torch import load

        for f in files:
            if layout == "specforge":
                data = torch.load(f, weights_only=True)
                tokens += int(data["aux_hidden_state"].shape[1])
            else:
                data = load(f.read_bytes())
                tokens += int(data["hidden_states"].shape[0])
    else:
        profile = build.build_profile([dump], shard=shard, progress=False)
        with tempfile.TemporaryDirectory() as tmp:
            profile.save(Path(tmp) / "p.safetensors")
        tokens = profile.tokens + int(profile.meta["skipped_tokens"])
    seconds = time.perf_counter() - t0
    return {"bytes": nbytes, "tokens": tokens, "seconds": seconds}


def run(kind: str, layout: str, root: Path, procs: int, before: Path | None) -> dict:
    """``procs`` workers at once (shards i/procs); per-process and aggregate MB/s."""
    code = before if kind == "build_before" else Path.cwd()
    env = {**_env(), "PYTHONPATH": f"{code}{os.pathsep}{HERE}"}
    start_at = time.time() + 6.0 + 3.0 * procs  # after every worker's imports, under load
    load = Path("/proc/loadavg").read_text().split()[:3]
    cmds = [
        [sys.executable, __file__, "--worker", "floor" if kind == "floor" else "build", "--layout", layout,
         "--root", str(root), "--shard", f"{i}/{procs}", "--start-at", repr(start_at)]
        for i in range(procs)
    ]
    ps = [subprocess.Popen(c, env=env, stdout=subprocess.PIPE, text=True) for c in cmds]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in ps]
    if any(p.returncode for p in ps):
        raise SystemExit(f"{kind} {layout} x{procs}: a worker failed")
    total = sum(o["bytes"] for o in outs)
    wall = max(o["seconds"] for o in outs)
    return {
        "loadavg_before": " ".join(load),
        "per_process_MBps": [round(o["bytes"] / o["seconds"] / 1e6, 1) for o in outs],
        "aggregate_MBps": round(total / wall / 1e6, 1),
        "tokens_per_s_aggregate": round(sum(o["tokens"] for o in outs) / wall),
        "seconds": [round(o["seconds"], 3) for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", choices=("floor", "build"))
    ap.add_argument("--layout", choices=LAYOUTS)
    ap.add_argument("--root", type=Path)
    ap.add_argument("--shard", default="0/1")
    ap.add_argument("--start-at", type=float, default=0.0)
    ap.add_argument("--data-dir", type=Path, default=Path(tempfile.gettempdir()) / "hs_tracer_profile_bench")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--before", type=Path, help="checkout of the builder to compare against")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.worker:
        i, n = (int(v) for v in args.shard.split("/"))
        print(json.dumps(worker(args.worker, args.layout, args.root, (i, n), args.start_at)))
        return

    from profile_build_data import Recipe, generate

    recipe = Recipe()
    dirs = generate(args.data_dir, recipe)
    kinds = ["floor", "build"] + (["build_before"] if args.before else [])
    sizes = {lay: sum(f.stat().st_size for f in dirs[lay].rglob("*") if f.is_file()) for lay in LAYOUTS}
    for lay in LAYOUTS:  # warm-up: page cache and first imports, not recorded
        run("floor", lay, dirs[lay], 1, None)
    runs: dict[str, list[dict]] = {}
    for rep in range(args.reps):
        for lay in LAYOUTS:
            for procs in (1, 2):
                for kind in kinds:
                    r = run(kind, lay, dirs[lay], procs, args.before)
                    runs.setdefault(f"{lay}/{procs}p/{kind}", []).append(r)
                    print(rep, lay, procs, kind, r["per_process_MBps"], r["aggregate_MBps"],
                          "load", r["loadavg_before"], flush=True)

    def med(key: str, field: str = "aggregate_MBps") -> float:
        return round(statistics.median(r[field] for r in runs[key]), 1)

    summary: dict = {}
    for lay in LAYOUTS:
        for procs in (1, 2):
            base = f"{lay}/{procs}p"
            cell = {kind: {"aggregate_MBps_median": med(f"{base}/{kind}"),
                           "per_process_MBps_median": round(statistics.median(
                               v for r in runs[f"{base}/{kind}"] for v in r["per_process_MBps"]), 1)}
                    for kind in kinds}
            for kind in kinds[1:]:
                ratios = [b["aggregate_MBps"] / f["aggregate_MBps"]
                          for f, b in zip(runs[f"{base}/floor"], runs[f"{base}/{kind}"], strict=True)]
                cell[f"{kind}_over_floor_median"] = round(statistics.median(ratios), 3)
            summary[base] = cell
        for kind in kinds:
            one, two = runs[f"{lay}/1p/{kind}"], runs[f"{lay}/2p/{kind}"]
            scale = [b["aggregate_MBps"] / a["aggregate_MBps"] for a, b in zip(one, two, strict=True)]
            summary[f"{lay}/scaling_2p_over_1p/{kind}"] = round(statistics.median(scale), 3)
    now = datetime.now(timezone.utc)
    out = {
        "benchmark": "profile_build",
        "date": now.isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores "
        f"({_cpu_model()}), {_mem_gib()} GiB, shared with other jobs (see loadavg), CPU only",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "method": __doc__,
        "recipe": {**recipe.__dict__, "digest": recipe.digest()},
        "layout_bytes": sizes,
        "summary": summary,
        "runs": runs,
    }
    path = args.out or RESULTS / f"profile_build_{now.date().isoformat()}.json"
    out["source"] = source_state(Path(__file__).resolve().parents[1])  # the commit measured
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def _mem_gib() -> int:
    kb = int(Path("/proc/meminfo").read_text().split()[1])
    return round(kb / 2**20)


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
