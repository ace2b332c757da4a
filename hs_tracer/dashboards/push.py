"""Upload the dashboards to a running Grafana through its HTTP API (grafana-client).

Authentication is a service-account token from the environment (``GRAFANA_TOKEN`` by default), never
a command-line argument, so it stays out of shell history and process listings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

DEFAULT_FOLDER = "hs_tracer"
FOLDER_UID = "hs-tracer"


class PushError(Exception):
    """Grafana refused or could not be reached; the message names the cause and the fix."""


@dataclass(frozen=True)
class Pushed:
    uid: str
    url: str
    version: int | None


def push(url: str, token: str, dashboards: Mapping[str, str], *, folder: str = DEFAULT_FOLDER,
         timeout_s: float = 10.0) -> list[Pushed]:
    """Create the folder if needed, then create or overwrite each dashboard (JSON text) in it."""
    from grafana_client import GrafanaApi
    from grafana_client.client import (
        GrafanaClientError,
        GrafanaException,
        GrafanaUnauthorizedError,
    )

    api = GrafanaApi.from_url(url=url, credential=token, timeout=timeout_s)
    try:
        folder_uid = _ensure_folder(api, folder, GrafanaClientError)
        out = []
        for name, text in sorted(dashboards.items()):
            model: dict[str, Any] = json.loads(text)
            model.pop("id", None)  # Grafana matches on uid; a foreign numeric id would be rejected
            answer = api.dashboard.update_dashboard({
                "dashboard": model, "folderUid": folder_uid, "overwrite": True,
                "message": f"hs-tracer dashboards push ({name})"})
            out.append(Pushed(uid=str(answer.get("uid", model.get("uid"))),
                              url=_absolute(url, str(answer.get("url", ""))),
                              version=answer.get("version")))
        return out
    except GrafanaUnauthorizedError as exc:
        raise PushError(f"Grafana at {url} rejected the token ({exc}); create a service-account token "
                        "with the Editor role and export it as GRAFANA_TOKEN") from exc
    except GrafanaException as exc:
        raise PushError(f"Grafana at {url} refused the upload: {exc}") from exc
    except OSError as exc:  # niquests' connection errors and timeouts are OSErrors
        raise PushError(f"cannot reach Grafana at {url} ({exc}); check --url and that Grafana runs") from exc


def _ensure_folder(api: Any, title: str, client_error: type[Exception]) -> str:
    try:
        return str(api.folder.get_folder(FOLDER_UID)["uid"])
    except client_error as exc:
        if getattr(exc, "status_code", None) != 404:
            raise
    return str(api.folder.create_folder(title, uid=FOLDER_UID)["uid"])


def _absolute(base: str, path: str) -> str:
    return base.rstrip("/") + path if path.startswith("/") else path
