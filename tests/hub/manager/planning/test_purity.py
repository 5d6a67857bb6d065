"""The planning package and the residency table import nothing heavy: they run (and CI
tests them) in an environment without torch, SQLAlchemy, Prometheus, FastAPI or pydantic."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pure

HEAVY = ("torch", "sqlalchemy", "prometheus_client", "fastapi", "pydantic", "transformers")
ROOT = Path(__file__).resolve().parents[4]


def test_importing_the_planner_loads_no_heavy_package() -> None:
    code = (
        "import json, sys; import hub.manager.planning, hub.manager.residency; "
        f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(out.stdout) == []
