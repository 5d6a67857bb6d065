"""The prepared GPU run's plumbing, without running a section: a run cut short still leaves
one merged JSON naming what did not finish, and the wheels that travel to a GPU machine are
the pinned versions, unpacked where Python finds them."""

from __future__ import annotations

import json
import tarfile
import zipfile
from pathlib import Path

from benchmarks.gpu_check import SMALL_TOTAL_S, TOTAL_S, merge, sections
from benchmarks.gpu_sections import summarise
from benchmarks.gpu_wheels import pinned, unpack


def test_sections_merge_into_one_json_and_the_summary_names_the_unfinished(tmp_path: Path) -> None:
    folder = tmp_path / "sections"
    folder.mkdir()
    (folder / "throughput.json").write_text(json.dumps(
        {"status": "done", "engine": {"tokens_per_s": 812.5}}))  # fmt: skip
    (folder / "hf_cb.json").write_text(json.dumps({"status": "running"}))  # killed at its limit
    merged = merge(tmp_path, {"device": "cuda:0", "engine_config": {"cuda_graphs": True}})
    on_disk = json.loads((tmp_path / "gpu_check.json").read_text())
    assert on_disk == merged
    assert on_disk["sections"]["throughput"]["engine"]["tokens_per_s"] == 812.5
    text = summarise(merged)
    assert "812.5" in text
    assert "cut short: hf_cb" in text
    assert '{"cuda_graphs": true}' in text


def test_results_get_the_merged_json_and_the_logs_not_the_models(tmp_path: Path) -> None:
    out, results = tmp_path / "out", tmp_path / "results"
    (out / "sections").mkdir(parents=True)
    (out / "sections" / "latency.json").write_text(json.dumps({"status": "done"}))
    (out / "sections" / "latency.log").write_text("one stream 5.9 ms\n")
    (out / "work").mkdir()
    (out / "work" / "model.safetensors").write_bytes(b"\0" * 4096)
    merge(out, {"device": "cuda:0", "engine_config": {}}, results)
    assert sorted(p.name for p in results.iterdir()) == ["gpu_check.json", "gpu_check_logs.tgz"]
    assert json.loads((results / "gpu_check.json").read_text())["sections"]["latency"]
    with tarfile.open(results / "gpu_check_logs.tgz") as tar:
        assert tar.getnames() == ["latency.log"]
        member = tar.extractfile("latency.log")
        assert member is not None and member.read() == b"one stream 5.9 ms\n"


def test_every_section_has_a_budget_that_fits_the_deadline() -> None:
    table = sections()
    assert {"environment", "throughput", "latency", "correctness", "restore", "embeddings",
            "footprint", "hf_static", "hf_cb", "hf_cb_graphs",
            "cuda_tests"} <= set(table)  # fmt: skip
    # Within the overall deadline, so no section is skipped when each takes its whole budget.
    assert sum(gpu for _, gpu, _ in table.values()) <= TOTAL_S <= 6 * 60
    assert sum(cpu for _, _, cpu in table.values()) <= SMALL_TOTAL_S < 10 * 60


def test_wheels_are_the_pinned_versions() -> None:
    constraints = (Path(__file__).resolve().parents[2] / "constraints.txt").read_text()
    [line] = [x for x in constraints.splitlines() if x.startswith("nvidia-ml-py==")]
    assert pinned(["nvidia-ml-py", "not-pinned-anywhere"]) == [line, "not-pinned-anywhere"]


def test_unpacked_wheels_put_their_purelib_at_the_top(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "demo-1.0-py3-none-any.whl", "w") as z:
        z.writestr("demo/__init__.py", "VALUE = 1\n")
        z.writestr("demo-1.0.data/purelib/extra.py", "X = 2\n")
        z.writestr("demo-1.0.data/scripts/tool", "#!/bin/sh\n")
    unpack(wheels, tmp_path / "site")
    assert (tmp_path / "site" / "demo" / "__init__.py").read_text() == "VALUE = 1\n"
    assert (tmp_path / "site" / "extra.py").exists()
    assert not (tmp_path / "site" / "tool").exists()
