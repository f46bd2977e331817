"""EAGLE-3 proposer: a one-layer drafter over three fused target states grows a dynamic draft
tree per request (EAGLE-2's tree, EAGLE-3's drafter).

Per step, for every drafting request of the batch at once (L = the last position with target
states; the root is token L+1):
  1. catch-up: one pass over every row's new positions (the accepted path, or the whole prompt
     the first time): fc fuses the target's three captured states [3 Ht] into a feature, the
     layer writes the drafter's KV at those positions, and its output at L gives the logits of
     the root's children.
  2. growth: depth by depth, the `topk` candidates of highest cumulative log-probability of
     every row are expanded in one pass (input: the candidate's token and its parent's
     output; they attend to the context and to their own ancestors through a tree mask),
     each yielding its `topk` children.
  3. the tree: each row's `max_nodes` candidates of highest cumulative log-probability.
Each pass is one call into the drafter (native kernels next to a native target: fc, layer and
draft head as quantized products over the drafter's own paged KV; torch otherwise). Candidates
are deterministic (top-k), so the verifier's tree rule keeps every output exactly the target's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specserve.config import EngineConfig
from specserve.drafts import DraftTreeProposal, SpecRequest
from specserve.drafts.tree import DraftTree
from specserve.kv.budget import num_kv_blocks
from specserve.model.loader import LoadedModel
from specserve.spec.eagle import DEFAULT_EAGLE_NODES, EagleOptions, FeatureTreeProposer, TreeCandidates
from specserve.spec.heads.eagle3_loader import DraftPass, Eagle3Drafter, load_eagle3_drafter
from specserve.spec.heads.eagle_kv import EagleKV
from specserve.spec.registry import MethodSpec


@dataclass(slots=True)
class _Row:
    index: int  # in the batch handed to propose
    request_id: str
    start: int  # first catch-up position
    states: torch.Tensor  # [C, 3 Ht] the target's captured states at positions start..L
    next_tokens: list[int]  # [C] the token after each of those positions
    depth: int
    max_nodes: int
    first: int = 0  # the request's first drafter entry

    @property
    def last(self) -> int:  # L
        return self.start + len(self.next_tokens) - 1


@dataclass(slots=True)
class DraftingTimes:
    """Where drafting time goes, for `bench`: catch-up passes and growth depths."""

    catch_up_s: float = 0.0
    catch_up_passes: int = 0
    depth_s: float = 0.0
    depth_passes: int = 0
    select_s: float = 0.0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        per = (lambda t, n: round(1e3 * t / n, 4) if n else None)
        return {"catch_up_ms": per(self.catch_up_s, self.catch_up_passes),
                "depth_ms": per(self.depth_s, self.depth_passes), "select_ms_total": round(1e3 * self.select_s, 3),
                "catch_up_passes": self.catch_up_passes, "depth_passes": self.depth_passes}


class Eagle3Proposer(FeatureTreeProposer):
    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, target: LoadedModel, engine: EngineConfig, max_nodes: int, topk: int):
        self.drafter = drafter
        self.hidden_layers = drafter.config.aux_layers
        self.max_nodes = max_nodes
        self.topk = min(topk, drafter.config.draft_vocab_size)
        self.kv = EagleKV(drafter.config.layer_config(), num_kv_blocks(target, engine), engine.block_size,
                          drafter.kv_dtype, drafter.device)
        bs = engine.block_size
        self.k_rows = self.kv.cache.k.view(1, -1, *self.kv.cache.k.shape[-2:])  # [1, rows, Hkv, D]
        self.v_rows = self.kv.cache.v.view(1, -1, *self.kv.cache.v.shape[-2:])
        self.block_size = bs
        self.times = DraftingTimes()

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        trees = [DraftTree.empty() for _ in batch]
        depth, begun = self._begin(batch)
        rows = [_Row(i, r.request_id, start, states, list(r.token_ids[start + 1:]), r.num_speculative_tokens,
                     r.max_nodes, self.kv.first(r.request_id)) for i, r, start, states in begun]
        if not rows:
            return DraftTreeProposal(trees)
        tables = self.kv.tables([r.request_id for r in rows], max(r.last for r in rows) + 1 + max(depth - 1, 0) * self.topk)
        t0 = time.perf_counter()
        root_out, root_logits = self._catch_up(rows, tables)  # [B, H], [B, Vd]
        self.times.catch_up_s += time.perf_counter() - t0
        self.times.catch_up_passes += 1
        for row, tree in zip(rows, self._grow(rows, tables, root_out, root_logits, depth)):
            trees[row.index] = tree
        for row in rows:  # the context stays, the tree slots go back
            self.kv.commit(row.request_id, row.last + 2)
        return DraftTreeProposal(trees)

    def _rows_of(self, tables: torch.Tensor, slots: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """Logical slots [N] of sequences seq [N] -> physical cache rows [N]."""
        bs = self.block_size
        return tables[seq, slots // bs] * bs + slots % bs

    # ---- 1. catch-up -------------------------------------------------------------------------

    def _catch_up(self, rows: list[_Row], tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over every row's new positions, causal -> output and logits at each L."""
        d = self.drafter
        counts = [len(r.next_tokens) for r in rows]
        q_start = torch.tensor([0] + counts).cumsum(0)
        seq = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(counts))
        positions = torch.cat([torch.arange(r.start, r.start + c) for r, c in zip(rows, counts)])
        tokens = torch.tensor([t for r in rows for t in r.next_tokens], dtype=torch.long)
        states = torch.cat([r.states for r in rows]).to(d.device, torch.float32)  # [N, 3 Ht]
        p = DraftPass(positions, self._rows_of(tables, positions, seq), q_start, tables, self.block_size, positions + 1,
                      torch.tensor([r.first for r in rows]))
        out, logits = d.step(d.embed(tokens.to(d.device)), states, p, self.k_rows, self.v_rows)
        ends = (q_start[1:] - 1).to(out.device)
        return out[ends], logits[ends]

    # ---- 2. and 3. growth and selection -------------------------------------------------------

    def _grow(self, rows: list[_Row], tables: torch.Tensor, roots: torch.Tensor, root_logits: torch.Tensor,
              depth: int) -> list[DraftTree]:
        d, k = self.drafter, self.topk
        bsz = len(rows)
        cands = TreeCandidates(root_logits, k)
        frontier_out = roots[:, None].expand(bsz, k, roots.shape[-1])  # [B, K, H] each parent's output
        span = max(depth - 1, 0) * k  # tree slots after each row's context
        frontier_anc = torch.zeros(bsz, k, max(span, 1), dtype=torch.uint8)  # expanded ancestors' tree slots
        last = torch.tensor([r.last for r in rows])
        seq = torch.arange(bsz).repeat_interleave(k)
        q_start = torch.arange(0, bsz * k + 1, k)
        kv_start = torch.tensor([r.first for r in rows])
        offset = 0
        for level in range(2, depth + 1):
            t0 = time.perf_counter()
            own = torch.arange(offset, offset + k)
            anc = frontier_anc.clone()
            anc[:, torch.arange(k), own] = 1
            size = offset + k
            positions = (last + level - 1).repeat_interleave(k)
            slots = (last + 1).repeat_interleave(k) + own.repeat(bsz)
            p = DraftPass(positions, self._rows_of(tables, slots, seq), q_start, tables, self.block_size,
                          (last + 1).repeat_interleave(k), kv_start,
                          tree_row=torch.arange(bsz * k) * size, tree_start=last + 1,
                          tree_size=torch.full((bsz,), size), tree_mask=anc[:, :, :size].contiguous().view(-1))
            ids = d.draft_ids[cands.frontier_tok.reshape(-1)]
            out, logits = d.step(d.embed(ids), frontier_out.reshape(bsz * k, -1), p, self.k_rows, self.v_rows)
            out = out.view(bsz, k, -1)
            parent = cands.expand(level, logits.view(bsz, k, -1), last=level == depth)
            offset += k
            if parent is not None:
                frontier_out = out.gather(1, parent[:, :, None].expand(bsz, k, out.shape[-1]))
                frontier_anc = anc.gather(1, parent[:, :, None].expand(bsz, k, anc.shape[-1]))
            self.times.depth_s += time.perf_counter() - t0
            self.times.depth_passes += 1
        t0 = time.perf_counter()
        trees = cands.trees([(r.depth, r.max_nodes) for r in rows], d.draft_ids)
        self.times.select_s += time.perf_counter() - t0
        return trees


def _build(options: EagleOptions, model: str | None, target: LoadedModel, engine: EngineConfig) -> Eagle3Proposer:
    return Eagle3Proposer(load_eagle3_drafter(model, target), target, engine,
                          max_nodes=options.num_draft_nodes or DEFAULT_EAGLE_NODES, topk=options.draft_topk)


# The same options as eagle's (the tree and its top-k), and the same default tree.
METHOD = MethodSpec("eagle3", EagleOptions, _build, auto_max_k=6,
                    needs_model="method 'eagle3' needs an EAGLE-3 drafter folder (its own, one from "
                                "`specserve train-draft --method eagle3`, or 'default' for the embedded model)")
