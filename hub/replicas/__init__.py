"""Replica membership: this hub process's heartbeat row in the database it shares with its
peers, and the list of live replicas (`GET /admin/replicas`, the dashboard)."""

from hub.replicas.identity import advertise_url, replica_id
from hub.replicas.membership import Membership, MembershipUnavailable

__all__ = ["Membership", "MembershipUnavailable", "advertise_url", "replica_id"]
