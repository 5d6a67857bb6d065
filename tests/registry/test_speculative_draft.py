"""An LLM registered with `speculative.draft` names a registered LLM version with its own
tokenizer: anything else is refused at registration (400), naming the problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from backends.llm.speculative.compat import draft_problem
from registry.errors import InvalidSourceError
from registry.service import Registry


def test_a_draft_must_be_registered_and_share_the_tokenizer(
    registry: Registry, tiny_llm_dir: Path, tmp_path: Path
) -> None:
    # The same model with two tokens' ids swapped in its tokenizer.
    other = tmp_path / "swapped"
    shutil.copytree(tiny_llm_dir, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    registry.draft_check = draft_problem
    registry.register("draft", "llm", str(tiny_llm_dir), aliases=["production"])
    registry.register("odd", "llm", str(other))

    def config(ref: str) -> dict[str, object]:
        return {"speculative": {"draft": ref, "num_tokens": 4}}

    view = registry.register("target", "llm", str(tiny_llm_dir), config=config("draft@production"))
    assert view.runtime_config["speculative"] == config("draft@production")["speculative"]
    with pytest.raises(InvalidSourceError, match=r"speculative.draft: .*'missing'"):
        registry.register("t2", "llm", str(tiny_llm_dir), config=config("missing@1"))
    with pytest.raises(InvalidSourceError, match="maps 2 tokens differently"):
        registry.register("t2", "llm", str(tiny_llm_dir), config=config("odd@1"))


def test_the_loader_hands_the_draft_folder_over_and_charges_it(
    registry: Registry, tiny_llm_dir: Path
) -> None:
    from hub.manager.loader import VersionLoader
    from hub.manager.state import ModelKey

    registry.register("draft", "llm", str(tiny_llm_dir), aliases=["production"])
    spec = {"draft": "draft@production", "num_tokens": 3}
    registry.register("plain", "llm", str(tiny_llm_dir))
    registry.register("target", "llm", str(tiny_llm_dir), config={"speculative": spec})
    loader = VersionLoader(registry)
    plain = loader.prepare(ModelKey("plain", 1))
    target = loader.prepare(ModelKey("target", 1))
    assert plain.draft_dir is None
    assert target.draft_dir is not None and (target.draft_dir / "config.json").is_file()
    assert target.draft_dir != target.artifact_dir  # the draft version's own copy
    # The same weights twice, and the KV reservation twice (the draft gets the target's).
    assert target.predict_memory() == 2 * plain.predict_memory()
