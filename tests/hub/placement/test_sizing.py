"""How placement sizes a version it has never loaded, and why it matters: three replicas that
hold two of six models each (tests/hub/replicas/test_placement.py), seen from replica `a`,
which never loaded the models it is asked for. Sized by their artifacts alone (a fifth of
what the manager charges: the encoder's run-time reserve dominates), every full replica
looked like it had room: `a` sent a missing model to be restored where it was parked warm,
there it evicted a model in use, and the next request for that one came back and evicted the
first; two models traded places on one replica while another replica's free slot stayed
empty. The peers' heartbeats carry what a parked version takes on a device, so every replica
sizes it alike."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from hub.manager import DeviceStatus, ModelStatus
from hub.placement.metrics import PlacementMetrics
from hub.placement.service import Placement
from hub.replicas.report import held_models
from hub.settings import ReplicaSettings
from registry.replicas import ReplicaView

MiB = 2**20
# As the placement cluster charges them: a model on a device, its artifacts, and a budget
# that holds two models and leaves less than a third one's room.
CHARGE, ARTIFACTS = 40 * MiB, 8 * MiB
BUDGET = 2 * CHARGE + 36 * MiB
NOW = 100.0


def status(name: str, state: str) -> ModelStatus:
    warm = state == "warm"
    return ModelStatus(
        name=name, version=1, kind="embedder", state=state, device=None if warm else "cpu",
        predicted_bytes=CHARGE, measured_bytes=CHARGE // 4, pinned=False, in_flight=0,
        waiting=0, last_used_s_ago=1.0, error=None, host_bytes=ARTIFACTS if warm else 0,
    )  # fmt: skip


def device(models: list[ModelStatus]) -> list[DeviceStatus]:
    used = sum(m.predicted_bytes for m in models if m.state == "loaded")
    return [DeviceStatus("cpu", BUDGET, used, BUDGET - used, 0, len(models))]


def row(replica_id: str, models: list[ModelStatus]) -> ReplicaView:
    """A peer's row as its heartbeat writes it (hub.replicas.report)."""
    return ReplicaView(
        id=replica_id, address=f"http://{replica_id}:8000", hub_version="test",
        started_at=None, last_seen=None, seen_s_ago=0.0,  # type: ignore[arg-type]
        models=held_models(models),
        devices=[{"name": d.name, "budget_bytes": d.budget_bytes, "free_bytes": d.free_bytes}
                 for d in device(models)],
        host_free_bytes=2**30, queue_depth=0,
    )  # fmt: skip


def replica_a(peers: list[ReplicaView]) -> Placement:
    """Replica `a`, holding p0 and p1 and nothing else (it never loaded the others)."""
    mine = [status("p0", "loaded"), status("p1", "loaded")]
    manager = SimpleNamespace(status=lambda: mine, device_status=lambda: device(mine))
    membership = SimpleNamespace(id="a", peers=peers, peers_as_of=NOW)
    version = SimpleNamespace(total_bytes=ARTIFACTS)
    catalog = SimpleNamespace(
        snapshot=SimpleNamespace(
            models={f"p{i}": SimpleNamespace(versions={1: version}) for i in range(6)}
        )
    )
    return Placement(
        ReplicaSettings(placement=True), membership, manager, catalog,  # type: ignore[arg-type]
        forwarder=None, metrics=PlacementMetrics(CollectorRegistry()),  # type: ignore[arg-type]
        clock=lambda: NOW,
    )  # fmt: skip


def ask(placement: Placement, model: str) -> tuple[list[str], str]:
    decision = placement.decide(SimpleNamespace(name=model, version=1))  # type: ignore[arg-type]
    return [p.id for p in decision.peers], decision.reason


def test_a_missing_model_loads_where_there_is_room_not_over_a_model_in_use() -> None:
    # b is full (p2, p3) and has p4 parked warm; c holds p5 and has a free slot.
    b = [status("p2", "loaded"), status("p3", "loaded"), status("p4", "warm")]
    c = [status("p5", "loaded")]
    a = replica_a([row("b", b), row("c", c)])
    assert ask(a, "p4") == (["c"], "room_peer")

    # Had p4 gone to b, b would have evicted p2 (parked warm in its turn), and p2's next
    # request would have gone back to b, evicting p4: the two trade places for good.
    b = [status("p4", "loaded"), status("p3", "loaded"), status("p2", "warm")]
    a = replica_a([row("b", b), row("c", c)])
    assert ask(a, "p2") == (["c"], "room_peer")


def test_a_warm_copy_with_room_is_still_restored_rather_than_loaded_cold() -> None:
    b = [status("p2", "loaded"), status("p4", "warm")]
    c = [status("p5", "loaded")]
    a = replica_a([row("b", b), row("c", c)])
    assert ask(a, "p4") == (["b"], "warm_peer")
