"""Logits processing, sampling and speculative verification (the rejection sampler)."""

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.reference import reference_verify
from specserve.sample.sampler import draw_noise, make_generator, race, sample
from specserve.sample.verifier import VerifyOutput, verify

__all__ = [
    "SamplingTensors",
    "VerifyOutput",
    "draw_noise",
    "make_generator",
    "processed_probs",
    "race",
    "reference_verify",
    "sample",
    "verify",
]
