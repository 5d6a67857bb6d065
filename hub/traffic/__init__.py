"""Versioned routing inside the hub: sticky weighted splits (assignment), per-version
samples and readouts (stats, significance, readout), shadow traffic (shadow, replays), fault
injection (faults), automated canaries (canary), wired together by `TrafficService`
(service). Routes report through `hub.traffic.request`. Statistics are per hub process."""
