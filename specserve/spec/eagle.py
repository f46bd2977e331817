"""EAGLE proposer: a one-layer feature-level drafter grows a dynamic draft tree per request, as
in EAGLE-2.

Per step and request (L = the last position with a target feature; the root is token L+1):
  1. catch-up: the drafter runs over the positions whose target features arrived since the
     last step (the accepted path, or the whole prompt the first time), writing its KV cache;
     its output at L predicts the feature at L+1, whose logits give the root's children.
  2. growth: depth by depth, the `topk` candidates of highest cumulative log-probability are
     expanded in one batched pass (input: the candidate's token and its parent's predicted
     feature), each yielding its `topk` children.
  3. the tree: the `max_nodes` candidates of highest cumulative log-probability. A child
     never scores above its parent, so their ancestors are in the tree too.
Candidates are deterministic (top-k), so the tree carries no draft probabilities: the
verifier's tree rule keeps greedy and sampled outputs exactly the target's.

EAGLE and EAGLE-3 draft with the same machinery (FeatureTreeProposer): every drafting request's
rows run together, flattened, one catch-up pass and one pass per depth, over the drafter's own
paged KV (heads/eagle_kv.py); EAGLE-3's drafter runs a pass on the native kernels or in torch,
EAGLE's heads in torch through the same flat drafter attention.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.drafts import DraftTreeProposal, SpecRequest, VerifyFeedback
from specserve.drafts.tree import DraftTree
from specserve.errors import InvalidParameterError
from specserve.kv.budget import num_kv_blocks
from specserve.model.loader import LoadedModel
from specserve.spec.draft_model import check_catch_up_window
from specserve.spec.heads import Drafter
from specserve.spec.heads.eagle_kv import DraftPass, EagleKV, FlatDraftAttention
from specserve.spec.hybrid import SuffixFirst
from specserve.spec.medusa import check_num_draft_nodes
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec
from specserve.spec.suffix import SuffixProposer

# Ties between a candidate and its parent (a child of probability 1 after rounding) go to the
# parent, so that a node is never chosen without its parent.
_DEPTH_TIE_BREAK = 1e-6


def path_floor(r: SpecRequest) -> float:
    """The least cumulative log-probability a node of r's tree may have (SpecRequest.min_path_prob)."""
    return math.log(r.min_path_prob) if r.min_path_prob > 0 else -math.inf


@dataclass(slots=True)
class _Row:
    index: int  # in the batch handed to propose
    request_id: str
    start: int  # first catch-up position
    states: torch.Tensor  # [C, F] the target's states at positions start..L (EAGLE-3: 3 captured)
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
    # With suffix decoding beside the drafter: the drafts each of them made.
    suffix_drafts: int = 0
    drafter_drafts: int = 0

    def as_dict(self) -> dict:
        per = (lambda t, n: round(1e3 * t / n, 4) if n else None)
        out = {"catch_up_ms": per(self.catch_up_s, self.catch_up_passes),
               "depth_ms": per(self.depth_s, self.depth_passes), "select_ms_total": round(1e3 * self.select_s, 3),
               "catch_up_passes": self.catch_up_passes, "depth_passes": self.depth_passes}
        if self.suffix_drafts or self.drafter_drafts:
            out["suffix_share"] = round(self.suffix_drafts / (self.suffix_drafts + self.drafter_drafts), 4)
        return out


class FeatureTreeProposer(Proposer):
    """What EAGLE and EAGLE-3 share (module note): a drafter KV per request fed with the
    target's states (EagleKV: `self.kv`), one catch-up pass and one pass per depth for every
    drafting request's rows, and a tree per request (`self.max_nodes` nodes, `self.topk`
    expanded per depth). `drafter` runs a pass (`step`) over flattened rows described by a
    DraftPass (heads/eagle_kv.py): EAGLE-3's Eagle3Drafter, or EAGLE's heads through _EagleSteps.
    """

    needs_hidden_states = True

    def __init__(self, drafter, target: LoadedModel, engine: EngineConfig, max_nodes: int, topk: int,
                 catch_up_window: int | None = None, suffix: SuffixFirst | None = None):
        self.drafter = drafter
        # Suffix decoding beside the drafter (spec/hybrid.py): the requests that take a suffix
        # draft skip the drafter this step (its catch-up waits for their next turn with it).
        self.suffix = suffix
        self.catch_up_window = catch_up_window  # EagleKV.begin's window (EagleOptions)
        self.max_nodes = max_nodes
        self.topk = min(topk, drafter.config.draft_vocab_size)
        self.kv = EagleKV(drafter.config.layer_config(), num_kv_blocks(target, engine), engine.block_size,
                          drafter.kv_dtype, drafter.device)
        self.k_rows = self.kv.cache.k.view(1, -1, *self.kv.cache.k.shape[-2:])  # [1, rows, Hkv, D]
        self.v_rows = self.kv.cache.v.view(1, -1, *self.kv.cache.v.shape[-2:])
        self.block_size = engine.block_size
        self.times = DraftingTimes()
        # The draft vocabulary's target ids, as each step reads them: a tensor on the drafter's
        # device for the growth passes' inputs, a host array for the trees.
        self.draft_ids = drafter.draft_ids
        self.draft_ids_host = drafter.draft_ids.cpu().numpy()
        # (B, K, depths) -> the growth metadata that does not depend on positions (a few
        # shapes per server: batch sizes up to max_num_seqs, depths up to the method's cap).
        self._shapes: dict[tuple[int, int, int], _GrowthShape] = {}

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        own = max(num_speculative_tokens, self.max_nodes)
        return own if self.suffix is None else max(own, self.suffix.num_draft_nodes(num_speculative_tokens))

    def observe_hidden(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        self.kv.observe(request_id, start_position, hidden)

    def add_request(self, request_id: str, prompt_token_ids) -> None:
        if self.suffix is not None:
            self.suffix.add_request(request_id, prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        self.kv.remove(request_id)
        if self.suffix is not None:
            self.suffix.remove_request(request_id)

    def observe(self, feedback: VerifyFeedback) -> None:
        if self.suffix is not None:
            self.suffix.observe(feedback)

    def _begin(self, batch: list[SpecRequest]) -> tuple[int, list[tuple[int, SpecRequest, int, torch.Tensor]]]:
        """-> (the batch's deepest tree, [(index in batch, request, first catch-up position,
        its target states [C, F])] for the requests that draft this step)."""
        depth = max((r.num_speculative_tokens for r in batch), default=0)
        begun = []
        for i, r in enumerate(batch):
            if not r.wants_tree:
                continue
            # Every request reserves the deepest growth of the batch, which runs for all rows.
            got = self.kv.begin(r.request_id, len(r.token_ids), (depth - 1) * self.topk, self.catch_up_window)
            if got is not None:
                begun.append((i, r, *got))
        return depth, begun

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        trees = [DraftTree.empty() for _ in batch]
        if self.suffix is not None:
            asking = sum(r.wants_tree for r in batch)
            batch, taken = self.suffix.split(batch, trees)
            self.times.suffix_drafts += taken
            self.times.drafter_drafts += asking - taken
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
        d, bs = self.drafter, self.block_size
        # The pass's metadata from plain lists: a step usually catches up one or two positions
        # of one request, where each numpy or torch op would cost more than the work (and a
        # prompt's thousand positions cost ~0.1 ms here against milliseconds of pass).
        positions: list[int] = []
        write_rows: list[int] = []
        q_start = [0]
        for r, table in zip(rows, tables.tolist()):
            span = range(r.start, r.start + len(r.next_tokens))
            positions += span
            write_rows += [table[p // bs] * bs + p % bs for p in span]
            q_start.append(len(positions))
        tokens = torch.tensor([t for r in rows for t in r.next_tokens] if len(rows) > 1 else rows[0].next_tokens,
                              dtype=torch.long)
        states = torch.cat([r.states for r in rows]) if len(rows) > 1 else rows[0].states  # [N, F]
        pos = torch.tensor(positions, dtype=torch.long)
        p = DraftPass(pos, torch.tensor(write_rows, dtype=torch.long), torch.tensor(q_start, dtype=torch.long), tables,
                      bs, pos + 1, torch.tensor([r.first for r in rows], dtype=torch.long))
        # Only each row's L goes past its key and value: the others only fill the cache.
        return d.step(d.embed(tokens.to(d.device)), states.to(d.device, torch.float32), p, self.k_rows, self.v_rows,
                      last_only=True)

    # ---- 2. and 3. growth and selection -------------------------------------------------------

    def _grow(self, rows: list[_Row], tables: torch.Tensor, roots: torch.Tensor, root_logits: torch.Tensor,
              depth: int) -> list[DraftTree]:
        d, k = self.drafter, self.topk
        if depth == 1:
            return self._depth_one(rows, root_logits)
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
                ids = self.draft_ids.index_select(0, cands.frontier_tok.view(-1))
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
        trees = cands.trees([(r.depth, r.max_nodes) for r in rows], self.draft_ids_host, floors)
        self.times.select_s += time.perf_counter() - t0
        return trees

    def _depth_one(self, rows: list[_Row], root_logits: torch.Tensor) -> list[DraftTree]:
        """Trees of one depth (the planner's most common choice on a CPU): each row's root
        children are its top min(k, max_nodes) candidates at or above its floor, what
        TreeCandidates and select_trees choose for them, without their general bookkeeping
        (~0.2 ms a step of Python and small tensors at batch 1)."""
        t0 = time.perf_counter()
        lp, tok = torch.log_softmax(root_logits, -1).topk(self.topk, dim=-1)  # [B, K], best first
        trees = []
        for row, scores, targets in zip(rows, lp.tolist(), self.draft_ids_host[tok.cpu().numpy()].tolist()):
            n = min(row.max_nodes, len(scores))
            while n and scores[n - 1] < row.floor:  # scores fall along the row: what stays is a prefix
                n -= 1
            trees.append(DraftTree(targets[:n], [-1] * n))
        self.times.select_s += time.perf_counter() - t0
        return trees


class _EagleSteps:
    """EAGLE's drafter (Drafter: its heads, draft vocabulary and the target's embedding) in the
    terms FeatureTreeProposer drafts with: a pass over flattened rows (EagleHead runs on [N, H]
    rows as on [B, T, H] ones), its keys and values in the drafter's KV, through the torch path's
    flat drafter attention."""

    def __init__(self, drafter: Drafter, device: torch.device):
        self.d = drafter
        self.config = drafter.config
        self.device = device
        self.kv_dtype = drafter.dtype

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.d.vocab.ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.d.embed(ids)

    def step(self, embeds: torch.Tensor, feature: torch.Tensor, p: DraftPass, k_rows: torch.Tensor,
             v_rows: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, feature [N, H] -> (out [N, H], logits [N, Vd]); last_only: each sequence's last
        row alone (out [B, H], logits [B, Vd]), as Eagle3Drafter.step."""
        d = self.d
        out = d.heads(embeds.to(d.dtype), feature.to(d.dtype), p.positions.to(self.device), p,
                      FlatDraftAttention(k_rows, v_rows))
        if last_only:
            out = out.index_select(0, (p.q_start[1:] - 1).to(out.device))
        return out, d.vocab(out)


class EagleProposer(FeatureTreeProposer):
    name = "eagle"

    def __init__(self, drafter: Drafter, target: LoadedModel, engine: EngineConfig, **options):
        super().__init__(_EagleSteps(drafter, target.model.device), target, engine, **options)


class TreeCandidates:
    """Every candidate of a batch of growing trees, numbered in creation order (parents before
    children: depth 1's k, then k * k per depth), and the frontier: the `k` candidates per row
    that the next depth expands."""

    def __init__(self, root_logits: torch.Tensor, k: int):
        """root_logits [B, Vd]: the root's children are its top k."""
        lp, tok = torch.log_softmax(root_logits, -1).topk(k, dim=-1)  # [B, K] depth-1 candidates
        self.k = k
        self.tok, self.score = [tok], [lp]  # per depth: draft-vocabulary indices, scores [B, n]
        self.picked: list[torch.Tensor] = []  # per expanded depth but the last: the next frontier [B, K]
        self.frontier_tok, self.frontier_score = tok, lp  # [B, K] draft-vocabulary indices, scores

    def frontier_below(self, floors: list[float]) -> bool:
        """Whether no row's frontier has a node at or above its floor (a log-probability): then
        no child of theirs can be kept, and growing stops."""
        if all(f == -math.inf for f in floors):
            return False
        best = self.frontier_score.max(-1).values.tolist()  # [B]
        return all(b < f for b, f in zip(best, floors))

    def expand(self, logits: torch.Tensor, last: bool) -> torch.Tensor | None:
        """The frontier's logits [B, K, Vd] add each node's top k children (the depth after the
        last one added). -> the next frontier [B, K] as indices among these K * K children
        (child c is a child of the frontier's node c // K); None when `last`."""
        k, bsz = self.k, logits.shape[0]
        # log_softmax before topk, not topk of the logits: two logits may round to one
        # log-probability, and such a tie must fall as the scores' top k says.
        clp, ctok = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [B, K, K]
        score = (self.frontier_score[:, :, None] + clp).view(bsz, k * k)
        ctok = ctok.reshape(bsz, k * k)
        self.tok.append(ctok)
        self.score.append(score)
        if last:
            return None
        # topk's values are the selected scores themselves: no gather of them.
        self.frontier_score, sel = score.topk(k, dim=-1)  # [B, K] the next depth's expanded nodes
        self.frontier_tok = ctok.gather(1, sel)
        self.picked.append(sel)
        return sel

    def trees(self, limits: list[tuple[int, int]], draft_ids: np.ndarray,
              floors: list[float] | None = None) -> list[DraftTree]:
        """Each row's best candidates (select_trees); draft_ids [Vd] (host) maps draft indices to
        target ids; floors: per row, the least cumulative log-probability a node may have."""
        k, bsz, depths = self.k, self.tok[0].shape[0], len(self.tok)
        depth_of, tie, fixed = _candidate_layout(k, depths)
        # Parent candidate ids: depths 1 and 2 are the layout's (fixed); depth i + 3's parents
        # are depth i + 2's frontier, each repeated for its k children.
        parents = [fixed[None].repeat(bsz, 0)]
        for i, sel in enumerate(self.picked[:depths - 2]):
            parents.append((sel.cpu().numpy() + (k + i * k * k)).repeat(k, 1))
        tok = torch.cat(self.tok, dim=1) if depths > 1 else self.tok[0]
        score = torch.cat(self.score, dim=1) if depths > 1 else self.score[0]
        return select_trees(limits, draft_ids[tok.cpu().numpy()], score.cpu(),
                            np.concatenate(parents, axis=1) if len(parents) > 1 else parents[0], depth_of, floors, tie)


@functools.lru_cache(maxsize=64)
def _candidate_layout(k: int, depths: int) -> tuple[np.ndarray, torch.Tensor, np.ndarray]:
    """What every tree of `depths` depths of top-k candidates shares: each candidate's depth [N],
    select_trees's depth tie-break for them (float32 [N], as the product of the depths and
    _DEPTH_TIE_BREAK), and the parents of depths 1 and 2 (-1: the root; depth 2's are depth 1's
    ids, each repeated for its k children). Shared by every call: read, never written."""
    sizes = [k] + [k * k] * (depths - 1)
    depth_of = np.repeat(np.arange(1, depths + 1), sizes)
    fixed = np.full(k, -1) if depths == 1 else np.concatenate([np.full(k, -1), np.repeat(np.arange(k), k)])
    return depth_of, _DEPTH_TIE_BREAK * torch.from_numpy(depth_of), fixed


def select_trees(limits: list[tuple[int, int]], tokens: np.ndarray, score: torch.Tensor, parents: np.ndarray,
                 depth_of: np.ndarray, floors: list[float] | None = None,
                 tie: torch.Tensor | None = None) -> list[DraftTree]:
    """Each row's best candidates as DraftTrees: limits[b] = (deepest depth, most nodes) of row
    b; candidates numbered in creation order (parents before children): target ids tokens
    [B, N], cumulative log-probabilities score float32 [B, N] (host), parent candidate ids
    parents [B, N] (-1: the root) and depths depth_of [N]. floors[b]: candidates scoring below
    it are left out (a child never scores above its parent, so what stays is a tree). tie: the
    depths' tie-break, _DEPTH_TIE_BREAK * depth_of, when the caller keeps it."""
    raw = score
    # float64: a tie-break of 1e-6 would vanish in float32 next to scores of -50.
    score = score.double() - (_DEPTH_TIE_BREAK * torch.from_numpy(depth_of) if tie is None else tie)  # [B, N]
    deepest_of = int(depth_of[-1])
    trees = []
    for b, (deepest, max_nodes) in enumerate(limits):
        floor = -math.inf if floors is None else floors[b]
        if deepest >= deepest_of and floor == -math.inf:  # every candidate may be chosen
            s, num_allowed = score[b], len(depth_of)
        else:
            allowed = depth_of <= deepest
            if floor > -math.inf:
                allowed = allowed & (raw[b].numpy() >= floor)
            num_allowed = int(allowed.sum())
            s = score[b]
            if num_allowed < len(depth_of):
                s = s.masked_fill(~torch.from_numpy(allowed), float("-inf"))
        chosen = s.topk(min(max_nodes, num_allowed)).indices.numpy()
        chosen.sort()  # creation order: parents first
        node_of = {c: i for i, c in enumerate(chosen.tolist())}
        trees.append(DraftTree(tokens[b, chosen].tolist(), [node_of.get(p, -1) for p in parents[b, chosen].tolist()]))
    return trees


@dataclass(frozen=True, slots=True)
class _GrowthShape:
    """What every proposal of B requests growing `depths` depths of K nodes shares (no positions),
    built once per (B, K, depths). n = B * K rows per pass, row b * K + i the frontier's i-th
    node of request b; depth j writes tree slot j * K + i after the context; the ancestor mask
    rows are `span` = depths * K bytes apart, of which the first tree_size[j] = (j + 1) * K are read."""

    seq_np: np.ndarray  # [n] the request of each row
    tree_slot: np.ndarray  # [depths, n] each row's tree slot at depth j
    level: np.ndarray  # [depths, 1] j
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
        return cls(seq, tree_slot, level, torch.from_numpy(seq), torch.from_numpy(np.arange(0, n + 1, k)),
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
        after = np.array([r.last + 1 for r in rows])  # [B] each row's first tree slot
        after_n = after[shape.seq_np]  # [n]
        write_rows = rows_of(tables.numpy(), after_n + shape.tree_slot, shape.seq_np)
        return cls(torch.from_numpy(after_n + shape.level), torch.from_numpy(write_rows), torch.from_numpy(after_n),
                   torch.tensor([r.first for r in rows]), torch.from_numpy(after))


MAX_DRAFT_TOPK = 32
MAX_SUFFIX_THRESHOLD = 64.0
# On the 2-core CPU a 9-token verification pass costs ~1.2-1.3x a decode step, and larger trees
# cost more than their extra acceptance brings (EAGLE on held-out prompts: 8 nodes, top-2).
DEFAULT_EAGLE_NODES = 8


@dataclass(frozen=True, slots=True)
class EagleOptions:
    """speculative_config's eagle keys: draft-tree nodes verified per step (num_speculative_tokens
    is the tree's depth; None: DEFAULT_EAGLE_NODES), and children kept per expanded node, nodes
    expanded per depth (EAGLE-2's top-k). catch_up_window W: a request whose drafter is more than
    W tokens behind (a long prompt never drafted from, or a pause the planner made) restarts its
    drafter's context from the last W tokens (EagleKV.begin), bounding what one probe costs;
    None (the default) catches up on everything, which is what a drafter that copies from its
    prompt wants. Drafts are proposals: the output is the target's either way. (Spec-Bench, 26
    prompts, AVX2 EPYC: W=16 took a catch-up pass from 0.85 to 0.63 ms and drafting from 0.31 to
    0.10 ms a pass, 0.96x plain both ways, within the run-to-run spread.)"""

    num_draft_nodes: int | None = None
    draft_topk: int = 2
    catch_up_window: int | None = None
    enable_suffix_decoding: bool = False
    suffix_threshold: float | None = None

    def __post_init__(self) -> None:
        check_num_draft_nodes(self.num_draft_nodes)
        check_catch_up_window(self.catch_up_window)
        topk = self.draft_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_DRAFT_TOPK:
            raise InvalidParameterError("draft_topk", topk, f"must be an integer in [1, {MAX_DRAFT_TOPK}]")
        if not isinstance(self.enable_suffix_decoding, bool):
            raise InvalidParameterError("enable_suffix_decoding", self.enable_suffix_decoding, "must be true or false")
        t = self.suffix_threshold
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= MAX_SUFFIX_THRESHOLD):
            raise InvalidParameterError("suffix_threshold", t, f"must be a number in [0, {MAX_SUFFIX_THRESHOLD}] (expected "
                                        "tokens kept), or None (chosen by what each source's drafts kept)")

    def companions(self) -> dict:
        """The keyword arguments FeatureTreeProposer takes from these options."""
        return {"max_nodes": self.num_draft_nodes or DEFAULT_EAGLE_NODES, "topk": self.draft_topk,
                "catch_up_window": self.catch_up_window,
                "suffix": SuffixFirst(SuffixProposer(), self.suffix_threshold) if self.enable_suffix_decoding else None}


def _build(options: EagleOptions, model: str | None, target: LoadedModel, engine: EngineConfig) -> EagleProposer:
    from specserve.spec.heads.drafter import drafter_path, load_drafter
    return EagleProposer(load_drafter(drafter_path(model, "eagle"), target), target, engine, **options.companions())


# EAGLE drafts one depth per small pass, so its cap is lower than n-gram's.
METHOD = MethodSpec("eagle", EagleOptions, _build, auto_max_k=6,
                    needs_model="method 'eagle' needs the folder `specserve train-draft` wrote")
