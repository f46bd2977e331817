"""A corpus of crafted model files: small GGUFs and Hugging Face folders, each wrong in one way
a hostile or broken file can be (huge counts, wrong types, NaN, impossible or missing tensors,
truncated data, JSON that is not an object or nests too deeply), plus valid controls.

Every file is a few kilobytes: a huge dimension is only claimed by the metadata, never backed
by data. `write_corpus(folder)` writes them all and returns the cases; test_crafted_models.py
loads each through `load_model` and checks the error each gets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.quants import quantize

from tests.helpers import write_wordlevel_tokenizer

# The valid model: vocab 32, hidden 64, 4 heads of 16 over 2 KV heads, MLP 128, 2 layers (the
# smallest shape the native kernels run: see loader._check_native_shape).
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, CONTEXT = 32, 64, 4, 2, 16, 128, 2, 64
U32, U64, F32, STR = GGUFValueType.UINT32, GGUFValueType.UINT64, GGUFValueType.FLOAT32, GGUFValueType.STRING


@dataclass(frozen=True)
class Case:
    name: str
    path: Path  # a .gguf file, a model folder, or (kind "config_file") a --config file
    kind: str  # "model" (load_model) or "config_file" (load_config_file)
    # What the error must name (a field, a tensor); None: a valid control that must load.
    field: str | None


def _meta() -> dict[str, tuple[object, GGUFValueType]]:
    return {
        "llama.context_length": (CONTEXT, U32),
        "llama.embedding_length": (HIDDEN, U32),
        "llama.feed_forward_length": (FFN, U32),
        "llama.block_count": (LAYERS, U32),
        "llama.attention.head_count": (HEADS, U32),
        "llama.attention.head_count_kv": (KV_HEADS, U32),
        "llama.attention.layer_norm_rms_epsilon": (1e-5, F32),
        "llama.rope.freq_base": (10000.0, F32),
    }


def _tensors(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """name -> float32 [out, in] (GGUF stores the dims reversed, the writer does that)."""
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.1

    out = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": np.ones(HIDDEN, np.float32)}
    for i in range(LAYERS):
        out |= {
            f"blk.{i}.attn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.attn_q.weight": w(HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_k.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_v.weight": w(KV_HEADS * HEAD_DIM, HIDDEN),
            f"blk.{i}.attn_output.weight": w(HIDDEN, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_norm.weight": np.ones(HIDDEN, np.float32),
            f"blk.{i}.ffn_gate.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_up.weight": w(FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": w(HIDDEN, FFN),
        }
    return out


def write_gguf(path: Path, meta: dict | None = None, drop_meta: tuple[str, ...] = (),
               edit: Callable[[dict], None] | None = None, chat_template: str | None = None,
               truncate: int = 0) -> Path:
    """The valid GGUF with metadata entries replaced (`meta`: key -> (value, GGUF type)) or
    dropped, its tensors edited in place by `edit` (a value that is a (blocks, type) tuple
    is written as quantized blocks), and the last `truncate` bytes cut off."""
    entries = _meta() | (meta or {})
    tensors = _tensors(np.random.default_rng(0))
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (value, vtype) in entries.items():
        if key not in drop_meta:
            writer.add_key_value(key, value, vtype)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    letters = [chr(ord("a") + i) for i in range(26)]
    writer.add_token_list(["<s>", "</s>", *letters, "ab", "ba", "aa", "bb"])
    writer.add_token_merges(["a b", "b a", "a a", "b b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, t in tensors.items():
        if isinstance(t, tuple):
            blocks, qtype = t  # uint8 [rows, bytes per row]
            writer.add_tensor(name, blocks, raw_dtype=qtype)
        else:
            writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[:-truncate])
    return path


def _q8_embedding(rows: int) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        w = np.random.default_rng(1).standard_normal((rows, HIDDEN)).astype(np.float32)
        tensors["token_embd.weight"] = (quantize(w, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    return edit


def _drop(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def _reshape(name: str, shape: tuple[int, ...]) -> Callable[[dict], None]:
    def edit(tensors: dict) -> None:
        tensors[name] = np.zeros(shape, np.float32)
    return edit


def write_hf(folder: Path, config: object = None, raw_config: str | None = None,
             edit: Callable[[dict], None] | None = None) -> Path:
    """A valid Llama model folder with config.json's keys overridden by `config` (a dict), or
    replaced by `config` itself (anything else) or by the text `raw_config`; `edit` changes the
    weights (Hugging Face names) before they are saved."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True)
    base = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": FFN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "max_position_embeddings": CONTEXT, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": True}
    if raw_config is not None:
        text = raw_config
    else:  # (json writes NaN as NaN, which Python's json reads back)
        text = json.dumps(base | (config or {}) if config is None or isinstance(config, dict) else config)
    (folder / "config.json").write_text(text)
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "attn_norm": "input_layernorm",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
             "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    weights = {}
    for name, t in _tensors(np.random.default_rng(0)).items():
        parts = name.split(".")
        if parts[0] == "blk":
            weights[f"model.layers.{parts[1]}.{names[parts[2]]}.weight"] = t
        else:
            weights[f"{names[parts[0]]}.weight"] = t
    if edit is not None:
        edit(weights)
    save_file(weights, str(folder / "model.safetensors"))
    write_wordlevel_tokenizer(folder, VOCAB)
    return folder


def write_corpus(root: Path) -> list[Case]:
    """Every crafted file under `root`, with what its error must name."""
    cases: list[Case] = []

    def gguf_case(name: str, field_: str | None, **kw) -> None:
        cases.append(Case(name, write_gguf(root / f"{name}.gguf", **kw), "model", field_))

    def hf_case(name: str, field_: str | None, **kw) -> None:
        cases.append(Case(name, write_hf(root / name, **kw), "model", field_))

    gguf_case("valid", None)
    # A context of 2**24 is allowed, and must cost no more than a short one (tables follow max_model_len).
    # The same tensors read as 8 heads of 8 (over 4 KV heads), in a quantized file: a valid model the
    # native kernels cannot run, refused before they are built.
    gguf_case("native_head_dim_8", "head_dim", edit=_q8_embedding(VOCAB),
              meta={"llama.attention.head_count": (8, U32), "llama.attention.head_count_kv": (4, U32)})
    gguf_case("long_context", None, meta={"llama.context_length": (2**24, U32)})
    gguf_case("context_2_31", "llama.context_length", meta={"llama.context_length": (2**31, U32)})
    gguf_case("context_2_26", "llama.context_length", meta={"llama.context_length": (2**26, U32)})
    gguf_case("key_length_2_30", "llama.attention.key_length", meta={"llama.attention.key_length": (2**30, U32)})
    gguf_case("block_count_2_31", "llama.block_count", meta={"llama.block_count": (2**31, U32)})
    gguf_case("vocab_huge", "llama.vocab_size", meta={"llama.vocab_size": (2**30, U32)})
    gguf_case("hidden_huge", "llama.embedding_length", meta={"llama.embedding_length": (2**40, U64)})
    gguf_case("head_count_0", "llama.attention.head_count", meta={"llama.attention.head_count": (0, U32)})
    gguf_case("kv_heads_not_dividing", "llama.attention.head_count_kv",
              meta={"llama.attention.head_count_kv": (3, U32)})
    gguf_case("heads_not_dividing_hidden", "llama.attention.head_count", meta={"llama.attention.head_count": (5, U32)})
    gguf_case("odd_head_dim", "llama.attention.key_length", meta={"llama.attention.key_length": (7, U32)})
    gguf_case("block_count_string", "llama.block_count", meta={"llama.block_count": ("two", STR)})
    gguf_case("hidden_float", "llama.embedding_length", meta={"llama.embedding_length": (32.5, F32)})
    gguf_case("context_missing", "llama.context_length", drop_meta=("llama.context_length",))
    gguf_case("rms_eps_negative", "llama.attention.layer_norm_rms_epsilon",
              meta={"llama.attention.layer_norm_rms_epsilon": (-1e-5, F32)})
    gguf_case("rms_eps_nan", "llama.attention.layer_norm_rms_epsilon",
              meta={"llama.attention.layer_norm_rms_epsilon": (math.nan, F32)})
    gguf_case("freq_base_nan", "llama.rope.freq_base", meta={"llama.rope.freq_base": (math.nan, F32)})
    gguf_case("rope_factor_0", "llama.rope.scaling.factor",
              meta={"llama.rope.scaling.type": ("linear", STR), "llama.rope.scaling.factor": (0.0, F32)})
    gguf_case("token_embd_too_few_rows", "token_embd.weight", edit=_q8_embedding(VOCAB // 2))
    gguf_case("missing_tensor", "blk.1.ffn_down.weight", edit=_drop("blk.1.ffn_down.weight"))
    gguf_case("wrong_shape", "blk.0.attn_q.weight", edit=_reshape("blk.0.attn_q.weight", (HIDDEN // 2, HIDDEN)))
    gguf_case("more_layers_than_block_count", "llama.block_count", meta={"llama.block_count": (1, U32)})
    gguf_case("fewer_layers_than_block_count", "blk.2.", meta={"llama.block_count": (3, U32)})
    gguf_case("truncated_data", "truncated", truncate=1000)
    gguf_case("invalid_chat_template", "chat template", chat_template="{% for %}")

    hf_case("hf_valid", None)
    hf_case("hf_config_list", "config.json", config=[1, 2, 3])
    hf_case("hf_config_nested", "config.json", raw_config="[" * 100_000 + "]" * 100_000)
    hf_case("hf_context_2_28", "max_position_embeddings", config={"max_position_embeddings": 2**28})
    hf_case("hf_layers_1e9", "num_hidden_layers", config={"num_hidden_layers": 1e9})
    hf_case("hf_hidden_float", "hidden_size", config={"hidden_size": 64.7})
    hf_case("hf_hidden_string", "hidden_size", config={"hidden_size": "32"})
    hf_case("hf_heads_0", "num_attention_heads", config={"num_attention_heads": 0})
    hf_case("hf_rms_eps_negative", "rms_norm_eps", config={"rms_norm_eps": -1e-6})
    hf_case("hf_rope_theta_nan", "rope_theta", config={"rope_theta": math.nan})
    hf_case("hf_rope_factor_0", "rope_scaling.factor", config={"rope_scaling": {"rope_type": "linear", "factor": 0}})
    hf_case("hf_vocab_huge", "vocab_size", config={"vocab_size": 2**40})
    hf_case("hf_tie_string", "tie_word_embeddings", config={"tie_word_embeddings": "yes"})
    hf_case("hf_embed_too_few_rows", "model.embed_tokens.weight",
            edit=_reshape("model.embed_tokens.weight", (VOCAB // 2, HIDDEN)))
    hf_case("hf_missing_tensor", "model.layers.1.mlp.up_proj.weight", edit=_drop("model.layers.1.mlp.up_proj.weight"))
    hf_case("hf_tokenizer_config_nested", "tokenizer_config.json")
    (root / "hf_tokenizer_config_nested" / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)

    nested = root / "nested_config_file.json"
    nested.write_text('{"model": ' + "[" * 100_000 + "]" * 100_000 + "}")
    cases.append(Case("config_file_nested", nested, "config_file", "config"))
    listed = root / "list_config_file.json"
    listed.write_text("[1, 2, 3]")
    cases.append(Case("config_file_list", listed, "config_file", "config"))
    return cases
