"""Tell an outage of a dependency (the database, MLflow) from every other error.

A load, a registry read or an alias move that fails because PostgreSQL or MLflow does not
answer is not the caller's or the model's fault: the hub answers 503 with `Retry-After` and
holds no backoff against the model. SQLAlchemy, psycopg, requests and MLflow each raise their
own classes (MLflow wraps a refused connection in a generic `MlflowException` whose context is
requests' `ConnectionError`), so the whole cause chain is searched.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import requests
from sqlalchemy import exc as sql_exc

from registry.errors import DependencyUnavailable

log = logging.getLogger(__name__)

# Exceptions that mean "the database did not answer", as opposed to a query it refused.
_DATABASE = (sql_exc.OperationalError, sql_exc.InterfaceError, sql_exc.TimeoutError)
# Exceptions raised by MLflow's HTTP client (requests, wrapping urllib3's) when the server is
# down, unreachable or too slow. Not the builtin TimeoutError or ConnectionError: asyncio's
# timeouts and a client that hung up raise those too.
_HTTP = (requests.ConnectionError, requests.Timeout)
# Every class above: an exception of one of them reaching the HTTP layer is a 503.
OUTAGE_CLASSES: tuple[type[BaseException], ...] = (*_DATABASE, *_HTTP)


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = e
    while current is not None and current not in seen and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def dependency_down(e: BaseException) -> str | None:
    """ "database" or "mlflow" when `e` (or an exception it was raised from) says that
    dependency did not answer; None for any other error."""
    for link in _chain(e):
        if isinstance(link, DependencyUnavailable):
            return link.dependency
        if isinstance(link, _DATABASE):
            return "database"
        if isinstance(link, _HTTP):
            return "mlflow"
        # MLflow's own word for a server that is up but cannot answer now (a 503 from it or
        # its proxy), read without importing MLflow.
        if getattr(link, "error_code", None) == "TEMPORARILY_UNAVAILABLE":
            return "mlflow"
    return None


# SQLSTATEs of a statement PostgreSQL cancelled while it waited: `statement_timeout`
# (query_canceled) and `lock_timeout` (lock_not_available). The server answered.
_WAITED_SQLSTATES = frozenset({"57014", "55P03"})


def _waited_for_lock(link: BaseException) -> bool:
    """Whether `link` says the database answered but a statement waited too long: for a row
    lock another transaction holds (PostgreSQL's timeouts, SQLite's "database is locked") or
    for a pooled connection others hold."""
    if isinstance(link, sql_exc.TimeoutError):
        return True
    if isinstance(link, sql_exc.OperationalError):
        orig = link.orig
        if getattr(orig, "sqlstate", None) in _WAITED_SQLSTATES:
            return True
        return "database is locked" in str(orig)
    return False


def _label(e: BaseException, dependency: str) -> str:
    """What did not answer, in the words a caller reads (no host, port or driver text)."""
    if dependency == "mlflow":
        return "MLflow is unreachable"
    if dependency == "database" and any(_waited_for_lock(link) for link in _chain(e)):
        # Another change to the same rows holds their lock (or every pooled connection) while
        # it waits on something slower, MLflow most often: the database itself is up.
        return (
            "the registry database is up, but this waited too long for another registry "
            "change (still running, often waiting on MLflow) to release the model's lock"
        )
    return "the registry database is unreachable"


def describe(e: BaseException) -> str:
    """One line saying what `e` is, safe to show any caller: for an outage its class and the
    dependency (a driver's text names hosts and ports); else its first line of text."""
    dependency = dependency_down(e)
    if dependency is not None and not isinstance(e, DependencyUnavailable):
        return f"{type(e).__name__}: {_label(e, dependency)}"
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}".rstrip(": ")


def as_unavailable(e: BaseException, what: str) -> DependencyUnavailable | None:
    """The DependencyUnavailable to raise instead of `e` (None when `e` is no outage);
    `what` says what was being done, for the message. Callers (any user) read the message,
    so it names the exception's class, not its text (hosts, ports, SQL)."""
    if isinstance(e, DependencyUnavailable):
        return e
    dependency = dependency_down(e)
    if dependency is None:
        return None
    label = _label(e, dependency)
    # Debug only: during an outage this runs for every call and every background check;
    # the hub logs the outage itself when it starts and ends (hub.dependencies).
    log.debug("%s: %s: %s", what, label, str(e).splitlines()[0][:500])
    return DependencyUnavailable(
        f"{what}: {label} ({type(e).__name__}); nothing was wrong with the request, retry shortly",
        dependency=dependency,
    )


@contextlib.contextmanager
def outage_named(what: str) -> Iterator[None]:
    """Re-raise an error caused by the database or MLflow not answering as
    DependencyUnavailable (a 503 to callers); any other error passes unchanged."""
    try:
        yield
    except Exception as e:
        outage = as_unavailable(e, what)
        if outage is None or outage is e:
            raise
        raise outage from e
