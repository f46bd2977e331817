"""Suffix decoding beside a drafter (spec/hybrid.py): which draft each request takes, fixed and
learned from what each source's drafts kept."""

from specserve.drafts import SpecRequest, VerifyFeedback
from specserve.drafts.tree import DraftTree
from specserve.sampling_params import SamplingParams
from specserve.spec.hybrid import DRAFTER_STEP_TOKENS, INITIAL_DRAFTER_TOKENS, SuffixFirst

GREEDY = SamplingParams(temperature=0, max_tokens=8)


class FixedSuffix:
    """A suffix proposer whose draft and estimate per request are set by the test."""

    def __init__(self, drafts: dict[str, tuple[DraftTree, float]]):
        self.drafts = drafts
        self.observed: list[VerifyFeedback] = []

    def draft(self, r):
        return self.drafts[r.request_id]

    def observe(self, feedback):
        self.observed.append(feedback)

    def num_draft_nodes(self, k):
        return k


def chain(n: int) -> DraftTree:
    return DraftTree(list(range(10, 10 + n)), list(range(-1, n - 1)))


def requests(*ids, k=3):
    return [SpecRequest(rid, [1, 2, 3], k, GREEDY, None, max_nodes=6) for rid in ids]


def feedback(rows):  # rows: (request id, drafted, kept)
    return VerifyFeedback([r for r, _, _ in rows], [d for _, d, _ in rows], [a for _, _, a in rows],
                          [[0] * (a + 1) for _, _, a in rows], [list(range(a)) for _, _, a in rows])


def test_a_fixed_threshold_takes_every_suffix_draft_expected_to_keep_that_many():
    s = SuffixFirst(FixedSuffix({"a": (chain(3), 1.2), "b": (chain(2), 0.9), "c": (DraftTree.empty(), 5.0)}), 1.0)
    batch = requests("a", "b", "c") + [SpecRequest("d", [1], 0, GREEDY, None)]
    trees = [DraftTree.empty()] * 4
    rest, taken = s.split(batch, trees)
    assert taken == 1 and trees[0].token_ids == [10, 11, 12] and not trees[1].num_nodes
    # the drafter gets the others, the taken one asking for nothing, every index kept
    assert [r.num_speculative_tokens for r in rest] == [0, 3, 3, 0] and [r.request_id for r in rest] == list("abcd")


def test_the_learned_choice_follows_what_each_source_kept():
    suffix = FixedSuffix({"a": (chain(2), 0.3)})
    s = SuffixFirst(suffix)
    # Before anything is verified: an estimate of 0.3 against the drafter's prior 0.5 (less its
    # dearer step) leaves the request to the drafter.
    assert 0.3 < INITIAL_DRAFTER_TOKENS - DRAFTER_STEP_TOKENS
    trees = [DraftTree.empty()]
    assert s.split(requests("a"), trees)[1] == 0
    # The drafter's drafts keep nothing for this request: suffix's draft wins.
    for _ in range(12):
        s.split(requests("a"), [DraftTree.empty()])
        s.observe(feedback([("a", 4, 0)]))
    assert s.drafter_expects("a") < 0.3 + DRAFTER_STEP_TOKENS
    assert s.split(requests("a"), trees)[1] == 1 and trees[0].num_nodes == 2
    # Suffix drafts keep far more than they promised: a smaller estimate still wins elsewhere,
    # where the drafter keeps ~0.5 a step.
    for _ in range(20):
        s.observe(feedback([("a", 2, 2)]))
        s.split(requests("a"), [DraftTree.empty()])
    suffix.drafts["b"] = (chain(1), 0.2)
    for _ in range(6):
        s.split(requests("b"), [DraftTree.empty()])
        s.observe(feedback([("b", 3, 1)]))
    assert s.split(requests("b"), [DraftTree.empty()])[1] == 1
    assert len(suffix.observed) > 0  # verification reaches the suffix trees (they index committed text)


def test_a_finished_request_is_forgotten():
    s = SuffixFirst(FixedSuffix({"a": (chain(1), 0.0)}))
    s.split(requests("a"), [DraftTree.empty()])
    s.observe(feedback([("a", 2, 0)]))
    s.suffix.remove_request = lambda rid: None
    s.remove_request("a")
    assert s.drafter_expects("a") == s.drafter_expects("never seen")
