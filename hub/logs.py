"""Logging set-up for `hub` commands: a dictConfig YAML file, or a plain format at a level."""

from __future__ import annotations

import logging
import logging.config
from pathlib import Path

import yaml

FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def configure_logging(level: str = "info", config_file: Path | None = None) -> None:
    if config_file is not None:
        logging.config.dictConfig(yaml.safe_load(config_file.read_text()))
        return
    logging.basicConfig(level=level.upper(), format=FORMAT)
    # MLflow and alembic are chatty at INFO about their own migrations.
    for noisy in ("alembic.runtime.migration", "mlflow.store.db.utils", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # urllib3 warns of every retried MLflow request: during an outage, one line per
    # background check. The hub logs the outage itself, once when it starts and once when
    # it ends (hub.dependencies).
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
