"""Turn a register source into a local folder: a folder as is, `hf://org/name[@revision]`
from the Hugging Face Hub (or its local cache when offline), or an MLflow model URI
(`models:/name/3`, `models:/name@alias`, `runs:/<run id>/<path>`) downloaded from the
hub's own MLflow. Fetched copies live in a staging folder removed after registration."""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from registry.errors import InvalidSourceError, NotFoundError
from registry.mlflow_store import MlflowStore

HF_PREFIX = "hf://"
MLFLOW_PREFIXES = ("models:/", "runs:/")
_HF_RE = re.compile(r"^hf://(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<rev>[\w./-]+))?$")
_MODEL_MARKERS = ("config.json", "modules.json")

log = logging.getLogger(__name__)


def find_model_root(folder: Path) -> Path:
    """The folder itself if it holds a model config, else the one subfolder that does (MLflow
    flavours nest the files, e.g. `model/` or `data/model/`)."""
    if any((folder / m).is_file() for m in _MODEL_MARKERS):
        return folder
    candidates = sorted(
        {p.parent for m in _MODEL_MARKERS for p in folder.rglob(m)},
        key=lambda p: (len(p.relative_to(folder).parts), str(p)),
    )
    if not candidates:
        return folder  # let inspection explain what is missing
    return candidates[0]


def local_folder(source: str) -> Path:
    """The folder a local source names, resolved; a path the OS cannot even look up (a
    symlink loop, a name too long) is an InvalidSourceError naming the problem."""
    path = Path(source.removeprefix("file://"))
    try:
        return path.expanduser().resolve()
    except RuntimeError:  # Python's word for a symlink loop met while resolving
        raise InvalidSourceError(f"source {source} is a symlink loop") from None
    except OSError as e:
        raise InvalidSourceError(f"source {source} cannot be looked up: {e.strerror}") from None


class SourceFetcher:
    def __init__(
        self, mlflow: MlflowStore, staging_dir: Path, hf_cache_dir: Path | None = None
    ) -> None:
        self.mlflow = mlflow
        self.staging_dir = staging_dir
        self.hf_cache_dir = hf_cache_dir

    @contextlib.contextmanager
    def fetch(self, source: str) -> Iterator[Path]:
        """Yield a local folder holding the source's files; fetched copies are removed after."""
        if source.startswith(HF_PREFIX):
            with self._staging() as tmp:
                yield self._from_hf(source, tmp)
        elif source.startswith(MLFLOW_PREFIXES):
            with self._staging() as tmp:
                yield find_model_root(self._from_mlflow(source, tmp))
        else:
            yield local_folder(source)

    @staticmethod
    def link_root(source: str, folder: Path) -> Path:
        """Where the fetched folder's symlinks may point: a Hugging Face snapshot links its
        files into its repository's cache (`../../blobs/`), anything else stays inside."""
        if source.startswith(HF_PREFIX) and folder.parent.name == "snapshots":
            return folder.parent.parent
        return folder

    @contextlib.contextmanager
    def _staging(self) -> Iterator[Path]:
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix="fetch-", dir=self.staging_dir))
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _from_hf(self, source: str, tmp: Path) -> Path:
        match = _HF_RE.match(source)
        if match is None:
            raise InvalidSourceError(
                f"source {source!r} is not of the form hf://org/name[@revision]"
            )
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        repo, revision = match.group("repo"), match.group("rev")
        try:
            # The hub cache (not `tmp`) keeps a later registration of the same revision fast
            # and lets offline machines register what was downloaded before.
            path = snapshot_download(
                repo,
                revision=revision,
                cache_dir=self.hf_cache_dir,
                # Weights as safetensors only; pickle checkpoints are never fetched.
                ignore_patterns=["*.bin", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack", "*.onnx"],
            )
        except (RepositoryNotFoundError, RevisionNotFoundError) as e:
            raise InvalidSourceError(f"{source}: {type(e).__name__}: {e}") from e
        except LocalEntryNotFoundError as e:
            raise InvalidSourceError(
                f"cannot fetch {source}: the Hugging Face Hub is not reachable (offline mode "
                "or no network) and the revision is not in the local cache; download it on a "
                "connected machine, or register a local folder instead"
            ) from e
        except OSError as e:
            raise InvalidSourceError(f"cannot fetch {source}: {e}") from e
        return Path(str(path))

    def _from_mlflow(self, source: str, tmp: Path) -> Path:
        from mlflow.exceptions import MlflowException

        try:
            uri = self._download_uri(source)
            return self.mlflow.download(uri, tmp)
        except MlflowException as e:
            raise InvalidSourceError(f"cannot fetch {source} from MLflow: {e.message}") from e

    def _download_uri(self, source: str) -> str:
        if source.startswith("runs:/"):
            return source
        ref = source.removeprefix("models:/")
        client: Any = self.mlflow.client
        if "@" in ref:
            name, alias = ref.split("@", 1)
            version = client.get_model_version_by_alias(name, alias).version
        elif "/" in ref:
            name, version = ref.rsplit("/", 1)
        else:
            raise NotFoundError(
                f"{source}: expected models:/<name>/<version> or models:/<name>@<alias>"
            )
        return str(client.get_model_version_download_uri(name, str(version)))
