"""Registration trusts a source folder less: links out of it, remote code, configs of the
wrong types or of absurd size are refused with 400 naming the file, key or number, before
anything is copied or allocated."""

from __future__ import annotations

import json
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from registry.errors import InvalidSourceError
from registry.service import Registry


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes: Any) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_a_symlink_out_of_the_folder_is_refused_naming_it(
    registry: Registry, tiny_embedder_dir: Path, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the artifact store")
    folder = _copy(tiny_embedder_dir, tmp_path / "linked")
    (folder / "notes.txt").symlink_to(secret)
    with pytest.raises(InvalidSourceError, match=r"notes\.txt .*outside the folder"):
        registry.register("emb", "embedder", str(folder))
    assert registry.list_models() == []

    # A link to a folder outside is refused too; a link inside the folder is fine.
    (folder / "notes.txt").unlink()
    (folder / "extra").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(InvalidSourceError, match="extra"):
        registry.register("emb", "embedder", str(folder))
    (folder / "extra").unlink()
    (folder / "tokenizer-copy.json").symlink_to(folder / "tokenizer.json")
    version = registry.register("emb", "embedder", str(folder))
    assert "tokenizer-copy.json" in version.manifest


def test_a_fifo_is_refused_rather_than_read_forever(
    registry: Registry, tiny_embedder_dir: Path, tmp_path: Path
) -> None:
    folder = _copy(tiny_embedder_dir, tmp_path / "fifo")
    os.mkfifo(folder / "pipe")
    with pytest.raises(InvalidSourceError, match=r"pipe .*not a regular file"):
        registry.register("emb", "embedder", str(folder))


def test_remote_code_is_refused_unless_allowed(
    registry: Registry, tiny_llm_dir: Path, tmp_path: Path
) -> None:
    folder = _copy(tiny_llm_dir, tmp_path / "auto-map")
    _edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    with pytest.raises(InvalidSourceError, match=r"config\.json has auto_map.*trust_remote_code"):
        registry.register("llm", "llm", str(folder))
    code = _copy(tiny_llm_dir, tmp_path / "code")
    (code / "modeling_evil.py").write_text("import os\n")
    with pytest.raises(InvalidSourceError, match=r"modeling_evil\.py"):
        registry.register("llm", "llm", str(code))
    assert registry.list_models() == []
    registry.trust_remote_code = True
    assert registry.register("llm", "llm", str(code)).version == 1


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"max_position_embeddings": "x"}, "max_position_embeddings"),
        ({"architectures": 1}, "architectures"),
        ({"architectures": ["LlamaForCausalLM", 3]}, "architectures"),
        ({"text_config": "x"}, "text_config"),
        ({"text_config": {"hidden_size": -4}}, "text_config.hidden_size"),
        ({"num_hidden_layers": 1_000_000}, "num_hidden_layers"),
        ({"vocab_size": True}, "vocab_size"),
        ({"hidden_size": 1.5}, "hidden_size"),
    ],
)
def test_config_of_the_wrong_types_is_refused_naming_the_key(
    registry: Registry, tiny_llm_dir: Path, tmp_path: Path, changes: dict[str, Any], named: str
) -> None:
    folder = _copy(tiny_llm_dir, tmp_path / "bad-config")
    _edit_config(folder, **changes)
    with pytest.raises(InvalidSourceError, match=rf"config.json {named} "):
        registry.register("llm", "llm", str(folder))


def test_a_config_too_large_for_any_device_is_refused_over_http_without_allocating(
    client: TestClient, tiny_llm_dir: Path, tiny_embedder_dir: Path, tmp_path: Path
) -> None:
    # A first registration loads what registering needs (MLflow, SQL), so that what follows
    # measures only the refused one.
    r = client.post(
        "/admin/registry/models",
        json={"name": "emb", "kind": "embedder", "source": str(tiny_embedder_dir)},
    )
    assert r.status_code == 201, r.text
    huge = _copy(tiny_llm_dir, tmp_path / "huge")
    # Within every per-key bound, but hundreds of G parameters: no 2 GiB device holds that.
    _edit_config(huge, num_hidden_layers=1000, hidden_size=16384, intermediate_size=8192)
    million = _copy(tiny_llm_dir, tmp_path / "million")
    _edit_config(million, num_hidden_layers=1_000_000)
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    r = client.post(
        "/admin/registry/models", json={"name": "huge", "kind": "llm", "source": str(huge)}
    )
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "parameters" in message and "largest device budget" in message
    r = client.post(
        "/admin/registry/models", json={"name": "huge", "kind": "llm", "source": str(million)}
    )
    assert r.status_code == 400 and "num_hidden_layers" in r.json()["error"]["message"]
    peak_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (peak_after - peak_before) * 1024 < 64 * 2**20
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["emb"]
