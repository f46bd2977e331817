"""Draft trees and the proposal types shared by spec/ (proposers) and sample/ (verifiers)."""

from specserve.drafts.proposal import DraftProposal, DraftTreeProposal, SpecRequest, VerifyFeedback
from specserve.drafts.tree import DraftTree

__all__ = ["DraftProposal", "DraftTree", "DraftTreeProposal", "SpecRequest", "VerifyFeedback"]
