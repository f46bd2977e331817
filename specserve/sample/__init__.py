"""Logits processing, sampling and speculative verification (the rejection sampler)."""

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.reference import reference_verify
from specserve.sample.sampler import draw_noise, make_generator, race, sample
from specserve.sample.tree_reference import reference_tree_verify
from specserve.sample.tree_verifier import TreeVerifyOutput, tree_verify, verify_flat
from specserve.sample.verifier import VerifyOutput, verify

__all__ = [
    "SamplingTensors",
    "TreeVerifyOutput",
    "VerifyOutput",
    "draw_noise",
    "make_generator",
    "processed_probs",
    "race",
    "reference_tree_verify",
    "reference_verify",
    "sample",
    "tree_verify",
    "verify",
    "verify_flat",
]
