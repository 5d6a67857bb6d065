"""The scale-out section (`replica:`): how this hub process announces itself to the other
replicas sharing its database, forwards requests to them and signs those forwards."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field, SecretStr, model_validator
from pydantic import field_validator as validator

from hub.settings.sections import Seconds, Section

# The shortest replica.hop_secret accepted: a guessable secret would let anyone re-route.
MIN_HOP_SECRET = 16


class ReplicaSettings(Section):
    """How this hub process announces itself to the other replicas sharing its database."""

    # Unique among the replicas of one database; default `<hostname>-<port>` (in Kubernetes
    # the hostname is the pod name). A restarted process with the same id takes its row over.
    id: str | None = Field(default=None, min_length=1, max_length=200)
    # The base URL at which peers reach this replica; default http://<host>:<port> (the
    # hostname when the hub binds every interface). In Kubernetes: the pod IP, see deploy/.
    advertise_url: str | None = None
    # How often this replica writes its heartbeat row (what it holds, free memory, queue).
    heartbeat_interval: Seconds = Field(default=5.0, gt=0)
    # A replica whose last heartbeat is older than this is no longer listed (a few missed
    # beats); must exceed heartbeat_interval.
    expire_after: Seconds = Field(default=15.0, gt=0)
    # The longest one heartbeat (or a listing) may wait for the database.
    sql_timeout: Seconds = Field(default=3.0, gt=0)
    # On SIGTERM (a pod being stopped) the hub stops accepting connections and gives the
    # requests in flight, streams included, this long to finish before it cuts them.
    drain_timeout: Seconds = Field(default=30.0, ge=0)
    # Model-aware placement (hub/placement): a request for a model this replica does not
    # hold goes to a live peer that holds it, and loads prefer the replica with room. false:
    # every replica serves every request itself. With one replica nothing changes either way.
    placement: bool = True
    # A peer that does not accept the connection within this long is skipped (the next
    # holder is tried, else the request is served here).
    forward_connect_timeout: Seconds = Field(default=1.0, gt=0)
    # The longest a forwarded request waits for the peer's answer to start, and then for
    # each next chunk of it (a stream's tokens); past it the caller gets a 503.
    forward_timeout: Seconds = Field(default=300.0, gt=0)
    # A peer whose last heartbeat reported this many queued requests (in flight plus waiting
    # for a load) takes no forwards; the request goes to the next holder or is served here.
    forward_max_queue_depth: int = Field(default=32, ge=1)
    # The secret every replica of one database shares: a request a replica forwards carries
    # an HMAC of it (method, path, body, route, time), and a replica obeys the hop headers
    # of a request only when they are signed with it. Without it placement is off (every
    # request is served where it lands) and hop headers are ignored. `hop_secret_file`: a
    # file holding it (a mounted Kubernetes Secret), read once at start; set one of the two.
    hop_secret: SecretStr | None = None
    hop_secret_file: Path | None = None

    @model_validator(mode="before")
    @classmethod
    def _secret_from_file(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("hop_secret_file") is None:
            return data
        if data.get("hop_secret") is not None:
            raise ValueError("set one of replica.hop_secret and replica.hop_secret_file")
        path = Path(data["hop_secret_file"])
        try:
            secret = path.read_text().strip()
        except OSError as e:
            raise ValueError(f"hop_secret_file {str(path)!r} cannot be read: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise ValueError(f"hop_secret_file {str(path)!r} is not text: {e}") from e
        return {**data, "hop_secret": secret}

    @validator("hop_secret")
    @classmethod
    def _long_enough(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and len(v.get_secret_value()) < MIN_HOP_SECRET:
            raise ValueError(
                f"replica.hop_secret has fewer than {MIN_HOP_SECRET} characters; "
                "make one with `openssl rand -hex 32`"
            )
        return v

    @model_validator(mode="after")
    def _expiry_after_beats(self) -> ReplicaSettings:
        if self.expire_after <= self.heartbeat_interval:
            raise ValueError(
                f"replica.expire_after ({self.expire_after}s) must exceed "
                f"replica.heartbeat_interval ({self.heartbeat_interval}s), else a live replica "
                "drops out of the list between two heartbeats"
            )
        return self

    @validator("advertise_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"https?://[^/\s]+/?", v):
            raise ValueError(f"{v!r} is not a base URL like http://10.0.0.7:8000")
        return v.rstrip("/") if v else v
