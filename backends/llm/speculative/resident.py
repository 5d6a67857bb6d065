"""A draft model as part of its target's backend: loaded, charged, offloaded, restored and
unloaded together with the target, so the manager sees one model of their summed footprint.

`load_draft` reads the draft's folder (the hub's loader materialises the registered
`speculative.draft` version and passes it in the backend context), refuses a draft whose
tokenizer is not the target's (LoadError naming the difference), and builds the
`DraftModel` the target's engine proposes with. The draft's KV cache takes the target's
block size and token budget and `kv_cache_bytes` of its own size (the same reservation as the
target's: a draft is smaller per token, so it holds more tokens than the target does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from backends.errors import InputError, LoadError
from backends.llm.config import EngineConfig
from backends.llm.model_runner import ModelRunner
from backends.llm.speculative.compat import check_same_tokenizer
from backends.llm.speculative.draft_model import DraftModel
from backends.loading import module_bytes
from backends.parking import ParkedWeights, park, release


class ResidentDraft:
    """The draft's runner and proposer, following its target's lifecycle."""

    def __init__(self, draft: DraftModel, name: str) -> None:
        self.draft = draft
        self.name = name
        self._parked: ParkedWeights | None = None

    @property
    def runner(self) -> ModelRunner:
        return self.draft.runner

    def memory_bytes(self) -> int:
        if self._parked is not None:
            return 0
        runner = self.runner
        fused = runner.fused.scratch_bytes
        return module_bytes(runner.model) + runner.kv_cache_bytes() + fused + runner.graph_bytes()

    def offload_bytes(self) -> int:
        return module_bytes(self.runner.model)

    def offload(self) -> None:
        if self._parked is not None:
            return
        self.runner.release_kv_cache()
        self._parked = park(self.runner.model)
        self.draft.reset()

    def restore(self, device: str) -> None:
        runner = self.runner
        if self._parked is not None:
            self._parked.restore(device)
            self._parked = None
            runner.device = torch.device(device)
        else:
            runner.to(device)
        if not runner.kv_caches:
            runner.allocate_kv_cache()
        self.draft.reset()

    def unload(self) -> None:
        if self._parked is not None:
            self._parked.discard()
        else:
            self.runner.release_kv_cache()
            release(self.runner.model)
        self._parked = None


def load_draft(
    draft_dir: Path | None,
    draft_name: str,
    target_tokenizer: Any,
    target_runner: ModelRunner,
    config: EngineConfig,
    device: str,
    dtype: torch.dtype | None,
    **runner_options: Any,
) -> ResidentDraft:
    """The draft `draft_name` from `draft_dir` on `device`; LoadError when the hub gave no
    folder or the draft does not fit the target (tokenizer, vocabulary)."""
    from transformers import AutoTokenizer

    if draft_dir is None:
        raise LoadError(
            f"speculative.draft {draft_name!r} was not resolved to a registered version; "
            "register the draft LLM first, then load this model through the hub"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    except Exception as e:
        raise LoadError(f"cannot load the tokenizer of draft {draft_name!r}: {e}") from e
    draft_config = EngineConfig(
        kv_cache_bytes=config.kv_cache_bytes,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        enable_prefix_caching=False,
        fused_step=config.fused_step,
        cuda_graphs=False,
    )
    try:
        check_same_tokenizer(target_tokenizer, tokenizer, f"draft {draft_name!r}")
    except InputError as e:
        raise LoadError(str(e)) from e
    runner = ModelRunner.load(draft_dir, device, dtype, draft_config, **runner_options)
    spec = config.speculative
    min_confidence = spec.min_draft_probability if spec is not None else 0.0
    draft = DraftModel(runner, config.block_size, config.max_num_batched_tokens, min_confidence)
    try:
        draft.check_vocab(target_runner.vocab_size)
    except InputError as e:
        runner.release_kv_cache()
        release(runner.model)
        raise LoadError(str(e)) from e
    return ResidentDraft(draft, draft_name)
