"""Tiny random EAGLE-3 drafter checkpoints in each published layout, named exactly as the real
files name things (see spec/heads/eagle3_checkpoint.py for where each name comes from).

Sizes: a target of hidden 64, 6 layers, vocabulary 500; a drafter of hidden 64 (4 heads of 16
over 2 KV heads, MLP 128) whose head covers 96 draft tokens. Each builder writes a folder and
returns what read_eagle3 must give back: the canonical tensors (float32, draft_ids int64) and
the own embedding, or None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from specserve.model.config import ModelConfig
from specserve.spec.heads.eagle3_config import DRAFT_IDS

HIDDEN, LAYERS, VOCAB, DRAFT_VOCAB, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 6, 500, 96, 4, 2, 16, 128
# The layer names after the layout's prefix ("midlayer." or "layers.0."), canonical name first.
LAYER = {
    "layer.input_layernorm.weight": "input_layernorm.weight",
    "layer.hidden_norm.weight": "hidden_norm.weight",
    "layer.q_proj.weight": "self_attn.q_proj.weight",
    "layer.k_proj.weight": "self_attn.k_proj.weight",
    "layer.v_proj.weight": "self_attn.v_proj.weight",
    "layer.o_proj.weight": "self_attn.o_proj.weight",
    "layer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "layer.gate_proj.weight": "mlp.gate_proj.weight",
    "layer.up_proj.weight": "mlp.up_proj.weight",
    "layer.down_proj.weight": "mlp.down_proj.weight",
}


def target_config(layers: int = LAYERS) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                       num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                       max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500000.0)


@dataclass(frozen=True)
class Built:
    folder: Path
    canonical: dict[str, torch.Tensor]  # what read_eagle3 must return as tensors
    own_embedding: torch.Tensor | None


def random_canonical(seed: int) -> dict[str, torch.Tensor]:
    """Every canonical tensor, random; draft_ids a sorted random subset of the vocabulary (as
    the published trainers pick the most frequent tokens in id order)."""
    g = torch.Generator().manual_seed(seed)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.1

    t = {"fc.weight": r(HIDDEN, 3 * HIDDEN), "layer.q_proj.weight": r(q, 2 * HIDDEN),
         "layer.k_proj.weight": r(kv, 2 * HIDDEN), "layer.v_proj.weight": r(kv, 2 * HIDDEN),
         "layer.o_proj.weight": r(HIDDEN, q), "layer.gate_proj.weight": r(FFN, HIDDEN),
         "layer.up_proj.weight": r(FFN, HIDDEN), "layer.down_proj.weight": r(HIDDEN, FFN),
         "lm_head.weight": r(DRAFT_VOCAB, HIDDEN)}
    for name in ("layer.input_layernorm.weight", "layer.hidden_norm.weight",
                 "layer.post_attention_layernorm.weight", "norm.weight"):
        t[name] = 1 + r(HIDDEN)
    t[DRAFT_IDS] = torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB].sort().values
    return t


def file_tensors(canonical: dict[str, torch.Tensor], prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The checkpoint's own names: the layer under `prefix`, d2t offsets [Vd] int64, t2d [V] bool."""
    out = {prefix + LAYER[n] if n in LAYER else n: t.to(dtype) for n, t in canonical.items() if n != DRAFT_IDS}
    ids = canonical[DRAFT_IDS]
    out["d2t"] = ids - torch.arange(len(ids))
    out["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, ids, True)
    return out


def expected(canonical: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What a reader gives back from tensors stored in `dtype`: float32 values, int64 ids."""
    return {n: t if n == DRAFT_IDS else t.to(dtype).float() for n, t in canonical.items()}


def write_json(path: Path, doc: object) -> None:
    path.write_text(json.dumps(doc, indent=2), encoding="utf-8")


def llama_keys() -> dict:
    """The Llama config keys EAGLE's and SpecForge's drafter configs carry (as in SpecForge's
    configs/llama3-8B-eagle3.json and EAGLE's eagle/traineagle3/config.json)."""
    return {"bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": HIDDEN,
            "initializer_range": 0.02, "intermediate_size": FFN, "max_position_embeddings": 2048,
            "model_type": "llama", "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True, "vocab_size": VOCAB,
            "draft_vocab_size": DRAFT_VOCAB}


def write_eagle(folder: Path, seed: int = 0) -> Built:
    """SafeAILab EAGLE-3: a Llama config with draft_vocab_size, `midlayer.*`, d2t/t2d, no
    embedding, no aux layers named. (EAGLE saves pytorch_model.bin; this is its conversion to
    safetensors under the same names, float16 as trained.)"""
    folder.mkdir(parents=True, exist_ok=True)
    canonical = random_canonical(seed)
    write_json(folder / "config.json", {"architectures": ["LlamaForCausalLM"], **llama_keys()})
    save_file(file_tensors(canonical, "midlayer.", torch.float16), str(folder / "model.safetensors"))
    return Built(folder, expected(canonical, torch.float16), None)


def write_specforge(folder: Path, seed: int = 1, aux_outputs: tuple[int, ...] | None = (1, 2, 4),
                    shards: int = 1) -> Built:
    """SpecForge: "LlamaForCausalLMEagle3", `midlayer.*`, d2t/t2d, no embedding; `aux_outputs`
    in "eagle_config" (SGLang's convention: the layers whose outputs are read), bfloat16; in
    `shards` files with a model.safetensors.index.json when more than one."""
    folder.mkdir(parents=True, exist_ok=True)
    canonical = random_canonical(seed)
    doc = {"architectures": ["LlamaForCausalLMEagle3"], **llama_keys(), "rope_theta": 500000.0,
           "torch_dtype": "bfloat16"}
    if aux_outputs is not None:
        doc["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_outputs), "use_aux_hidden_state": True}
    write_json(folder / "config.json", doc)
    tensors = file_tensors(canonical, "midlayer.", torch.bfloat16)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({n: tensors[n] for n in part}, str(folder / file))
            weight_map |= {n: file for n in part}
        write_json(folder / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    return Built(folder, expected(canonical, torch.bfloat16), None)


def write_speculators(folder: Path, seed: int = 2, aux: tuple[int, ...] | None = (2, 3, 5),
                      norm_before_residual: bool = True) -> Built:
    """vLLM speculators: Eagle3Speculator config with the layer's sizes under
    transformer_layer_config, `layers.0.*`, d2t/t2d, the target's embedding copied in, aux layers
    in vLLM's convention (the layers whose entering streams are read)."""
    folder.mkdir(parents=True, exist_ok=True)
    canonical = random_canonical(seed)
    g = torch.Generator().manual_seed(seed + 100)
    embedding = torch.randn(VOCAB, HIDDEN, generator=g).to(torch.bfloat16)
    doc = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": "0.3.0", "draft_vocab_size": DRAFT_VOCAB, "norm_before_residual": norm_before_residual,
        "target_hidden_size": None, "embed_requires_grad": False, "has_no_defaults_at_init": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                                     "accept_tolerance": 0.0, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"],
                                            "name_or_path": "meta-llama/Llama-3.1-8B-Instruct"}},
        "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                     "hidden_size": HIDDEN, "intermediate_size": FFN, "num_attention_heads": HEADS,
                                     "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "num_hidden_layers": 1,
                                     "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 8192},
                                     "max_position_embeddings": 131072, "vocab_size": VOCAB,
                                     "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"},
    }
    if aux is not None:
        doc["eagle_aux_hidden_state_layer_ids"] = list(aux)
    write_json(folder / "config.json", doc)
    tensors = file_tensors(canonical, "layers.0.", torch.bfloat16) | {"embed_tokens.weight": embedding}
    save_file(tensors, str(folder / "model.safetensors"))
    return Built(folder, expected(canonical, torch.bfloat16), embedding.float())
