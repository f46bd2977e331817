"""Tokenization: text <-> token ids, chat templates, and streaming detokenization."""

from specserve.tokenizer.detokenizer import IncrementalDetokenizer
from specserve.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer"]
