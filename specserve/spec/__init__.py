"""Proposers behind one interface (`propose(batch) -> DraftProposal`, `observe(feedback)`)."""

from specserve.spec.ngram import NgramIndex, NgramProposer
from specserve.spec.proposer import DraftProposal, Proposer, SpecRequest, VerifyFeedback

__all__ = [
    "DraftProposal",
    "NgramIndex",
    "NgramProposer",
    "Proposer",
    "SpecRequest",
    "VerifyFeedback",
]
