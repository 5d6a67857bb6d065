"""API tests: the whole app over HTTP. The traffic routes' tests use the two-version hub of
tests.support.traffic_hub."""

from tests.support.traffic_hub import traffic_settings, two_versions  # noqa: F401 (fixtures)
