"""Structured outputs: the output's text held to a JSON schema, a regex, a choice or a grammar.

llguidance compiles each constraint (once per constraint, on a small thread pool, off the engine
step) into a matcher; every constrained sample has its own, which yields the bitmask of the tokens
allowed next and advances on each token the sample emits.
"""

from llmpipe.structured_output.grammar import check_structured_outputs
from llmpipe.structured_output.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "check_structured_outputs"]
