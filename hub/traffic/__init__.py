"""Versioned routing inside the hub, after the router (hub.routing) has picked a version:
per-version samples and readouts (stats, significance, readout), shadow traffic (shadow,
replays), fault injection (faults), automated canaries (canary, canary_analysis), wired
together by `TrafficService` (service). Routes report through the request's `ServedRequest`
(request), reached from the handle `Serving.serve` yields. Statistics are per hub process."""
