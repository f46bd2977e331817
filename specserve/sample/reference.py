"""Per-row, per-position reference of `verify`, written to be checked by eye against the
algorithm (Leviathan et al. 2023; Chen et al. 2023). Test oracle only: slow by design.

It draws the same random numbers in the same order as `verify` (n uniforms, then one exponential
race over the vocabulary), so with equal generator states the two must agree token for token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.sample.logits import SamplingTensors, processed_probs


def reference_verify(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, draft_probs: torch.Tensor | None,
                     target_logits: torch.Tensor, st: SamplingTensors,
                     generators: list[torch.Generator | None]) -> list[list[int]]:
    """Same inputs as `verify` (on CPU); returns each row's emitted tokens (accepted drafts + one more)."""
    rows, vocab = draft_token_ids.shape[0], target_logits.shape[-1]
    out = []
    for b in range(rows):
        g, n, greedy = generators[b], int(num_draft[b]), st.greedy_rows[b]
        p = processed_probs(target_logits[b : b + 1], st.select([b]))[0]  # [k+1, V]
        u = None if greedy else torch.rand(n, dtype=torch.float64, generator=g)
        emitted, dist = [], p[n]  # if every draft is accepted: the bonus token from p_n
        for j in range(n):
            x = int(draft_token_ids[b, j])
            q = F.one_hot(torch.tensor(x), vocab).float() if draft_probs is None else draft_probs[b, j]
            if greedy:
                accept = x == int(target_logits[b, j].argmax())
            else:
                accept = float(u[j]) < float(p[j, x]) / float(q[x]) if float(q[x]) > 0 else float(p[j, x]) > 0
            if not accept:
                residual = (p[j] - q).clamp(min=0)
                dist = p[j] if greedy or float(residual.sum()) == 0 else residual
                break
            emitted.append(x)
        # Exponential race: argmax(w / E), E ~ Exp(1), is an exact draw from w / sum(w).
        e = torch.ones(vocab, dtype=torch.float64) if greedy else -torch.rand(vocab, dtype=torch.float64, generator=g).log()
        emitted.append(int((dist.double() / e).argmax()))
        out.append(emitted)
    return out
