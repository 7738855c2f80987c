"""Speculative decoding: proposers guess the next k tokens cheaply; the target model verifies them
all in one forward pass, and rejection sampling keeps exactly the target's distribution."""

from llmpipe.spec.proposal import Proposal, Proposer
from llmpipe.spec.rejection import verify

__all__ = ["Proposal", "Proposer", "verify"]
