"""Run a version through its validation gate: load it where the manager finds room (or the
CPU), run a smoke inference for its kind, then its own evaluation set if it has one.

The gate never raises for a failing model: every problem, a load failure included, becomes a
failed check with a reason, and the result is what gets stored and audited."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hub.errors import HubError
from hub.manager import ModelManager
from hub.validation import checks
from hub.validation.checks import Check
from hub.validation.evalset import parse_eval_set
from registry.views import VersionView


@dataclass(frozen=True)
class GateResult:
    passed: bool
    checks: list[Check] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "seconds": round(self.seconds, 3),
                "checks": [asdict(c) for c in self.checks]}  # fmt: skip

    @property
    def reasons(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.passed]


class ValidationGate:
    """Runs a version through load, smoke test and eval set; never raises for a failing
    model (a load failure, a timeout after `timeout` seconds, an exception become failed
    checks), so the result can always be stored and audited."""

    def __init__(self, manager: ModelManager, timeout: float) -> None:
        self.manager = manager
        self.timeout = timeout

    async def run(self, version: VersionView) -> GateResult:
        start = time.perf_counter()
        results: list[Check] = []
        try:
            async with asyncio.timeout(self.timeout):
                async with self.manager.acquire(
                    version.name, version.version, version.kind
                ) as backend:
                    results.append(Check("load", True, f"loaded on {backend.device}"))
                    results.extend(await checks.smoke(version.kind, backend))
                    if version.eval_set:
                        eval_set = parse_eval_set(version.kind, version.eval_set)
                        results.append(await checks.evaluate(eval_set, backend))
        except TimeoutError:
            results.append(
                Check("timeout", False, f"the gate took longer than {self.timeout:.0f}s")
            )
        except HubError as e:
            results.append(Check("load", False, e.message))
        except Exception as e:
            results.append(Check("error", False, f"{type(e).__name__}: {e}"))
        passed = bool(results) and all(c.passed for c in results)
        return GateResult(passed, results, time.perf_counter() - start)
