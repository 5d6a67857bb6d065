"""Forwarding mechanics against a real HTTP peer (uvicorn on loopback, in the test's event
loop): a server-sent-event stream passes through chunk by chunk as the peer writes it, the
caller's headers and body arrive with the hop headers, the peer's answer headers come back,
a caller that leaves closes the peer's connection too, and a peer that refuses the
connection is reported before anything was sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.types import Message, Receive, Scope, Send

from benchmarks.launch.process import free_port
from hub.api.placement import _unless_client_leaves
from hub.placement.forwarding import (
    FORWARDED_BY,
    ROUTE_HEADER,
    Forwarder,
    Hop,
    HopSigner,
    PeerUnreachable,
    incoming_hop,
    parse_route_header,
    route_header,
)
from hub.routing import Route
from hub.settings import ReplicaSettings
from tests.support.live import serving

BODY = b'{"model": "chat", "prompt": "hi", "stream": true}'
SECRET = "shared-by-every-replica"


class StreamingPeer:
    """Answers any request with three SSE events; the second only once `release` is set,
    so a forwarder that buffered the answer would never pass the first one on."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.client_left = asyncio.Event()
        self.seen: dict[str, Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        message = await receive()
        self.seen = {
            "scope": scope,
            "path": scope["path"],
            "query": scope["query_string"],
            "headers": {k.decode(): v.decode() for k, v in scope["headers"]},
            "body": message["body"],
        }
        await send({"type": "http.response.start", "status": 200, "headers": [
            (b"content-type", b"text/event-stream"), (b"x-hub-model-version", b"3"),
            (b"x-hub-replica", b"peer-1")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        watcher = asyncio.create_task(self._watch(receive))
        await self.release.wait()
        watcher.cancel()
        for chunk in (b"data: 2\n\n", b"data: [DONE]\n\n"):
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _watch(self, receive: Receive) -> None:
        if (await receive())["type"] == "http.disconnect":
            self.client_left.set()


@pytest.fixture
async def peer() -> AsyncIterator[tuple[str, StreamingPeer]]:
    app = StreamingPeer()
    async with serving(app) as address:
        yield address, app


def _scope() -> Scope:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"trace=1",
        "headers": [
            (b"host", b"hub.example"),
            (b"authorization", b"Bearer user-key"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
            (b"connection", b"keep-alive"),
            # What a client may send: replaced by the forwarder's own, signed.
            (b"x-hub-forwarded-by", b"client"),
            (b"x-hub-hop-signature", b"t=1,v1=00"),
        ],
    }


async def test_a_stream_passes_through_as_the_peer_writes_it(
    peer: tuple[str, StreamingPeer],
) -> None:
    address, app = peer
    forwarder = Forwarder(ReplicaSettings(hop_secret=SECRET), "replica-a")
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)
        if message.get("body") == b"data: 1\n\n":
            app.release.set()  # the first event reached the caller before the peer wrote on

    route = Route("chat", 3, "llm", split=True)
    try:
        async with asyncio.timeout(60):  # a hang guard: a buffering forwarder never returns
            status = await forwarder.forward(address, _scope(), BODY, route, send)
    finally:
        await forwarder.close()
    assert status == 200
    start, *body = sent
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    assert headers["x-hub-model-version"] == "3" and headers["x-hub-replica"] == "peer-1"
    assert headers["content-type"] == "text/event-stream"
    chunks = [m["body"] for m in body if m["body"]]
    assert chunks == [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    assert body[-1]["more_body"] is False

    seen = app.seen
    assert (seen["path"], seen["query"], seen["body"]) == ("/v1/completions", b"trace=1", BODY)
    assert seen["headers"]["authorization"] == "Bearer user-key"
    assert seen["headers"]["host"] != "hub.example"
    assert seen["headers"][FORWARDED_BY.lower()] == "replica-a"
    assert parse_route_header(seen["headers"][ROUTE_HEADER.lower()]) == (
        "chat", "3", True, None, False,
    )  # fmt: skip
    # Signed over what the peer received: a peer with the same secret obeys it, another not.
    assert incoming_hop(seen["scope"], BODY, HopSigner(SECRET)) == Hop("replica-a", "chat@3;split")
    assert incoming_hop(seen["scope"], BODY, HopSigner("another-secret-entirely")) is None
    assert incoming_hop(seen["scope"], BODY + b" ", HopSigner(SECRET)) is None


async def test_a_client_leaving_a_forwarded_stream_leaves_the_peer_too(
    peer: tuple[str, StreamingPeer],
) -> None:
    address, app = peer
    forwarder = Forwarder(ReplicaSettings(), "replica-a")
    first_event = asyncio.Event()

    async def send(message: Message) -> None:
        if message.get("body") == b"data: 1\n\n":
            first_event.set()

    async def receive() -> Message:  # the caller's connection: it leaves after one event
        await first_event.wait()
        return {"type": "http.disconnect"}

    forwarding = forwarder.forward(address, _scope(), BODY, Route("chat", 3, "llm"), send)
    try:
        async with asyncio.timeout(60):  # hang guards
            assert await _unless_client_leaves(forwarding, receive)
            await app.client_left.wait()  # the peer saw its client (us) go
    finally:
        app.release.set()
        await forwarder.close()


async def test_a_refused_connection_is_reported_before_anything_is_sent() -> None:
    forwarder = Forwarder(ReplicaSettings(), "replica-a")
    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    try:
        with pytest.raises(PeerUnreachable):
            await forwarder.forward(
                f"http://127.0.0.1:{free_port()}", _scope(), BODY, Route("chat", 3, "llm"), send
            )
    finally:
        await forwarder.close()
    assert sent == []


def test_the_route_header_round_trips() -> None:
    for route in (
        Route("a", 1, "embedder"),
        Route("a", 2, "embedder", pinned=True),
        Route("b", 7, "llm", split=True, via="a"),
    ):
        name, ref, split, via, pinned = parse_route_header(route_header(route))
        assert (name, int(ref), split, via, pinned) == (
            route.name, route.version, route.split, route.via, route.pinned,
        )  # fmt: skip
