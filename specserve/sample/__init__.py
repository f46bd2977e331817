"""Logits processing, sampling and speculative verification."""

from specserve.sample.logits import SamplingTensors, argmax_rows, processed_probs
from specserve.sample.noise import PositionNoise, draw_exponentials
from specserve.sample.reference import reference_verify
from specserve.sample.sampler import race, race_rows, sample
from specserve.sample.tree_reference import reference_tree_verify
from specserve.sample.tree_verifier import FlatVerifyOutput, TreeVerifyOutput, tree_verify, verify_flat
from specserve.sample.verifier import VerifyOutput, verify

__all__ = [
    "FlatVerifyOutput",
    "PositionNoise",
    "SamplingTensors",
    "TreeVerifyOutput",
    "VerifyOutput",
    "argmax_rows",
    "draw_exponentials",
    "processed_probs",
    "race",
    "race_rows",
    "reference_tree_verify",
    "reference_verify",
    "sample",
    "tree_verify",
    "verify",
    "verify_flat",
]
