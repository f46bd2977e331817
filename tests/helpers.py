"""Tiny random-weight checkpoints made with transformers, saved as real model folders."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from safetensors import safe_open


def write_wordlevel_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens "<s>", "</s>", "t2" ... so that tiny models are real
    model folders the loader accepts. Words are split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    vocab = {"<s>": 0, "</s>": 1} | {f"t{i}": i for i in range(2, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="</s>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))


def make_tiny_checkpoint(folder: Path, kind: str = "llama", *, vocab_size: int = 64, hidden: int = 64,
                         layers: int = 2, heads: int = 4, kv_heads: int = 2, tied: bool = False,
                         rope_scaling: dict | None = None, seed: int = 0, max_positions: int = 512,
                         **config) -> Path:
    """Save a random-weight model folder of `kind` (llama, qwen2, qwen3, phi3, gemma2 or gemma3)
    and return its path; `config`: further keys of the transformers config (Qwen3's head_dim,
    attention_bias, Gemma's sliding_window...)."""
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_positions, tie_word_embeddings=tied, rms_norm_eps=1e-6,
                  bos_token_id=0, eos_token_id=1, **config)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(**common, rope_theta=1e6)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif kind == "gemma2":
        cfg = transformers.Gemma2Config(**common, rope_theta=10000.0, pad_token_id=1)
        model = transformers.Gemma2ForCausalLM(cfg)
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(**common, pad_token_id=1)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif kind == "phi3":
        # (Phi-3's default pad token, 32000, lies outside a tiny vocabulary.)
        cfg = transformers.Phi3Config(**common, rope_theta=10000.0, pad_token_id=1)
        model = transformers.Phi3ForCausalLM(cfg)
    else:
        extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
        cfg = transformers.LlamaConfig(**common, rope_theta=10000.0, **extra)
        model = transformers.LlamaForCausalLM(cfg)
    # Random init gives near-uniform logits; larger weights give peaked, varied distributions,
    # which make greedy ties impossible and acceptance tests meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.5 / p.shape[-1] ** 0.5 * 4)
    model.eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_wordlevel_tokenizer(folder, vocab_size)
    return folder


def make_varied_checkpoint(folder: Path, kind: str, seed: int = 0, **config) -> Path:
    """make_tiny_checkpoint, its 1-D weights (norms, biases) random too: a q_norm swapped with
    k_norm, or a bias dropped, then shows in the logits."""
    make_tiny_checkpoint(folder, kind, vocab_size=64, seed=seed, **config)
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    g = torch.Generator().manual_seed(seed + 100)
    for name, t in tensors.items():
        if t.dim() == 1:
            base = 1.0 if name.endswith("norm.weight") else 0.0
            tensors[name] = base + 0.3 * torch.randn(t.shape, generator=g)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


def gguf_tensor_name(hf: str, arch: str) -> str:
    """The llama.cpp name of a Hugging Face tensor name (gguf's tensor map for qwen3, phi3 and gemma)."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
             "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
             "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             # Phi-3: llama.cpp's ffn_up holds [gate; up].
             "mlp.gate_up_proj.weight": "ffn_up.weight"}
    if arch.startswith("gemma"):
        names |= {"post_attention_layernorm.weight": "post_attention_norm.weight",
                  "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                  "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
    return f"blk.{layer}.{names[rest]}"


# IQ4_NL's grid (ggml's kvalues_iq4nl): a stored nibble q stands for d * IQ4_NL_VALUES[q].
IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def quantize_blocks(w: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """float32 [rows, cols] as raw GGUF blocks uint8 [rows, row_bytes]: the gguf package's quantizer,
    or for IQ4_NL (which it only dequantizes) a plain one: d = the block's largest-magnitude value
    / -127 (ggml's first guess), each weight to the nearest grid value."""
    if qtype != GGMLQuantizationType.IQ4_NL:
        return quantize(w, qtype)
    blocks = w.reshape(-1, 32)
    big = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
    d = (big / -127.0).astype(np.float16)
    scaled = np.divide(blocks, d.astype(np.float32)[:, None], out=np.zeros_like(blocks), where=d[:, None] != 0)
    q = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    raw = np.concatenate([d.reshape(-1, 1).view(np.uint8), q[:, :16] | (q[:, 16:] << 4)], axis=1)
    return raw.reshape(w.shape[0], -1)


def write_gguf(folder: Path, path: Path, quantized: bool, drop=(), extra_tensors=None, meta=None,
               qtypes: Sequence[GGMLQuantizationType] = (GGMLQuantizationType.Q8_0,)) -> Path:
    """The folder's weights as a GGUF of its architecture (float32, or quantized matrices with the
    embedding kept float: `qtypes` in turn, Q8_0 by default), with the metadata llama.cpp's
    converter writes for it (Gemma's norm weights as 1 + w, its window and soft-caps)."""
    cfg = json.loads((folder / "config.json").read_text())
    arch = cfg["model_type"].removesuffix("_text")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg["sliding_window"])
        # (llama.cpp's newer key: one flag per layer, where the pattern is not the family's own)
        writer.add_key_value(f"{arch}.attention.sliding_window_pattern",
                             [t == "sliding_attention" for t in cfg["layer_types"]], gguf.GGUFValueType.ARRAY,
                             sub_type=gguf.GGUFValueType.BOOL)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key):
                writer.add_key_value(f"{arch}.{key}", cfg[key], gguf.GGUFValueType.FLOAT32)
    for key, (value, vtype) in (meta or {}).items():
        writer.add_key_value(key, value, vtype)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    chars = [chr(c) for c in range(ord("A"), ord("A") + cfg["vocab_size"] - 3)]
    writer.add_token_list(["<s>", "</s>", *chars, "AB"])
    writer.add_token_merges(["A B"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    with safe_open(str(folder / "model.safetensors"), framework="np") as f:
        tensors = {gguf_tensor_name(n, arch): f.get_tensor(n).astype(np.float32) for n in f.keys()}
    if arch.startswith("gemma"):
        tensors = {n: t + 1 if n.endswith("norm.weight") else t for n, t in tensors.items()}
    tensors |= extra_tensors or {}
    matrices = 0
    for name, t in tensors.items():
        if name in drop:
            continue
        if quantized and t.ndim == 2 and name != "token_embd.weight":
            qtype = qtypes[matrices % len(qtypes)]
            matrices += 1
            writer.add_tensor(name, quantize_blocks(t, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def edit_config(folder: Path, **changes) -> Path:
    """Set (or, with None, remove) keys of the model folder's config.json -> the folder."""
    path = folder / "config.json"
    doc = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            doc.pop(key, None)
        else:
            doc[key] = value
    path.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    return folder


def chi_square_pvalue(outcomes: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of observed outcome indices against probs; cells expecting < 5 are pooled.
    A single outcome of probability 0 gives p = 0."""
    n = outcomes.numel()
    observed = torch.bincount(outcomes, minlength=probs.numel()).double()
    if observed[probs == 0].sum() > 0:
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), chi2 / 2))


def ragged_prompts(n: int, seed: int = 0, lo: int = 2, hi: int = 70) -> list[list[int]]:
    """n prompts of random lengths in [lo, hi) over a 64-token vocabulary, each a short random
    phrase repeated (so the n-gram proposer finds matches)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = [rng.randrange(2, 64) for _ in range(rng.randrange(2, 6))]
        out.append((phrase * 40)[: rng.randrange(lo, hi)])
    return out


def generate_ids(llm, prompts, params) -> list[list[int]]:
    """Output token ids of `llm.generate`, in prompt order."""
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_native_rows_batch_invariant(loaded, levels: list[int]) -> None:
    """Exact, on a native model: a token's logits 30 tokens into a request are the same bits
    alone, among draft tokens and next to another request, on every CPU level of `levels`."""
    from specserve.hardware import Isa
    from specserve.model.runner import ForwardBatch, ModelRunner

    ids = ragged_prompts(1, seed=5, lo=40, hi=41)[0]
    out = []
    for lvl in levels:
        loaded.model.level = lvl
        runner = ModelRunner.paged(loaded.model, 16, 16)

        def run(tables, starts, tokens):
            return runner.execute(ForwardBatch(tables, starts, tokens, all_logits=True))

        run([[0, 1, 2]], [0], [ids[:30]])
        run([[8, 9]], [0], [[7, 8, 9, 10, 11]])
        alone = run([[0, 1, 2]], [30], [ids[30:31]])[0, 0]
        verify = run([[0, 1, 2]], [30], [ids[30:36]])[0]
        batched = run([[8, 9], [0, 1, 2]], [5, 30], [[12, 13, 14], ids[30:36]])
        assert torch.equal(verify[0], alone) and torch.equal(batched[1, :6], verify), Isa(lvl).label
        out.append(verify)
    for lvl, o in zip(levels[1:], out[1:]):
        assert torch.equal(o, out[0]), Isa(lvl).label


def native_levels() -> list[int]:
    """The CPU levels with kernels of their own that the native kernels run here, lowest first:
    generic, avx2, avx512, avx512_vnni, then amx where the CPU has it and the process was
    granted its tiles (avx512_bf16 has no kernels of its own: its tables are avx512_vnni's)."""
    from specserve.hardware import Isa, native_level

    top = native_level()
    if top is None:  # the native tests skip; the lists stay non-empty for their parameters
        return [Isa.GENERIC]
    return [lvl for lvl in (Isa.GENERIC, Isa.AVX2, Isa.AVX512, Isa.AVX512_VNNI, Isa.AMX) if lvl <= top]
