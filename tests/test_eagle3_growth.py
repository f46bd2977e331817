"""EAGLE-3 tree growth against a straightforward reference of the same arithmetic: the proposer
precomputes every depth's metadata and selects trees in bulk, the reference below builds each
depth's metadata from scratch and selects node by node. Both must grow bit-identical candidates
(tokens, cumulative log-probabilities, parents) and therefore identical trees, on the torch path
and on the native kernels, with peaked logits, near-ties and exact ties (a zero drafter)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from specserve import native
from specserve.config import EngineConfig
from specserve.drafts import SpecRequest
from specserve.drafts.tree import DraftTree
from specserve.sampling_params import SamplingParams
from specserve.spec import eagle
from specserve.spec.eagle3 import Eagle3Proposer
from specserve.spec.heads.eagle3_loader import DraftPass, Eagle3Drafter, load_eagle3_drafter
from tests.test_eagle3 import random_head

GREEDY = SamplingParams(temperature=0)
_TIE_BREAK = 1e-6  # eagle.py's depth tie-break


class _RefCandidates:
    """Every candidate in creation order; each depth's log_softmax, top k, scores and frontier
    spelled out."""

    def __init__(self, root_logits: torch.Tensor, k: int):
        lp, tok = torch.log_softmax(root_logits, -1).topk(k, dim=-1)
        self.k = k
        self.tok, self.score, self.parent, self.depth = [tok], [lp], [torch.full_like(tok, -1)], [1]
        self.frontier_id = torch.arange(k).expand(tok.shape[0], k)
        self.frontier_tok, self.frontier_score = tok, lp

    def expand(self, level: int, logits: torch.Tensor, last: bool) -> torch.Tensor | None:
        k, bsz = self.k, logits.shape[0]
        clp, ctok = torch.log_softmax(logits, -1).topk(k, dim=-1)
        score = (self.frontier_score[:, :, None] + clp).flatten(1)
        base = k + (level - 2) * k * k
        self.tok.append(ctok.flatten(1))
        self.score.append(score)
        self.parent.append(self.frontier_id[:, :, None].expand(bsz, k, k).flatten(1))
        self.depth.append(level)
        if last:
            return None
        sel = score.topk(k, dim=-1).indices
        self.frontier_id = base + sel
        self.frontier_tok = ctok.flatten(1).gather(1, sel)
        self.frontier_score = score.gather(1, sel)
        return sel // k

    def trees(self, limits: list[tuple[int, int]], draft_ids: torch.Tensor) -> list[DraftTree]:
        depth_of = torch.cat([torch.full((t.shape[1],), lv) for t, lv in zip(self.tok, self.depth)])
        score = torch.cat(self.score, dim=1).double() - _TIE_BREAK * depth_of
        tokens = draft_ids[torch.cat(self.tok, dim=1)]
        parents = torch.cat(self.parent, dim=1)
        trees = []
        for b, (deepest, max_nodes) in enumerate(limits):
            allowed = depth_of <= deepest
            s = score[b].masked_fill(~allowed, float("-inf"))
            n = min(max_nodes, int(allowed.sum()))
            chosen = s.topk(n).indices.sort().values.tolist()
            node_of = {c: i for i, c in enumerate(chosen)}
            par = parents[b].tolist()
            trees.append(DraftTree([int(tokens[b, c]) for c in chosen], [node_of.get(par[c], -1) for c in chosen]))
        return trees


class ReferenceProposer(Eagle3Proposer):
    """Eagle3Proposer whose catch-up and growth build every tensor per row and per depth."""

    def _rows_of(self, tables, slots, seq):
        bs = self.block_size
        return tables[seq, slots // bs] * bs + slots % bs

    def _catch_up(self, rows, tables):
        d = self.drafter
        counts = [len(r.next_tokens) for r in rows]
        q_start = torch.tensor([0] + counts).cumsum(0)
        seq = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(counts))
        positions = torch.cat([torch.arange(r.start, r.start + c) for r, c in zip(rows, counts)])
        tokens = torch.tensor([t for r in rows for t in r.next_tokens], dtype=torch.long)
        states = torch.cat([r.states for r in rows]).float()
        p = DraftPass(positions, self._rows_of(tables, positions, seq), q_start, tables, self.block_size,
                      positions + 1, torch.tensor([r.first for r in rows]))
        out, logits = d.step(d.embed(tokens), states, p, self.k_rows, self.v_rows)
        ends = q_start[1:] - 1
        if d.native is None:
            # The torch path's catch-up takes its draft head over each sequence's last row only;
            # a float32 product's bits can depend on its row count (AVX2 builds of the BLAS pick
            # kernels by it), so the reference takes the head over the same rows.
            return out[ends], d.head.logits(out[ends])
        return out[ends], logits[ends]

    def _grow(self, rows, tables, roots, root_logits, depth):
        d, k = self.drafter, self.topk
        bsz = len(rows)
        cands = _RefCandidates(root_logits, k)
        frontier_out = roots[:, None].expand(bsz, k, roots.shape[-1])
        span = max(depth - 1, 0) * k
        frontier_anc = torch.zeros(bsz, k, max(span, 1), dtype=torch.uint8)
        last = torch.tensor([r.last for r in rows])
        seq = torch.arange(bsz).repeat_interleave(k)
        q_start = torch.arange(0, bsz * k + 1, k)
        kv_start = torch.tensor([r.first for r in rows])
        offset = 0
        for level in range(2, depth + 1):
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
            out, logits = d.step(d.embed(ids), frontier_out.reshape(bsz * k, -1).contiguous(), p, self.k_rows,
                                 self.v_rows)
            out = out.view(bsz, k, -1)
            parent = cands.expand(level, logits.view(bsz, k, -1), last=level == depth)
            offset += k
            if parent is not None:
                frontier_out = out.gather(1, parent[:, :, None].expand(bsz, k, out.shape[-1]))
                frontier_anc = anc.gather(1, parent[:, :, None].expand(bsz, k, anc.shape[-1]))
        self.candidates = cands
        return cands.trees([(r.depth, r.max_nodes) for r in rows], d.draft_ids)


def _candidates_of(cands) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (draft indices, scores) [B, N] of every candidate, creation order (the parents are
    compared through the trees)."""
    return (torch.cat(cands.tok, 1), torch.cat(cands.score, 1))


def run_side_by_side(drafter: Eagle3Drafter, target, monkeypatch, depths: list[int], nodes: list[int], topk: int,
                     vocab: int, steps: int = 3, first: int = 3) -> int:
    """Both proposers fed the same states and tokens for `steps` proposals of a batch of
    len(depths) requests (request 0 starting its entries at `first`); every step's candidates
    and trees must be equal. -> trees compared."""
    engine = EngineConfig(max_num_seqs=len(depths), max_model_len=256, num_kv_blocks=64, block_size=4)
    fast = Eagle3Proposer(drafter, target, engine, max_nodes=max(nodes), topk=topk)
    ref = ReferenceProposer(drafter, target, engine, max_nodes=max(nodes), topk=topk)
    grown = []
    real_trees = eagle.TreeCandidates.trees

    def recording(self, limits, draft_ids, floors=None):
        grown.append(self)
        return real_trees(self, limits, draft_ids, floors)

    monkeypatch.setattr(eagle.TreeCandidates, "trees", recording)
    h3 = 3 * drafter.config.target_hidden_size
    gen = torch.Generator().manual_seed(7)
    seqs = {f"r{i}": torch.randint(2, vocab, (9 + 5 * i,), generator=gen).tolist() for i in range(len(depths))}
    states = {r: torch.randn(len(s) + 4 * steps, h3, generator=gen) for r, s in seqs.items()}
    starts = {r: (first if i == 0 else 0) for i, r in enumerate(seqs)}
    for prop in (fast, ref):
        for rid, s in seqs.items():
            prop.observe_hidden(rid, starts[rid], states[rid][starts[rid]:len(s) - 1])
    compared = 0
    for step in range(steps):
        batch = [SpecRequest(rid, s, depths[i], GREEDY, None, max_nodes=nodes[i]) for i, (rid, s) in enumerate(seqs.items())]
        got = fast.propose(batch).trees
        want = ref.propose(batch).trees
        assert [(t.token_ids, t.parents) for t in got] == [(t.token_ids, t.parents) for t in want], step
        for a, b in zip(_candidates_of(grown[-1]), _candidates_of(ref.candidates)):
            assert torch.equal(a, b), step
        compared += len(got)
        for i, (rid, s) in enumerate(seqs.items()):  # an accepted path of 1 + i drafts and a bonus
            n = len(s)
            seqs[rid] = s + torch.randint(2, vocab, (2 + i,), generator=gen).tolist()
            for prop in (fast, ref):
                prop.observe_hidden(rid, n - 1, states[rid][n - 1:n + 1 + i])
    return compared


@pytest.mark.parametrize("scale,topk", [(3.0, 3), (1e-3, 2), (0.0, 2), (3.0, 1)])
def test_growth_equals_the_reference_on_the_torch_path(tiny, monkeypatch, scale, topk):
    """Peaked logits, near-ties, all-equal logits (every top k a tie) and a chain (top 1); a
    batch of three with different depths and node budgets."""
    target = tiny["loaded"]
    head = random_head(target, vocab=list(range(3, 60)), scale=scale)
    drafter = Eagle3Drafter(head.config, head, target.model.embed_tokens, None)
    assert run_side_by_side(drafter, target, monkeypatch, depths=[4, 2, 5], nodes=[7, 3, 12], topk=topk, vocab=64) == 9


@pytest.mark.skipif(native.load() is None, reason=f"native kernels unavailable: {native.unavailable_reason()}")
@pytest.mark.parametrize("depths,nodes,topk", [([4], [8], 2), ([4, 3], [8, 5], 2), ([5, 1, 6], [10, 4, 16], 3)])
def test_growth_equals_the_reference_on_the_native_kernels(smollm_native, monkeypatch, depths, nodes, topk):
    """The shipped drafter on the native kernels, alone and batched (a request of depth 1 among
    deeper ones: it drafts from the root's children only)."""
    drafter = load_eagle3_drafter("default", smollm_native)
    assert drafter.native is not None
    compared = run_side_by_side(drafter, smollm_native, monkeypatch, depths, nodes, topk, vocab=2000)
    assert compared == 3 * len(depths)


@pytest.mark.parametrize("topk", [1, 2, 4])
def test_one_depth_shortcut_chooses_the_trees_of_the_general_selection(topk):
    """A batch whose trees have one depth skips the candidates' bookkeeping (_depth_one): for
    every node budget (below, at and above k) and floor (none, between the candidates, above
    them all) it must choose what TreeCandidates and select_trees choose."""
    gen = torch.Generator().manual_seed(3)
    vocab = 50
    draft_ids = torch.randperm(1000, generator=gen)[:vocab]
    logits = torch.randn(6, vocab, generator=gen) * 3.0  # no exact ties
    lp = torch.log_softmax(logits, -1).sort(-1, descending=True).values
    floors = [-math.inf, float(lp[1, 0]) + 1.0, float((lp[2, 0] + lp[2, 1]) / 2), float(lp[3, min(topk, 3) - 1]),
              -math.inf, float(lp[5, 0]) - 1e-4]
    budgets = [1, 3, 2, 8, max(1, topk - 1), topk]
    rows = [eagle._Row(i, f"r{i}", 0, torch.zeros(1, 1), [1], 1, n, floor=f)
            for i, (n, f) in enumerate(zip(budgets, floors))]
    proposer = SimpleNamespace(topk=topk, draft_ids_host=draft_ids.numpy(), times=eagle.DraftingTimes())
    got = eagle.FeatureTreeProposer._depth_one(proposer, rows, logits)
    want = eagle.TreeCandidates(logits, topk).trees([(1, n) for n in budgets], draft_ids.numpy(), floors)
    assert [(t.token_ids, t.parents) for t in got] == [(t.token_ids, t.parents) for t in want]
    assert [t.num_nodes for t in got][:2] == [1, 0]  # a floor above every candidate leaves no tree
