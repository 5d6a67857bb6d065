"""The hub's dependencies (the registry database, MLflow): bounded blocking calls to them and
a background check of whether they answer, which readiness and metrics read."""

from hub.dependencies.calls import BoundedCalls
from hub.dependencies.monitor import DependencyMonitor, DependencyState

__all__ = ["BoundedCalls", "DependencyMonitor", "DependencyState"]
