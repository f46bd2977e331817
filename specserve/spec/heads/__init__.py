"""Trained drafters: Medusa heads and the EAGLE feature-level draft layer, their config and files."""

from specserve.spec.heads.config import DRAFTER_METHODS, DrafterConfig, TargetIdentity
from specserve.spec.heads.drafter import Drafter, bind, load_drafter, new_drafter, new_heads, save_drafter
from specserve.spec.heads.modules import DraftVocab, EagleHead, MedusaHeads

__all__ = [
    "DRAFTER_METHODS",
    "DraftVocab",
    "Drafter",
    "DrafterConfig",
    "EagleHead",
    "MedusaHeads",
    "TargetIdentity",
    "bind",
    "load_drafter",
    "new_drafter",
    "new_heads",
    "save_drafter",
]
