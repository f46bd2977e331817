"""Tokenizer layer: GGUF and HF-folder loading checked against transformers, chat templates,
streaming detokenization, and user errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import gguf
import pytest
from tokenizers import pre_tokenizers

from specserve.errors import InvalidParameterError, ModelLoadError, PromptError
from specserve.tokenizer import IncrementalDetokenizer, Tokenizer
from specserve.tokenizer.gguf_vocab import PRE_TOKENIZERS, build_pre_tokenizer

TEXTS = [
    "Hello, world!",
    "café naïve façade Ångström",
    "日本語のテキストと中文",
    "emoji 😀🎉 and 👨‍👩‍👧 family",
    "tabs\tand  double  spaces\n\nnew paragraph   \n",
    "digits 1234567890 and 3.14159, -42",
    "  leading and trailing spaces  ",
    "I'M here, you'll see; it's 'quoted'",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>\n",
    "",
]

CHATS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, in 日本語 😀"},
    ],
]


@pytest.fixture(scope="module")
def reader(smollm_gguf_path) -> gguf.GGUFReader:
    from tests.conftest import gguf_reader

    return gguf_reader(smollm_gguf_path)


@pytest.fixture(scope="module")
def tok(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def hf_tok(smollm_gguf_path):
    """transformers' own tokenizer for the same GGUF: the reference."""
    from transformers import AutoTokenizer

    from tests.conftest import gguf_read_once

    with gguf_read_once():
        return AutoTokenizer.from_pretrained(smollm_gguf_path.parent, gguf_file=smollm_gguf_path.name)


@pytest.fixture(scope="module")
def hf_folder(hf_tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm_tokenizer")
    hf_tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder_tok(hf_folder) -> Tokenizer:
    return Tokenizer.from_hf_folder(hf_folder)


# ---- GGUF tokenizer ---------------------------------------------------------------------------


def test_gguf_metadata(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.pad_token_id, tok.add_bos) == (1, 2, False)
    assert tok.eos_token_ids == frozenset({2})
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.id_to_token(10**6) is None
    assert "<|im_start|>" in tok.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip_and_matches_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_never_split(tok):
    assert tok.encode("<|im_end|><|endoftext|><file_sep>") == [2, 0, 5]
    assert tok.decode([1, 4093, 2]) == "user"


def test_smollm_split_equals_its_tokenizer_json_form():
    # SmolLM2's tokenizer.json: Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
    reference = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ours = build_pre_tokenizer(PRE_TOKENIZERS["smollm"])
    for text in TEXTS:
        assert ours.pre_tokenize_str(text) == reference.pre_tokenize_str(text)


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt-2", ["I", "'", "M", "Ġ12345", "Ġok"]),
        ("smollm", ["I", "'", "M", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),
        ("llama3", ["I", "'M", "Ġ", "123", "45", "Ġok"]),
        ("qwen2", ["I", "'M", "Ġ", "1", "2", "3", "4", "5", "Ġok"]),
    ],
)
def test_pre_tokenizer_families(pre, pieces):
    split = build_pre_tokenizer(PRE_TOKENIZERS[pre]).pre_tokenize_str("I'M 12345 ok")
    assert [piece for piece, _ in split] == pieces


# ---- chat templates ----------------------------------------------------------------------------


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_transformers(tok, hf_tok, messages):
    expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert tok.encode_chat(messages) == hf_tok.encode(expected, add_special_tokens=False)
    without = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == without


def test_template_helpers_and_fallback(tok):
    custom = "{{ bos_token }}|{{ eos_token }}|{{ strftime_now('%Y') | length }}|{{ messages | tojson }}"
    rendered = dataclasses.replace(tok, chat_template=custom).apply_chat_template([{"role": "user", "content": "<&>"}])
    assert rendered == '<|im_start|>|<|im_end|>|4|[{"role": "user", "content": "<&>"}]'

    chatml = dataclasses.replace(tok, chat_template=None)
    assert chatml.apply_chat_template(CHATS[1]) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


# ---- HF folder tokenizer -----------------------------------------------------------------------


def test_hf_folder_matches_gguf_and_transformers(folder_tok, tok, hf_tok):
    assert (folder_tok.vocab_size, folder_tok.bos_token_id, folder_tok.pad_token_id) == (49152, 1, 2)
    assert folder_tok.eos_token_ids == tok.eos_token_ids
    assert folder_tok.add_bos is False
    for text in TEXTS:
        assert folder_tok.encode(text) == tok.encode(text) == hf_tok.encode(text)
    for messages in CHATS:
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert folder_tok.apply_chat_template(messages) == expected
        assert folder_tok.encode_chat(messages) == tok.encode_chat(messages)


def test_hf_folder_config_variants(hf_folder, tmp_path):
    """Template inside tokenizer_config.json, generation_config EOS lists, and no double BOS."""
    shutil.copy(hf_folder / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((hf_folder / "tokenizer_config.json").read_text())
    config |= {
        "add_bos_token": True,
        "bos_token": {"content": "<|endoftext|>", "special": True},
        "chat_template": "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    folder_tok = Tokenizer.from_hf_folder(tmp_path)
    assert folder_tok.eos_token_ids == frozenset({0, 2})
    assert folder_tok.encode("hi") == [0, 6004]
    assert folder_tok.encode("hi", add_special_tokens=False) == [6004]
    assert folder_tok.encode_chat([{"role": "user", "content": "hi"}]) == [0, 6004]


# ---- incremental detokenization ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_detokenizer_streams_complete_text(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, tok.encode_chat(CHATS[0]))
    pieces = [detok.step([i]) for i in ids]
    assert not any("\ufffd" in piece for piece in pieces)
    pieces.append(detok.flush())
    assert "".join(pieces) == detok.text == tok.decode(ids)


def test_detokenizer_splits_characters_across_tokens(tok):
    # The emoji is two byte-level tokens: nothing may be shown until its last byte arrives.
    ids = tok.encode("a 😀 b")
    assert len(ids) > len("a 😀 b".split()) and tok.decode(ids[:2]).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok)
    assert detok.step(ids[:1]) == "a"
    assert detok.step(ids[1:2]) == ""
    assert detok.step(ids[2:]) == " 😀 b"
    assert detok.flush() == ""


def test_detokenizer_flush_shows_incomplete_tail(tok):
    ids = tok.encode("ok 😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.step([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(ids)
    assert detok.text.endswith("\ufffd")


def test_detokenizer_with_space_stripping_decoder(tmp_path):
    """SentencePiece-style decoders drop the first token's leading space; the stream must too."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    backend = HFTokenizer(models.WordLevel({"\u2581Hello": 0, "\u2581world": 1, "!": 2, "</s>": 3}, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    spm = Tokenizer.from_hf_folder(tmp_path)
    generated = [0, 1, 2]
    detok = IncrementalDetokenizer(spm, spm.encode("Hello world"))
    assert [detok.step([i]) for i in generated] == ["Hello", " world", "!"]
    assert detok.text == spm.decode(generated) == "Hello world!"


def test_detokenizer_skips_special_tokens(tok):
    ids = tok.encode("Hello<|im_end|> world")
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.step([i]) for i in ids) + detok.flush() == "Hello world"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert "".join(keep.step([i]) for i in ids) + keep.flush() == "Hello<|im_end|> world"


# ---- errors -------------------------------------------------------------------------------------


def test_missing_or_corrupt_tokenizer_json(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="not a valid tokenizer"):
        Tokenizer.from_hf_folder(tmp_path)


def _write_gguf(path, model: str, pre: str = "default") -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(["a", "b"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def _spm_reference(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SentencePiece BPE, written plainly: spaces as U+2581, then merge the adjacent
    pair whose concatenation is the highest-scoring token (leftmost among equals) until none is;
    a symbol without a token becomes its UTF-8 bytes' <0xNN> tokens."""
    symbols = list(text.replace(" ", "\u2581"))
    while True:
        pairs = [(scores[vocab[a + b]], -i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])) if a + b in vocab]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return [i for s in symbols for i in ([vocab[s]] if s in vocab else [vocab[f"<0x{b:02X}>"] for b in s.encode()])]


def test_sentencepiece_gguf_tokenizer_merges_by_score_with_byte_fallback(tmp_path):
    """Exact against the reference on random text: merges chosen by score, not by order of
    appearance; characters outside the vocabulary (é) as bytes; a control token matched whole."""
    import random

    pieces = ["\u2581", "a", "b", "c", "ab", "bc", "ca", "\u2581a", "abc", "bca", "\u2581ab", "cab", "aa"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *pieces, "<ctl>"]
    rng = random.Random(0)
    scores = [0.0] * 259 + [rng.uniform(-10, 0) for _ in pieces] + [0.0]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [3]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(False)
    writer.add_bos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    tok = Tokenizer.from_gguf(gguf.GGUFReader(tmp_path / "spm.gguf"))
    vocab = {t: i for i, t in enumerate(tokens)}
    for _ in range(300):
        text = "".join(rng.choice("abc é") for _ in range(rng.randrange(1, 12)))
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == _spm_reference(text, vocab, scores), text
        assert tok.decode(ids) == text
    assert tok.encode("ab<ctl>ca", add_special_tokens=False) == [vocab["ab"], len(tokens) - 1, vocab["ca"]]


def test_unsupported_gguf_tokenizers(tmp_path):
    with pytest.raises(ModelLoadError, match="'t5'.*supports 'gpt2', 'llama'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "unigram.gguf", "t5"))
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.pre='mystery'"):
        Tokenizer.from_gguf(_write_gguf(tmp_path / "pre.gguf", "gpt2", pre="mystery"))


@pytest.mark.parametrize(
    "messages, error, match",
    [
        ([], PromptError, "messages is empty"),
        ([{"role": "wizard", "content": "hi"}], InvalidParameterError, r"messages\[0\]\.role.*system, user"),
        ([{"role": "user"}], InvalidParameterError, r"messages\[0\].*'role' and 'content'"),
        ([{"content": "hi"}], InvalidParameterError, r"messages\[0\].*'role' and 'content'"),
        ([{"role": "user", "content": 3}], InvalidParameterError, r"messages\[0\]\.content"),
        ("hi", InvalidParameterError, "list of"),
    ],
)
def test_bad_messages(tok, messages, error, match):
    with pytest.raises(error, match=match):
        tok.encode_chat(messages)


def test_template_exception_becomes_prompt_error(tok):
    strict = dataclasses.replace(tok, chat_template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(PromptError, match="roles must alternate"):
        strict.apply_chat_template(CHATS[0])
    with pytest.raises(ModelLoadError, match="not valid Jinja"):
        dataclasses.replace(tok, chat_template="{% for %}")
