"""The model's tokenizer: text <-> token ids, special token ids, and chat prompts.

One class over a HF `tokenizers.Tokenizer`, loaded either from a HF folder (tokenizer.json) or from
a GGUF file's metadata. BOS handling is done here rather than by the backend's post-processor,
so that both sources follow one rule: BOS is prepended exactly when `add_bos and add_special_tokens`.

Chat prompts can keep message content from forging turns (`plain_content`): a message holding the
text of a control token such as `<|im_end|>` would otherwise be encoded as that control token, as
`transformers` and vLLM do, letting a user close their turn and open a system one.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
from tokenizers import Tokenizer as HFTokenizer

from specserve.errors import ModelLoadError, PromptError
from specserve.tokenizer.chat import CHATML_TEMPLATE, ChatTemplate, validate_messages
from specserve.tokenizer.gguf_vocab import read_gguf_tokenizer
from specserve.tokenizer.tool_prompt import prompt_messages

# The special-token names transformers hands to chat templates as variables.
_TEMPLATE_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")

# Renders a chat template: ChatTemplate.render in this process, or the server's worker process
# (render_worker.RenderWorker.render), which adds a time limit.
# Called as renderer(template, messages, add_generation_prompt, tools).
Renderer = Callable[[ChatTemplate, list[dict], bool, list[dict] | None], str]


@dataclass(frozen=True)
class Tokenizer:
    backend: HFTokenizer = field(repr=False)
    vocab_size: int  # every token id, added/special tokens included
    bos_token_id: int | None
    eos_token_ids: frozenset[int]  # every token that ends generation
    pad_token_id: int | None
    chat_template: str | None  # the model's own template; None means the ChatML fallback is used
    add_bos: bool  # whether encode(..., add_special_tokens=True) prepends BOS
    # bos_token/eos_token/unk_token/pad_token text, passed to the chat template as variables
    special_tokens: Mapping[str, str] = field(default_factory=dict, repr=False)
    _chat: ChatTemplate = field(init=False, repr=False, compare=False)
    # The text of every special (control) token.
    _control_texts: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Compiled once at load, so a broken template is a load error rather than a per-request one.
        object.__setattr__(self, "_chat", ChatTemplate(self.chat_template or CHATML_TEMPLATE, self.special_tokens))
        added = self.backend.get_added_tokens_decoder().values()
        object.__setattr__(self, "_control_texts", tuple(t.content for t in added if t.special))

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        """A copy of the backend that encodes control-token text as plain text: a copy, since the
        flag is the backend's state and encodes run in threads. Built when a message first holds
        such text (a copy of a 262k-token vocabulary takes ~2 s); two threads racing to build it
        build equal copies, and one is kept."""
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, with tokenizer_config.json and generation_config.json when present.

        The chat template comes from chat_template.jinja (newer transformers) or from
        tokenizer_config.json. EOS ids are the config's eos_token plus every eos_token_id in
        generation_config.json, which is where chat models list their end-of-turn tokens.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {folder}: specserve needs a HF fast tokenizer file")
        try:
            backend = HFTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # the Rust library raises bare Exceptions for every parse error
            raise ModelLoadError(f"{tokenizer_file} is not a valid tokenizer file: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")

        texts = {name: _token_text(config.get(name)) for name in _TEMPLATE_TOKEN_NAMES}
        ids = {name: None if text is None else backend.token_to_id(text) for name, text in texts.items()}
        for name in ("bos_token", "eos_token"):
            if texts[name] is not None and ids[name] is None:
                raise ModelLoadError(
                    f"tokenizer_config.json names {name} {texts[name]!r}, which is not in the vocabulary"
                )

        eos_ids = {ids["eos_token"]} | set(_as_list(generation.get("eos_token_id")))
        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No flag: the tokenizer.json post-processor is the source of truth (Llama 3 adds BOS there).
            add_bos = ids["bos_token"] is not None and backend.encode("a").ids[:1] == [ids["bos_token"]]
        return cls(
            backend=backend,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            bos_token_id=ids["bos_token"],
            eos_token_ids=frozenset(eos_ids - {None}),
            pad_token_id=ids["pad_token"],
            chat_template=_hf_chat_template(folder, config),
            add_bos=add_bos,
            special_tokens={name: text for name, text in texts.items() if text is not None and ids[name] is not None},
        )

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader) -> Tokenizer:
        """Build the tokenizer a GGUF file describes (byte-level BPE only; see gguf_vocab)."""
        spec = read_gguf_tokenizer(reader)
        ids = {
            "bos_token": spec.bos_token_id,
            "eos_token": spec.eos_token_id,
            "unk_token": spec.unk_token_id,
            "pad_token": spec.pad_token_id,
        }
        return cls(
            backend=spec.backend,
            vocab_size=spec.vocab_size,
            bos_token_id=spec.bos_token_id,
            eos_token_ids=spec.eos_token_ids,
            pad_token_id=spec.pad_token_id,
            chat_template=spec.chat_template,
            add_bos=spec.add_bos,
            special_tokens={name: spec.backend.id_to_token(i) for name, i in ids.items() if i is not None},
        )

    # ---- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it releases the GIL (the server encodes in a thread while its
        # event loop serves others; a 2 MB prompt takes ~1 s) and gives the same ids.
        ids = self.backend.encode_batch([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    # ---- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            renderer: Renderer = ChatTemplate.render, tools: list[dict] | None = None) -> str:
        """Render OpenAI-style messages with the model's template (ChatML if it has none); `tools`
        as tool_prompt.prompt_messages offers them."""
        messages, tools = prompt_messages(validate_messages(messages), tools, self._chat.source)
        return renderer(self._chat, messages, add_generation_prompt, tools)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, *, plain_content: bool = False,
                    renderer: Renderer = ChatTemplate.render, tools: list[dict] | None = None) -> list[int]:
        return self.chat_prompt(messages, add_generation_prompt, plain_content=plain_content, renderer=renderer,
                                tools=tools)[1]

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True, *, plain_content: bool = False,
                    renderer: Renderer = ChatTemplate.render,
                    tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The rendered chat prompt and its token ids.

        plain_content: control-token text inside message content is encoded as plain text, so
        only the template's own markers become control tokens (off: as transformers does).
        tools: offered to the model as tool_prompt.prompt_messages says; with plain_content, a
        template that takes them as its variable may not be given control-token text in them or
        in past calls (where it lands in the prompt is unknown), while the Hermes format puts
        them into message content, which is encoded as plain text.
        """
        messages, tools = prompt_messages(validate_messages(messages), tools, self._chat.source)
        if plain_content:
            self._refuse_control_text_in_tools(messages, tools)
        text = renderer(self._chat, messages, add_generation_prompt, tools)
        # Templates such as Llama 3's write the BOS text themselves; adding BOS again would double it.
        bos = self.special_tokens.get("bos_token")
        add_bos = not (bos and text.startswith(bos))
        forging = [i for i, m in enumerate(messages) if plain_content and self._has_control_text(m["content"])]
        if not forging:
            return text, self.encode(text, add_special_tokens=add_bos)
        pieces = self._content_pieces(messages, forging, text, renderer, add_generation_prompt, tools)
        ids = [self.bos_token_id] if add_bos and self.add_bos and self.bos_token_id is not None else []
        for k, piece in enumerate(pieces):  # even: the template's text; odd: a message's content
            backend = self._plain_backend if k % 2 else self.backend
            if piece:
                ids += backend.encode_batch([piece], add_special_tokens=False)[0].ids
        return text, ids

    def _has_control_text(self, content: str | None) -> bool:
        return bool(content) and any(t in content for t in self._control_texts)

    def _refuse_control_text_in_tools(self, messages: list[dict], tools: list[dict] | None) -> None:
        if tools and self._has_control_text(json.dumps(tools, ensure_ascii=False)):
            raise PromptError("tools hold control-token text (such as the model's end-of-turn marker); remove it")
        for i, m in enumerate(messages):
            if m.get("tool_calls") and self._has_control_text(json.dumps(m["tool_calls"], ensure_ascii=False)):
                raise PromptError(f"messages[{i}].tool_calls hold control-token text (such as the model's "
                                  "end-of-turn marker); remove it")

    def _content_pieces(self, messages: list[dict], forging: list[int], text: str, renderer: Renderer,
                        add_generation_prompt: bool, tools: list[dict] | None) -> list[str]:
        """`text` cut into template text and the content of the messages in `forging`, alternately.

        The template renders again with those contents between markers it cannot produce (a
        random nonce in private-use characters). Whitespace at a content's ends stays outside the
        markers, so a template that trims content renders the same text. A template that changes
        content in other ways (slices it, upper-cases it) renders something else: then the
        content's place is unknown and the request is refused rather than encoded unsafely.
        Cutting the text changes only where a piece ends: the ids decode to the same text.
        """
        nonce = secrets.token_hex(8)
        opening, closing = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"
        marked = [dict(m) for m in messages]
        for i in forging:
            content = messages[i]["content"]
            core = content.strip()
            start = len(content) - len(content.lstrip())
            marked[i]["content"] = content[:start] + opening + core + closing + content[start + len(core):]
        marked_text = renderer(self._chat, marked, add_generation_prompt, tools)
        pieces = re.split(f"{re.escape(opening)}(.*?){re.escape(closing)}", marked_text, flags=re.DOTALL)
        if "".join(pieces) != text:
            raise PromptError(f"messages[{forging[0]}].content holds control-token text, and the model's chat "
                              "template changes message content, so it cannot be encoded as plain text; "
                              "remove the control-token text")
        return pieces


def _read_json(path: Path) -> dict:
    """An optional JSON file: {} when absent, ModelLoadError when present but unreadable."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} could not be read: {e}") from e
    except RecursionError:  # a crafted file of a million brackets
        raise ModelLoadError(f"{path} nests too deeply to be a tokenizer's JSON file") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object, found {type(data).__name__}")
    return data


def _token_text(value: object) -> str | None:
    # Older tokenizer_config.json files store special tokens as serialised AddedToken dicts.
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_list(value: object) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _hf_chat_template(folder: Path, config: dict) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    # Some repos ship several named templates (e.g. "default", "tool_use"); chat uses "default".
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    return template if isinstance(template, str) else None
