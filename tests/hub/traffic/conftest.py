"""Traffic tests run against a hub with two embedder versions (tests.support.traffic_hub).

The statistics and the canary decision are pure (tests run without FastAPI too): in that
mode the hub fixtures are not imported."""

import os

if os.environ.get("HUB_PURE_TESTS") != "1":
    from tests.support.traffic_hub import (  # noqa: F401 (fixtures and helpers of this folder)
        TrafficHub,
        embed,
        register,
        traffic_settings,
        two_versions,
        versions,
    )
