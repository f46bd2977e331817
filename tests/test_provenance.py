"""Token provenance: every generated token is labelled by how it came (plain step, accepted draft,
corrected, bonus), and the streamed text arrives as pieces that carry those labels."""

from __future__ import annotations

import pytest

from specserve.config import EngineConfig
from specserve.drafts.proposal import DraftProposal, DraftTreeProposal, SpecRequest
from specserve.drafts.tree import DraftTree
from specserve.engine.engine import LLMEngine
from specserve.outputs import BONUS, CORRECTED, DRAFT, PLAIN, TOKEN_SOURCES
from specserve.sampling_params import SamplingParams
from specserve.spec.proposer import Proposer
from tests.helpers import ragged_prompts


class OracleProposer(Proposer):
    """Drafts the known greedy continuation, with a wrong token at chosen output positions:
    provenance is then known exactly. `tree`: each draft becomes a two-leaf fork at its end
    (the oracle's token and a wrong one) so that a path can end at a leaf or at rejected
    children."""

    name = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong_at: set[int], tree: bool = False):
        self.answers, self.wrong_at, self.tree = answers, wrong_at, tree

    def _draft(self, r: SpecRequest) -> list[int]:
        for prompt, answer in self.answers.items():
            if tuple(r.token_ids[: len(prompt)]) == prompt:
                done = len(r.token_ids) - len(prompt)
                out = answer[done: done + r.num_speculative_tokens]
                return [(t + 1) % 64 if done + j in self.wrong_at else t for j, t in enumerate(out)]
        raise AssertionError("unknown prompt")

    def num_draft_nodes(self, k: int) -> int:
        return k + 1 if self.tree else k

    def propose(self, batch: list[SpecRequest]) -> DraftProposal | DraftTreeProposal:
        drafts = [self._draft(r) for r in batch]
        if not self.tree:
            return DraftProposal.from_lists(drafts, max(r.num_speculative_tokens for r in batch), "cpu")
        trees = []
        for d in drafts:
            if not d:
                trees.append(DraftTree.empty())
                continue
            # The chain but its last node, then two leaves under it: the draft's and a wrong one.
            trees.append(DraftTree(d + [(d[-1] + 7) % 64], list(range(-1, len(d) - 1)) + [len(d) - 2]))
        return DraftTreeProposal(trees)


def _engine(tiny, proposer=None, k=0):
    config = EngineConfig(max_model_len=128, max_num_seqs=4, num_kv_blocks=40)
    return LLMEngine(tiny["loaded"], config, proposer, num_speculative_tokens=k)


def _run(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs, pieces = {}, {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
            pieces[o.request_id].extend(o.new_pieces)
            assert "".join(p.text for p in o.new_pieces) == o.new_text
    return outs, pieces


def test_plain_decoding_labels_every_token_plain(tiny):
    prompts = ragged_prompts(3, seed=2, lo=3, hi=12)
    outs, pieces = _run(_engine(tiny), prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for rid, o in outs.items():
        c = o.outputs[0]
        assert c.token_sources == [PLAIN] * len(c.token_ids) == [PLAIN] * 12
        assert "".join(p.text for p in pieces[rid]) == c.text
        assert {p.source for p in pieces[rid]} <= {PLAIN}


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_sources_follow_verification_exactly(tiny, tree):
    prompts = ragged_prompts(2, seed=5, lo=4, hi=10)
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)
    plain, _ = _run(_engine(tiny), prompts, params)
    answers = {tuple(p): plain[str(i)].outputs[0].token_ids for i, p in enumerate(prompts)}
    # k = 3: output 0 is the prefill's (plain); then passes draft outputs 1-3 (all right: three
    # drafts and a bonus at 4), 5-7 with 6 wrong (5 draft, 6 corrected), 7-9 (draft x3, bonus 10),
    # 11-12 at the end (max_depth leaves room for one draft: 11 draft, 12 bonus).
    outs, pieces = _run(_engine(tiny, OracleProposer(answers, {6}, tree), k=3), prompts, params)
    expect = [PLAIN, DRAFT, DRAFT, DRAFT, BONUS, DRAFT, CORRECTED, DRAFT, DRAFT, DRAFT, BONUS, DRAFT, BONUS]
    for i, p in enumerate(prompts):
        o = outs[str(i)]
        c = o.outputs[0]
        assert c.token_ids == answers[tuple(p)]  # lossless all the same
        assert c.token_sources == expect
        assert c.token_sources.count(DRAFT) == o.spec.num_accepted
        # Every pass emits exactly one token that is not an accepted draft.
        assert len(c.token_ids) - c.token_sources.count(DRAFT) == o.spec.num_target_passes + 1
        assert "".join(x.text for x in pieces[str(i)]) == c.text
        assert [x.source for x in pieces[str(i)]] == [s for s, t in zip(expect, c.token_ids)
                                                      if tiny["loaded"].tokenizer.decode([t])]


def test_tree_path_ending_at_a_leaf_is_a_bonus_and_before_rejected_children_is_corrected(tiny):
    """A path that stops where the accepted node still has (rejected) children ends in a corrected
    token; one that reaches a leaf ends in a bonus, though other branches were rejected."""
    prompts = ragged_prompts(1, seed=8, lo=5, hi=6)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    plain, _ = _run(_engine(tiny), prompts, params)
    answer = plain["0"].outputs[0].token_ids
    outs, _ = _run(_engine(tiny, OracleProposer({tuple(prompts[0]): answer}, {1}, tree=True), k=1), prompts, params)
    # k = 1: each tree is one wrong-or-right node plus a wrong sibling, both children of the root:
    # output 1's both wrong (corrected), output 2's right (a draft, then output 3 a bonus).
    assert outs["0"].outputs[0].token_sources == [PLAIN, CORRECTED, DRAFT, BONUS]


def test_stop_string_hold_back_splits_a_token_but_keeps_its_source(tiny):
    prompts = ragged_prompts(2, seed=3, lo=3, hi=9)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain, _ = _run(_engine(tiny), prompts, params)
    text = plain["0"].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    answers = {tuple(p): plain[str(i)].outputs[0].token_ids for i, p in enumerate(prompts)}
    outs, pieces = _run(_engine(tiny, OracleProposer(answers, {4, 9}), k=3), prompts,
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    c = outs["0"].outputs[0]
    assert c.finish_reason == "stop" and stop not in c.text
    assert "".join(p.text for p in pieces["0"]) == c.text
    assert all(p.source in TOKEN_SOURCES and p.text for p in pieces["0"])
    assert set(c.token_sources) == {PLAIN, DRAFT, CORRECTED, BONUS}
