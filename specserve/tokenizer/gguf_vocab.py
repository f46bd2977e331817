"""Build a HF `tokenizers.Tokenizer` from the tokenizer a GGUF file describes in its metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary, merges, token types and special ids
under llama.cpp's `tokenizer.ggml.*` keys, and names the pre-tokenizer only by a string
(`tokenizer.ggml.pre`). llama.cpp is the reference for what those keys mean, so the pre-tokenizer
regexes below are llama.cpp's (src/llama-vocab.cpp), written in the form the models' own
tokenizer.json files use.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from specserve.errors import ModelLoadError

# "gpt2": byte-level BPE with merges (SmolLM, Llama 3, Qwen2); "llama": SentencePiece's BPE
# with scores and byte fallback (Llama 2, Gemma).
SUPPORTED_MODELS = ("gpt2", "llama")

# GPT-2's split; HF's ByteLevel(use_regex=True) applies the same one.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is Llama 3's split with single digits instead of runs of up to three.
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizerSpec:
    # Regexes applied in turn, each splitting every piece further (matches and gaps both kept),
    # which is how llama.cpp's unicode_regex_split and HF's Split(behavior="isolated") both work.
    splits: tuple[str, ...]
    # Llama 3 vocabularies look a whole piece up before merging (HF BPE `ignore_merges`).
    ignore_merges: bool = False
    # llama.cpp's BOS default for this family, when the file has no tokenizer.ggml.add_bos_token.
    add_bos_default: bool = False


_GPT2_SPEC = PreTokenizerSpec((_GPT2,))
_LLAMA3_SPEC = PreTokenizerSpec((_LLAMA3,), ignore_merges=True, add_bos_default=True)
_QWEN2_SPEC = PreTokenizerSpec((_QWEN2,))
# StarCoder-style: every digit on its own, then GPT-2's split. SmolLM2's tokenizer.json spells
# this Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]; the pieces are the same.
_DIGITS_SPEC = PreTokenizerSpec((r"\p{N}", _GPT2))

PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {
    # llama.cpp falls back to an ad-hoc punctuation-first split for "default", a value written only by
    # converters that did not recognise the tokenizer; GPT-2's split is what such byte-level
    # vocabularies were almost always trained with, and is what HF's ByteLevel does.
    "default": _GPT2_SPEC,
    "gpt-2": _GPT2_SPEC,
    "mpt": _GPT2_SPEC,
    "olmo": _GPT2_SPEC,
    "llama-bpe": _LLAMA3_SPEC,
    "llama3": _LLAMA3_SPEC,
    "llama-v3": _LLAMA3_SPEC,
    "qwen2": _QWEN2_SPEC,
    "deepseek-r1-qwen": _QWEN2_SPEC,
    "stablelm2": _QWEN2_SPEC,
    "smollm": _DIGITS_SPEC,
    "starcoder": _DIGITS_SPEC,
    "refact": _DIGITS_SPEC,
    "codeshell": _DIGITS_SPEC,
}


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """Everything `Tokenizer` needs, read out of a GGUF file's metadata."""

    backend: HFTokenizer
    vocab_size: int  # number of token ids in the file, special tokens included
    bos_token_id: int | None
    eos_token_id: int | None  # the file's EOS, the chat template's `eos_token`
    eos_token_ids: frozenset[int]  # eos plus llama.cpp's end-of-turn / end-of-message ids
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos: bool
    chat_template: str | None


def _value(reader: gguf.GGUFReader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _required(reader: gguf.GGUFReader, key: str):
    value = _value(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF tokenizer is incomplete: metadata key {key!r} is missing")
    return value


def build_pre_tokenizer(pre: PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
    """The regex splits, then the mapping of each piece's bytes into the byte alphabet."""
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _sentencepiece_bpe(tokens: list[str], scores: list[float], token_types: list[int], space_prefix: bool) -> HFTokenizer:
    """llama.cpp's SPM tokenizer: spaces become U+2581, then adjacent symbols merge again and
    again, the pair whose concatenation is the highest-scoring token first (the leftmost among
    equals); a character without a token becomes its UTF-8 bytes' <0xNN> tokens. That is HF's
    BPE with merges ranked by the merged token's score, and byte fallback."""
    normal = gguf.TokenType.NORMAL
    vocab = {token: i for i, token in enumerate(tokens)}
    pieces = {token for token, kind in zip(tokens, token_types) if kind == normal}
    ranked = []  # (score, merged id, left, right): every split of a normal token into two normal tokens
    for i, (token, kind) in enumerate(zip(tokens, token_types)):
        if kind != normal or len(token) < 2:
            continue
        ranked += [(-scores[i], i, token[:k], token[k:]) for k in range(1, len(token))
                   if token[:k] in pieces and token[k:] in pieces]
    ranked.sort()
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, _, a, b in ranked], byte_fallback=True,
                                     unk_token=None, fuse_unk=True))
    steps = [normalizers.Replace(" ", "\u2581")]
    backend.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if space_prefix else []) + steps)
    parts = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(parts + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    _add_matched_whole(backend, tokens, token_types)
    return backend


def _add_matched_whole(backend: HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    # Control tokens (<|im_end|>) and user-defined ones (<think>) must be matched whole in text, as
    # llama.cpp does, or BPE would cut them up. Only control tokens are special, i.e. dropped by
    # decode(skip_special_tokens=True); user-defined ones are real text the model writes.
    kinds = {gguf.TokenType.CONTROL: True, gguf.TokenType.USER_DEFINED: False}
    added = [
        AddedToken(token, special=kinds[kind], normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind in kinds
    ]
    backend.add_special_tokens([t for t in added if t.special])
    backend.add_tokens([t for t in added if not t.special])


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int], pre: PreTokenizerSpec) -> HFTokenizer:
    # Byte-level vocabularies are stored already spelled in GPT-2's byte alphabet, so they are used
    # verbatim; merges are "left right" pairs in that alphabet, which has no plain space.
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges))
    backend.pre_tokenizer = build_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_matched_whole(backend, tokens, token_types)
    return backend


def read_gguf_tokenizer(reader: gguf.GGUFReader) -> GGUFTokenizerSpec:
    model = _value(reader, "tokenizer.ggml.model")
    if model not in SUPPORTED_MODELS:
        found = "no tokenizer.ggml.model key" if model is None else f"tokenizer model {model!r}"
        raise ModelLoadError(
            f"GGUF file has {found}; specserve supports {', '.join(map(repr, SUPPORTED_MODELS))} "
            "(byte-level BPE, as in SmolLM, Llama 3, Qwen2; SentencePiece BPE, as in Llama 2, Gemma)"
        )
    # Files from before llama.cpp recorded the pre-tokenizer have no key; llama.cpp treats them as "default".
    pre_name = _value(reader, "tokenizer.ggml.pre") or "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.pre={pre_name!r} is not supported; supported: {', '.join(sorted(PRE_TOKENIZERS))}"
        )
    tokens = _required(reader, "tokenizer.ggml.tokens")
    token_types = _value(reader, "tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
    if len(token_types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer has {len(tokens)} tokens but {len(token_types)} token types")
    if model == "llama":
        scores = _required(reader, "tokenizer.ggml.scores")
        if len(scores) != len(tokens):
            raise ModelLoadError(f"GGUF tokenizer has {len(tokens)} tokens but {len(scores)} scores")
        # llama.cpp's default for SentencePiece vocabularies is a leading space; Gemma's files say none.
        prefix = _value(reader, "tokenizer.ggml.add_space_prefix")
        backend = _sentencepiece_bpe(tokens, scores, token_types, True if prefix is None else bool(prefix))
    else:
        backend = _byte_level_bpe(tokens, _required(reader, "tokenizer.ggml.merges"), token_types, pre)

    def token_id(key: str) -> int | None:
        value = _value(reader, f"tokenizer.ggml.{key}")
        if value is not None and not 0 <= value < len(tokens):
            raise ModelLoadError(f"GGUF tokenizer.ggml.{key}={value} is outside the vocabulary of {len(tokens)}")
        return value

    eos_ids = {token_id(key) for key in ("eos_token_id", "eot_token_id", "eom_token_id")} - {None}
    add_bos = _value(reader, "tokenizer.ggml.add_bos_token")
    return GGUFTokenizerSpec(
        backend=backend,
        vocab_size=len(tokens),
        bos_token_id=token_id("bos_token_id"),
        eos_token_id=token_id("eos_token_id"),
        eos_token_ids=frozenset(eos_ids),
        unk_token_id=token_id("unknown_token_id"),
        pad_token_id=token_id("padding_token_id"),
        add_bos=pre.add_bos_default if add_bos is None else bool(add_bos),
        chat_template=_value(reader, "tokenizer.chat_template"),
    )
