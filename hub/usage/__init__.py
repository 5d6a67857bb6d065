"""Usage metering: what every answered inference request consumed, per caller, model,
version and hour, in SQL (registry.usage) and in Prometheus.

`Serving.serve` (hub.serving) meters each request it serves: the caller the user-key check
named (`caller`), the routed version, and the counts the route reports on its request
handle. `UsageMeter.record` adds them to the next group commit and waits for it, so a
request's usage is durable before its answer's last bytes leave.
"""

from hub.usage.caller import ANONYMOUS, caller_name, current_caller, note_caller
from hub.usage.meter import UsageMeter

__all__ = ["ANONYMOUS", "UsageMeter", "caller_name", "current_caller", "note_caller"]
