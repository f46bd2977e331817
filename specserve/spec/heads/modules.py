"""The trainable parts of the drafters, as nn.Modules over the target's frozen pieces.

Both drafters read the target's final hidden state (after its final norm: the input of its
vocabulary projection) and score tokens with the target's own vocabulary projection, restricted
to a draft vocabulary (`DraftVocab`), so only small blocks are trained and stored:

- Medusa: K residual blocks h + SiLU(W_k h + b_k); head k predicts token t+1+k from the hidden
  state at t (the target's own head predicts t+1).
- EAGLE: fc(concat(embed(token_{t+1}), feature_t)) [2H -> H], then one Llama decoder layer
  (the project's own, over the attention interface), giving the predicted feature_{t+1}, which
  the vocabulary projection turns into logits for token t+2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model.config import ModelConfig
from specserve.model.linear import Linear
from specserve.model.llama import DecoderLayer, RotaryEmbedding


class DraftVocab(nn.Module):
    """The target's vocabulary projection restricted to `ids` (frozen): hidden -> logits over
    the draft vocabulary. A drafter proposes only these tokens; verification is unaffected, and
    the target's logits still cover the whole vocabulary."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("ids", ids.long(), persistent=False)  # [Vd] target token id of each row
        self.proj = Linear(weight.shape[1], weight.shape[0], bias=False)  # weight [Vd, H]
        self.proj.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., Vd]."""
        return self.proj(hidden).float()


class MedusaHeads(nn.Module):
    """K residual blocks in one [H -> K H] product (one call instead of K at inference).

    Zero-initialised, every head starts as the identity, i.e. predicting what the target's own
    head predicts; training moves head k towards token t+1+k."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.proj = Linear(hidden_size, num_heads * hidden_size, bias=True)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> head features [..., K, H]."""
        update = F.silu(self.proj(hidden)).unflatten(-1, (self.num_heads, hidden.shape[-1]))
        return hidden.unsqueeze(-2) + update


class EagleHead(nn.Module):
    """Feature-level autoregression: (embedding of token t+1, feature at t) -> feature at t+1.

    `forward` goes through the project's attention interface, so one module serves training
    (an unrolled attention over whole sequences) and drafting (flattened rows over the drafter's
    paged KV with tree masks: heads/eagle_kv.py's FlatDraftAttention).
    """

    def __init__(self, layer_cfg: ModelConfig, positions: int | None = None):
        """positions: how many the RoPE tables cover (the target's; None: the layer's context)."""
        super().__init__()
        h = layer_cfg.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        self.layer = DecoderLayer(layer_cfg, 0)
        self.rotary = RotaryEmbedding(layer_cfg, positions)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                meta, cache) -> torch.Tensor:
        """token_embeds, features [B, T, H] (training) or [N, H] (drafting's flattened rows);
        positions [B, T] or [N] (RoPE) -> predicted features of the same shape.
        `cache.attend(0, q, k, v, meta)` stores this pass's keys and values and attends."""
        x = self.fc(torch.cat((token_embeds, features), dim=-1))
        cos, sin = self.rotary.tables(positions, x.dtype)
        return self.layer(x, cos, sin, meta, cache)
