"""One exception, one status: what `/metrics` counts equals what the caller is answered.

Every error class the hub, its backends and its registry define (and one nobody mapped) is
raised from inside a real embedding request; the status in `hub_requests_total` must be the
status of the HTTP answer, and both must be what `status_of` says.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.exceptions import RequestValidationError
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException

import backends
import hub
import registry
from backends.encoders.embedder import EmbedderBackend
from backends.errors import BackendError, CapacityError, LoadError
from backends.llm.engine import EngineStepError
from backends.llm.isolation import RequestFailedError
from hub.api.limits import RequestTooLarge
from hub.app import create_app
from hub.errors import HubError
from hub.outcome import CLIENT_CLOSED, ClientGone, status_of
from hub.settings import HubSettings
from registry.errors import NotFoundError, RegistryError


class VanishedVersion(NotFoundError):
    """A registry error subclass the table does not name: mapped by its parent."""


class QueueOverflow(CapacityError):
    """A backend error subclass the table does not name: mapped by its parent."""


def _import_all(package: object) -> None:
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):  # type: ignore[attr-defined]
        if info.name.startswith(("backends.llm.kernels", "backends.tiny")):
            continue
        importlib.import_module(info.name)


def _subclasses(cls: type[BaseException]) -> Iterator[type[BaseException]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def error_classes() -> list[type[BaseException]]:
    for package in (hub, backends, registry):
        _import_all(package)
    ours = ("hub", "backends", "registry")
    found = {
        cls
        for root in (HubError, BackendError, RegistryError)
        for cls in _subclasses(root)
        if cls.__module__.split(".")[0] in ours
    }
    others = [ClientGone, RequestValidationError, HTTPException, RuntimeError,
              VanishedVersion, QueueOverflow]  # fmt: skip
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}") + others


def make(cls: type[BaseException]) -> BaseException:
    if cls is RequestValidationError:
        return RequestValidationError([{"loc": ("body", "input"), "msg": "bad", "type": "x"}])
    if cls is HTTPException:
        return HTTPException(status_code=418, detail="short and stout")
    if cls is RequestFailedError:
        return RequestFailedError("req-1", ValueError("boom"))
    if cls is EngineStepError:  # unattributable: every request of the step ended
        return EngineStepError(["req-1", "req-2"], RuntimeError("device lost"))
    if cls is RequestTooLarge:
        return RequestTooLarge(1024, 4096)
    return cls("boom")


def counts(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "hub_requests":
            continue
        for sample in family.samples:
            if sample.name == "hub_requests_total":
                out[sample.labels["status"]] = sample.value
    return out


@pytest.fixture(scope="module")
def classes() -> list[type[BaseException]]:
    return error_classes()


def test_every_error_class_is_covered(classes: list[type[BaseException]]) -> None:
    names = {c.__name__ for c in classes}
    # The classes the issue names, so a broken discovery cannot pass silently.
    assert {"LoadError", "InputError", "CapacityError", "BackendClosedError", "BadRequest",
            "Unavailable", "InjectedFault", "ValidationFailed", "NotFoundError",
            "IntegrityError", "ConflictError", "EngineStepError"} <= names  # fmt: skip


def test_metrics_and_answers_agree_for_every_error_class(
    settings: HubSettings,
    tiny_embedder_dir: Path,
    classes: list[type[BaseException]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    raised: list[BaseException] = []

    async def failing_embed(self: EmbedderBackend, *args: object, **kwargs: object) -> None:
        raise raised[-1]

    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        body = {"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)}
        r = client.post("/admin/registry/models", json=body)
        assert r.status_code == 201, r.text
        request = {"model": "emb", "input": "hi"}
        assert client.post("/v1/embeddings", json=request).status_code == 200
        monkeypatch.setattr(EmbedderBackend, "embed", failing_embed)
        seen: dict[str, int] = {}
        retry_after: str | None = None
        for cls in classes:
            raised.append(make(cls))
            before = counts(client)
            r = client.post("/v1/embeddings", json=request)
            after = counts(client)
            counted = [s for s in after if after[s] - before.get(s, 0) == 1]
            assert counted == [str(r.status_code)], (cls, counted, r.status_code, r.text)
            assert r.status_code == status_of(raised[-1]).status, cls
            if r.status_code != CLIENT_CLOSED:
                error = r.json()["error"]
                assert error["type"] == status_of(raised[-1]).error_type, cls
                if r.status_code >= 400 and isinstance(raised[-1], HubError | BackendError):
                    assert r.headers["X-Hub-Model-Version"] == "1", cls
            seen[cls.__name__] = r.status_code
            if cls is EngineStepError:
                retry_after = r.headers.get("Retry-After")
    # What a user notices, spelled out for the classes the issue calls out.
    assert seen["LoadError"] == 503  # was counted 500 while answered 503
    assert seen["VanishedVersion"] == 404  # a registry subclass was a 500
    assert seen["QueueOverflow"] == 503
    assert seen["InputError"] == 400
    assert seen["RuntimeError"] == 500
    # The engine recovers from a step nobody's input explains: retry, not a server bug.
    assert seen["EngineStepError"] == 503 and retry_after is not None and int(retry_after) >= 1
    assert seen["ClientGone"] == CLIENT_CLOSED


def test_load_error_answer_says_retry_later() -> None:
    outcome = status_of(LoadError("weights missing"))
    assert (outcome.status, outcome.error_type) == (503, "service_unavailable")
    assert status_of(VanishedVersion("gone")).status == 404
    assert status_of(KeyError("x")).status == 500
