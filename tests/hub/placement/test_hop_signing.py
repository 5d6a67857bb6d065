"""Hop signatures: a signature checks out only for the same method, path with query, body,
hop headers and secret, within HOP_MAX_SKEW of the receiver's clock; a replica without the
secret signs nothing and trusts nothing. The secret comes from the settings or a file (a
mounted Kubernetes Secret), and a short one is refused at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hub.placement.forwarding import HOP_MAX_SKEW, HopSigner
from hub.settings import HubSettings, SettingsError, load_settings

SECRET = "shared-by-every-replica"
REQUEST = ("POST", b"/v1/embeddings?x=1", b'{"model": "emb"}', "replica-a", "emb@2;split")


def test_a_signature_holds_for_the_request_it_signed_only() -> None:
    refused: list[str] = []
    now = [1_000_000.0]
    sender = HopSigner(SECRET, clock=lambda: now[0])
    receiver = HopSigner(SECRET, clock=lambda: now[0], refused=refused.append)
    signature = sender.sign(*REQUEST)
    assert receiver.verify(*REQUEST, signature)
    for i, other in enumerate(["GET", b"/v1/embeddings?x=2", b'{"model": "nobody"}', "p",
                               "rr@1;split"]):  # fmt: skip
        changed: list[Any] = list(REQUEST)
        changed[i] = other
        method, target, body, by, route = changed
        assert not receiver.verify(method, target, body, by, route, signature), other
    assert not receiver.verify(*REQUEST, None)
    assert not receiver.verify(*REQUEST, "t=1,v1=00")
    assert not HopSigner("another-secret-entirely").verify(*REQUEST, signature)
    assert refused == ["bad_signature"] * 5 + ["unsigned", "bad_signature"]
    # Within the skew either way it holds; past it, it is stale.
    now[0] += HOP_MAX_SKEW - 1
    assert receiver.verify(*REQUEST, signature)
    now[0] += 2
    assert not receiver.verify(*REQUEST, signature) and refused[-1] == "stale"
    now[0] -= 2 * HOP_MAX_SKEW + 2
    assert not receiver.verify(*REQUEST, signature) and refused[-1] == "stale"


def test_without_a_secret_nothing_is_signed_or_trusted() -> None:
    signed = HopSigner(SECRET).sign(*REQUEST)
    bare = HopSigner(None)
    assert not bare.enabled and bare.sign(*REQUEST) is None
    assert not bare.verify(*REQUEST, signed)


def test_the_secret_comes_from_the_settings_or_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert HubSettings().replica.hop_secret is None  # one replica needs none
    secret_file = tmp_path / "hop-secret"
    secret_file.write_text(SECRET + "\n")  # as `kubectl create secret --from-file` may hold it
    monkeypatch.setenv("HUB_REPLICA__HOP_SECRET_FILE", str(secret_file))
    secret = load_settings().replica.hop_secret
    assert secret is not None and secret.get_secret_value() == SECRET
    secret_file.write_text("short")
    with pytest.raises(SettingsError, match="fewer than 16 characters"):
        load_settings()
    monkeypatch.setenv("HUB_REPLICA__HOP_SECRET_FILE", str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match="cannot be read"):
        load_settings()
    monkeypatch.setenv("HUB_REPLICA__HOP_SECRET", SECRET)
    with pytest.raises(SettingsError, match="set one of"):
        load_settings()
