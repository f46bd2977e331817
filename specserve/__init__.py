"""specserve: an LLM inference and serving engine centred on lossless speculative decoding."""

from specserve.errors import SpecserveError
from specserve.llm import LLM
from specserve.outputs import CompletionOutput, RequestOutput, SpecStats
from specserve.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "SpecStats", "SpecserveError", "__version__"]
