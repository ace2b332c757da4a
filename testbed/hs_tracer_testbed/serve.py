"""A traced testbed server: SGLang's own HTTP server on the CPU, EAGLE-3 with the testbed pair and
``HS_TRACER=1``, the way a production server runs (``make serve``; the operator drill starts three).

SGLang runs with ``--enable-metrics``, so its ``/metrics`` on the server port carries SGLang's own
series and every ``hs_tracer_*`` series of its scheduler: the one address Prometheus scrapes.
``--draft`` serves the trained draft as configured or a copy miswired the way real incidents happen;
``--profile`` picks the reference profile (the testbed's by default, ``none`` for none). Any
``HS_TRACER_*`` variable in the environment reaches the engine.

    python -m hs_tracer_testbed.serve --port 30000
    curl -s localhost:30000/generate -H 'Content-Type: application/json' \\
        -d '{"text": "the duck", "sampling_params": {"max_new_tokens": 32, "temperature": 0}}'
    curl -s localhost:30000/metrics | grep ^hs_tracer_
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from hs_tracer_testbed import ensure_testbed
from hs_tracer_testbed.demo import testbed_profile
from hs_tracer_testbed.miswire import SCENARIOS, write_variant
from hs_tracer_testbed.runtime.launcher import count_start, engine_kwargs, prepare_process

DEFAULT_PORT = 30000
"""SGLang's own default port: ``/generate`` and ``/metrics`` (with hs_tracer's series) live here."""
CONFIGURED = "configured"


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hs_tracer_testbed.serve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", default=CONFIGURED, choices=[CONFIGURED, *SCENARIOS],
                   help="the trained draft as configured (default) or a miswired copy of it")
    p.add_argument("--profile", default=None, metavar="PATH|none",
                   help="HS_TRACER_PROFILE for the server (default: the testbed's reference profile)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    tb = ensure_testbed()
    profile = str(testbed_profile(tb)) if args.profile is None else args.profile
    env = {"HS_TRACER": os.environ.get("HS_TRACER", "1")}
    if profile != "none":
        env["HS_TRACER_PROFILE"] = profile
    with tempfile.TemporaryDirectory(prefix="hs-tracer-serve-") as tmp:
        draft = (tb.draft if args.draft == CONFIGURED
                 else write_variant(tb.draft, Path(tmp) / "draft", args.draft))
        prepare_process(env)
        from sglang.srt.entrypoints.http_server import launch_server
        from sglang.srt.server_args import ServerArgs

        count_start()
        print(f"hs_tracer testbed server ({args.draft} draft, profile {profile}): "
              f"http://{args.host}:{args.port}/generate, metrics on http://{args.host}:{args.port}/metrics",
              file=sys.stderr, flush=True)
        launch_server(ServerArgs(**engine_kwargs(tb.target, draft, host=args.host, port=args.port,
                                                 enable_metrics=True)))


if __name__ == "__main__":
    main()
