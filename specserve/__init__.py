"""specserve: an LLM inference and serving engine centred on lossless speculative decoding."""

from specserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["SamplingParams", "__version__"]
