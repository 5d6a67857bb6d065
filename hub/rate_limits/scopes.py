"""The scopes a request's rate limits are counted in: its key's own, and its key's on each
model the request counts against.

A key's `limits` hold over everything it does; `limits.models` adds the same four limits for
its requests to one model, by registered name, and a request is admitted only when it fits
every scope it counts in. Per-model limits are per model name, as OpenAI's are: a request
naming `name@version` or `name@alias` (or a version in the path) counts against `name`. A
LoRA adapter is a model of its own that runs on its base model's weights; as an OpenAI
fine-tune shares its base model's limits, a request to an adapter counts against its own
name and its base model's name (the base of the version it names, else of the version an
unversioned request is served by default).

Each scope has buckets of its own in the ledger, under a name of its own (`ledger_name`), so
a key's consumption on one model is shared across replicas through the same SQL rows and
sync as the key's.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from registry.keys import KeyLimits, ModelLimits
from registry.refs import version_number
from registry.views import RegistrySnapshot

# Between a key's name and a model's in a ledger name: neither may contain it.
SEPARATOR = "/"
# The longest ledger name `hub_rate_limit_spend.key_name` holds.
LEDGER_NAME_CHARS = 200
# Starts a ledger name that stands for a longer one (no key name starts with it).
DIGEST_MARK = "#"


@dataclass(slots=True)
class LimitScope:
    """One set of buckets a request draws from: `limits` under ledger name `ledger`, those
    of the key itself (`model` None) or of the key on `model`."""

    ledger: str
    limits: ModelLimits
    model: str | None = None

    def describe(self, limit: str) -> str:
        """The limit named as a refusal names it: `tokens_per_minute` (the key's) or
        `tokens_per_minute for model tiny-llama`."""
        return limit if self.model is None else f"{limit} for model {self.model}"


def ledger_name(key: str, model: str) -> str:
    """The ledger name of key `key`'s consumption on model `model`: `key/model`, or, when that
    is longer than a ledger name may be, a digest of it (the same on every replica)."""
    name = f"{key}{SEPARATOR}{model}"
    if len(name) <= LEDGER_NAME_CHARS:
        return name
    return DIGEST_MARK + hashlib.sha256(name.encode()).hexdigest()


def counted_models(model: str | None, snapshot: RegistrySnapshot) -> tuple[str, ...]:
    """The registered names a request for `model` (`name` or `name@ref`, as the caller named
    it; None: unknown) counts against: its name, then its base model's for a LoRA adapter."""
    if not model:
        return ()
    name, _, ref = model.partition("@")
    view = snapshot.models.get(name)
    if view is None:
        return (name,)
    number = None
    if ref:
        number = version_number(ref)
        if number is None:
            number = view.aliases.get(ref)
    if number is None:
        number = view.default_version()
    version = view.versions.get(number) if number is not None else None
    base = version.base.name if version is not None and version.base is not None else None
    return (name, base) if base is not None and base != name else (name,)


def scopes_of(key: str, limits: KeyLimits, models: tuple[str, ...] = ()) -> list[LimitScope]:
    """The scopes a request of key `key` counting against `models` is admitted in: the key's
    own when it has a limit of its own, and the key's on each of `models` it limits."""
    out = [] if limits.empty else [LimitScope(key, limits)]
    for model in models:
        own = limits.models.get(model)
        if own is not None:
            out.append(LimitScope(ledger_name(key, model), own, model))
    return out
