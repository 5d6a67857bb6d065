"""The `traffic:` settings section: units, bounds, and every key documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from hub.settings import SettingsError, TrafficSettings, load_settings

REPO = Path(__file__).resolve().parents[3]


def test_units_and_bounds(tmp_path: Path) -> None:
    path = tmp_path / "hub.yaml"
    path.write_text("traffic: {shadow_max_wait: 250ms, canary_tick: 2s, sample_window: 500}\n")
    traffic = load_settings(path).traffic
    assert (traffic.shadow_max_wait, traffic.canary_tick, traffic.sample_window) == (0.25, 2, 500)
    path.write_text("traffic: {shadow_queue_size: 0}\n")
    with pytest.raises(SettingsError, match=r"traffic\.shadow_queue_size"):
        load_settings(path)
    path.write_text("traffic: {shadow_queue: 10}\n")
    with pytest.raises(SettingsError, match=r"unknown key 'traffic\.shadow_queue'"):
        load_settings(path)


def test_every_key_is_documented() -> None:
    readme = (REPO / "docs" / "configuration.md").read_text()
    example = (REPO / "configs" / "production.example.yaml").read_text()
    for key in TrafficSettings.model_fields:
        assert f"  {key}: " in readme, f"docs/configuration.md lacks traffic.{key}"
        assert f"  {key}: " in example, f"production.example.yaml lacks traffic.{key}"
