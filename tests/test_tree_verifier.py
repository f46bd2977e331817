"""Tree verification on hand-built and random trees: a chain tree gives exactly the chain
verifier's output, greedy trees accept what verifying each path as a chain accepts, and the
vectorised verifier agrees token for token with the per-row reference."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.sample import SamplingTensors, make_generator, processed_probs, reference_tree_verify, tree_verify, verify
from specserve.sampling_params import SamplingParams as SP
from specserve.drafts.tree import DraftTree

PARAMS = [SP(temperature=0), SP(temperature=1.0), SP(temperature=0.7, top_p=0.9), SP(temperature=1.2, top_k=3), SP(min_p=0.2, temperature=0.9)]


def gens(n: int, base: int = 0) -> list[torch.Generator]:
    return [make_generator(base + b, "cpu") for b in range(n)]


def random_tree(rng: random.Random, vocab: int, max_nodes: int, q_rows: torch.Tensor | None) -> DraftTree:
    """Random shape; q_rows [1 + max_nodes, V] gives each node's q as its parent's row (siblings share it)."""
    n = rng.randrange(0, max_nodes + 1)
    parents = [rng.randrange(-1, i) for i in range(n)]
    tokens = [rng.randrange(vocab) for _ in range(n)]
    probs = None if q_rows is None else q_rows[torch.tensor([p + 1 for p in parents], dtype=torch.long)]
    return DraftTree(tokens, parents, probs)


def test_tree_helpers():
    tree = DraftTree.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [2]], [[5, 6], [7, 8], [9]])
    # [2] has no third candidate at depth 1: it is left out.
    assert tree.token_ids == [5, 6, 7, 8, 7, 9] and tree.parents == [-1, -1, 0, 0, 1, 2]
    assert tree.depths() == [1, 1, 2, 2, 2, 3] and tree.max_depth == 3
    assert tree.paths() == [[0, 2, 5], [0, 3], [1, 4]]
    assert tree.children() == [[0, 1], [2, 3], [4], [5], [], [], []]
    mask = tree.attention_mask()
    assert mask.shape == (7, 7) and (mask.sum(-1) - 1).tolist() == [0] + tree.depths()
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 3, 6]  # node 5: root, nodes 0, 2 and itself
    assert DraftTree.chain([4, 5, 6]).paths() == [[0, 1, 2]]
    trie = DraftTree.from_token_paths([[1, 2, 3], [1, 2, 4], [5], [1, 9]], max_nodes=5)
    assert trie.token_ids == [1, 2, 3, 4, 5] and trie.parents == [-1, 0, 1, 1, -1]
    with pytest.raises(ValueError, match="parents must come before"):
        DraftTree([1, 2], [1, -1])
    with pytest.raises(ValueError, match="needs its parent"):
        DraftTree.from_choices([[0, 1]], [[1], [2, 3]])


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot_q", "draft_q"])
def test_chain_tree_reproduces_the_chain_verifier_exactly(with_q):
    vocab, k, rows = 6, 4, 40
    g = torch.Generator().manual_seed(0)
    params = [PARAMS[b % len(PARAMS)] for b in range(rows)]
    st = SamplingTensors.from_params(params, "cpu")
    for trial in range(5):
        logits = torch.randn(rows, k + 1, vocab, generator=g) * 2
        q = processed_probs(logits[:, :k] + torch.randn(rows, k, vocab, generator=g), st)  # [B, k, V]
        n = torch.randint(0, k + 1, (rows,), generator=g)
        n[0] = k  # the widest row sets the logits' width
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(rows, k)
        drafts = torch.where(torch.arange(k) < n[:, None], drafts, -1)
        chain = verify(drafts, n, q if with_q else None, logits, st, gens(rows, trial * rows))
        trees = [DraftTree.chain(drafts[b, : n[b]].tolist(), q[b, : n[b]] if with_q else None) for b in range(rows)]
        tree = tree_verify(trees, logits, st, gens(rows, trial * rows))
        assert torch.equal(tree.output_token_ids, chain.output_token_ids)
        assert torch.equal(tree.num_accepted, chain.num_accepted)
        assert tree.accepted_nodes == [list(range(a)) for a in chain.num_accepted.tolist()]


def test_greedy_tree_accepts_what_each_path_accepts_as_a_chain():
    rng, vocab, rows, max_nodes = random.Random(1), 4, 60, 12
    st = SamplingTensors.from_params([SP(temperature=0)] * rows, "cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        trees = [random_tree(rng, vocab, max_nodes, None) for _ in range(rows)]
        width = 1 + max(t.num_nodes for t in trees)
        logits = torch.randn(rows, width, vocab, generator=g)
        out = tree_verify(trees, logits, st, [None] * rows)
        for b, tree in enumerate(trees):
            best = []
            for path in tree.paths():  # verify the path alone: its own logits [1, 1 + len, V]
                chain = verify(torch.tensor([[tree.token_ids[c] for c in path]]), torch.tensor([len(path)]), None,
                               logits[b, [0] + [c + 1 for c in path]].unsqueeze(0), st.select([b]), [None])
                a = int(chain.num_accepted[0])
                if a > len(best):
                    best, tokens = path[:a], chain.output_token_ids[0, : a + 1].tolist()
            if not best:
                tokens = [int(logits[b, 0].argmax())]
            assert out.accepted_nodes[b] == best
            assert out.output_token_ids[b, : len(best) + 1].tolist() == tokens


@pytest.mark.parametrize("with_q", [False, True], ids=["one_hot_q", "draft_q"])
def test_tree_verifier_agrees_with_the_reference(with_q):
    rng, vocab, rows, max_nodes = random.Random(2), 5, 50, 10
    g = torch.Generator().manual_seed(2)
    params = [PARAMS[b % len(PARAMS)] for b in range(rows)]
    st = SamplingTensors.from_params(params, "cpu")
    accepted = 0
    for trial in range(6):
        q_rows = processed_probs(torch.randn(rows, max_nodes + 1, vocab, generator=g), st) if with_q else None
        trees = [random_tree(rng, vocab, max_nodes, None if q_rows is None else q_rows[b]) for b in range(rows)]
        width = 1 + max(t.num_nodes for t in trees)
        logits = torch.randn(rows, width, vocab, generator=g) * 1.5
        out = tree_verify(trees, logits, st, gens(rows, 100 * trial))
        ref = reference_tree_verify(trees, logits, st, gens(rows, 100 * trial))
        for b in range(rows):
            a = int(out.num_accepted[b])
            assert out.output_token_ids[b, : a + 1].tolist() == ref[b]
            assert (out.output_token_ids[b, a + 1 :] == -1).all()
            assert [trees[b].token_ids[c] for c in out.accepted_nodes[b]] == ref[b][:-1]
            accepted += a
    assert accepted > 50  # the trees do get accepted, at several depths


def test_sibling_after_a_rejection_is_tested_against_the_residual():
    # p at the root is [.5, .5, 0, 0]; deterministic children 0 then 1. Child 0 is accepted
    # with probability .5; when rejected, the residual is all on token 1, so child 1 is always
    # accepted: every step accepts one of the two.
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4, [0.25] * 4])
    logits = probs.log().unsqueeze(0)  # [1, 3, 4]
    tree = DraftTree([0, 1], [-1, -1])
    st = SamplingTensors.from_params([SP(temperature=1.0)], "cpu")
    firsts = []
    for seed in range(60):
        out = tree_verify([tree], logits, st, gens(1, seed))
        assert out.num_accepted.tolist() == [1]
        firsts.append(out.accepted_nodes[0] == [0])
    assert 10 < sum(firsts) < 50
    # The same with children drawn from q = [0, .5, .5, 0] (i.i.d., both token 2, then token 1):
    # token 2 has p = 0, so both copies are rejected; the residual max(0, p - q) after them is
    # [.5, 0, 0, 0] and the second rejection leaves it unchanged: token 0 is recovered.
    q = torch.tensor([0.0, 0.5, 0.5, 0.0]).expand(2, 4)
    out = tree_verify([DraftTree([2, 2], [-1, -1], q)], logits, st, gens(1))
    assert out.num_accepted.tolist() == [0] and out.output_token_ids.tolist() == [[0, -1]]


def test_shape_checks():
    st = SamplingTensors.from_params([SP()], "cpu")
    with pytest.raises(ValueError, match="must be \\[1, 1 \\+ 2, V\\]"):
        tree_verify([DraftTree([1, 2], [-1, 0])], torch.zeros(1, 2, 4), st, [None])
