"""Medusa speculation end to end (float32, greedy): the output equals plain greedy decoding,
single and batched, on a tiny target and the embedded model; trees follow the trained choices
within the node budget and the depth."""

import pytest
import torch

from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec.heads import load_drafter, new_drafter, save_drafter
from specserve.spec.medusa import MedusaProposer
from specserve.drafts import SpecRequest
from tests.helpers import ragged_prompts

CHOICES = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 0, 0]]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


def untrained_medusa(target, folder, choices=CHOICES, vocab=None):
    """Zero-initialised heads: each starts as the identity, i.e. predicting what the target's
    own head predicts (the right token whenever the text repeats a token)."""
    ids = torch.arange(target.config.vocab_size) if vocab is None else vocab
    save_drafter(folder, new_drafter(target, "medusa", ids, num_heads=4, tree_choices=choices))
    return str(folder)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
@pytest.mark.parametrize("depth,nodes", [(4, None), (2, 3)])
def test_greedy_medusa_equals_plain(tiny, tmp_path, max_num_seqs, depth, nodes):
    folder = untrained_medusa(tiny["loaded"], tmp_path / "m")
    prompts = ragged_prompts(6, seed=3)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=tiny["loaded"], max_num_seqs=1).generate(prompts, GREEDY, use_tqdm=False)]
    spec = {"method": "medusa", "model": folder, "num_speculative_tokens": depth, "num_draft_nodes": nodes}
    outs = LLM(loaded=tiny["loaded"], max_num_seqs=max_num_seqs, speculative_config=spec).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > 0 and len(stats.drafted_per_position) <= depth


def test_trees_follow_the_choices_within_budget_and_depth(tiny, tmp_path):
    proposer = MedusaProposer(load_drafter(untrained_medusa(tiny["loaded"], tmp_path / "m"), tiny["loaded"]),
                              max_nodes=6)
    assert proposer.num_draft_nodes(2) == 6 and proposer.num_draft_nodes(9) == 9
    hidden = torch.randn(3, tiny["loaded"].config.hidden_size)
    proposer.observe_hidden("a", 0, hidden)  # positions 0..2: drafts for a request of 4 tokens
    params = SamplingParams(temperature=0)
    for depth, budget, expected in [(4, 6, 6), (2, 6, 5), (4, 2, 2), (1, 6, 3)]:
        tree = proposer.propose([SpecRequest("a", [1, 2, 3, 4], depth, params, None, max_nodes=budget)]).trees[0]
        assert tree.num_nodes == expected and tree.max_depth <= depth
    # Identity heads rank the target's own prediction first at every depth.
    top = int(tiny["loaded"].model.compute_logits(hidden[-1]).argmax())
    tree = proposer.propose([SpecRequest("a", [1, 2, 3, 4], 4, params, None, max_nodes=6)]).trees[0]
    assert [tree.token_ids[i] for i in tree.paths()[0]] == [top] * 3
    # Features that end elsewhere than the request's last verified position: no draft.
    assert proposer.propose([SpecRequest("a", [1, 2, 3], 4, params, None, max_nodes=6)]).trees[0].num_nodes == 0


def test_medusa_folder_without_a_tree_is_refused(tiny, tmp_path):
    folder = untrained_medusa(tiny["loaded"], tmp_path / "m", choices=None)
    with pytest.raises(InvalidParameterError, match="tree_choices"):
        LLM(loaded=tiny["loaded"], speculative_config={"method": "medusa", "model": folder})


@pytest.mark.slow
@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_smollm_medusa_greedy_equals_plain(smollm_native, tmp_path, max_num_seqs):
    folder = untrained_medusa(smollm_native, tmp_path / "m", vocab=torch.arange(8192))
    msgs = [[{"role": "user", "content": p}] for p in
            ("Count from one to ten in words.", "Repeat: one one two two three three.")]
    params = SamplingParams(temperature=0, max_tokens=16)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=smollm_native, max_num_seqs=1).chat(msgs, params, use_tqdm=False)]
    llm = LLM(loaded=smollm_native, max_num_seqs=max_num_seqs,
              speculative_config={"method": "medusa", "model": folder, "num_speculative_tokens": 4})
    outs = llm.chat(msgs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert LLM.aggregate_spec_stats(outs).num_drafted > 0
