"""The validation gate a version passes before an alias moves to it."""

from hub.validation.evalset import EvalSet, parse_eval_set
from hub.validation.gate import Check, GateResult, ValidationGate

__all__ = ["Check", "EvalSet", "GateResult", "ValidationGate", "parse_eval_set"]
