"""Reference profiles from the testbed's real dumps: readers, provenance, sharding, merge, CLI."""

from __future__ import annotations

import gzip
import json
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from hs_tracer.cli import build_parser, main
from hs_tracer.profile import build, readers
from hs_tracer.profile.capture_format import CaptureManifest, CaptureWriter, read_manifest
from hs_tracer.profile.model import Profile, ProfileError, merge_profiles
from hs_tracer.profile_builder import BuildRequest, build_profile_file
from hs_tracer.sources import Convention


@pytest.fixture(scope="session")
def testbed():
    from hs_tracer_testbed.build import ensure_testbed

    return ensure_testbed(progress=False)


@pytest.fixture(scope="session")
def plan(testbed) -> dict:
    return testbed.load_manifest()["layers"]


@pytest.fixture(scope="session")
def specforge_profile(testbed, tmp_path_factory) -> Path:
    """The SpecForge-data profile with atlas, built through the CLI (ids from the draft's config)."""
    out = tmp_path_factory.mktemp("profile") / "specforge.safetensors"
    rc = main(
        [
            "profile",
            "build",
            str(testbed.specforge_data),
            "-o",
            str(out),
            "--draft",
            str(testbed.draft),
            "--target",
            str(testbed.target),
            "--atlas",
            str(testbed.atlas_data),
            "--no-progress",
        ]
    )
    assert rc == 0
    return out


def test_specforge_profile_provenance(specforge_profile: Path, plan: dict, testbed) -> None:
    p = Profile.load(specforge_profile)
    m = p.meta
    assert m["producer"] == "specforge" and m["ids_origin"] == "draft_config"
    assert m["convention"] == "specforge" and m["layer_ids"] == plan["draft_config_ids"]
    assert p.sources == plan["aux_sources"]
    assert m["num_layers"] == plan["num_hidden_layers"] and m["target_arch"] == "DeepseekV3ForCausalLM"
    assert m["dtype"] == "bfloat16" and m["num_slots"] == 3
    n_files = len(list(testbed.specforge_data.rglob("data_*.ckpt")))
    assert m["records"] == n_files and m["files"] == n_files
    assert m["tokens"] == int(p.slots.count[0, 0]) > 0  # no non-finite values in the testbed dumps
    assert m["skipped_tokens"] == n_files  # position 0 of every record
    assert p.extras is not None and p.extras.names == ["final_norm"]
    assert p.atlas is not None and p.atlas.names == [*plan["atlas_sources"], "final_norm"]
    assert stat.S_IMODE(specforge_profile.stat().st_mode) == 0o600
    # the statistics are those of the data: slot 0's mean equals the mean over the records read directly
    total, n = 0.0, 0
    for f in sorted(testbed.specforge_data.rglob("data_*.ckpt"))[:]:
        aux = torch.load(f, weights_only=True)["aux_hidden_state"][0, 1:, : p.hidden_size].float()
        total, n = total + aux.sum(0).double(), n + aux.shape[0]
    np.testing.assert_allclose(p.slots.mean()[0], (total / n).numpy(), rtol=1e-6, atol=1e-9)


def test_speculators_profile_matches_specforge(
    testbed, specforge_profile: Path, plan: dict, tmp_path: Path
) -> None:
    """The same tensors written by the other tool's layout give the same profile (C_in ids + verifier)."""
    out = tmp_path / "spec.safetensors"
    assert (
        main(
            [
                "profile",
                "build",
                str(testbed.speculators_data),
                "-o",
                str(out),
                "--target",
                str(testbed.target),
                "--no-progress",
            ]
        )
        == 0
    )
    q = Profile.load(out)
    p = Profile.load(specforge_profile)
    assert q.meta["producer"] == "speculators" and q.meta["ids_origin"] == "default"
    assert q.meta["layer_ids"] == plan["speculators_c_in"][:3] and q.sources == p.sources
    assert q.extras is not None and q.extras.names == [f"block:{plan['num_hidden_layers'] - 1}"]
    np.testing.assert_allclose(q.slots.sum, p.slots.sum, rtol=1e-9, atol=1e-6)
    np.testing.assert_allclose(q.slots.sumsq, p.slots.sumsq, rtol=1e-9)


def test_sharded_build_merges_to_the_single_build(testbed, specforge_profile: Path, tmp_path: Path) -> None:
    shards = []
    for i in range(3):
        out = tmp_path / f"s{i}.safetensors"
        assert (
            main(
                [
                    "profile",
                    "build",
                    str(testbed.specforge_data),
                    "-o",
                    str(out),
                    "--draft",
                    str(testbed.draft),
                    "--target",
                    str(testbed.target),
                    "--atlas",
                    str(testbed.atlas_data),
                    "--shard",
                    f"{i}/3",
                    "--no-progress",
                ]
            )
            == 0
        )
        shards.append(out)
    assert not Profile.load(shards[0]).meta["complete"]
    merged_path = tmp_path / "merged.safetensors"
    assert main(["profile", "merge", *map(str, shards[::-1]), "-o", str(merged_path)]) == 0
    merged, single = Profile.load(merged_path), Profile.load(specforge_profile)
    assert merged.meta["complete"] and merged.meta["shards"] == [0, 1, 2]
    for key in ("tokens", "records", "files", "sources", "layer_ids", "skipped_tokens"):
        assert merged.meta[key] == single.meta[key], key
    for a, b in (
        (merged.slots, single.slots),
        (merged.extras.stats, single.extras.stats),
        (merged.atlas.stats, single.atlas.stats),
    ):
        np.testing.assert_array_equal(a.count, b.count)
        np.testing.assert_allclose(a.sum, b.sum, rtol=1e-12, atol=1e-9)
        np.testing.assert_allclose(a.sumsq, b.sumsq, rtol=1e-12)
    for key in ("keys", "tokens", "sum", "sumsq"):  # the calibration sample is the same pieces
        np.testing.assert_array_equal(merged.pieces[key], single.pieces[key])
    with pytest.raises(ProfileError, match="appear twice"):
        merge_profiles([Profile.load(shards[0]), Profile.load(shards[0])])


def test_merge_refuses_different_wiring(testbed, specforge_profile: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    assert (
        main(
            [
                "profile",
                "build",
                str(testbed.specforge_data),
                "-o",
                str(other),
                "--layer-ids",
                "2,4,5",
                "--convention",
                "specforge",
                "--target",
                str(testbed.target),
                "--shard",
                "0/8",
                "--measure-sequences",
                "0",
                "--no-progress",
            ]
        )
        == 0
    )
    assert Profile.load(other).sources == ["block:2", "block:4", "block:5"]
    assert main(["profile", "merge", str(specforge_profile), str(other), "-o", str(tmp_path / "x")]) == 2


def test_specforge_reader_gzip_and_refuses_pickled_code(testbed, tmp_path: Path) -> None:
    rows = tmp_path / "sf" / "rows_0-2000"
    rows.mkdir(parents=True)
    src = sorted(testbed.specforge_data.rglob("data_*.ckpt"))[:2]
    for i, f in enumerate(src):
        with gzip.open(rows / f"data_{i}.ckpt.gz", "wb") as g:
            g.write(f.read_bytes())
    reader = readers.detect(tmp_path / "sf")
    assert isinstance(reader, readers.SpecForgeReader) and len(reader.files()) == 2
    rec = next(reader.records(reader.files()[0], 3, reader.layout().hidden_size))
    direct = torch.load(src[0], weights_only=True)["aux_hidden_state"][0].float().numpy()
    np.testing.assert_array_equal(rec.slots.reshape(rec.slots.shape[0], -1).float().numpy(), direct)
    # a file carrying a pickled object (code on load) is refused, not executed
    torch.save({"aux_hidden_state": torch.zeros(1, 2, 6), "evil": shutil.rmtree}, rows / "data_9.ckpt")
    with pytest.raises(readers.LayoutError, match="weights_only"):
        list(reader.records(rows / "data_9.ckpt", 3, 2))


def test_capture_format_roundtrip_and_build(testbed, plan: dict, tmp_path: Path) -> None:
    """A capture (what the live tracer writes) carries its own wiring: ids come from the data."""
    cap = tmp_path / "cap"
    sources = plan["sglang_fed_sources"]
    recs = [torch.load(f, weights_only=True) for f in sorted(testbed.specforge_data.rglob("data_*.ckpt"))[:4]]
    hidden = recs[0]["aux_hidden_state"].shape[-1] // 3
    manifest = CaptureManifest(
        num_slots=3,
        hidden_size=hidden,
        sources=sources,
        layers_to_capture=plan["sglang_layers_to_capture"],
        num_layers=plan["num_hidden_layers"],
        target_arch="DeepseekV3ForCausalLM",
    )
    writer = CaptureWriter(cap, manifest)
    for d in recs:
        aux = d["aux_hidden_state"][0]
        writer.write(aux.to(torch.bfloat16), d["input_ids"].numpy(), np.arange(aux.shape[0]), [3, 1, 2])
    assert stat.S_IMODE((cap / "manifest.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((cap / "capture_00000.safetensors").stat().st_mode) == 0o600
    assert read_manifest(cap).shards[0]["file"] == "capture_00000.safetensors"
    out = tmp_path / "cap.safetensors"
    assert main(["profile", "build", str(cap), "-o", str(out), "--no-progress"]) == 0
    p = Profile.load(out)
    assert p.meta["producer"] == "hs_tracer_capture" and p.meta["ids_origin"] == "data"
    assert p.sources == sources and p.meta["records"] == 4
    direct = tmp_path / "direct.safetensors"  # the library call the command makes, without argv
    assert build_profile_file(BuildRequest([cap], direct, no_progress=True)) == 0
    assert Profile.load(direct).sources == sources


def test_the_build_flags_defaults_are_the_build_requests() -> None:
    """A caller that builds through :class:`BuildRequest` gets what ``profile build`` does by default."""
    args = build_parser().parse_args(["profile", "build", "dump", "-o", "out.safetensors"])
    assert BuildRequest.from_args(args) == BuildRequest([Path("dump")], Path("out.safetensors"))


def test_ids_resolution_rules(testbed, tmp_path: Path) -> None:
    target = build.read_target(testbed.target)
    # flags need a convention; --draft and --layer-ids together are ambiguous: exit 2 with the fix
    args = [
        "profile",
        "build",
        str(testbed.specforge_data),
        "-o",
        str(tmp_path / "p"),
        "--no-progress",
        "--target",
        str(testbed.target),
    ]
    assert main([*args, "--layer-ids", "1,3,4"]) == 2
    assert (
        main([*args, "--layer-ids", "1,3,4", "--convention", "specforge", "--draft", str(testbed.draft)]) == 2
    )
    assert main([*args, "--layer-ids", "1,x"]) == 2
    assert main([*args, "--shard", "3/3"]) == 2
    # --expected-data: measured with the draft, on a directory that exists
    assert main([*args, "--expected-data", str(testbed.specforge_data)]) == 2  # no --draft
    assert main([*args, "--draft", str(testbed.draft), "--expected-data", str(tmp_path / "none")]) == 2
    assert not (tmp_path / "p").exists()
    # the SGLang DeepSeek rule: draft ids [2,4,5] are kept as layers_to_capture -> blocks 1,3,4
    d = build.open_dump(
        testbed.specforge_data,
        target=target,
        ids=build.IdSpec([2, 4, 5], Convention.SGLANG_DRAFT_CONFIG, "flag", "deepseek"),
    )
    assert d.slot_sources == ["block:1", "block:3", "block:4"]
    with pytest.raises(build.BuildError, match="3 slots"):
        build.open_dump(
            testbed.specforge_data, target=target, ids=build.IdSpec([1, 2], Convention.SPECFORGE, "flag")
        )
    with pytest.raises(build.BuildError, match="layer count"):
        build.open_dump(testbed.specforge_data)
    assert main(["profile", "build", str(tmp_path), "-o", str(tmp_path / "p")]) == 2  # no known layout


def test_show(specforge_profile: Path, capsys) -> None:
    assert main(["profile", "show", str(specforge_profile), "--json"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["format"] == "hs_tracer_profile" and meta["atlas"]["producer"] == "speculators"
    assert main(["profile", "show", str(specforge_profile.with_name("missing"))]) == 2
