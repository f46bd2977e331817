"""Statistical test that tree verification is lossless: with an imperfect drafter proposing a
tree per step, the first three emitted tokens follow the target's processed distribution exactly.

The toy models are those of test_verifier_stats (logits tables indexed by the last two tokens).
Two kinds of trees:
- deterministic candidates: a static tree whose children at every node are the draft's top
  ranked tokens in that node's context (Medusa / EAGLE top-k style, q = None);
- sampled candidates: at every node, children drawn i.i.d. from the draft's q in that node's
  context (SpecInfer style), duplicates included.
As there, seeds are fixed and the threshold p > 1e-3 leaves room for other seeds; a verifier fed
stale positions (the same noise at every step) fails the same test by a wide margin, which shows
the test has power.
"""

from __future__ import annotations

import pytest
import torch

from specserve.sample import PositionNoise, SamplingTensors, tree_verify
from specserve.sampling_params import SamplingParams as SP
from specserve.drafts.tree import DraftTree
from tests.helpers import chi_square_pvalue
from tests.test_verifier_stats import BOS, DRAFT, LENGTH, PARAMS, TARGET, V, exact_joint, table_probs

ROWS = 20_000
CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]  # ranks, as in Medusa
STATIC = DraftTree.from_choices(CHOICES, [list(range(3))] * 3)  # the shape; token_ids are the ranks
WIDTHS = [3, 2, 1]  # i.i.d. children per node at depth 1, 2, 3
IID = DraftTree.from_token_paths([[a, b, 0] for a in range(WIDTHS[0]) for b in range(WIDTHS[1])])


def build_trees(prev2: torch.Tensor, prev1: torch.Tensor, sampled: bool, q_table: torch.Tensor,
                g: torch.Generator) -> tuple[list[DraftTree], torch.Tensor]:
    """Every row's tree (one shape for all) in the contexts (prev2, prev1) [L] ->
    (trees, [L, 1 + N, 2] context after each flat index, root first)."""
    shape = IID if sampled else STATIC
    ctx = [(prev2, prev1)]  # per flat index: [L] tensors
    tokens = []
    for i, parent in enumerate(shape.parents):
        a, b = ctx[parent + 1]
        if sampled:  # one i.i.d. draw per child from q in its parent's context
            tok = torch.multinomial(q_table[a, b], 1, generator=g).squeeze(1)
        else:  # the draft's candidate of this node's rank
            tok = DRAFT[a, b].argsort(-1, descending=True)[:, shape.token_ids[i]]
        tokens.append(tok)
        ctx.append((b, tok))
    contexts = torch.stack([torch.stack(c, -1) for c in ctx], 1)  # [L, 1 + N, 2]
    tokens = torch.stack(tokens, 1).tolist()  # [L][N]
    return [DraftTree(t, shape.parents) for t in tokens], contexts


def simulate(params: SP, rows: int, sampled: bool, seed: int, seeded_rows: bool = False,
             stale_positions: bool = False) -> tuple[torch.Tensor, float]:
    """-> ([rows] outcome indices as in test_verifier_stats.exact_joint, mean accepted per step)."""
    st = SamplingTensors.from_params([params] * rows, "cpu")
    q_table = table_probs(DRAFT, params)
    g = torch.Generator().manual_seed(seed)
    noise = [PositionNoise(seed * rows + b) for b in range(rows)] if seeded_rows else [None] * rows
    out = [[] for _ in range(rows)]
    accepted = steps = 0
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        while any(len(o) < LENGTH for o in out):
            live = [b for b in range(rows) if len(out[b]) < LENGTH]
            prev = torch.tensor([([BOS, BOS] + out[b])[-2:] for b in live])  # [L, 2]
            trees, contexts = build_trees(prev[:, 0], prev[:, 1], sampled, q_table, g)
            logits = TARGET[contexts[..., 0], contexts[..., 1]]  # [L, 1 + N, V]
            # Each row's next token comes at position len(out[b]) of its output.
            positions = [0 if stale_positions else len(out[b]) for b in live]
            res = tree_verify(trees, logits, st.select(live), [noise[b] for b in live], positions)
            for j, b in enumerate(live):
                a = int(res.num_accepted[j])
                out[b] += res.output_token_ids[j, : a + 1].tolist()
                accepted += a
            steps += len(live)
    toks = torch.tensor([o[:LENGTH] for o in out])
    return toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], accepted / steps


@pytest.mark.parametrize("sampled", [False, True], ids=["top_k_candidates", "iid_q_candidates"])
@pytest.mark.parametrize("name", ["t1.0", "all"])
def test_tree_sampling_reproduces_the_target_distribution(name, sampled):
    params = PARAMS[name]
    outcomes, mean_accepted = simulate(params, ROWS, sampled, seed=1)
    assert mean_accepted > 0.5  # the trees are accepted often, at several depths
    assert chi_square_pvalue(outcomes, exact_joint(params)) > 1e-3


def test_tree_sampling_with_per_request_generators():
    params = PARAMS["t0.7"]
    outcomes, _ = simulate(params, 10_000, sampled=True, seed=2, seeded_rows=True)
    assert chi_square_pvalue(outcomes, exact_joint(params)) > 1e-3


def test_reused_noise_fails():
    params = PARAMS["t1.0"]
    outcomes, _ = simulate(params, ROWS, sampled=True, seed=1, seeded_rows=True, stale_positions=True)
    assert chi_square_pvalue(outcomes, exact_joint(params)) < 1e-6
