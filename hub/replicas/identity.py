"""Who this replica is to its peers: a unique id and the base URL at which they reach it."""

from __future__ import annotations

import socket

from hub.settings import HubSettings

WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def replica_id(settings: HubSettings) -> str:
    """`replica.id`, else `<hostname>-<port>`: unique per machine and port, and in Kubernetes
    the pod's name (a restarted container takes over its pod's row)."""
    return settings.replica.id or f"{socket.gethostname()}-{settings.port}"


def advertise_url(settings: HubSettings) -> str:
    """`replica.advertise_url`, else http://<host>:<port>, naming this machine by its hostname
    when the hub binds every interface (peers cannot reach 0.0.0.0)."""
    if settings.replica.advertise_url:
        return settings.replica.advertise_url
    host = settings.host
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    if ":" in host:  # an IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"
