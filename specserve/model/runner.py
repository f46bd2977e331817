"""The model runner: owns the model and its KV cache, turns a batch into tensors, runs it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate

import torch

from specserve.model.attention import DenseKVCache
from specserve.model.flat_batch import FlatBatch, flat_batch
from specserve.model.llama import LlamaModel
from specserve.model.paged_kv import PagedKVCache


@dataclass(slots=True)
class ForwardBatch:
    """Requests computing tokens in one forward pass (the scheduler's per-request decision)."""

    # Where each request's KV lives: its block table (paged cache) or its slot id (dense cache).
    locations: list[list[int]] | list[int]
    start_positions: list[int]  # each request's num_computed_tokens
    token_ids: list[list[int]]  # tokens to compute, one list per request (prompt chunk, or last token + drafts)
    all_logits: bool  # True: logits at every position [B, T, V]; False: at each request's last token [B, 1, V]
    # Per request, a [T_i, T_i] bool token-tree mask (see flat_batch) or None for causal
    # tokens; None: every request causal.
    tree_masks: list[torch.Tensor | None] | None = None
    keep_hidden: bool = False  # also return the final hidden states of every computed token
    # With keep_hidden: the residual streams entering these decoder layers, concatenated
    # [.., len * hidden], stand in for the final hidden states (EAGLE-3 reads three of them).
    # Captured by the same pass; empty: the final hidden states.
    aux_layers: tuple[int, ...] = ()


@dataclass(slots=True)
class ForwardOutput:
    logits: torch.Tensor  # float32 [B, T, V] (all_logits) or [B, 1, V]
    # Per request [T_i, hidden]: the final hidden states (after the last norm, the LM head's
    # input) of the tokens it computed, in order ([T_i, len * hidden] captured states with
    # ForwardBatch.aux_layers); None unless ForwardBatch.keep_hidden.
    hidden: list[torch.Tensor] | None


@dataclass(slots=True)
class FlatForwardOutput:
    """A pass over flattened tokens (`ModelRunner.forward_rows`): request i computed tokens
    [token_start[i], token_start[i + 1]) and has logits rows [logit_start[i], logit_start[i + 1])."""

    logits: torch.Tensor  # float32 [M, V]: each request's last num_logits[i] tokens, request by request
    logit_start: list[int]  # [B + 1]
    # [N, hidden] final hidden states of every token (keep_hidden; [N, len * hidden] captured
    # states with aux_layers), else None
    hidden: torch.Tensor | None
    token_start: list[int]  # [B + 1]


class ModelRunner:
    """Runs a model over one KV cache: a paged pool (the engine's, the draft model's), or a
    dense per-slot cache (single-request tools: the forward and quality benchmarks, training
    data)."""

    def __init__(self, model: LlamaModel, cache: PagedKVCache | DenseKVCache):
        self.model = model
        self.device = model.device
        self.cache = cache

    @classmethod
    def dense(cls, model: LlamaModel, num_slots: int, max_len: int) -> "ModelRunner":
        cfg = model.config
        return cls(model, DenseKVCache(cfg.num_layers, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim,
                                       model.kv_dtype, model.device))

    @classmethod
    def paged(cls, model: LlamaModel, num_blocks: int, block_size: int) -> "ModelRunner":
        cfg = model.config
        return cls(model, PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                       model.kv_dtype, model.device))

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """-> float32 logits [B, T, V] (all_logits) or [B, 1, V] (last token of each request)."""
        return self.forward(batch).logits

    def execute_last(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits at each request's last token [B, 1, V], for a batch of ragged lengths."""
        return self.forward_last(batch).logits

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        return self._forward_flat(batch)

    def _hidden_flat(self, batch: ForwardBatch) -> tuple[torch.Tensor, FlatBatch, torch.Tensor | None]:
        """hidden [N, hidden] of the batch's tokens flattened, no padding computed: every model
        on either cache (model.forward_flat; measured as fast as the padded pass it replaced for
        a single request on the dense cache, faster for ragged batches), and the captured
        states [N, len * hidden] when the batch asks for aux_layers (else None)."""
        if isinstance(self.cache, PagedKVCache):
            tables, block_size = batch.locations, self.cache.block_size
        else:  # a dense slot is one block of `stride` rows
            tables, block_size = [[slot] for slot in batch.locations], self.cache.stride
        flat = flat_batch(batch.token_ids, tables, block_size, batch.start_positions, batch.tree_masks)
        # [layers, blocks, block_size, Hkv, D] or [layers, rows, Hkv, D], in model.kv_dtype
        k, v = self.cache.k, self.cache.v
        k, v = k.view(k.shape[0], -1, *k.shape[-2:]), v.view(v.shape[0], -1, *v.shape[-2:])
        if batch.keep_hidden and batch.aux_layers:
            # The model captures each layer once; a shallow model's drafter may name one twice.
            unique = tuple(sorted(set(batch.aux_layers)))
            hidden, aux = self.model.forward_flat_aux(flat, k, v, unique)
            if unique != tuple(batch.aux_layers):
                pick = [unique.index(i) for i in batch.aux_layers]
                aux = aux.view(aux.shape[0], len(unique), -1)[:, pick].reshape(aux.shape[0], -1)
            return hidden, flat, aux
        return self.model.forward_flat(flat, k, v), flat, None  # [N, hidden]

    def _forward_flat(self, batch: ForwardBatch) -> ForwardOutput:
        hidden, flat, aux = self._hidden_flat(batch)
        starts = flat.q_start.tolist()
        states = hidden if aux is None else aux
        kept = [states[a:b] for a, b in zip(starts, starts[1:])] if batch.keep_hidden else None
        if not batch.all_logits:
            return ForwardOutput(self.model.compute_logits(hidden[flat.ends]).unsqueeze(1), kept)  # [B, 1, V]
        logits = self.model.compute_logits(hidden)  # [N, V]
        lens = [b - a for a, b in zip(starts, starts[1:])]
        t = max(lens)
        if min(lens) == t:
            return ForwardOutput(logits.view(len(lens), t, -1), kept)
        # Ragged: padded to [B, T, V] with zero logits where a request has no token.
        padded = logits.new_zeros(len(lens) * t, logits.shape[-1])
        rows = torch.cat([torch.arange(i * t, i * t + n) for i, n in enumerate(lens)]).to(logits.device)
        return ForwardOutput(padded.index_copy_(0, rows, logits).view(len(lens), t, -1), kept)

    @torch.inference_mode()
    def forward_rows(self, batch: ForwardBatch, num_logits: list[int]) -> FlatForwardOutput:
        """One pass over every request's tokens, flattened (prompt chunks, decode tokens, draft
        chains and trees side by side), with logits only where asked: at request i's last
        num_logits[i] tokens (0: none, e.g. a prompt chunk that samples nothing). The engine's
        step is this one call."""
        lens = [len(t) for t in batch.token_ids]
        if any(not 0 <= n <= q for n, q in zip(num_logits, lens)) or len(num_logits) != len(lens):
            raise ValueError(f"num_logits {num_logits} must give each request 0..its token count {lens}")
        token_start = [0, *accumulate(lens)]
        logit_start = [0, *accumulate(num_logits)]
        rows = [j for e, n in zip(token_start[1:], num_logits) for j in range(e - n, e)]
        hidden, _, aux = self._hidden_flat(batch)  # [N, hidden]
        index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, index)) if rows else hidden.new_zeros(0, 0)
        kept = (hidden if aux is None else aux) if batch.keep_hidden else None
        return FlatForwardOutput(logits.float(), logit_start, kept, token_start)

    @torch.inference_mode()
    def states(self, batch: ForwardBatch) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """One pass computing no logits -> per request its final hidden states [T_i, hidden]
        and, when the batch names aux_layers, its captured states [T_i, len * hidden] (else
        None): what drafter training reads (train/features.py)."""
        hidden, flat, aux = self._hidden_flat(batch)
        starts = flat.q_start.tolist()
        bounds = list(zip(starts, starts[1:]))
        return [hidden[a:b] for a, b in bounds], None if aux is None else [aux[a:b] for a, b in bounds]

    def forward_last(self, batch: ForwardBatch) -> ForwardOutput:
        """Logits at each request's last token [B, 1, V], for a batch of ragged lengths (prompt
        chunks next to decodes): one pass, whatever the lengths (see flat_attention.py)."""
        return self.forward(replace(batch, all_logits=False))

    def synchronize(self) -> None:
        """Wait for queued device work, so that host timers measure it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

