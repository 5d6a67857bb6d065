"""Traffic tests run against a hub with two embedder versions (tests.support.traffic_hub)."""

from tests.support.traffic_hub import (  # noqa: F401 (fixtures and helpers of this folder)
    TrafficHub,
    embed,
    register,
    traffic_settings,
    two_versions,
    versions,
)
