"""logit_bias through the logits-processor hook (sample/processors.py): plain decoding follows
the biased distribution, and speculation verifies drafts against it, so greedy speculative
output equals plain greedy output with the same bias, and a seed gives the same sampled text."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.drafts.tree import DraftTree
from specserve.errors import InvalidParameterError
from specserve.sample.processors import LogitBias, apply_processors, keep_nodes, node_paths
from tests.helpers import generate_ids
from tests.test_spec_e2e import tiny_prompts


def test_node_paths_and_keep_nodes():
    tree = DraftTree([5, 6, 7, 8], [-1, 0, -1, 1])  # 5 -> 6 -> 8, and 7
    assert node_paths(tree) == [[], [5], [5, 6], [7], [5, 6, 8]]
    cut = keep_nodes(tree, [True, False, True, True])  # dropping 6 drops 8 below it
    assert (cut.token_ids, cut.parents) == ([5, 7], [-1, -1])
    assert keep_nodes(DraftTree.chain([1, 2, 3]), [True, True, False]).is_chain


def test_logit_bias_adds_to_every_row():
    logits = torch.zeros(3, 10)
    apply_processors([LogitBias({2: 5.0, 7: -100.0}, 10)], logits, [1, 2], DraftTree.chain([4, 4]))
    assert logits[:, 2].tolist() == [5.0] * 3 and logits[:, 7].tolist() == [-100.0] * 3
    assert logits[:, [0, 1, 3]].abs().sum() == 0


@pytest.mark.parametrize("bad", [{"3": 1.0}, {3: 101.0}, {-1: 1.0}, {3: float("nan")}, {3: True}, [3]])
def test_logit_bias_bad_values_named(bad):
    with pytest.raises(InvalidParameterError, match="logit_bias"):
        SamplingParams(logit_bias=bad)


def test_logit_bias_past_vocabulary_refused(tiny):
    llm = LLM(loaded=tiny["loaded"])
    with pytest.raises(InvalidParameterError, match=r"logit_bias.*\[0, 64\)"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logit_bias={64: 1.0}), use_tqdm=False)


def test_ban_and_force(tiny):
    llm = LLM(loaded=tiny["loaded"])
    prompts = tiny_prompts(3)
    plain = generate_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    banned = sorted({t for ids in plain for t in ids})[:4]
    out = generate_ids(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                    logit_bias={t: -100.0 for t in banned}))
    assert all(t not in banned for ids in out for t in ids)
    forced = generate_ids(llm, prompts, SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True,
                                                       logit_bias={9: 100.0}))
    assert all(ids == [9] * 6 for ids in forced)


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 3},
                                  {"method": "draft_model", "model": "draft", "num_speculative_tokens": 3}])
def test_speculation_with_bias_equals_plain(tiny, spec):
    spec = dict(spec)
    if spec.get("model") == "draft":
        spec["model"] = tiny["draft"]
    prompts = tiny_prompts(4)
    plain = LLM(loaded=tiny["loaded"])
    fast = LLM(loaded=tiny["loaded"], speculative_config=spec)
    # The bias moves the argmax onto tokens the prompt repeats, so n-gram drafts are both
    # accepted and rejected along the way.
    bias = {t: 2.5 for t in range(2, 64, 5)}
    for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logit_bias=bias),
                   SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logit_bias=bias)):
        want = generate_ids(plain, prompts, params)
        assert generate_ids(fast, prompts, params) == want
        assert want != generate_ids(plain, prompts, dataclasses.replace(params, logit_bias=None))
    stats = fast.engine.stats()
    assert stats.num_steps > 0
