"""Llama-family transformer (Llama 2/3, Mistral, Qwen2, SmolLM, TinyLlama) over the project's
attention interface.

Weights are stored fused where the maths allows it: one [q; k; v] projection and one
[gate; up] projection per layer. At the embedded model's size, per-op overhead rivals the
matrix products on a CPU, so two matmuls fewer per layer is a measurable share of a step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.attention import AttentionMetadata, DenseKVCache
from specserve.model.config import ModelConfig, rope_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the model dtype, as the reference implementation
        # does; in float32 the two casts are no-ops.
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables [max_positions, head_dim // 2] in float32, gathered by position."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float32), rope_inv_freq(cfg))
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, T, 1, head_dim // 2] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(2).to(dtype), self.sin[positions].unsqueeze(2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [B, T, H, D]; cos, sin: [B, T, 1, D // 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, cache: DenseKVCache) -> torch.Tensor:
        bsz, t, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(bsz, t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(bsz, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(bsz, t, self.num_kv_heads, self.head_dim)
        return self.o_proj(cache.attend(self.layer, q, k, v, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """forward(input_ids [B, T], meta, cache) -> hidden states [B, T, hidden];
    compute_logits(hidden [..., hidden]) -> float32 logits [..., vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: DenseKVCache) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary.tables(meta.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, meta, cache)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
