"""Proposers behind one interface (`propose(batch) -> DraftProposal | DraftTreeProposal`, `observe(feedback)`)."""

from specserve.spec.ngram import NgramIndex, NgramProposer
from specserve.spec.proposer import DraftProposal, DraftTreeProposal, Proposer, SpecRequest, VerifyFeedback
from specserve.spec.tree import DraftTree

__all__ = [
    "DraftProposal",
    "DraftTree",
    "DraftTreeProposal",
    "NgramIndex",
    "NgramProposer",
    "Proposer",
    "SpecRequest",
    "VerifyFeedback",
]
