"""Incremental detokenization: turn a growing list of token ids into a stream of text.

Decoding token by token is wrong twice over: byte-level BPE can split one UTF-8 character (an emoji,
a CJK ideograph) across tokens, and decoders that join or strip spaces (WordPiece, SentencePiece's
Metaspace) need to see neighbouring tokens. So, as vLLM does, each step decodes a short window
twice: from `prefix_offset` to `read_offset` (text already emitted) and from `prefix_offset` to the
end; the difference is the new text. The window always starts where the text was complete, and new
text is held back while it ends in U+FFFD, i.e. while a character is still incomplete.
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.tokenizer.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids: returns only new, complete text each call.

    The concatenation of every `step()` result and `flush()` equals
    `tokenizer.decode(generated_ids)`, for every decoder, so streamed and non-streamed responses
    agree. That is why the window starts at the first generated token: vLLM also decodes a few
    prompt tokens as context, which for SentencePiece keeps a leading space that decode() drops.
    `prompt_ids` is accepted so that callers hand over the whole request; the prompt is complete
    text, so no character of the output can start inside it.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""  # all text emitted so far
        self._ids: list[int] = []  # generated ids only
        self._prefix_offset = 0  # window start: text before this point is settled
        self._read_offset = 0  # text up to here has been emitted

    def step(self, new_ids: Sequence[int]) -> str:
        """Append `new_ids`; return the text they complete (possibly "")."""
        self._ids.extend(new_ids)
        prefix_text, full_text = self._decode_window()
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            # Nothing visible yet (e.g. a skipped special token), or a character is still incomplete.
            return ""
        return self._emit(full_text[len(prefix_text) :])

    def flush(self) -> str:
        """At the end of generation: whatever was held back, incomplete characters shown as U+FFFD."""
        prefix_text, full_text = self._decode_window()
        return self._emit(full_text[len(prefix_text) :])

    def _decode_window(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        emitted = self._read_offset - self._prefix_offset
        decode = self.tokenizer.decode
        return (
            decode(window[:emitted], self.skip_special_tokens),
            decode(window, self.skip_special_tokens),
        )

    def _emit(self, new_text: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += new_text
        return new_text
