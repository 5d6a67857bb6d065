"""Whether a draft model can draft for a target: the same tokenizer. Imports no torch, so
the hub checks a registration with it (`draft_problem`) as well as the backend at load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from backends.errors import InputError


def check_same_tokenizer(target: Any, draft: Any, draft_name: str = "the draft model") -> None:
    """InputError naming the difference when `draft`'s tokenizer is not `target`'s (their
    vocabularies, token by token, and their special tokens)."""
    target_vocab, draft_vocab = target.get_vocab(), draft.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        raise InputError(
            f"{draft_name} has a vocabulary of {len(draft_vocab)} tokens and the target "
            f"{len(target_vocab)}; speculative decoding needs the same tokenizer",
            param="speculative.draft",
        )
    differing = [t for t, i in target_vocab.items() if draft_vocab.get(t) != i]
    if differing:
        raise InputError(
            f"{draft_name}'s tokenizer maps {len(differing)} tokens differently from the "
            f"target's (first: {differing[0]!r}); speculative decoding needs the same tokenizer",
            param="speculative.draft",
        )
    for name in ("bos_token_id", "eos_token_id"):
        if getattr(target, name, None) != getattr(draft, name, None):
            raise InputError(
                f"{draft_name}'s {name} is {getattr(draft, name, None)}, the target's "
                f"{getattr(target, name, None)}; speculative decoding needs the same tokenizer",
                param="speculative.draft",
            )


def draft_problem(target_dir: Path, draft_dir: Path) -> str | None:
    """Why the LLM in `draft_dir` cannot draft for the one in `target_dir` (their tokenizers
    differ, or one cannot be read), or None."""
    from transformers import AutoTokenizer

    try:
        target = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
        draft = AutoTokenizer.from_pretrained(draft_dir, local_files_only=True)
    except Exception as e:
        return f"its tokenizer or the model's cannot be read: {e}"
    try:
        check_same_tokenizer(target, draft)
    except InputError as e:
        return str(e)
    return None
