"""The speculative verifier (rejection sampler): a pure function from draft tokens, draft
probabilities and target logits to the tokens a step emits, keeping the output distribution
exactly the target's processed distribution p.

Per row b with n = num_draft[b] drafts x_0..x_{n-1}:
- greedy: accept x_j while x_j == argmax(target_j); then emit the target argmax at the first
  mismatch (or at position n when all match).
- sampling: accept x_j when u_j * q_j(x_j) < p_j(x_j), i.e. with probability min(1, p/q); at the
  first rejection emit a sample of normalise(max(0, p_j - q_j)) ("recovered"); when all n are
  accepted emit a sample of p_n ("bonus"). q is one-hot at x_j for deterministic proposers.

Randomness per sampled row, from its generator, always in this order whatever is accepted:
n uniforms, then one exponential race over the vocabulary (see sampler.draw_noise). Drawing all
n uniforms up front (instead of stopping at the rejection) makes the order fixed, so the
vectorised code below and the per-row reference consume identical random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.sampler import draw_noise, race


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    output_token_ids: torch.Tensor  # [B, k+1] int64: accepted drafts, then the recovered or bonus token, then -1
    num_accepted: torch.Tensor  # [B] int64: draft tokens accepted, 0..num_draft[b]
    num_emitted: torch.Tensor  # [B] int64: num_accepted + 1
    accepted_mask: torch.Tensor  # [B, k] bool: draft position j accepted (j < num_accepted)
    recovered_token_ids: torch.Tensor  # [B] int64: token emitted at the first rejection, or -1
    bonus_token_ids: torch.Tensor  # [B] int64: token emitted after all drafts were accepted, or -1


def verify(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, st: SamplingTensors,
           generators: list[torch.Generator | None]) -> VerifyOutput:
    """draft_token_ids [B, k] int64 (-1 past num_draft), num_draft [B] int64 in 0..k,
    draft_probs [B, k, V] float32 processed q (None: deterministic proposer, q one-hot),
    target_logits [B, k+1, V] raw logits after each of the k+1 inputs."""
    rows, k = draft_token_ids.shape
    vocab = target_logits.shape[-1]
    if target_logits.shape[:2] != (rows, k + 1):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must be [{rows}, {k + 1}, V] "
                         f"for draft_token_ids {tuple(draft_token_ids.shape)}")
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} rows")
    device = target_logits.device
    n_list = num_draft.tolist()  # the one host sync: how many uniforms each row draws
    p = processed_probs(target_logits, st)  # [B, k+1, V]; one-hot on greedy rows
    drafts = draft_token_ids.clamp(min=0)  # [B, k]; padding reads token 0, masked out below
    valid = torch.arange(k, device=device) < num_draft.unsqueeze(-1)  # [B, k]

    # Acceptance of each position on its own; the accepted prefix is decided after.
    greedy_ok = drafts == target_logits[:, :k].argmax(-1)  # [B, k]
    p_x = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    uniforms, expo = draw_noise(generators, st.greedy_rows, n_list, k, vocab, device)  # [B, k], [B, V]
    sampled_ok = uniforms * q_x.double() < p_x.double()  # P(u * q < p) = min(1, p / q)
    ok = torch.where(st.greedy.unsqueeze(-1), greedy_ok, sampled_ok) & valid
    accepted_mask = ok.long().cumprod(-1).bool()  # [B, k]: the prefix before the first rejection
    num_accepted = accepted_mask.sum(-1)  # [B]
    rejected = num_accepted < num_draft  # [B]

    # The emitted token comes from position a = num_accepted: the residual after a rejection,
    # else (bonus, or any greedy row, whose p is already the one-hot argmax) p itself.
    batch = torch.arange(rows, device=device)
    p_a = p[batch, num_accepted]  # [B, V]
    weights = p_a
    if k > 0:
        at = num_accepted.clamp(max=k - 1)
        q_a = F.one_hot(drafts[batch, at], vocab).float() if draft_probs is None else draft_probs[batch, at]
        residual = (p_a - q_a).clamp(min=0)  # [B, V]
        # Mathematically nonzero whenever a rejection happened; rounding (p == q) can zero it.
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
        use_residual = (rejected & ~st.greedy).unsqueeze(-1)
        weights = torch.where(use_residual, residual, p_a)
    emitted = race(weights, expo)  # [B]

    out = torch.where(accepted_mask, draft_token_ids, -1)
    out = torch.cat([out, torch.full((rows, 1), -1, dtype=torch.long, device=device)], dim=1)
    out.scatter_(1, num_accepted.unsqueeze(-1), emitted.unsqueeze(-1))
    return VerifyOutput(
        output_token_ids=out,
        num_accepted=num_accepted,
        num_emitted=num_accepted + 1,
        accepted_mask=accepted_mask,
        recovered_token_ids=torch.where(rejected, emitted, -1),
        bonus_token_ids=torch.where(rejected, -1, emitted),
    )
