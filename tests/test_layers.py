"""The export process runs apart from SGLang: importing it loads nothing of the SGLang integration
and no SGLang (the import layers themselves are checked by `lint-imports`, pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
import hs_tracer.export.process
import hs_tracer.export.analysis, hs_tracer.export.otel, hs_tracer.export.prometheus  # what it runs
print(json.dumps(sorted(m for m in sys.modules
                        if m.startswith("hs_tracer.integrations") or m.split(".")[0] == "sglang")))
"""


def test_the_export_process_imports_nothing_of_the_sglang_integration() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
