"""Suffix decoding: the suffix tree against brute-force counts, drafts grown best first, the
global tree's bound and eviction, parameter checks; then greedy identity and the sampled
distribution in the engine."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpeculativeConfig
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec import SpecRequest, VerifyFeedback
from specserve.spec.suffix import SuffixProposer, SuffixTree, draft_tree
from tests.test_spec_e2e import LENGTH, assert_smollm_greedy_equals_plain, micro, sample_first_tokens, tiny_prompts  # noqa: F401  (micro: a fixture)

GREEDY = SamplingParams(temperature=0.0)


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    """The definition: occurrences of every substring of at most `depth` tokens."""
    out: Counter = Counter()
    for s in seqs:
        for end in range(1, len(s) + 1):
            for n in range(1, min(depth, end) + 1):
                out[tuple(s[end - n:end])] += 1
    return out


def tree_counts(tree: SuffixTree) -> Counter:
    out: Counter = Counter()
    stack = [((), tree.root)]
    while stack:
        path, node = stack.pop()
        for t, child in tree.children(node).items():
            out[path + (t,)] = tree.count(child)
            stack.append((path + (t,), child))
    return out


@settings(max_examples=120, deadline=None)
@given(seqs=st.lists(st.lists(st.integers(0, 3), max_size=20), max_size=5), depth=st.integers(1, 5),
       drop=st.integers(0, 4))
def test_tree_counts_every_substring_and_removal_undoes_adding(seqs, depth, drop):
    tree = SuffixTree(depth)
    for s in seqs:
        tree.add(s)
    assert tree_counts(tree) == substring_counts(seqs, depth)
    assert tree.num_nodes == 1 + len(substring_counts(seqs, depth))
    gone = seqs[drop:drop + 2]
    for s in gone:
        tree.remove(s)
    kept = seqs[:drop] + seqs[drop + 2:]
    assert tree_counts(tree) == substring_counts(kept, depth)
    assert tree.num_nodes == 1 + len(substring_counts(kept, depth))


def test_match_finds_the_longest_continued_suffix():
    tree = SuffixTree(4)
    tree.add([1, 2, 3, 9, 2, 3, 7])
    node, length = tree.match([5, 1, 2, 3])
    assert length == 3 and set(tree.children(node)) == {9}  # "1 2 3" was followed by 9
    node, length = tree.match([8, 2, 3])
    assert length == 2 and set(tree.children(node)) == {9, 7}
    assert tree.match([3, 7]) is None  # "7" ends the sequence: never continued
    assert tree.match([4]) is None


def test_drafts_are_the_most_frequent_continuations_best_first():
    tree = SuffixTree(8)
    for s in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 6]):
        tree.add(s)
    node, length = tree.match([0, 1, 2])
    draft, score = draft_tree(tree, [0, 1, 2], node, length, max_depth=4, max_nodes=10, min_prob=0.0)
    # 3 follows "1 2" three times in four, 6 once; after "1 2 3": 4 twice, 5 once.
    assert list(zip(draft.token_ids, draft.parents)) == [(3, -1), (4, 0), (6, -1), (5, 0)]
    assert score == pytest.approx(0.75 + 0.5 + 0.25 + 0.25)
    small, _ = draft_tree(tree, [0, 1, 2], node, length, max_depth=4, max_nodes=10, min_prob=0.3)
    assert small.token_ids == [3, 4]
    shallow, _ = draft_tree(tree, [0, 1, 2], node, length, max_depth=1, max_nodes=10, min_prob=0.0)
    assert shallow.token_ids == [3, 6]
    few, _ = draft_tree(tree, [0, 1, 2], node, length, max_depth=4, max_nodes=1, min_prob=0.0)
    assert few.token_ids == [3]


def test_a_draft_goes_on_past_the_trees_depth():
    """A tree of depth 4 holds substrings of 4 tokens; a remembered 30-token text is still
    drafted in one piece, each step past the depth continuing from its own last 2 tokens."""
    text = list(range(10, 40))
    tree = SuffixTree(4)
    tree.add(text)
    node, length = tree.match([10, 11])
    draft, score = draft_tree(tree, [10, 11], node, length, max_depth=20, max_nodes=20, min_prob=0.1)
    assert draft.token_ids == text[2:22] and draft.is_chain and score == 20


def test_second_request_drafts_the_first_ones_output():
    p = SuffixProposer(max_depth=8, cache_tokens=100)
    prompt, output = [1, 2, 3], [7, 8, 9, 10, 11, 12]
    p.add_request("a", prompt)
    p.propose([SpecRequest("a", prompt + output, 4, GREEDY, None, 6)])
    p.remove_request("a")
    # The global tree holds the prompt's tail and the output: the same question is answered
    # from its first token on.
    tree = p.propose([SpecRequest("b", prompt, 4, GREEDY, None, 6)]).trees[0]
    assert tree.token_ids == output[:3]  # depth follows the 3-token match
    tree = p.propose([SpecRequest("b", prompt + output[:2], 4, GREEDY, None, 6)]).trees[0]
    assert tree.token_ids == output[2:6]  # capped at k


def test_tokens_committed_without_a_proposal_reach_the_global_tree():
    """Steps where the engine drafts nothing (adaptive depth 0, the last step) call no propose;
    their tokens arrive through observe, and the whole answer is remembered."""
    p = SuffixProposer(max_depth=4, cache_tokens=100)
    p.propose([SpecRequest("a", [1, 2, 7], 2, GREEDY, None, 3)])
    p.observe(VerifyFeedback(["a"], [0], [0], [[8, 9]], [[]]))
    p.observe(VerifyFeedback(["a"], [1], [1], [[10, 11]], [[0]]))
    p.propose([SpecRequest("a", [1, 2, 7, 8, 9, 10, 11], 2, GREEDY, None, 3)])  # in step: nothing re-indexed
    p.observe(VerifyFeedback(["a"], [0], [0], [[12]], [[]]))
    p.remove_request("a")
    assert list(p.cached) == [(1, 2, 7, 8, 9, 10, 11, 12)]
    assert tree_counts(p.global_tree) == substring_counts([[1, 2, 7, 8, 9, 10, 11, 12]], 4)
    # First drafting after 5 tokens of output: the answer still starts after the prompt's
    # last max_depth tokens.
    prompt, output = [20, 21, 22, 23, 24, 25], [30, 31, 32, 33, 34, 35]
    p.propose([SpecRequest("b", prompt + output[:5], 2, GREEDY, None, 3, num_prompt_tokens=len(prompt))])
    p.observe(VerifyFeedback(["b"], [0], [0], [[35]], [[]]))
    p.remove_request("b")
    assert list(p.cached)[-1] == (22, 23, 24, 25, 30, 31, 32, 33, 34, 35)


def test_global_tree_is_bounded_and_least_recently_used_goes_first():
    p = SuffixProposer(max_depth=2, cache_tokens=10)
    outs = {"a": [11, 12, 13, 14], "b": [21, 22, 23, 24], "c": [31, 32, 33, 34]}
    for rid, out in outs.items():
        p.add_request(rid, [1])
        p.propose([SpecRequest(rid, [1] + out, 2, GREEDY, None, 2)])
        if rid == "c":  # "a" answered again before "c" arrives: "b" is now the oldest
            p.add_request("a2", [1])
            p.propose([SpecRequest("a2", [1] + outs["a"], 2, GREEDY, None, 2)])
            p.remove_request("a2")
        p.remove_request(rid)
    assert p.cached_tokens <= 10
    assert list(p.cached) == [(1, 11, 12, 13, 14), (1, 31, 32, 33, 34)]
    assert tree_counts(p.global_tree) == substring_counts([[1, 11, 12, 13, 14], [1, 31, 32, 33, 34]], 2)


def test_request_tree_follows_a_changed_sequence():
    p = SuffixProposer(max_depth=4, cache_tokens=0)
    p.add_request("r", [1, 2, 3, 1, 2])
    assert p.propose([SpecRequest("r", [1, 2, 3, 1, 2], 2, GREEDY, None, 2)]).trees[0].token_ids == [3, 1]
    # Recomputed after preemption with a different tail: the tree is rebuilt, not appended to.
    assert p.propose([SpecRequest("r", [1, 2, 4, 1, 2], 2, GREEDY, None, 2)]).trees[0].token_ids == [4, 1]
    assert p.propose([SpecRequest("r", [1, 2, 4, 1, 2], 0, GREEDY, None, 0)]).trees[0].num_nodes == 0
    p.remove_request("r")
    assert not p.requests and not p.cached  # cache_tokens=0: no global tree


@pytest.mark.parametrize("key, value, needle", [
    ("suffix_tree_depth", 0, r"suffix_tree_depth.*\[1, 64\]"),
    ("suffix_cache_tokens", -1, r"suffix_cache_tokens.*0: no global tree"),
    ("suffix_spec_factor", 0, r"suffix_spec_factor.*\(0, 64\]"),
    ("suffix_min_token_prob", 1.0, r"suffix_min_token_prob.*\[0, 1\)"),
])
def test_suffix_knobs_are_checked(key, value, needle):
    with pytest.raises(InvalidParameterError, match=needle):
        SpeculativeConfig.from_dict({"method": "suffix", key: value})
    with pytest.raises(InvalidParameterError, match="applies to method 'suffix' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "suffix_tree_depth": 8})


# ---- in the engine -------------------------------------------------------------------------

def test_tiny_greedy_suffix_equals_plain_twice_through(tiny):
    """Greedy output equals plain decoding's, token for token, with four requests in flight;
    the second pass over the same prompts drafts from the global tree and accepts more."""
    prompts = tiny_prompts()
    params = replace(GREEDY, max_tokens=48)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=tiny["loaded"], max_num_seqs=1).generate(prompts, params, use_tqdm=False)]
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    first = llm.generate(prompts, params, use_tqdm=False)
    second = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == plain
    assert [o.outputs[0].token_ids for o in second] == plain
    a, b = LLM.aggregate_spec_stats(first), LLM.aggregate_spec_stats(second)
    assert a.num_drafted > 0
    assert b.mean_accepted_length > a.mean_accepted_length
    assert b.acceptance_by_position[0] > max(0.8, a.acceptance_by_position[0])  # the answers were remembered


def test_smollm_greedy_suffix_equals_plain(smollm_native):
    """Twice through one engine: the second time drafts from the global tree."""
    assert_smollm_greedy_equals_plain(smollm_native, {"method": "suffix"}, max_num_seqs=3, max_tokens=48, rounds=2)


def test_suffix_sampling_has_the_target_distribution(micro):  # noqa: F811
    """Trees of remembered continuations (the global tree fills with earlier samples, so the
    frequent ones are drafted) verified at temperature 1: the joint law of the first 3 tokens
    is the target's."""
    loaded, _ = micro
    llm = LLM(loaded=loaded, max_num_seqs=64,
              speculative_config={"method": "suffix", "num_speculative_tokens": 2, "suffix_min_token_prob": 0.0})
    outs, pvalue = sample_first_tokens(llm, [3, 5, 2, 3, 5, 2, 3],
                                       SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True))
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > len(outs) // 2 and 0.05 < stats.acceptance_rate < 0.95, stats
    assert pvalue > 1e-3


def test_removed_nodes_are_reused_and_no_tree_node_is_a_collector_object():
    """A cache that keeps taking sequences in and out holds a bounded number of node slots, and
    the garbage collector tracks none of a tree's node tables (a full collection would walk
    them all)."""
    import gc

    tree = SuffixTree(6)
    tree.add([1, 2, 3, 4, 5, 6, 7, 8])
    for i in range(50):
        seq = [(i * 7 + j) % 13 for j in range(30)]
        tree.add(seq)
        tree.remove(seq)
    assert tree_counts(tree) == substring_counts([[1, 2, 3, 4, 5, 6, 7, 8]], 6)
    assert len(tree.counts) <= 1 + 8 * 6 + 30 * 6  # one sequence's nodes at most beside the kept one
    assert not any(gc.is_tracked(k) for k in tree.kids if k is not None)
