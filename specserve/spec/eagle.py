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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from specserve.config import EngineConfig
from specserve.errors import InvalidParameterError
from specserve.kv.budget import num_kv_blocks
from specserve.model.loader import LoadedModel
from specserve.spec.heads import Drafter
from specserve.spec.heads.eagle_kv import EagleKV
from specserve.drafts import DraftTreeProposal, SpecRequest
from specserve.spec.medusa import check_num_draft_nodes
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec
from specserve.drafts.tree import DraftTree

# A catch-up of at most this many positions (a decode step's accepted path) shares a padded
# pass with the others; a longer one (a prompt) runs alone rather than padding every row to it.
_SHARED_CATCH_UP = 16
# Ties between a candidate and its parent (a child of probability 1 after rounding) go to the
# parent, so that a node is never chosen without its parent.
_DEPTH_TIE_BREAK = 1e-6


def path_floor(r: SpecRequest) -> float:
    """The least cumulative log-probability a node of r's tree may have (SpecRequest.min_path_prob)."""
    return math.log(r.min_path_prob) if r.min_path_prob > 0 else -math.inf


@dataclass(slots=True)
class _Row:
    """A request drafting this step."""

    index: int  # in the batch handed to propose
    request_id: str
    start: int  # first catch-up position
    features: torch.Tensor  # [C, H] target features at positions start..L
    next_tokens: list[int]  # [C] the token after each of those positions (the drafter's token input)
    depth: int  # deepest allowed node
    max_nodes: int
    floor: float = -math.inf  # log of SpecRequest.min_path_prob: no node below it

    @property
    def last(self) -> int:  # L
        return self.start + len(self.next_tokens) - 1


class FeatureTreeProposer(Proposer):
    """What EAGLE and EAGLE-3 share: a drafter KV per request fed with the target's states
    (EagleKV: `self.kv`), and a tree per request whose growth every drafting request's rows run
    together (`self.max_nodes` nodes, `self.topk` expanded per depth)."""

    needs_hidden_states = True
    kv: EagleKV
    max_nodes: int
    topk: int

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        return max(num_speculative_tokens, self.max_nodes)

    def observe_hidden(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        self.kv.observe(request_id, start_position, hidden)

    def remove_request(self, request_id: str) -> None:
        self.kv.remove(request_id)

    def _begin(self, batch: list[SpecRequest]) -> tuple[int, list[tuple[int, SpecRequest, int, torch.Tensor]]]:
        """-> (the batch's deepest tree, [(index in batch, request, first catch-up position,
        its target states [C, F])] for the requests that draft this step)."""
        depth = max((r.num_speculative_tokens for r in batch), default=0)
        begun = []
        for i, r in enumerate(batch):
            if r.num_speculative_tokens < 1 or r.max_nodes < 1:
                continue
            # Every request reserves the deepest growth of the batch, which runs for all rows.
            got = self.kv.begin(r.request_id, len(r.token_ids), (depth - 1) * self.topk)
            if got is not None:
                begun.append((i, r, *got))
        return depth, begun


class EagleProposer(FeatureTreeProposer):
    name = "eagle"

    def __init__(self, drafter: Drafter, target: LoadedModel, engine: EngineConfig, max_nodes: int, topk: int):
        self.drafter = drafter
        self.max_nodes = max_nodes
        self.topk = min(topk, drafter.config.draft_vocab_size)
        model = target.model
        self.kv = EagleKV(drafter.config.layer_config(), num_kv_blocks(target, engine), engine.block_size,
                          drafter.dtype, model.device)

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        trees = [DraftTree.empty() for _ in batch]
        depth, begun = self._begin(batch)
        rows = [_Row(i, r.request_id, start, features, list(r.token_ids[start + 1:]), r.num_speculative_tokens,
                     r.max_nodes, path_floor(r)) for i, r, start, features in begun]
        if not rows:
            return DraftTreeProposal(trees)
        roots = self._catch_up(rows)  # [B, H]
        for row, tree in zip(rows, self._grow(rows, roots, depth)):
            trees[row.index] = tree
        for row in rows:  # the context stays, the tree slots go back
            self.kv.commit(row.request_id, row.last + 2)
        return DraftTreeProposal(trees)

    # ---- 1. catch-up -------------------------------------------------------------------------

    def _catch_up(self, rows: list[_Row]) -> torch.Tensor:
        """Feed each row's new positions; -> the drafter's output at each row's L [B, H]."""
        short = [j for j, r in enumerate(rows) if len(r.next_tokens) <= _SHARED_CATCH_UP]
        groups = ([short] if short else []) + [[j] for j in range(len(rows)) if j not in short]
        out: list[torch.Tensor | None] = [None] * len(rows)
        for group in groups:
            for j, h in zip(group, self._catch_up_pass([rows[j] for j in group])):
                out[j] = h
        return torch.stack(out)

    def _catch_up_pass(self, rows: list[_Row]) -> torch.Tensor:
        device, h = self.kv.device, self.drafter.config.hidden_size
        width = max(len(r.next_tokens) for r in rows)
        tokens = torch.zeros(len(rows), width, dtype=torch.long)
        features = torch.zeros(len(rows), width, h, dtype=self.drafter.dtype, device=device)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        slots = torch.full((len(rows), width), -1, dtype=torch.long)
        for b, r in enumerate(rows):
            c = len(r.next_tokens)
            tokens[b, :c] = torch.tensor(r.next_tokens)
            features[b, :c] = r.features
            positions[b, :c] = torch.arange(r.start, r.start + c)
            slots[b, :c] = positions[b, :c]
        span = max(r.last for r in rows) + 1
        keys = torch.arange(span)
        first = torch.tensor([self.kv.first(r.request_id) for r in rows])[:, None, None]
        # Causal from the request's first entry; padding queries see that entry (never nothing).
        upto = torch.where(slots >= 0, positions, first[:, :, 0])[:, :, None]
        visible = (keys >= first) & (keys <= upto)  # [B, C, S]
        meta = self.kv.metadata(self.kv.tables([r.request_id for r in rows], span), positions, slots, visible)
        d = self.drafter
        g = d.heads(d.embed(tokens.to(device)).to(d.dtype), features, meta.positions, meta, self.kv.cache)  # [B, C, H]
        last = torch.tensor([len(r.next_tokens) - 1 for r in rows], device=device)
        return g[torch.arange(len(rows), device=device), last]

    # ---- 2. and 3. growth and selection -------------------------------------------------------

    def _grow(self, rows: list[_Row], roots: torch.Tensor, depth: int) -> list[DraftTree]:
        d, k = self.drafter, self.topk
        bsz = len(rows)
        cands = TreeCandidates(d.vocab(roots), k)
        floors = [r.floor for r in rows]
        if cands.frontier_below(floors):
            depth = 1
        frontier_feat = roots[:, None].expand(bsz, k, roots.shape[-1])  # [B, K, H] the parent's output
        span = (depth - 1) * k  # tree slots after each row's context
        frontier_anc = torch.zeros(bsz, k, max(span, 1), dtype=torch.bool)  # expanded ancestors' tree slots
        last = torch.tensor([r.last for r in rows])
        first = torch.tensor([self.kv.first(r.request_id) for r in rows])
        num_keys = int(last.max()) + 1 + span
        tables = self.kv.tables([r.request_id for r in rows], num_keys)
        keys = torch.arange(num_keys)
        context = (keys >= first[:, None]) & (keys <= last[:, None])  # [B, S]
        rel = keys[None, :] - (last[:, None] + 1)  # [B, S] tree slot of each key (< 0: context)
        offset = 0
        for level in range(2, depth + 1):
            own = torch.arange(offset, offset + k)
            anc = frontier_anc.clone()
            anc[:, torch.arange(k), own] = True
            tree_part = anc.gather(2, rel.clamp(0, span - 1)[:, None, :].expand(bsz, k, num_keys))
            visible = context[:, None, :] | (tree_part & (rel >= 0)[:, None, :])  # [B, K, S]
            positions = (last + level - 1)[:, None].expand(bsz, k)
            slots = last[:, None] + 1 + own[None, :]
            meta = self.kv.metadata(tables, positions, slots, visible)
            g = d.heads(d.embed(d.vocab.ids[cands.frontier_tok]).to(d.dtype), frontier_feat, meta.positions, meta,
                        self.kv.cache)
            sel = cands.expand(d.vocab(g), last=level == depth)
            offset += k
            if sel is None or cands.frontier_below(floors):  # nothing deeper could be kept
                break
            parent = sel // k  # [B, K] each next frontier node's parent in this frontier
            frontier_feat = g.gather(1, parent[:, :, None].expand(bsz, k, g.shape[-1]))
            frontier_anc = anc.gather(1, parent.cpu()[:, :, None].expand(bsz, k, anc.shape[-1]))
        return cands.trees([(r.depth, r.max_nodes) for r in rows], d.vocab.ids, floors)



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

    def trees(self, limits: list[tuple[int, int]], draft_ids: torch.Tensor,
              floors: list[float] | None = None) -> list[DraftTree]:
        """Each row's best candidates (select_trees); draft_ids [Vd] maps draft indices to target
        ids; floors: per row, the least cumulative log-probability a node may have."""
        k, bsz = self.k, self.tok[0].shape[0]
        sizes = [t.shape[1] for t in self.tok]
        # Parent candidate ids, per depth: -1 (the root) at depth 1, the frontier's ids each
        # repeated for its k children after (depth 2's frontier is depth 1, ids 0..k-1).
        parents = [np.full((bsz, k), -1)]
        if len(sizes) > 1:
            parents.append(np.broadcast_to(np.repeat(np.arange(k), k), (bsz, k * k)))
        for i, sel in enumerate(self.picked[:len(sizes) - 2]):  # depth i + 3's parents, at depth i + 2
            parents.append(np.repeat(sel.cpu().numpy() + (k + i * k * k), k, axis=1))
        return select_trees(limits, draft_ids.cpu().numpy()[torch.cat(self.tok, dim=1).cpu().numpy()],
                            torch.cat(self.score, dim=1).cpu(), np.concatenate(parents, axis=1),
                            np.repeat(np.arange(1, len(sizes) + 1), sizes), floors)


def select_trees(limits: list[tuple[int, int]], tokens: np.ndarray, score: torch.Tensor, parents: np.ndarray,
                 depth_of: np.ndarray, floors: list[float] | None = None) -> list[DraftTree]:
    """Each row's best candidates as DraftTrees: limits[b] = (deepest depth, most nodes) of row
    b; candidates numbered in creation order (parents before children): target ids tokens
    [B, N], cumulative log-probabilities score float32 [B, N] (host), parent candidate ids
    parents [B, N] (-1: the root) and depths depth_of [N]. floors[b]: candidates scoring below
    it are left out (a child never scores above its parent, so what stays is a tree)."""
    raw = score
    # float64: a tie-break of 1e-6 would vanish in float32 next to scores of -50.
    score = score.double() - _DEPTH_TIE_BREAK * torch.from_numpy(depth_of)  # [B, N]
    trees = []
    for b, (deepest, max_nodes) in enumerate(limits):
        allowed = depth_of <= deepest
        if floors is not None and floors[b] > -math.inf:
            allowed = allowed & (raw[b].numpy() >= floors[b])
        num_allowed = int(allowed.sum())
        s = score[b] if num_allowed == len(depth_of) else score[b].masked_fill(~torch.from_numpy(allowed), float("-inf"))
        chosen = np.sort(s.topk(min(max_nodes, num_allowed)).indices.numpy())  # creation order: parents first
        node_of = {c: i for i, c in enumerate(chosen.tolist())}
        trees.append(DraftTree(tokens[b, chosen].tolist(), [node_of.get(p, -1) for p in parents[b, chosen].tolist()]))
    return trees


MAX_DRAFT_TOPK = 32
# On the 2-core CPU a 9-token verification pass costs ~1.2-1.3x a decode step, and larger trees
# cost more than their extra acceptance brings (EAGLE on held-out prompts: 8 nodes, top-2).
DEFAULT_EAGLE_NODES = 8


@dataclass(frozen=True, slots=True)
class EagleOptions:
    """speculative_config's eagle keys: draft-tree nodes verified per step (num_speculative_tokens
    is the tree's depth; None: DEFAULT_EAGLE_NODES), and children kept per expanded node, nodes
    expanded per depth (EAGLE-2's top-k)."""

    num_draft_nodes: int | None = None
    draft_topk: int = 2

    def __post_init__(self) -> None:
        check_num_draft_nodes(self.num_draft_nodes)
        topk = self.draft_topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_DRAFT_TOPK:
            raise InvalidParameterError("draft_topk", topk, f"must be an integer in [1, {MAX_DRAFT_TOPK}]")


def _build(options: EagleOptions, model: str | None, target: LoadedModel, engine: EngineConfig) -> EagleProposer:
    from specserve.spec.heads.drafter import drafter_path, load_drafter
    return EagleProposer(load_drafter(drafter_path(model, "eagle"), target), target, engine,
                         max_nodes=options.num_draft_nodes or DEFAULT_EAGLE_NODES, topk=options.draft_topk)


# EAGLE drafts one depth per small pass, so its cap is lower than n-gram's.
METHOD = MethodSpec("eagle", EagleOptions, _build, auto_max_k=6,
                    needs_model="method 'eagle' needs the folder `specserve train-draft` wrote")
