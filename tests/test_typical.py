"""Typical acceptance (lossy, opt-in): the rule on hand-built trees, greedy rows exactly as the
lossless tree verifier, the emitted token sampled from p, off by default, and end to end on the
engine (greedy output still equals plain decoding; the bar decides what sampled rows accept)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sample import PositionNoise, SamplingTensors, tree_verify
from specserve.sample.typical import TypicalAcceptance
from specserve.sampling_params import SamplingParams as SP
from specserve.drafts.tree import DraftTree
from tests.helpers import chi_square_pvalue, generate_ids, ragged_prompts
from tests.test_medusa import untrained_medusa
from tests.test_tree_verifier import random_tree

RULE = TypicalAcceptance(posterior_threshold=0.09, posterior_alpha=0.3)


def logits_for(rows: list[list[float]]) -> torch.Tensor:
    """[1, N, V] logits whose softmax is exactly the given probability rows."""
    return torch.tensor(rows, dtype=torch.float32).log()[None]


def test_nodes_pass_when_their_probability_clears_the_bar():
    # Root row: entropy of [0.5, 0.3, 0.2, 0] is 1.0297 -> bar min(0.09, 0.3 * 0.357) = 0.09.
    p_root = [0.5, 0.3, 0.2, 0.0]
    h = -sum(x * math.log(x) for x in p_root if x)
    assert min(0.09, 0.3 * math.exp(-h)) == 0.09
    # Node 0 (token 3, p 0) fails; node 1 (token 2, p 0.2) passes; under node 1 (flat 2, a
    # peaked row: bar 0.09) node 2 (token 1, p 0.05) fails and node 3 (token 0, p 0.94) passes.
    tree = DraftTree([3, 2, 1, 0], [-1, -1, 1, 1])
    rows = [p_root, [0.25] * 4, [0.94, 0.05, 0.005, 0.005], [0.25] * 4, [0.1, 0.2, 0.3, 0.4]]
    st = SamplingTensors.from_params([SP(temperature=1.0)], "cpu")
    out = tree_verify([tree], logits_for(rows), st, [PositionNoise(0)], [0], RULE)
    assert out.accepted_nodes == [[1, 3]] and out.num_accepted.tolist() == [2]
    assert out.output_token_ids[0, :2].tolist() == [2, 0]
    # A stricter bar: 0.2 is not above min(0.25, 0.9 * exp(-H)) = 0.25 at the root.
    strict = TypicalAcceptance(posterior_threshold=0.25, posterior_alpha=0.9)
    out = tree_verify([tree], logits_for(rows), st, [PositionNoise(0)], [0], strict)
    assert out.accepted_nodes == [[]]


def test_greedy_rows_are_exactly_the_lossless_tree_verifier():
    rng, g = random.Random(0), torch.Generator().manual_seed(0)
    vocab, rows = 5, 30
    st = SamplingTensors.from_params([SP(temperature=0)] * rows, "cpu")
    for _ in range(5):
        trees = [random_tree(rng, vocab, 8) for _ in range(rows)]
        width = 1 + max(t.num_nodes for t in trees)
        logits = torch.randn(rows, width, vocab, generator=g) * 2
        a = tree_verify(trees, logits, st, [None] * rows, [0] * rows)
        b = tree_verify(trees, logits, st, [None] * rows, [0] * rows, RULE)
        assert a.accepted_nodes == b.accepted_nodes
        assert torch.equal(a.output_token_ids, b.output_token_ids)


def test_emitted_token_is_sampled_from_p_at_the_last_accepted_node():
    # Node 0 passes (p 0.7 at the root), node 1 below it fails (p 0.01): the token after the
    # path is sampled from p at node 0.
    tree = DraftTree([0, 3], [-1, 0])
    p_node0 = [0.1, 0.2, 0.3, 0.01, 0.39]
    rows = [[0.7, 0.1, 0.1, 0.05, 0.05], p_node0, [0.2] * 5]
    st = SamplingTensors.from_params([SP(temperature=1.0)], "cpu")
    picks = []
    for seed in range(3000):
        out = tree_verify([tree], logits_for(rows), st, [PositionNoise(seed)], [0], RULE)
        assert out.accepted_nodes == [[0]]
        picks.append(int(out.output_token_ids[0, 1]))
    assert chi_square_pvalue(torch.tensor(picks), torch.tensor(p_node0, dtype=torch.float64)) > 1e-3


def test_off_by_default_and_checked():
    assert SpeculativeConfig(method="ngram").acceptance_method == "rejection_sampler"
    assert not SpeculativeConfig(method="ngram").lossy
    assert SpeculativeConfig(method="ngram", acceptance_method="typical_acceptance_sampler").lossy
    with pytest.raises(InvalidParameterError, match="acceptance_method.*rejection_sampler, typical_acceptance_sampler"):
        SpeculativeConfig(method="ngram", acceptance_method="typical")
    for name, bad in (("posterior_threshold", 0), ("posterior_alpha", 1.5), ("posterior_threshold", "0.1")):
        with pytest.raises(InvalidParameterError, match=f"{name}.*\\(0, 1\\]"):
            SpeculativeConfig(method="ngram", acceptance_method="typical_acceptance_sampler", **{name: bad})


def test_default_engine_keeps_the_lossless_verifier(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram"})
    assert llm.engine.typical_acceptance is None


TYPICAL = {"acceptance_method": "typical_acceptance_sampler"}


@pytest.mark.parametrize("method", ["ngram", "medusa"])
def test_greedy_output_still_equals_plain(tiny, tmp_path, method):
    prompts = ragged_prompts(6, seed=5)
    greedy = SP(temperature=0, max_tokens=30, ignore_eos=True)
    plain = generate_ids(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts, greedy)
    spec = {"method": method, "num_speculative_tokens": 4, **TYPICAL}
    if method == "medusa":
        spec["model"] = untrained_medusa(tiny["loaded"], tmp_path / "m")
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, speculative_config=spec)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert LLM.aggregate_spec_stats(outs).num_accepted > 0


def test_the_bar_decides_what_sampled_rows_accept(tiny):
    """Chains from the n-gram proposer go through the typical rule. A bar near zero accepts
    every drafted token the target gives any probability (all of them, with a 64-token vocabulary
    at temperature 1); the highest bar (p above exp(-entropy)) takes far fewer."""
    prompts = ragged_prompts(4, seed=7, lo=30)
    params = [SP(temperature=1.0, max_tokens=24, ignore_eos=True, seed=i) for i in range(len(prompts))]

    def stats(threshold, alpha):
        spec = {"method": "ngram", "num_speculative_tokens": 3, **TYPICAL,
                "posterior_threshold": threshold, "posterior_alpha": alpha}
        outs = LLM(loaded=tiny["loaded"], max_num_seqs=4, speculative_config=spec).generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        return LLM.aggregate_spec_stats(outs)
    loose = stats(1e-9, 1e-9)
    assert loose.num_drafted > 0 and loose.num_accepted == loose.num_drafted
    strict = stats(1.0, 1.0)
    assert strict.num_drafted > 0 and strict.num_accepted < strict.num_drafted / 2
