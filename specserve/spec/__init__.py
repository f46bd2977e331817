"""Proposers behind one interface (`propose(batch) -> DraftProposal | DraftTreeProposal`, `observe(feedback)`)."""

from specserve.spec.ngram import NgramIndex, NgramProposer
from specserve.drafts import DraftProposal, DraftTree, DraftTreeProposal, SpecRequest, VerifyFeedback
from specserve.spec.proposer import Proposer

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
