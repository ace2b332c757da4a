"""Layer identity on a real pretrained model: false alarms and what each miswiring is reported as.

What is measured: the profile of the real SmolLM2-135M target (hs_tracer_testbed.real_layers: the
``docs`` domain at SpecForge's default blocks [1, 14, 26], calibration pieces, every-layer atlas) and
live windows of four other text domains (held-out docs topics, standard-library code, licence prose,
chat prompts). A window draws whole documents of one domain at random until it holds the window size
(the last size: every document of the domain, one window). Each window is judged wired correctly and
as each miswiring of the catalogue, with the default thresholds:

* false alarm: a correctly wired window whose status is not ``ok`` (critical: with a critical finding);
* per miswiring: the fraction of windows ``miswired`` (exit 1), ``warning`` (ambiguity only), ``ok``;
  the fraction in which every slot is named exactly or has the source really fed among its
  candidates ("honest"), and in which a shifted slot is reported as carrying its trained source
  ("wrong": must be 0).

Run from the repository root:  .venv/bin/python benchmarks/diagnosis_real.py [--reps N]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
from datetime import date
from pathlib import Path

import numpy as np

from hs_tracer.diagnosis.identity import diagnose
from hs_tracer.sources import EMBEDDING, UNKNOWN
from hs_tracer_testbed.real_layers import LIVE_DOMAINS, TRAINED, LayerRecipe, ensure_real_layers

RESULTS = Path(__file__).resolve().parent / "results" / "diagnosis_real.json"
SIZES = (256, 512)


def _shift(source: str, by: int) -> str:
    return f"block:{int(source.split(':')[1]) + by}"


def scenarios() -> dict[str, list[str]]:
    t = list(TRAINED)
    return {
        "correct": t,
        "all_slots_one_layer_late": [_shift(s, 1) for s in t],
        "all_slots_one_layer_early": [_shift(s, -1) for s in t],
        "deep_slots_one_layer_late": [t[0], *(_shift(s, 1) for s in t[1:])],
        "deep_slots_one_layer_early": [t[0], *(_shift(s, -1) for s in t[1:])],
        "last_slot_two_layers_late": [*t[:2], _shift(t[2], 2)],
        "embedding_first": [EMBEDDING, *t[:2]],
        "slots_swapped": [t[1], t[0], t[2]],
    }


def windows(tokens_per_doc: np.ndarray, size: int | None, reps: int, rng) -> list[np.ndarray]:
    if size is None:
        return [np.arange(len(tokens_per_doc))]
    out = []
    for _ in range(reps):
        order = rng.permutation(len(tokens_per_doc))
        n = np.cumsum(tokens_per_doc[order])
        if n[-1] < size:
            break
        out.append(order[: int(np.searchsorted(n, size)) + 1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args()
    real = ensure_real_layers()
    rng = np.random.default_rng(0)
    scen = scenarios()
    out: dict = {}
    for domain in LIVE_DOMAINS:
        per_doc = real.live[domain]["count"][:, 0, 0]
        out[domain] = {"tokens": int(per_doc.sum()), "documents": len(per_doc)}
        for size in (*SIZES, None):
            label = "all" if size is None else str(size)
            picks = windows(per_doc, size, args.reps, rng)
            res = {}
            for name, fed in scen.items():
                c = {"windows": len(picks), "ok": 0, "warning": 0, "drift": 0, "miswired": 0, "critical": 0,
                     "honest": 0, "wrong": 0}
                for docs in picks:
                    stats = real.window(domain, fed, docs)
                    r = diagnose(stats, real.profile, tokens=int(stats.count.max()))
                    c[r.status] += 1
                    c["critical"] += r.exit_code
                    ok = True
                    for s, source, trained in zip(r.slots, fed, TRAINED, strict=True):
                        named = s.observed_source == source or (s.observed_source == UNKNOWN
                                                                and source in (s.candidates or []))
                        ok &= named
                        c["wrong"] += int(source != trained and s.observed_source == trained)
                    c["honest"] += int(ok)
                res[name] = {k: (v if k == "windows" else round(v / max(len(picks), 1), 3))
                             for k, v in c.items()}
            out[domain][label] = res
    git = ["git", "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip()
    doc = {
        "benchmark": "diagnosis_real",
        "date": date.today().isoformat(),
        "commit": commit,
        "machine": f"{platform.machine()} {platform.processor() or ''} (shared CPU VM)".strip(),
        "method": __doc__.split("Run from")[0].strip(),
        "recipe": LayerRecipe().__dict__,
        "profile_tokens": real.profile.tokens,
        "results": out,
    }
    RESULTS.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({d: {s: {k: v["miswired"] for k, v in out[d][s].items()} for s in ("all",)}
                      for d in out}, indent=1))


if __name__ == "__main__":
    main()
