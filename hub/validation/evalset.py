"""A version's own evaluation set: cases with expected outputs or thresholds, per kind.

Stored with the version (JSON) at registration and run by the validation gate after the
smoke test. Shapes:

    llm:      {"cases": [{"prompt": "...", "max_tokens": 8, "expect_contains": "..."}]}
    embedder: {"cases": [{"text": "a", "similar_to": "b", "min_cosine": 0.8}]}
    reranker: {"cases": [{"query": "q", "documents": ["d0", "d1"], "expect_top": 0}]}

plus an optional `min_pass_rate` (default 1.0: every case must pass).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hub.errors import BadRequest


class _Case(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str | None = None


class LLMCase(_Case):
    prompt: str = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1, le=512)] = 16
    expect_equals: str | None = None
    expect_contains: str | None = None
    expect_regex: str | None = None

    @model_validator(mode="after")
    def _has_expectation(self) -> LLMCase:
        if not (self.expect_equals or self.expect_contains or self.expect_regex):
            raise ValueError("an llm case needs expect_equals, expect_contains or expect_regex")
        return self


class EmbedderCase(_Case):
    text: str = Field(min_length=1)
    similar_to: str | None = None
    min_cosine: Annotated[float, Field(ge=-1, le=1)] | None = None
    dissimilar_to: str | None = None
    max_cosine: Annotated[float, Field(ge=-1, le=1)] | None = None

    @model_validator(mode="after")
    def _has_expectation(self) -> EmbedderCase:
        if (self.similar_to is None) != (self.min_cosine is None):
            raise ValueError("similar_to and min_cosine go together")
        if (self.dissimilar_to is None) != (self.max_cosine is None):
            raise ValueError("dissimilar_to and max_cosine go together")
        if self.similar_to is None and self.dissimilar_to is None:
            raise ValueError(
                "an embedder case needs similar_to/min_cosine or dissimilar_to/max_cosine"
            )
        return self


class RerankerCase(_Case):
    query: str = Field(min_length=1)
    documents: list[str] = Field(min_length=1)
    expect_top: int | None = Field(default=None, ge=0)
    min_top_score: float | None = None

    @model_validator(mode="after")
    def _has_expectation(self) -> RerankerCase:
        if self.expect_top is None and self.min_top_score is None:
            raise ValueError("a reranker case needs expect_top or min_top_score")
        if self.expect_top is not None and self.expect_top >= len(self.documents):
            raise ValueError(f"expect_top {self.expect_top} is not a document index")
        return self


_CASES: dict[str, type[_Case]] = {
    "llm": LLMCase,
    "embedder": EmbedderCase,
    "reranker": RerankerCase,
}


class EvalSet(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: str
    cases: list[Any]
    min_pass_rate: float = 1.0


def parse_eval_set(kind: str, data: dict[str, Any]) -> EvalSet:
    """Validate a stored or submitted eval set for `kind`; BadRequest names what is wrong."""
    if not isinstance(data, dict) or not isinstance(data.get("cases"), list) or not data["cases"]:
        raise BadRequest(
            "eval_set must be an object with a non-empty `cases` list", param="eval_set"
        )
    unknown = set(data) - {"cases", "min_pass_rate"}
    if unknown:
        raise BadRequest(f"eval_set: unknown keys {sorted(unknown)}", param="eval_set")
    rate = data.get("min_pass_rate", 1.0)
    if not isinstance(rate, int | float) or not 0 < rate <= 1:
        raise BadRequest("eval_set.min_pass_rate must be in (0, 1]", param="eval_set")
    case_cls = _CASES[kind]
    cases = []
    for i, raw in enumerate(data["cases"]):
        try:
            cases.append(case_cls.model_validate(raw))
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'case'}: {err['msg']}"
                for err in e.errors()
            )
            raise BadRequest(f"eval_set.cases[{i}]: {problems}", param="eval_set") from None
    return EvalSet(kind=kind, cases=cases, min_pass_rate=float(rate))
