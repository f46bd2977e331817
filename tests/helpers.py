"""Tiny random-weight checkpoints made with transformers, saved as real model folders."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch


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
    """Save a random-weight model folder of `kind` (llama, qwen2, qwen3 or phi3) and return its
    path; `config`: further keys of the transformers config (Qwen3's head_dim, attention_bias...)."""
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


def native_levels() -> list[int]:
    """The CPU levels with kernels of their own that the native kernels run here, lowest first:
    generic, avx2, avx512, avx512_vnni, then amx where the CPU has it and the process was
    granted its tiles (avx512_bf16 has no kernels of its own: its tables are avx512_vnni's)."""
    from specserve.hardware import Isa, native_level

    top = native_level()
    if top is None:  # the native tests skip; the lists stay non-empty for their parameters
        return [Isa.GENERIC]
    return [lvl for lvl in (Isa.GENERIC, Isa.AVX2, Isa.AVX512, Isa.AVX512_VNNI, Isa.AMX) if lvl <= top]
