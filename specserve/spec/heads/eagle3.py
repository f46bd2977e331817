"""The EAGLE-3 drafter in torch: the reference that training runs and the native drafter
(spec/heads/native_eagle3.py) is checked against. Its parameter names are the canonical ones of
eagle3_config.py, so a state dict loads from any supported checkpoint layout unchanged.

One drafting depth, per token (shapes per row; H the drafter's hidden size):
  feature  = fc(concat(h_low, h_mid, h_high))     [3 Ht] -> [H]   (depth 1, from the target)
           | the previous depth's output          [H]             (depth > 1, the drafter's own)
  residual = feature            (norm_before_residual: hidden_norm(feature))
  x        = concat(input_layernorm(embed(token)), hidden_norm(feature))      [2H]
  h        = residual + o_proj(attention(q_proj x, k_proj x, v_proj x))       (RoPE on q, k)
  out      = h + down(silu(gate(post_norm h)) * up(post_norm h))              [H] -> next depth
  logits   = lm_head(norm(out))                                              [Vd] -> draft_ids
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.llama import RMSNorm, RotaryEmbedding, apply_rope
from specserve.spec.heads.eagle3_config import Eagle3Config


class Eagle3Layer(nn.Module):
    """The decoder layer whose attention reads [2H] (token embedding beside the feature)."""

    def __init__(self, cfg: Eagle3Config):
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta, cache) -> torch.Tensor:
        """embeds, feature [..., T, H]; cos, sin from RotaryEmbedding.tables -> out [..., T, H].
        `cache.attend(0, q, k, v, meta)` stores this pass's keys and values and attends."""
        normed = self.hidden_norm(feature)
        residual = normed if self.norm_before_residual else feature
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)  # [..., T, 2H]
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        h = residual + self.o_proj(cache.attend(0, q, k, v, meta))
        m = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


class Eagle3Head(nn.Module):
    """fc + layer + final norm + draft-vocabulary head: every trained part of an EAGLE-3 drafter.
    `draft_ids` [Vd] (a buffer) maps draft rows to target token ids."""

    def __init__(self, cfg: Eagle3Config, positions: int | None = None):
        """positions: how many the RoPE tables cover (the target's; None: the config's context)."""
        super().__init__()
        self.config = cfg
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.layer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab_size), persistent=True)
        self.rotary = RotaryEmbedding(cfg.layer_config(), positions)

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:
        """[..., 3 Ht] the target's three captured states -> the depth-1 feature [..., H]."""
        return self.fc(target_states)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, meta,
                cache) -> torch.Tensor:
        """embeds, feature [..., T, H]; positions [..., T] -> out [..., T, H] (the next feature)."""
        cos, sin = self.rotary.tables(positions, feature.dtype)
        return self.layer(embeds, feature, cos, sin, meta, cache)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [..., H] -> float32 logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(out)).float()
