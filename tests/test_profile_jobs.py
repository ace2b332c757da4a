"""The sharded profile build as Kubernetes runs it (deploy/kubernetes/profile-*-job.yaml), offline.

The manifests are checked the way Kubernetes would read them (Indexed mode, the shard count agreeing
with ``completions``, every ``$(VAR)`` defined, mounts backed by volumes, claims documented), then the
containers' exact command lines are run here for n = 3: each volume's mount path maps to a local
directory, ``JOB_COMPLETION_INDEX`` is set as the Job controller sets it, and the merged profile must
equal the single-process build (counts exactly, sums to 1e-12, calibration pieces bit for bit).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from hs_tracer.cli import main
from hs_tracer.profile.model import Profile

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy/kubernetes"
DOC = ROOT / "docs/profiles.md"
CONTROLLER_ENV = {"JOB_COMPLETION_INDEX"}  # set by the Job controller in Indexed mode


def _job(name: str) -> dict[str, Any]:
    [doc] = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    assert doc["apiVersion"] == "batch/v1" and doc["kind"] == "Job"
    return doc


@pytest.fixture(scope="module")
def build_job() -> dict[str, Any]:
    return _job("profile-build-job.yaml")


@pytest.fixture(scope="module")
def merge_job() -> dict[str, Any]:
    return _job("profile-merge-job.yaml")


def _container(job: dict[str, Any]) -> dict[str, Any]:
    [c] = job["spec"]["template"]["spec"]["containers"]
    return c


def _env(job: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: str(v["value"]) for v in _container(job).get("env", [])}


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command/args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def test_build_job_is_indexed_one_shard_per_index(build_job: dict[str, Any]) -> None:
    spec = build_job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"  # required by backoffLimitPerIndex
    assert spec["maxFailedIndexes"] == 0 and spec["backoffLimitPerIndex"] >= 1
    env = _env(build_job)
    assert int(env["HS_TRACER_SHARD_COUNT"]) == spec["completions"] >= spec["parallelism"] >= 1
    cmd = _container(build_job)["command"]
    assert cmd[:3] == ["hs-tracer", "profile", "build"] and "--resume" in cmd
    assert "--shard=$(JOB_COMPLETION_INDEX)/$(HS_TRACER_SHARD_COUNT)" in cmd
    out = next(a for a in cmd if a.startswith("--output="))
    assert "$(JOB_COMPLETION_INDEX)" in out  # every index writes its own file
    merge_cmd = _container(_job("profile-merge-job.yaml"))["command"][-1]
    glob = merge_cmd.split()[-1]
    assert Path(out.split("=", 1)[1]).match(glob.replace("*", "$(JOB_COMPLETION_INDEX)"))


@pytest.mark.parametrize("name", ["profile-build-job.yaml", "profile-merge-job.yaml"])
def test_jobs_reference_defined_variables_volumes_and_documented_claims(name: str) -> None:
    job = _job(name)
    pod = job["spec"]["template"]["spec"]
    c = _container(job)
    defined = set(_env(job)) | (CONTROLLER_ENV if job["spec"].get("completionMode") == "Indexed" else set())
    for arg in c["command"] + c.get("args", []):
        for ref in re.findall(r"\$\((\w+)\)", arg):
            assert ref in defined, f"{name}: {arg} uses undefined $({ref})"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert set(mounts) == set(volumes)
    doc = DOC.read_text()
    for v in volumes.values():
        assert v["persistentVolumeClaim"]["claimName"] in doc, f"docs/profiles.md: {v}"
        if v["persistentVolumeClaim"].get("readOnly"):
            assert mounts[v["name"]].get("readOnly")
    # every absolute path on the command line is under a mount (else it is not in the pod)
    for word in " ".join(c["command"]).replace("=", " ").split():
        if word.startswith("/"):
            assert any(word.startswith(m["mountPath"] + "/") for m in mounts.values()), word
    assert c["image"] in doc and job["metadata"]["name"] in doc


def _run(
    job: dict[str, Any], mounts: dict[str, Path], extra_env: dict[str, str]
) -> subprocess.CompletedProcess:
    """The container's command as the kubelet would run it, with mount paths mapped to ``mounts``."""
    c = _container(job)
    paths = {m["mountPath"]: mounts[m["name"]] for m in c["volumeMounts"]}
    env = {**_env(job), **extra_env}
    args = []
    for arg in c["command"]:
        arg = _expand(arg, env)
        for mount, local in sorted(paths.items(), key=lambda kv: -len(kv[0])):
            arg = re.sub(rf"(?<![\w/]){re.escape(mount)}(?=/|$)", str(local), arg)
        args.append(arg)
    bin_dir = str(Path(sys.executable).parent)  # hs-tracer, as installed next to this interpreter
    proc_env = {**os.environ, **env, "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}
    return subprocess.run(args, env=proc_env, capture_output=True, text=True, timeout=600)


def test_indexed_job_command_lines_run_locally_and_merge_to_the_single_build(
    build_job: dict[str, Any], merge_job: dict[str, Any], testbed, tmp_path: Path
) -> None:
    tb = testbed
    n = 3
    build_job["spec"]["completions"] = build_job["spec"]["parallelism"] = n  # what a user changes
    for var in _container(build_job)["env"]:
        if var["name"] == "HS_TRACER_SHARD_COUNT":
            var["value"] = str(n)
    data, models, shards = tmp_path / "data", tmp_path / "models", tmp_path / "shards"
    for d in (data, models, shards):
        d.mkdir()
    (data / "specforge").symlink_to(tb.specforge_data, target_is_directory=True)
    (models / "target").symlink_to(tb.target, target_is_directory=True)
    (models / "draft").symlink_to(tb.draft, target_is_directory=True)
    mounts = {"training-data": data, "models": models, "shards": shards}

    for i in range(n - 1):
        proc = _run(build_job, mounts, {"JOB_COMPLETION_INDEX": str(i)})
        assert proc.returncode == 0, proc.stderr[-2000:]
    early = _run(merge_job, mounts, {})  # a shard missing: the merge refuses and writes nothing
    assert early.returncode == 2 and "missing" in early.stderr
    assert not (shards / "profile.safetensors").exists()
    proc = _run(build_job, mounts, {"JOB_COMPLETION_INDEX": str(n - 1)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ETA" in proc.stderr  # not a terminal: progress comes as log lines

    first = shards / "shard-0.safetensors"
    before = first.stat().st_mtime_ns
    again = _run(build_job, mounts, {"JOB_COMPLETION_INDEX": "0"})  # a retried or re-run index
    assert again.returncode == 0 and "skipped" in again.stdout and first.stat().st_mtime_ns == before

    merged_run = _run(merge_job, mounts, {})
    assert merged_run.returncode == 0, merged_run.stderr[-2000:]
    merged = Profile.load(shards / "profile.safetensors")

    single_path = tmp_path / "single.safetensors"
    rc = main(["profile", "build", str(tb.specforge_data), "--draft", str(tb.draft), "--target",
               str(tb.target), "-o", str(single_path), "--no-progress"])
    assert rc == 0
    single = Profile.load(single_path)
    assert merged.meta["complete"] and merged.meta["shards"] == list(range(n))
    for key in ("tokens", "records", "files", "sources", "layer_ids", "skipped_tokens", "ids_origin"):
        assert merged.meta[key] == single.meta[key], key
    for a, b in ((merged.slots, single.slots), (merged.extras.stats, single.extras.stats)):
        np.testing.assert_array_equal(a.count, b.count)
        np.testing.assert_allclose(a.sum, b.sum, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(a.sumsq, b.sumsq, rtol=1e-12)
    for key in ("keys", "tokens", "sum", "sumsq"):
        np.testing.assert_array_equal(merged.pieces[key], single.pieces[key])


def test_resume_rebuilds_when_the_shard_files_change(testbed, tmp_path: Path) -> None:
    """A shard is skipped only when it was built from the same files: touching one file rebuilds it."""
    tb = testbed
    data = tmp_path / "sf" / "rows_0-2000"
    data.mkdir(parents=True)
    for f in sorted(tb.specforge_data.rglob("data_*.ckpt"))[:4]:
        (data / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "p.safetensors"
    common = ["profile", "build", str(tmp_path / "sf"), "--draft", str(tb.draft), "--target", str(tb.target),
              "--resume", "-o", str(out), "--no-progress"]
    args = [*common, "--shard", "1/2"]
    assert main(args) == 0
    key = Profile.load(out).meta["build_key"]
    assert main(args) == 0 and Profile.load(out).meta["build_key"] == key
    victim = sorted(data.iterdir())[1]  # files 1, 3 are shard 1
    os.utime(victim, ns=(victim.stat().st_atime_ns, victim.stat().st_mtime_ns + 10**9))
    assert main(args) == 0 and Profile.load(out).meta["build_key"] != key
    assert main([*common, "--shard", "0/2"]) == 0
    assert Profile.load(out).meta["shards"] == [0]  # another shard's output is never taken as this one
