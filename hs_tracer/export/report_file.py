"""The live report file of one scheduler process: ``HS_TRACER_REPORT_DIR/scheduler-<pid>.json``.

Written by the scheduler process (startup, failures, and every refresh while the exporters run in it)
or by its export process (every refresh otherwise); always by atomic rename, so a reader never sees
half a file. The folder is recreated if it was removed while running; a write the OS refuses is
logged once per distinct reason and tracing goes on.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

logger = logging.getLogger("hs_tracer")


class ReportFile:
    def __init__(self, report_dir: Path, scheduler_pid: int) -> None:
        self.report_dir = report_dir
        self.path = report_dir / f"scheduler-{scheduler_pid}.json"
        self._error: str | None = None  # the last reason the OS refused a write

    def write(self, report: dict[str, Any]) -> None:
        tmp = self.path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            self.report_dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(report, indent=2, default=str))
            tmp.replace(self.path)
            self._error = None
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if self._error != exc.strerror:
                self._error = exc.strerror
                logger.error("hs_tracer: cannot write the report to %s (%s); tracing goes on",
                             self.report_dir, exc.strerror or exc)
