"""Usage metering: what every answered inference request consumed, per caller, model,
version and hour, in SQL (registry.usage) and in Prometheus.

`Serving.serve` (hub.serving) meters each request it serves: the caller the user-key check
named (hub.usage.caller), the routed version, and the counts the route reports on its
request handle. `UsageMeter.record` (hub.usage.meter) adds them to the next group commit and
waits for it, so a request's usage is durable before its answer's last bytes leave.
`hub usage` (hub.usage.cli) reads `GET /admin/usage`. This package's root imports nothing,
so the command line loads none of the database modules.
"""
