"""``hs-tracer dashboards build|push``: the Grafana dashboard and the Prometheus rules, as code.

``build`` renders the generated files (dashboard JSON, rule file, Kubernetes PrometheusRule and
dashboard ConfigMap) into a repository checkout and lints the dashboard; ``--check`` only compares.
``push`` uploads the dashboard to a Grafana through its HTTP API with a token from the environment.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

TOKEN_ENV = "GRAFANA_TOKEN"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "dashboards",
        help="build the Grafana dashboard and Prometheus alert rules, or push the dashboard to Grafana",
        description="Dashboards and alert rules as code (docs/deploy.md).",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)

    b = actions.add_parser("build", help="write the generated dashboard, rule and Kubernetes files",
                           description="Render grafana/dashboards/*.json, deploy/prometheus/rules/*.yml "
                                       "and the Kubernetes PrometheusRule and dashboard ConfigMap under "
                                       "ROOT, after linting the dashboard. Exit 1 if --check finds "
                                       "stale files or the lint finds problems.")
    b.add_argument("--root", type=Path, default=None,
                   help="folder to write into (default: the current directory when it is an hs_tracer "
                        "checkout, i.e. holds grafana/dashboards; anywhere else --root is required)")
    b.add_argument("--runbook-base", metavar="URL", default=None,
                   help="absolute URL of your copy of docs/runbook.md that every alert's runbook_url "
                        "links into (default: the project's published runbook)")
    b.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a committed file differs from a fresh rendering")
    b.set_defaults(func=run_build)

    u = actions.add_parser("push", help="upload the dashboard to Grafana through its HTTP API",
                           description=f"Create or overwrite the hs_tracer dashboard in a Grafana folder. "
                                       f"The token comes from ${TOKEN_ENV} (a service-account token with "
                                       f"the Editor role).")
    u.add_argument("--url", required=True, help="Grafana base URL, e.g. http://localhost:3000")
    u.add_argument("--folder", default="hs_tracer", help="folder title (created if missing)")
    u.add_argument("--token-env", default=TOKEN_ENV, metavar="VAR",
                   help=f"environment variable holding the token (default {TOKEN_ENV})")
    u.set_defaults(func=run_push)


def _require(module: str, package: str) -> None:
    """A missing optional dependency is an input problem with a one-line fix, not a traceback."""
    import importlib.util

    from hs_tracer.errors import InputError

    if importlib.util.find_spec(module) is None:
        raise InputError(f"{package} is not installed; install hs_tracer's dashboards extra "
                         f"(pip install 'hs_tracer[dashboards]', or from a checkout "
                         f"pip install '.[dashboards]')")


def run_build(args: argparse.Namespace) -> int:
    import json

    _require("grafana_foundation_sdk", "grafana-foundation-sdk")
    import hs_tracer.dashboards as dashboards
    from hs_tracer.dashboards import lint, overview

    if args.root is None:
        args.root = Path(".")
        if not (args.root / dashboards.DASHBOARD_DIR).is_dir():
            from hs_tracer.errors import InputError

            raise InputError(f"the current folder is not an hs_tracer checkout (no "
                             f"{dashboards.DASHBOARD_DIR}/ here); pass --root DIR to write grafana/ and "
                             "deploy/ under DIR")
    if args.runbook_base is not None:
        from hs_tracer.dashboards.alerts import runbook_url
        from hs_tracer.errors import InputError

        try:
            runbook_url("", args.runbook_base)
        except ValueError as exc:
            raise InputError(f"--runbook-base: {exc}; e.g. https://wiki.example.com/hs_tracer/runbook.md"
                             ) from None
    problems = lint.lint(json.loads(overview.render()), lint.OVERVIEW_EXCLUSIONS)
    for problem in problems:
        print(f"lint: {problem}", file=sys.stderr)
    if args.check:
        stale = dashboards.stale(args.root, args.runbook_base)
        for rel in stale:
            print(f"stale: {rel} (run `hs-tracer dashboards build`)", file=sys.stderr)
        return 1 if stale or problems else 0
    for path in dashboards.write(args.root, args.runbook_base):
        print(path)
    return 1 if problems else 0


def run_push(args: argparse.Namespace) -> int:
    from hs_tracer.errors import InputError

    _require("grafana_foundation_sdk", "grafana-foundation-sdk")
    _require("grafana_client", "grafana-client")
    from hs_tracer.dashboards import overview
    from hs_tracer.dashboards.push import PushError, push

    token = os.environ.get(args.token_env, "").strip()
    if not token:
        raise InputError(f"no Grafana token: ${args.token_env} is unset or empty; create a service-account "
                         f"token (Grafana > Administration > Service accounts, role Editor) and run "
                         f"`export {args.token_env}=<token>`")
    if not args.url.startswith(("http://", "https://")):
        raise InputError(f"--url {args.url}: give Grafana's base URL with its scheme, e.g. "
                         "http://localhost:3000")
    try:
        pushed = push(args.url, token, {overview.FILENAME: overview.render()}, folder=args.folder)
    except PushError as exc:
        print(f"hs-tracer dashboards push: error: {exc}", file=sys.stderr)
        return 1
    for d in pushed:
        print(f"pushed {d.uid} (version {d.version}): {d.url}")
    return 0
