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

import math
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.drafts import DraftTreeProposal, SpecRequest
from specserve.drafts.tree import DraftTree
from specserve.errors import InvalidParameterError
from specserve.kv.budget import num_kv_blocks
from specserve.model.loader import LoadedModel
from specserve.spec.eagle import DEFAULT_EAGLE_NODES, EagleOptions, FeatureTreeProposer, TreeCandidates, path_floor
from specserve.spec.heads.eagle3_loader import DEFAULT_DRAFTER_FORMAT, DRAFTER_FORMATS, DraftPass, Eagle3Drafter, load_eagle3_drafter
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
    floor: float = -math.inf  # log of SpecRequest.min_path_prob: no node below it

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
        # (B, K, depths) -> the growth metadata that does not depend on positions (a few
        # shapes per server: batch sizes up to max_num_seqs, depths up to the method's cap).
        self._shapes: dict[tuple[int, int, int], _GrowthShape] = {}

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        trees = [DraftTree.empty() for _ in batch]
        depth, begun = self._begin(batch)
        rows = [_Row(i, r.request_id, start, states, list(r.token_ids[start + 1:]), r.num_speculative_tokens,
                     r.max_nodes, self.kv.first(r.request_id), path_floor(r)) for i, r, start, states in begun]
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

    def _rows_of(self, tables: np.ndarray, slots: np.ndarray, seq: np.ndarray) -> np.ndarray:
        """Logical slots [..., N] of sequences seq [N] -> physical cache rows [..., N]."""
        bs = self.block_size
        return tables[seq, slots // bs] * bs + slots % bs

    # ---- 1. catch-up -------------------------------------------------------------------------

    def _catch_up(self, rows: list[_Row], tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over every row's new positions, causal -> output [B, H] and logits [B, Vd] at
        each L."""
        d = self.drafter
        # The pass's metadata in numpy (a handful of tiny arrays: each torch op would cost more
        # than its work), handed over without copies.
        counts = np.fromiter((len(r.next_tokens) for r in rows), np.int64, len(rows))
        ends = np.cumsum(counts)  # [B] one past each row's last entry
        seq = np.repeat(np.arange(len(rows)), counts)  # [N]
        starts = np.fromiter((r.start for r in rows), np.int64, len(rows))
        positions = np.arange(ends[-1]) + (starts - (ends - counts))[seq]  # [N]
        tokens = torch.tensor([t for r in rows for t in r.next_tokens] if len(rows) > 1 else rows[0].next_tokens,
                              dtype=torch.long)
        states = torch.cat([r.states for r in rows]) if len(rows) > 1 else rows[0].states  # [N, 3 Ht]
        p = DraftPass(torch.from_numpy(positions), torch.from_numpy(self._rows_of(tables.numpy(), positions, seq)),
                      torch.from_numpy(np.concatenate(([0], ends))), tables, self.block_size,
                      torch.from_numpy(positions + 1),
                      torch.from_numpy(np.fromiter((r.first for r in rows), np.int64, len(rows))))
        # Only each row's L goes past its key and value: the others only fill the cache.
        return d.step(d.embed(tokens.to(d.device)), states.to(d.device, torch.float32), p, self.k_rows, self.v_rows,
                      last_only=True)

    # ---- 2. and 3. growth and selection -------------------------------------------------------

    def _grow(self, rows: list[_Row], tables: torch.Tensor, roots: torch.Tensor, root_logits: torch.Tensor,
              depth: int) -> list[DraftTree]:
        d, k = self.drafter, self.topk
        cands = TreeCandidates(root_logits, k)
        floors = [r.floor for r in rows]
        t0 = time.perf_counter()  # the plan counts as growth time, spread over the depths
        if depth > 1 and not cands.frontier_below(floors):
            key = (len(rows), k, depth - 1)
            shape = self._shapes.get(key)
            if shape is None:
                shape = self._shapes[key] = _GrowthShape.of(*key)
            plan = _GrowthPlan.of(shape, rows, tables, self._rows_of)
            frontier_out = roots.index_select(0, shape.seq.to(roots.device))  # [B * K, H] each parent's output
            frontier_anc = shape.own[0]  # [B * K, span] expanded ancestors' tree slots, own slot set
            for j in range(depth - 1):  # level j + 2
                anc = frontier_anc if j == 0 else frontier_anc + shape.own[j]  # own slot free until now: + is |
                p = DraftPass(plan.positions[j], plan.write_rows[j], shape.q_start, tables, self.block_size,
                              plan.prefix_len, plan.kv_start, tree_row=shape.tree_row, tree_start=plan.tree_start,
                              tree_size=shape.tree_size[j], tree_mask=anc.view(-1))
                ids = d.draft_ids.index_select(0, cands.frontier_tok.view(-1))
                out, logits = d.step(d.embed(ids), frontier_out, p, self.k_rows, self.v_rows)
                last = j == depth - 2
                sel = cands.expand(logits.view(len(rows), k, -1), last=last)
                t1 = time.perf_counter()
                self.times.depth_s += t1 - t0
                self.times.depth_passes += 1
                t0 = t1
                if last or cands.frontier_below(floors):  # nothing deeper could be kept
                    break
                flat = shape.parent_row.to(sel.device).gather(1, sel).view(-1)  # [B * K] parent's row in this pass
                frontier_out = out.index_select(0, flat)
                frontier_anc = anc.index_select(0, flat.cpu())
        trees = cands.trees([(r.depth, r.max_nodes) for r in rows], d.draft_ids, floors)
        self.times.select_s += time.perf_counter() - t0
        return trees


@dataclass(frozen=True, slots=True)
class _GrowthShape:
    """What every proposal of B requests growing `depths` depths of K nodes shares (no positions),
    built once per (B, K, depths). n = B * K rows per pass, row b * K + i the frontier's i-th
    node of request b; depth j writes tree slot j * K + i after the context; the ancestor mask
    rows are `span` = depths * K bytes apart, of which the first tree_size[j] = (j + 1) * K are read."""

    seq_np: np.ndarray  # [n] the request of each row
    tree_slot: np.ndarray  # [depths, n] each row's tree slot at depth j
    seq: torch.Tensor  # [n]
    q_start: torch.Tensor  # [B + 1]
    tree_row: torch.Tensor  # [n] byte offset of each row's ancestor mask
    tree_size: torch.Tensor  # [depths, B]
    own: torch.Tensor  # [depths, n, span] uint8: each row's own tree slot at depth j
    parent_row: torch.Tensor  # [B, K * K] the row of child c's parent: b * K + c // K

    @classmethod
    def of(cls, bsz: int, k: int, depths: int) -> _GrowthShape:
        n, span = bsz * k, depths * k
        seq = np.repeat(np.arange(bsz), k)
        level = np.arange(depths)[:, None]  # [depths, 1]
        tree_slot = level * k + np.tile(np.arange(k), bsz)
        own = np.zeros((depths, n, span), dtype=np.uint8)
        own[level, np.arange(n), tree_slot] = 1
        return cls(seq, tree_slot, torch.from_numpy(seq), torch.from_numpy(np.arange(0, n + 1, k)),
                   torch.from_numpy(np.arange(n) * span), torch.from_numpy(np.repeat((level + 1) * k, bsz, axis=1)),
                   torch.from_numpy(own), torch.from_numpy(np.arange(0, n, k)[:, None] + np.arange(k * k) // k))


@dataclass(slots=True)
class _GrowthPlan:
    """The growth passes' metadata that depends on the rows' positions, for one proposal (depth
    j's are row views): depth j (level j + 2) sits at position L + 1 + j and writes slot
    L + 1 + tree_slot."""

    positions: torch.Tensor  # [depths, n]
    write_rows: torch.Tensor  # [depths, n] physical cache rows
    prefix_len: torch.Tensor  # [n] the context: slots up to L
    kv_start: torch.Tensor  # [B]
    tree_start: torch.Tensor  # [B] L + 1

    @classmethod
    def of(cls, shape: _GrowthShape, rows: list[_Row], tables: torch.Tensor, rows_of) -> _GrowthPlan:
        after = np.fromiter((r.last + 1 for r in rows), np.int64, len(rows))  # [B] each row's first tree slot
        after_n = after[shape.seq_np]  # [n]
        return cls(torch.from_numpy(after_n + np.arange(len(shape.tree_slot))[:, None]),
                   torch.from_numpy(rows_of(tables.numpy(), after_n + shape.tree_slot, shape.seq_np)),
                   torch.from_numpy(after_n), torch.from_numpy(np.fromiter((r.first for r in rows), np.int64, len(rows))),
                   torch.from_numpy(after))


@dataclass(frozen=True, slots=True)
class Eagle3Options(EagleOptions):
    """eagle's options (the tree and its top-k), and the format of the drafter's matrices on the
    native kernels (vLLM's speculative_config "quantization" names the draft's): Q4_0 by
    default, half the bytes a drafting depth reads of Q8_0's (Spec-Bench, 65 prompts, on the
    2-core Xeon: a depth 0.60 ms against 0.76, 0.97x plain against 0.95x; tau at k=4 on 24
    prompts 1.567 against 1.584), or Q8_0 / Q4_1. Drafts are only proposals: the output is the
    target's whatever the format."""

    quantization: str = DEFAULT_DRAFTER_FORMAT

    def __post_init__(self) -> None:
        EagleOptions.__post_init__(self)
        if self.quantization not in DRAFTER_FORMATS:
            raise InvalidParameterError("quantization", self.quantization,
                                        f"must be one of {', '.join(DRAFTER_FORMATS)} (the EAGLE-3 drafter's format)")


def _build(options: Eagle3Options, model: str | None, target: LoadedModel, engine: EngineConfig) -> Eagle3Proposer:
    return Eagle3Proposer(load_eagle3_drafter(model, target, quantization=options.quantization), target, engine,
                          max_nodes=options.num_draft_nodes or DEFAULT_EAGLE_NODES, topk=options.draft_topk)


# eagle's tree and its default, and the drafter's format.
METHOD = MethodSpec("eagle3", Eagle3Options, _build, auto_max_k=6,
                    needs_model="method 'eagle3' needs an EAGLE-3 drafter folder (its own, one from "
                                "`specserve train-draft --method eagle3`, or 'default' for the embedded model)")
