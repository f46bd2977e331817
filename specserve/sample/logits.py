"""Logits -> the processed distribution that both plain sampling and the speculative verifier use.

One function, `processed_probs`, defines the distribution of every request: temperature, then
top-k, then top-p, then min-p, renormalised. The sampler draws from it and the verifier compares
draft tokens against it, so speculation cannot change what a request samples from.

Tie rules (ties are rare with real logits but must not depend on token order or batch layout):
- top-k keeps every token whose logit is >= the k-th largest logit, so a tie at the boundary
  keeps all tied tokens (possibly more than k).
- top-p keeps every token whose probability is >= that of the token at which the cumulative
  mass (most probable first) first reaches top_p; equivalently, a token is kept when the mass of
  tokens strictly more probable than it is < top_p. A tie at the boundary keeps all tied tokens.
- min-p keeps every token with probability >= min_p * (max probability).
- greedy rows (temperature 0) are one-hot at the argmax of the raw logits, the lowest token id
  among equal maxima (torch.argmax's documented rule).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams


def argmax_rows(logits: torch.Tensor) -> list:
    """The argmax over the last dimension of logits [..., V] -> token ids as nested lists of the
    leading shape, the lowest among equal maxima (and a row's first NaN, as torch.argmax). Host
    float32 logits go through numpy: torch's argmax over a vocabulary row costs ~60 us at one
    row on a 2-core CPU (its reduction is parallel), numpy's ~5 (in the engine, right after a
    pass: 88 against 43 us)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


@dataclass(frozen=True, slots=True)
class SamplingTensors:
    """Per-row sampling parameters of a batch, as tensors on the logits' device.

    Filters on greedy rows are stored as "off": a greedy row is one-hot whatever they say, and
    leaving them on would only make `any_*` ask for work no row needs.
    """

    temperature: torch.Tensor  # [B] float32; 0 on greedy rows
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1 = off
    min_p: torch.Tensor  # [B] float32; 0 = off
    greedy: torch.Tensor  # [B] bool
    greedy_rows: tuple[bool, ...]  # host copy of `greedy`, for per-row loops without a device sync
    params: tuple[SamplingParams, ...]  # the source rows, so `select` needs no device sync
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    max_top_k: int  # largest top_k of any row (0 when none), the width of one batched topk

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str) -> SamplingTensors:
        greedy = [p.greedy for p in params]
        top_k = [0 if g else max(p.top_k, 0) for p, g in zip(params, greedy)]  # -1 is "off" too
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        min_p = [0.0 if g else p.min_p for p, g in zip(params, greedy)]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            greedy_rows=tuple(greedy),
            params=tuple(params),
            all_greedy=all(greedy),
            any_top_k=any(k > 0 for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            any_min_p=any(p > 0.0 for p in min_p),
            max_top_k=max(top_k, default=0),
        )

    def select(self, rows: list[int]) -> SamplingTensors:
        """The sub-batch of the given rows, in that order."""
        return SamplingTensors.from_params([self.params[i] for i in rows], self.temperature.device)

    def __len__(self) -> int:
        return len(self.params)


def processed_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """logits [B, V] or [B, T, V] (row b uses st's row b at every t) -> float32 probs, same shape.

    Deterministic: the same logits row and parameters give bit-identical probabilities whatever
    else is in the batch, because every step works along the vocabulary of one row.
    """
    shape, vocab = logits.shape, logits.shape[-1]
    if shape[0] != len(st):
        raise ValueError(f"logits have {shape[0]} rows but the sampling tensors have {len(st)}")
    x = logits.float().reshape(-1, vocab)  # [N, V], N = B * T
    per_row = x.shape[0] // shape[0]

    def rows(t: torch.Tensor) -> torch.Tensor:  # [B] -> [N, 1]
        return t.repeat_interleave(per_row).unsqueeze(-1)

    if st.all_greedy:
        return _one_hot_argmax(x).reshape(shape)
    greedy = rows(st.greedy)
    # Greedy rows divide by 1: their result is replaced by the one-hot below, and a 0 would
    # turn them into inf/nan on the way.
    x = x / torch.where(greedy, 1.0, rows(st.temperature))
    if st.any_top_k:
        x = x.masked_fill(~_top_k_keep(x, rows(st.top_k), st.max_top_k), float("-inf"))
    if st.any_top_p or st.any_min_p:
        probs = x.softmax(-1)
        keep = torch.ones_like(x, dtype=torch.bool)
        if st.any_top_p:
            keep &= probs >= _top_p_threshold(probs, rows(st.top_p))
        if st.any_min_p:
            # top-p never removes the most probable token and renormalising scales every
            # token alike, so comparing with the max before renormalising is the same rule.
            keep &= probs >= rows(st.min_p) * probs.amax(-1, keepdim=True)
        x = x.masked_fill(~keep, float("-inf"))
    probs = x.softmax(-1)
    if any(st.greedy_rows):
        probs = torch.where(greedy, _one_hot_argmax(logits.float().reshape(-1, vocab)), probs)
    return probs.reshape(shape)


def _one_hot_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [N, V] -> float32 one-hot [N, V] at the first maximum of each row."""
    out = torch.zeros_like(x, dtype=torch.float32)
    return out.scatter_(-1, x.argmax(-1, keepdim=True), 1.0)


def _top_k_keep(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """x [N, V], top_k [N, 1] (0 = off) -> keep mask [N, V]: logit >= the row's k-th largest."""
    vocab = x.shape[-1]
    k = top_k.clamp(max=vocab)
    largest = x.topk(min(max_top_k, vocab), dim=-1).values  # [N, K], descending
    kth = largest.gather(-1, (k - 1).clamp(min=0))  # [N, 1]
    return (x >= kth) | (k == 0)


# Widths of the partial sorts top-p tries before a full one (module-level for the tests): a
# row's boundary lies among its K most probable tokens as soon as their mass reaches top_p,
# which at usual temperatures 128 or 2,048 of them do. A 49k-token row: topk 128 ~0.05 ms,
# 2,048 ~0.2 ms, a full sort ~3.4 ms (the 2-core Zen 4).
TOP_P_WIDTHS = (128, 2048)


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [N, V], top_p [N, 1] -> [N, 1] smallest probability to keep (0 where top_p is 1).

    The boundary token is the first, most probable first, at which the cumulative mass reaches
    top_p; if rounding keeps the sum just below top_p the last token is the boundary.

    Computed from each row's K most probable tokens where their cumulative mass already
    reaches top_p (K from TOP_P_WIDTHS, then the whole row): the cumulative sums never fall and
    the first K of them are the full sort's first K, so the boundary and its probability are
    the full sort's, bit for bit.
    """
    vocab = probs.shape[-1]
    out = torch.zeros_like(top_p, dtype=probs.dtype)
    todo = (top_p < 1.0).view(-1).nonzero().view(-1)  # top_p == 1 keeps everything: threshold 0
    for k in (*[w for w in TOP_P_WIDTHS if w < vocab], vocab):
        if todo.numel() == 0:
            break
        sub, p = probs.index_select(0, todo), top_p.index_select(0, todo)
        ordered = sub.topk(k, dim=-1).values if k < vocab else sub.sort(dim=-1, descending=True).values  # [n, k]
        mass = ordered.cumsum(-1)
        done = (mass[:, -1:] >= p).view(-1) if k < vocab else torch.ones_like(todo, dtype=torch.bool)
        before = (mass < p).sum(-1, keepdim=True).clamp(max=k - 1)
        out.index_copy_(0, todo[done], ordered.gather(-1, before)[done])
        todo = todo[~done]
    return out
