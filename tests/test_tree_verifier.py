"""Tree verification on hand-built and random trees: a chain tree gives exactly the chain
verifier's output, greedy trees accept what verifying each path as a chain accepts, sampled
trees emit plain sampling's tokens along the accepted path, and the vectorised verifier agrees
token for token with the per-row reference."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.sample import PositionNoise, SamplingTensors, reference_tree_verify, sample, tree_verify, verify
from specserve.sample.tree_verifier import verify_flat
from specserve.sampling_params import SamplingParams as SP
from specserve.drafts.tree import DraftTree

PARAMS = [SP(temperature=0), SP(temperature=1.0), SP(temperature=0.7, top_p=0.9), SP(temperature=1.2, top_k=3), SP(min_p=0.2, temperature=0.9)]


def noises(n: int, base: int = 0) -> list[PositionNoise]:
    return [PositionNoise(base + b) for b in range(n)]


def random_tree(rng: random.Random, vocab: int, max_nodes: int) -> DraftTree:
    """Random shape and tokens (siblings may repeat a token)."""
    n = rng.randrange(0, max_nodes + 1)
    parents = [rng.randrange(-1, i) for i in range(n)]
    return DraftTree([rng.randrange(vocab) for _ in range(n)], parents)


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


def test_chain_tree_reproduces_the_chain_verifier_exactly():
    vocab, k, rows = 6, 4, 40
    g = torch.Generator().manual_seed(0)
    params = [PARAMS[b % len(PARAMS)] for b in range(rows)]
    st = SamplingTensors.from_params(params, "cpu")
    for trial in range(5):
        logits = torch.randn(rows, k + 1, vocab, generator=g) * 2
        # Drafts: the target's own race (as a coupled draft would often be) or a random token.
        races = torch.stack([sample(logits[:, j], st, noises(rows, trial * rows), [trial + j] * rows)
                             for j in range(k)], 1)
        drafts = torch.where(torch.rand(rows, k, generator=g) < 0.7, races, torch.randint(vocab, (rows, k), generator=g))
        n = torch.randint(0, k + 1, (rows,), generator=g)
        n[0] = k  # the widest row sets the logits' width
        drafts = torch.where(torch.arange(k) < n[:, None], drafts, -1)
        chain = verify(drafts, n, logits, st, noises(rows, trial * rows), [trial] * rows)
        trees = [DraftTree.chain(drafts[b, : n[b]].tolist()) for b in range(rows)]
        tree = tree_verify(trees, logits, st, noises(rows, trial * rows), [trial] * rows)
        assert torch.equal(tree.output_token_ids, chain.output_token_ids)
        assert torch.equal(tree.num_accepted, chain.num_accepted)
        assert tree.accepted_nodes == [list(range(a)) for a in chain.num_accepted.tolist()]


def test_greedy_tree_accepts_what_each_path_accepts_as_a_chain():
    rng, vocab, rows, max_nodes = random.Random(1), 4, 60, 12
    st = SamplingTensors.from_params([SP(temperature=0)] * rows, "cpu")
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        trees = [random_tree(rng, vocab, max_nodes) for _ in range(rows)]
        width = 1 + max(t.num_nodes for t in trees)
        logits = torch.randn(rows, width, vocab, generator=g)
        out = tree_verify(trees, logits, st, [None] * rows, [0] * rows)
        for b, tree in enumerate(trees):
            best = []
            for path in tree.paths():  # verify the path alone: its own logits [1, 1 + len, V]
                chain = verify(torch.tensor([[tree.token_ids[c] for c in path]]), torch.tensor([len(path)]),
                               logits[b, [0] + [c + 1 for c in path]].unsqueeze(0), st.select([b]), [None], [0])
                a = int(chain.num_accepted[0])
                if a > len(best):
                    best, tokens = path[:a], chain.output_token_ids[0, : a + 1].tolist()
            if not best:
                tokens = [int(logits[b, 0].argmax())]
            assert out.accepted_nodes[b] == best
            assert out.output_token_ids[b, : len(best) + 1].tolist() == tokens


def test_tree_verifier_agrees_with_the_reference():
    rng, vocab, rows, max_nodes = random.Random(2), 5, 50, 10
    g = torch.Generator().manual_seed(2)
    params = [PARAMS[b % len(PARAMS)] for b in range(rows)]
    st = SamplingTensors.from_params(params, "cpu")
    accepted = 0
    for trial in range(6):
        trees = [random_tree(rng, vocab, max_nodes) for b in range(rows)]
        width = 1 + max(t.num_nodes for t in trees)
        logits = torch.randn(rows, width, vocab, generator=g) * 1.5
        positions = [rng.randrange(1000) for _ in range(rows)]
        out = tree_verify(trees, logits, st, noises(rows, 100 * trial), positions)
        ref = reference_tree_verify(trees, logits, st, noises(rows, 100 * trial), positions)
        for b in range(rows):
            a = int(out.num_accepted[b])
            assert out.output_token_ids[b, : a + 1].tolist() == ref[b]
            assert (out.output_token_ids[b, a + 1 :] == -1).all()
            assert [trees[b].token_ids[c] for c in out.accepted_nodes[b]] == ref[b][:-1]
            accepted += a
    assert accepted > 50  # the trees do get accepted, at several depths


def test_flat_verification_is_tree_verification():
    """verify_flat on a flattened pass (rows without drafts among them, which it samples in one
    batch) emits what tree_verify emits on the padded logits, row for row."""
    rng, vocab, rows, max_nodes = random.Random(4), 6, 40, 6
    g = torch.Generator().manual_seed(4)
    params = [PARAMS[b % len(PARAMS)] for b in range(rows)]
    st = SamplingTensors.from_params(params, "cpu")
    for trial in range(4):
        trees = [random_tree(rng, vocab, max_nodes) if b % 3 else DraftTree.empty() for b in range(rows)]
        width = 1 + max(t.num_nodes for t in trees)
        logits = torch.randn(rows, width, vocab, generator=g) * 1.5
        flat = torch.cat([logits[b, : 1 + t.num_nodes] for b, t in enumerate(trees)])
        starts = [0]
        for t in trees:
            starts.append(starts[-1] + 1 + t.num_nodes)
        positions = [rng.randrange(1000) for _ in range(rows)]
        out = verify_flat(trees, flat, starts, params, noises(rows, 50 * trial), positions)
        want = tree_verify(trees, logits, st, noises(rows, 50 * trial), positions)
        for b in range(rows):
            a = int(want.num_accepted[b])
            assert out.token_ids[b] == want.output_token_ids[b, : a + 1].tolist()
            assert out.accepted_nodes[b] == want.accepted_nodes[b]


def test_sampled_tree_emits_plain_samplings_tokens_along_its_path():
    rng, vocab, rows, max_nodes = random.Random(3), 4, 40, 10
    g = torch.Generator().manual_seed(3)
    st = SamplingTensors.from_params([SP(temperature=0.9)] * rows, "cpu")
    for trial in range(4):
        trees = [random_tree(rng, vocab, max_nodes) for _ in range(rows)]
        logits = torch.randn(rows, 1 + max(t.num_nodes for t in trees), vocab, generator=g)
        out = tree_verify(trees, logits, st, noises(rows, trial), [5] * rows)
        for b, path in enumerate(out.accepted_nodes):
            flat = [0] + [c + 1 for c in path]  # the logits plain decoding of this text would see
            want = [int(sample(logits[b, f : f + 1], st.select([b]), [PositionNoise(trial + b)], [5 + d]))
                    for d, f in enumerate(flat)]
            assert out.output_token_ids[b, : len(flat)].tolist() == want


def test_siblings_share_their_depth_s_race():
    # p at the root is [.5, .5, 0, 0]; children 0 then 1. The race at the root picks 0 or 1, so
    # exactly one child is accepted every step, and which one follows the noise.
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4, [0.25] * 4])
    logits = probs.log().unsqueeze(0)  # [1, 3, 4]
    tree = DraftTree([0, 1], [-1, -1])
    st = SamplingTensors.from_params([SP(temperature=1.0)], "cpu")
    firsts = []
    for seed in range(60):
        out = tree_verify([tree], logits, st, noises(1, seed), [0])
        assert out.num_accepted.tolist() == [1]
        firsts.append(out.accepted_nodes[0] == [0])
    assert 10 < sum(firsts) < 50
    # Children carrying a token p excludes are never accepted; the race's token is emitted.
    for seed in range(20):
        out = tree_verify([DraftTree([2, 2], [-1, -1])], logits, st, noises(1, seed), [0])
        assert out.num_accepted.tolist() == [0] and out.output_token_ids[0, 0] in (0, 1)


def test_shape_checks():
    st = SamplingTensors.from_params([SP()], "cpu")
    with pytest.raises(ValueError, match="must be \\[1, 1 \\+ 2, V\\]"):
        tree_verify([DraftTree([1, 2], [-1, 0])], torch.zeros(1, 2, 4), st, [None], [0])
