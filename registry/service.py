"""The registry service: register versions, read models, versions and aliases, audit moves.

SQL and MLflow are written together; when the second write fails the first is undone, so a
refused or failed registration leaves nothing behind in either store.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from registry.adapters import inspect_adapter_folder, is_adapter_folder, resolve_base
from registry.aliases import AliasBook, event_view
from registry.cache import ArtifactCache
from registry.canaries import CanaryBook
from registry.db import Database
from registry.errors import ConflictError, InvalidConfigError, InvalidSourceError, NotFoundError
from registry.fetch import SourceFetcher
from registry.folder_checks import check_source_text
from registry.mlflow_store import MlflowStore
from registry.schema import AliasEvent, ModelVersion, RegisteredModel
from registry.sources import InspectedSource, check_weights_cover_config, inspect_folder
from registry.traffic import TrafficBook
from registry.views import BaseRef, EventView, ModelView, RegistrySnapshot, VersionView

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
ALIAS_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")
# MLflow reserves these forms: `latest` and `v<number>` would be ambiguous with versions.
RESERVED_ALIAS_RE = re.compile(r"^(latest|v\d+)$", re.IGNORECASE)

log = logging.getLogger(__name__)

# Checks a runtime config for a kind, raising ValueError (with a `key` attribute naming the
# offending key, when it has one) for a config that kind cannot use. The hub passes
# `backends.runtime_config.parse_runtime_config`; the registry imports no backend itself.
ConfigCheck = Callable[[str, Mapping[str, Any]], object]


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise InvalidSourceError(
            f"invalid model name {name!r}: use letters, digits, '.', '_' and '-' "
            "(at most 200, starting with a letter or digit)"
        )


def check_alias(alias: str) -> None:
    if not ALIAS_RE.match(alias) or RESERVED_ALIAS_RE.match(alias):
        raise InvalidSourceError(
            f"invalid alias {alias!r}: start with a letter, then letters, digits, '_' or '-'; "
            "'latest' and 'v<number>' are reserved"
        )


def _version_view(
    row: ModelVersion, model: RegisteredModel, aliases: Mapping[str, int]
) -> VersionView:
    return VersionView(
        name=model.name,
        kind=model.kind,
        version=row.version,
        source_uri=row.source_uri,
        mlflow_model_uri=row.mlflow_model_uri,
        artifact_uri=row.artifact_uri,
        manifest=dict(row.manifest),
        total_bytes=row.total_bytes,
        dtype=row.dtype,
        runtime_config=dict(row.runtime_config or {}),
        status=row.status,
        validation=row.validation,
        eval_set=row.eval_set,
        created_at=row.created_at,
        aliases=tuple(sorted(a for a, v in aliases.items() if v == row.version)),
        base=(
            BaseRef(row.base_model, row.base_version)
            if row.base_model is not None and row.base_version is not None
            else None
        ),
    )


def _model_view(model: RegisteredModel, aliases: Mapping[str, int]) -> ModelView:
    return ModelView(
        name=model.name,
        kind=model.kind,
        description=model.description,
        created_at=model.created_at,
        updated_at=model.updated_at,
        versions={v.version: _version_view(v, model, aliases) for v in model.versions},
        aliases=dict(aliases),
    )


class Registry:
    """Models, versions and aliases, kept in SQL and MLflow together. With `check_config`,
    `register` refuses a runtime config the kind cannot use (InvalidConfigError naming the
    key) before anything is fetched or written; the config is stored as given."""

    def __init__(
        self,
        db: Database,
        mlflow: MlflowStore,
        cache: ArtifactCache,
        *,
        allow_pickle: bool = False,
        hf_cache_dir: Path | None = None,
        check_config: ConfigCheck | None = None,
        trust_remote_code: bool = False,
        max_model_bytes: int | None = None,
        folder_check: Callable[[Path, str], str | None] | None = None,
        adapter_check: Callable[[Path, Path, Mapping[str, Any]], str | None] | None = None,
        draft_check: Callable[[Path, Path], str | None] | None = None,
    ) -> None:
        self.db = db
        self.check_config = check_config
        self.mlflow = mlflow
        self.cache = cache
        self.allow_pickle = allow_pickle
        self.trust_remote_code = trust_remote_code
        # The largest device budget: a config whose weights cannot fit it is refused.
        self.max_model_bytes = max_model_bytes
        # The serving side's own refusal (an LLM architecture it cannot run): folder and kind
        # in, a reason out (None: servable). Injected, as the registry imports no backend.
        self.folder_check = folder_check
        # The same for a LoRA adapter: adapter folder, its base's folder and runtime config
        # in, a reason out (unsupported PEFT features, shapes or target modules that do not
        # fit the base, a rank above its max_lora_rank).
        self.adapter_check = adapter_check
        # The same for an LLM's `speculative.draft`: the LLM's folder and the draft's in, why
        # the draft cannot draft for it out (a different tokenizer).
        self.draft_check = draft_check
        self.traffic = TrafficBook(db)
        self.aliases = AliasBook(db, mlflow, self.traffic)
        self.canaries = CanaryBook(db, self.traffic)
        self.fetcher = SourceFetcher(mlflow, cache.cache_dir / ".staging", hf_cache_dir)

    # ---- writes -------------------------------------------------------------------------
    def register(
        self,
        name: str,
        kind: str,
        source: str,
        *,
        aliases: Iterable[str] = (),
        config: Mapping[str, Any] | None = None,
        description: str = "",
        eval_set: Mapping[str, Any] | None = None,
        actor: str = "system",
        base: str | None = None,
    ) -> VersionView:
        """Register the files at `source` (a folder, `hf://org/name[@rev]`, or an MLflow model
        URI) as a new version of `name` and return it. A LoRA adapter folder needs `base`
        (`name@version-or-alias` of a registered LLM; the alias is resolved now and the
        version recorded). Nothing is written to MLflow or SQL unless the source passes
        inspection."""
        check_name(name)
        check_source_text(source)
        aliases = list(aliases)
        for alias in aliases:
            check_alias(alias)
        self._check_config(kind, config or {})
        base_ref = resolve_base(base, self.get_model) if base is not None else None
        with self.fetcher.fetch(source) as folder:
            return self._register_folder(
                name, kind, source, folder, aliases, config, description, eval_set, actor,
                base_ref,
            )  # fmt: skip

    def _inspect(
        self, folder: Path, kind: str, source: str, base: BaseRef | None
    ) -> InspectedSource:
        """Inspect `folder` as a full model or, with `base`, as a LoRA adapter of it."""
        adapter = is_adapter_folder(folder)
        if adapter and base is None:
            raise InvalidSourceError(
                f"source {source} is a LoRA adapter (adapter_config.json); register it with "
                '"base": "name@version-or-alias" naming the registered llm it was trained on'
            )
        if base is None:
            return inspect_folder(
                folder,
                kind,
                allow_pickle=self.allow_pickle,
                trust_remote_code=self.trust_remote_code,
                link_root=self.fetcher.link_root(source, folder),
                max_model_bytes=self.max_model_bytes,
            )
        if not adapter:
            raise InvalidSourceError(
                f"base is only for a LoRA adapter, and source {source} is none (no "
                "adapter_config.json); leave base out to register a full model"
            )
        if kind != "llm":
            raise InvalidSourceError(
                f"a LoRA adapter is registered as kind llm, not {kind}; register it with kind llm"
            )
        inspected = inspect_adapter_folder(folder, link_root=self.fetcher.link_root(source, folder))
        if self.adapter_check is not None:
            base_view = self.get_version(base.name, base.version)
            problem = self.adapter_check(
                folder, self.materialise(base_view), base_view.runtime_config
            )
            if problem is not None:
                raise InvalidSourceError(f"adapter {source} does not fit base {base}: {problem}")
        return inspected

    def _register_folder(
        self,
        name: str,
        kind: str,
        source: str,
        folder: Path,
        aliases: list[str],
        config: Mapping[str, Any] | None,
        description: str,
        eval_set: Mapping[str, Any] | None,
        actor: str,
        base: BaseRef | None,
    ) -> VersionView:
        inspected = self._inspect(folder, kind, source, base)
        # What is stored: the defaults read from the model's files, then the caller's keys.
        runtime_config = {**inspected.runtime_defaults, **(config or {})}
        self._check_config(kind, runtime_config)
        problem = None
        if self.folder_check is not None and base is None:
            problem = self.folder_check(folder, kind)
        if problem is None and kind == "llm" and base is None:
            self._check_draft(folder, runtime_config)
        if problem is not None:
            raise InvalidSourceError(f"source {source} cannot be served: {problem}")
        if base is None:
            check_weights_cover_config(folder, kind)
        with self.db.session() as s:
            existing = s.scalar(select(RegisteredModel).where(RegisteredModel.name == name))
            if existing is not None and existing.kind != kind:
                raise ConflictError(
                    f"model {name!r} is registered as a {existing.kind}; cannot add a {kind} "
                    "version to it"
                )
        tags = {"hub.kind": kind, "hub.source": source}
        if base is not None:
            tags["hub.base"] = str(base)
        version, artifact_uri = self.mlflow.log_version(
            name, folder, description=description, tags=tags
        )
        try:
            with self.db.session() as s:
                model = s.scalar(select(RegisteredModel).where(RegisteredModel.name == name))
                if model is None:
                    model = RegisteredModel(name=name, kind=kind, description=description)
                    s.add(model)
                    s.flush()
                s.add(
                    ModelVersion(
                        model_id=model.id,
                        version=version,
                        source_uri=source,
                        mlflow_model_uri=f"models:/{name}/{version}",
                        mlflow_version=str(version),
                        artifact_uri=artifact_uri,
                        manifest=inspected.manifest,
                        total_bytes=inspected.total_bytes,
                        dtype=inspected.dtype,
                        runtime_config=runtime_config,
                        status="registered",
                        eval_set=dict(eval_set) if eval_set else None,
                        base_model=base.name if base is not None else None,
                        base_version=base.version if base is not None else None,
                    )
                )
        except Exception:
            log.exception("SQL write of %s v%d failed; removing the MLflow version", name, version)
            self.mlflow.delete_version(name, version)
            raise
        for alias in aliases:
            self.set_alias(name, alias, version, actor=actor, reason="set at registration")
        log.info("registered %s v%d (%s%s, %d bytes) from %s", name, version, kind,
                 f", adapter on {base}" if base else "", inspected.total_bytes,
                 source)  # fmt: skip
        return self.get_version(name, version)

    def _check_draft(self, folder: Path, config: Mapping[str, Any]) -> None:
        """InvalidSourceError (400) when the config's `speculative.draft` names no registered
        LLM version, or one that cannot draft for the model in `folder`."""
        speculative = config.get("speculative")
        draft = speculative.get("draft") if isinstance(speculative, Mapping) else None
        if not isinstance(draft, str):
            return
        try:
            ref = resolve_base(draft, self.get_model)
        except InvalidSourceError as e:
            raise InvalidSourceError(f"speculative.draft: {e}") from None
        if self.draft_check is None:
            return
        problem = self.draft_check(
            folder, self.materialise(self.get_version(ref.name, ref.version))
        )
        if problem is not None:
            raise InvalidSourceError(f"speculative.draft {draft!r} cannot draft for it: {problem}")

    def _check_config(self, kind: str, config: Mapping[str, Any]) -> None:
        if self.check_config is None:
            return
        try:
            self.check_config(kind, config)
        except ValueError as e:
            raise InvalidConfigError(str(e), key=getattr(e, "key", None)) from e

    def set_alias(
        self,
        name: str,
        alias: str,
        version: int | None,
        *,
        actor: str,
        reason: str = "",
        action: str | None = None,
        validation: dict[str, Any] | None = None,
    ) -> EventView:
        """Point `alias` at `version` (None removes it) and record the move in the audit log."""
        check_alias(alias)
        return self.aliases.move(
            name, alias, version, actor=actor, reason=reason, action=action, validation=validation
        )

    def record_validation(self, name: str, version: int, result: dict[str, Any]) -> None:
        """Store a validation gate's result on the version (status validated or failed)."""
        with self.db.session() as s:
            model = self._model_row(s, name)
            row = s.scalar(
                select(ModelVersion).where(
                    ModelVersion.model_id == model.id, ModelVersion.version == version
                )
            )
            if row is None:
                raise NotFoundError(f"model {name!r} has no version {version}")
            row.validation = result
            row.status = "validated" if result.get("passed") else "failed"

    # ---- reads --------------------------------------------------------------------------
    def snapshot(self) -> RegistrySnapshot:
        """Everything served, from SQL alone (aliases as the audit log records them; see
        registry.aliases): it never waits for MLflow."""
        with self.db.session() as s:
            rows = s.scalars(
                select(RegisteredModel).options(selectinload(RegisteredModel.versions))
            ).all()
            aliases = AliasBook.recorded_by_model(s)
            return RegistrySnapshot(
                models={m.name: _model_view(m, aliases.get(m.id, {})) for m in rows},
                traffic=self.traffic.policies(s),
            )

    def list_models(self) -> list[ModelView]:
        snap = self.snapshot()
        return [snap.models[n] for n in snap.names()]

    def get_model(self, name: str) -> ModelView:
        """One model from SQL alone (as `snapshot`)."""
        with self.db.session() as s:
            model = self._model_row(s, name)
            return _model_view(model, AliasBook.recorded_by_model(s, model.id).get(model.id, {}))

    def get_version(self, name: str, version: int) -> VersionView:
        model = self.get_model(name)
        try:
            return model.versions[version]
        except KeyError:
            known = ", ".join(str(v) for v in sorted(model.versions)) or "none"
            raise NotFoundError(
                f"model {name!r} has no version {version} (versions: {known})"
            ) from None

    def events(self, name: str | None = None, limit: int = 100) -> list[EventView]:
        with self.db.session() as s:
            query = select(AliasEvent, RegisteredModel.name).join(RegisteredModel)
            if name is not None:
                query = query.where(RegisteredModel.name == name)
            query = query.order_by(AliasEvent.id.desc()).limit(limit)
            return [event_view(event, model_name) for event, model_name in s.execute(query)]

    def materialise(self, version: VersionView) -> Path:
        """The verified local folder of a version (downloaded on first use)."""
        return self.cache.materialise(
            version.name, version.version, version.artifact_uri, version.manifest
        )

    # ---- helpers ------------------------------------------------------------------------
    def _model_row(self, s: Session, name: str) -> RegisteredModel:
        model = s.scalar(
            select(RegisteredModel)
            .where(RegisteredModel.name == name)
            .options(selectinload(RegisteredModel.versions))
        )
        if model is None:
            known = s.scalars(select(RegisteredModel.name).order_by(RegisteredModel.name)).all()
            raise NotFoundError(
                f"model {name!r} is not registered (known: {', '.join(known) or 'none'})"
            )
        return model
