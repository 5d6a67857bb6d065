"""Per-kind checks of the validation gate: a smoke inference and the evaluation set."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from hub.validation.evalset import EmbedderCase, EvalSet, LLMCase, RerankerCase

SMOKE_TEXTS = ["The validation gate checks this model.", "hello"]
SMOKE_PROMPT = "The validation gate checks that this model"
SMOKE_TOKENS = 4


@dataclass(frozen=True)
class Check:
    """One check of the gate: its name, whether it passed, and why in words."""

    name: str
    passed: bool
    detail: str


def _check(name: str, passed: bool, detail: str) -> Check:
    return Check(name, passed, detail)


async def smoke(kind: str, backend: Any) -> list[Check]:
    if kind == "embedder":
        return await _smoke_embedder(backend)
    if kind == "llm":
        return await _smoke_llm(backend)
    if kind == "reranker":
        return await _smoke_reranker(backend)
    return [_check("smoke", False, f"no smoke test is defined for kind {kind!r}")]


async def evaluate(eval_set: EvalSet, backend: Any) -> Check:
    outcomes: list[tuple[bool, str]] = []
    for i, case in enumerate(eval_set.cases):
        label = case.name or f"case {i}"
        if isinstance(case, EmbedderCase):
            ok, detail = await _embedder_case(case, backend)
        elif isinstance(case, LLMCase):
            ok, detail = await _llm_case(case, backend)
        elif isinstance(case, RerankerCase):
            ok, detail = await _reranker_case(case, backend)
        else:
            ok, detail = False, f"cases of type {type(case).__name__} are not supported"
        outcomes.append((ok, f"{label}: {detail}"))
    passed = sum(ok for ok, _ in outcomes)
    rate = passed / len(outcomes)
    failures = [d for ok, d in outcomes if not ok]
    detail = f"{passed}/{len(outcomes)} cases passed (need {eval_set.min_pass_rate:.0%})"
    if failures:
        detail += "; failed: " + "; ".join(failures[:5])
    return _check("eval_set", rate >= eval_set.min_pass_rate, detail)


async def _smoke_embedder(backend: Any) -> list[Check]:
    result = await backend.embed(SMOKE_TEXTS)
    vectors = np.asarray(result.vectors)
    dim = backend.dimension
    shape_ok = vectors.shape == (len(SMOKE_TEXTS), dim)
    finite = bool(np.isfinite(vectors).all())
    norms = np.linalg.norm(vectors, axis=1) if finite else np.zeros(len(vectors))
    nonzero = bool(finite and (norms > 1e-6).all())
    return [
        _check("dimension", shape_ok, f"vectors {vectors.shape}, model dimension {dim}"),
        _check("finite", finite, "all values finite" if finite else "NaN or inf in the output"),
        _check("non_degenerate", nonzero, f"vector norms {np.round(norms, 4).tolist()}"),
    ]


async def _smoke_reranker(backend: Any) -> list[Check]:
    scored = await backend.rerank(SMOKE_TEXTS[0], SMOKE_TEXTS)
    scores = np.asarray(scored.scores, dtype=np.float64)
    count_ok = scores.shape == (len(SMOKE_TEXTS),)
    finite = bool(np.isfinite(scores).all())
    return [
        _check("scores", count_ok, f"{scores.size} scores for {len(SMOKE_TEXTS)} documents"),
        _check("finite", finite, "all scores finite" if finite else "NaN or inf in the scores"),
    ]


async def _reranker_case(case: RerankerCase, backend: Any) -> tuple[bool, str]:
    scores = [float(s) for s in (await backend.rerank(case.query, case.documents)).scores]
    top = max(range(len(scores)), key=scores.__getitem__)
    ok, details = True, [f"top document {top} scored {scores[top]:.4f}"]
    if case.expect_top is not None and top != case.expect_top:
        ok = False
        details.append(
            f"expected document {case.expect_top} (scored {scores[case.expect_top]:.4f})"
        )
    if case.min_top_score is not None and not scores[top] >= case.min_top_score:
        ok = False
        details.append(f"below the minimum {case.min_top_score}")
    return ok, ", ".join(details)


async def _embedder_case(case: EmbedderCase, backend: Any) -> tuple[bool, str]:
    texts = [case.text] + [t for t in (case.similar_to, case.dissimilar_to) if t is not None]
    vectors = np.asarray((await backend.embed(texts)).vectors, dtype=np.float64)
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    details, ok = [], True
    idx = 1
    if case.similar_to is not None and case.min_cosine is not None:
        cos = float(unit[0] @ unit[idx])
        ok &= cos >= case.min_cosine
        details.append(f"cosine to similar {cos:.4f} (min {case.min_cosine})")
        idx += 1
    if case.dissimilar_to is not None and case.max_cosine is not None:
        cos = float(unit[0] @ unit[idx])
        ok &= cos <= case.max_cosine
        details.append(f"cosine to dissimilar {cos:.4f} (max {case.max_cosine})")
    return bool(ok), ", ".join(details)


async def _greedy(backend: Any, prompt: str, max_tokens: int) -> tuple[str, list[float]]:
    """Greedy text for `prompt` and the log-probability of each generated token."""
    from backends.llm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
    text, logprobs = "", list[float]()
    async for out in backend.generate(backend.encode(prompt), params):
        text += out.text
        logprobs.extend(lp.logprob for lp in out.logprobs)
    return text, logprobs


async def _smoke_llm(backend: Any) -> list[Check]:
    text, logprobs = await _greedy(backend, SMOKE_PROMPT, SMOKE_TOKENS)
    finite = bool(logprobs) and all(np.isfinite(lp) for lp in logprobs)
    return [
        _check("generates", bool(logprobs), f"{len(logprobs)} tokens: {text[:60]!r}"),
        _check(
            "finite",
            finite,
            "log-probabilities finite" if finite else f"non-finite log-probabilities {logprobs}",
        ),
    ]


async def _llm_case(case: LLMCase, backend: Any) -> tuple[bool, str]:
    text, _ = await _greedy(backend, case.prompt, case.max_tokens)
    ok = (
        (case.expect_equals is None or text == case.expect_equals)
        and (case.expect_contains is None or case.expect_contains in text)
        and (case.expect_regex is None or re.search(case.expect_regex, text) is not None)
    )
    return ok, f"greedy output {text[:80]!r}"
