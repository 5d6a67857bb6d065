"""Structured outputs: grammars compiled by llguidance constrain sampling token by token.

`spec.StructuredOutput` is what a request asks for (pure Python, imported by the sampling
parameters); `compiler.GrammarCompiler` compiles and caches it per engine; a
`guide.TokenGuide` per sequence tracks the grammar's state; `guide.MaskFiller` turns a
step's guides into logit masks while the model runs.
"""

from backends.llm.structured.spec import StructuredOutput

__all__ = ["StructuredOutput"]
