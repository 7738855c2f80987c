"""Structured outputs: the output's text held to a JSON schema, a regex, a choice or a grammar.

llguidance compiles each constraint (once per constraint, on a small thread pool, off the engine
step) into a matcher; every constrained sample has its own, which yields the bitmask of the tokens
allowed next and advances on each token the sample emits.

Constraints are untrusted input to a native compiler: the server checks each one first in a worker
process (sandbox.py, worker.py), against the bounds in grammar.py, so that one that would crash,
stall or never end is a 400 for its own request and costs no one else anything.
"""

from llmpipe.structured_output.manager import StructuredOutputManager
from llmpipe.structured_output.sandbox import check_structured_outputs

__all__ = ["StructuredOutputManager", "check_structured_outputs"]
