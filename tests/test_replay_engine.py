"""Capture from the real engine (CPU testbed, EAGLE-3, the hs_tracer plugin inside) and replay it.

Three engine runs in one fresh interpreter (the CPU runtime must be prepared before SGLang is
imported): the testbed draft as configured and a copy miswired by its config.json only
(``ids_shifted``), both with ``HS_TRACER_CAPTURE_DIR``; and a run with tracing on but no capture dir.
Then ``hs-tracer replay`` and ``hs-tracer diagnose`` on what the scheduler wrote.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from typing import Any

import pytest

from hs_tracer.cli import main as cli

SCENARIO = "ids_shifted"
NUM_PROMPTS = 160  # ~2,000 scored tokens: replay's calibrated level needs that many for a firm verdict
NEW_TOKENS = 12

SCRIPT = """
    import json, sys, time
    from pathlib import Path
    from hs_tracer_testbed.corpus import prompts
    from hs_tracer_testbed.miswire import write_variant
    from hs_tracer_testbed.runtime.launcher import engine

    def main():
        target, draft, out, scenario, n, new = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), \\
            sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
        texts = prompts(seed=1234, n=n)
        sampling = {"temperature": 0.0, "max_new_tokens": new}
        runs = [("correct", draft, {"HS_TRACER_CAPTURE_DIR": str(out / "cap-correct")}),
                (scenario, write_variant(draft, out / "draft-miswired", scenario),
                 {"HS_TRACER_CAPTURE_DIR": str(out / "cap-miswired")}),
                ("off", draft, {})]
        result = {"prompts": texts}
        for name, d, extra in runs:
            env = {"HS_TRACER": "1", "HS_TRACER_CAPTURE_RATE": "1", **extra}
            with engine(target, d, env=env) as eng:
                outs = eng.generate(texts if name != "off" else texts[:4], sampling)
                time.sleep(2)  # let the recorder write what it holds (a server keeps running)
            result[name] = [o["text"] for o in outs]
        print("RESULT " + json.dumps(result))

    if __name__ == "__main__":
        main()
"""


@pytest.fixture(scope="module")
def live(testbed, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("replay-engine")
    script = out / "run_engines.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HS_TRACER")}
    proc = subprocess.run([sys.executable, str(script), str(testbed.target), str(testbed.draft), str(out),
                           SCENARIO, str(NUM_PROMPTS), str(NEW_TOKENS)],
                          env=env, cwd=out, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return {"dir": out, "stderr": proc.stderr, **json.loads(line[len("RESULT "):])}


@pytest.fixture(scope="module")
def replays(live, testbed, testbed_profile) -> dict[str, Any]:
    import contextlib
    import io

    out = {}
    for name, draft in (("correct", testbed.draft), ("miswired", live["dir"] / "draft-miswired")):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = cli(["replay", str(live["dir"] / f"cap-{name}"), "--draft", str(draft), "--target",
                        str(testbed.target), "--training-data", str(testbed.specforge_data), "--profile",
                        str(testbed_profile), "--max-tokens", "3000", "--json"])
        out[name] = (code, json.loads(buf.getvalue()))
    return out


@pytest.mark.engine
def test_live_capture_is_private_and_holds_the_prompts(live, testbed) -> None:
    from hs_tracer.profile.capture_format import read_manifest
    from hs_tracer.replay.data import load_capture
    from hs_tracer_testbed.target import encode

    cap = live["dir"] / "cap-correct"
    assert stat.S_IMODE(cap.stat().st_mode) == 0o700
    files = list(cap.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert sum("captures contain user data" in ln for ln in live["stderr"].splitlines()) == 2  # one per run

    m = read_manifest(cap)
    assert m.rows == "prefill_draft_extend" and m.sample_rate == 1.0 and m.sglang_version == "0.5.23"
    assert m.sources == m.wiring["sources"] and m.wiring["layers_to_capture"] == m.layers_to_capture
    _manifest, seqs, accept = load_capture(cap)
    encoded = [list(ids) for ids in encode(live["prompts"], add_eos=False)]
    for seq in seqs:  # every captured request is one prompt's tokens (after any cached prefix)
        ids = seq.ids.tolist()
        assert any(p[seq.first_position:] == ids for p in encoded), ids
    assert len(seqs) == len(live["prompts"])
    assert accept.size > 0 and accept.min() >= 1


@pytest.mark.engine
def test_capture_off_writes_nothing(live) -> None:
    written = [p for p in live["dir"].rglob("*") if p.is_file() and (p.suffix == ".safetensors"
                                                                     or p.name == "manifest.json")]
    assert all(p.parent.name in ("cap-correct", "cap-miswired") or "draft-miswired" in p.parts
               for p in written), written


@pytest.mark.engine
def test_replay_correct_wiring_is_at_training_level(replays) -> None:
    code, r = replays["correct"]
    assert (code, r["status"]) == (0, "ok")
    assert r["capture"]["slot_sources"] == r["trained_sources"]
    assert r["capture"]["agreement"] >= r["training_level"]
    assert r["capture"]["agreement"] > 3 * r["baselines"]["most_frequent_token"]
    assert r["fix"] == {}


@pytest.mark.engine
def test_replay_miswired_falls_short_and_names_the_fix(replays, testbed) -> None:
    code, r = replays["miswired"]
    _c, ok = replays["correct"]
    assert (code, r["status"]) == (1, "miswired")
    served, good = r["capture"]["agreement"], ok["capture"]["agreement"]
    n1, n2 = r["capture"]["tokens"], ok["capture"]["tokens"]
    stderr = (served * (1 - served) / n1 + good * (1 - good) / n2) ** 0.5
    assert served < r["training_level"]
    assert good - served > 2 * stderr, (good, served, stderr)  # measured gap, not a fixed number

    assert r["capture"]["slot_sources"][0] == "embedding"  # ids_shifted puts the embedding in slot 0
    assert r["capture"]["slot_evidence"][0] == "equals embed_tokens(ids)"
    trained_ids = json.loads((testbed.draft / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    fix = r["fix"]
    assert fix["eagle_aux_hidden_state_layer_ids"] == trained_ids
    assert fix["configured_layer_ids"] == [i - 1 for i in trained_ids]
    assert fix["sources"] == r["trained_sources"] != r["capture"]["slot_sources"]
    best = r["alternatives"][0]
    assert best["name"] != "as served" and best["agreement"] > served


@pytest.mark.engine
def test_diagnose_reads_the_live_capture(live, testbed_profile, capsys: pytest.CaptureFixture[str]) -> None:
    verdicts = {}
    for name in ("correct", "miswired"):
        capsys.readouterr()
        cap = live["dir"] / f"cap-{name}"
        code = cli(["diagnose", str(cap), "--profile", str(testbed_profile), "--json"])
        verdicts[name] = (code, json.loads(capsys.readouterr().out))
    code, ok = verdicts["correct"]
    assert code == 0 and ok["acceptance"]["steps"] > 0
    code, bad = verdicts["miswired"]
    assert bad["acceptance"]["mean_accept_length"] < ok["acceptance"]["mean_accept_length"]
    assert code == 1 and bad["status"] == "miswired"
    assert bad["slots"][0]["index"] == 0 and bad["slots"][0]["observed_source"] == "embedding"
    assert [s["observed_source"] for s in ok["slots"]] == [s["expected_source"] for s in ok["slots"]]
