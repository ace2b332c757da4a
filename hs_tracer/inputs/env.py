"""``HS_TRACER_*`` settings, checked fully when the plugin starts, before any hook is registered.

:func:`hs_tracer.config.load` parses each variable (types and ranges); this adds what parsing cannot
see: the profile loads and is consistent, the report and capture directories can be written (or
created), the metrics address resolves and an explicitly set port can be bound, and a misspelt
variable name is caught. Any problem: one line naming the variable(s), and tracing stays off.
"""

from __future__ import annotations

import difflib
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from hs_tracer import config
from hs_tracer.errors import InputError

# Variables of other hs_tracer tools (the testbed, tests): not tracer settings.
_OTHER_PREFIXES = ("HS_TRACER_TESTBED_", "HS_TRACER_TEST_")


def _writable_dir(name: str, path: Path) -> str | None:
    """None if ``path`` is (or can be created as) a directory this process can write into."""
    if path.exists():
        if not path.is_dir():
            return f"{name}={path}: exists and is not a directory; point it at a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"{name}={path}: directory is not writable by this process; fix its permissions"
        return None
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        return f"{name}={path}: cannot be created ({parent} is not a writable directory)"
    return None


def _bindable(addr: str, port: int | None) -> str | None:
    try:
        infos = socket.getaddrinfo(addr, port or 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"HS_TRACER_METRICS_ADDR={addr!r} does not resolve ({exc}); give an address such as 0.0.0.0"
    if port is None:
        return None
    family, kind, proto, _name, sockaddr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(sockaddr)
        except OSError as exc:
            return (f"HS_TRACER_METRICS_PORT={port}: cannot bind {addr}:{port} ({exc.strerror or exc}); "
                    "give a free port")
    return None


def problems(environ: Mapping[str, str], cfg: config.TracerConfig) -> list[str]:
    """What the parser cannot see; one message per problem."""
    from hs_tracer.inputs.profile import load_profile

    found: list[str] = []
    known = set(config.VARIABLES)
    for name in sorted(environ):
        if name.startswith("HS_TRACER_") and name not in known and not name.startswith(_OTHER_PREFIXES):
            near = difflib.get_close_matches(name, sorted(known), n=1)
            if near:
                found.append(f"{name} is not an hs_tracer setting; did you mean {near[0]}?")
    if cfg.profile is not None:
        try:
            load_profile(cfg.profile, flag="HS_TRACER_PROFILE")
        except InputError as exc:
            found.append(str(exc).replace("HS_TRACER_PROFILE ", "HS_TRACER_PROFILE=", 1))
    for name, path in (("HS_TRACER_REPORT_DIR", cfg.report_dir), ("HS_TRACER_CAPTURE_DIR", cfg.capture_dir)):
        if path is not None:
            msg = _writable_dir(name, path)
            if msg:
                found.append(msg)
    multiprocess = environ.get("PROMETHEUS_MULTIPROC_DIR") or environ.get("prometheus_multiproc_dir")
    explicit_port = None if multiprocess or not environ.get("HS_TRACER_METRICS_PORT") else cfg.metrics_port
    msg = _bindable(cfg.metrics_addr, explicit_port)
    if msg:
        found.append(msg)
    return found


def _errors(environ: Mapping[str, str]) -> tuple[config.TracerConfig, list[str]]:
    cfg, errors = config.load(environ)
    if not errors:
        errors = problems(environ, cfg)
    return cfg, [" ".join(e.split()) for e in errors]


def validate(environ: Mapping[str, str] = os.environ) -> tuple[config.TracerConfig, str | None]:
    """The settings, and one line saying everything that is wrong with them (None when valid)."""
    cfg, errors = _errors(environ)
    if not errors:
        return cfg, None
    return cfg, "hs_tracer: tracing stays off, invalid settings: " + " | ".join(errors)


def require_valid(environ: Mapping[str, str] = os.environ) -> config.TracerConfig:
    """For a launcher that starts an engine itself (``hs-tracer demo``, the testbed launcher): the
    plugin's checks, raised as :class:`InputError` before the engine starts, so the line reaches the
    terminal and not only the scheduler's log. Nothing to check while ``HS_TRACER`` is off (the
    plugin then reads no other variable)."""
    if not config.enabled(environ):
        return config.TracerConfig()
    cfg, errors = _errors(environ)
    if errors:
        raise InputError(" | ".join(errors))
    return cfg


def require_valid_for(command: str, overrides: Mapping[str, str], replaced: Mapping[str, str] | None = None,
                      environ: Mapping[str, str] = os.environ) -> tuple[config.TracerConfig, list[str]]:
    """For a command that runs engines with settings of its own (``overrides``, checked with the
    rest as the engines will get them; ``replaced``: variables it sets per engine, with what it puts
    there in words). Every ``HS_TRACER_*`` variable of the caller's environment is checked first,
    also one the command replaces: a mistyped or invalid setting stops the command (one line) instead
    of passing unseen. Returns the engines' settings and one note per caller's variable the command
    replaces."""
    if any(name.startswith("HS_TRACER") for name in environ):
        _cfg, errors = _errors(environ)
        if errors:
            raise InputError(" | ".join(errors))
    cfg = require_valid({**environ, **overrides})
    notes = [f"{command} runs its engines with {name}={value}; your {name}={environ[name]} is not used"
             for name, value in overrides.items() if name in environ and environ[name] != value]
    notes += [f"{command} runs its engines with {name} set to {what}; your {name}={environ[name]} is not "
              "used" for name, what in (replaced or {}).items() if name in environ]
    return cfg, notes
