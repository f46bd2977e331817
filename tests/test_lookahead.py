"""Lookahead decoding (spec/lookahead.py): the tree it drafts for given W, N, G and budgets, the
Jacobi step and the n-gram pool on made-up predictions, the window's slide, its settings; end to
end, greedy output exactly plain greedy, the sampled distribution exactly the target's, node
predictions equal to the target's argmax, and a failing request failing alone."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specserve.config import AUTO_MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from specserve.drafts import SpecRequest, VerifyFeedback
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec.lookahead import LookaheadProposer, LookaheadWindow, NgramPool, check_lookahead_params, draft_tree
from tests.helpers import generate_ids, ragged_prompts
from tests.test_engine_paged import alone, assert_all_blocks_free
from tests.test_spec_e2e import LENGTH, assert_smollm_greedy_equals_plain, micro, sample_first_tokens  # noqa: F401 (micro: a fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def window(columns: list[list[int]]) -> LookaheadWindow:
    w = LookaheadWindow(0, len(columns[0]), [], random.Random(0))
    w.columns = [list(c) for c in columns]
    return w


def paths_of(tree) -> list[list[int]]:
    return [[tree.token_ids[i] for i in p] for p in tree.paths()]


# ---- the tree ----------------------------------------------------------------------------------

# W = 3 columns of N - 1 = 2 levels: column i is [g0[i], g1[i]].
COLUMNS = [[10, 20], [11, 21], [12, 22]]


def test_tree_shape_depths_and_mask():
    """G = 2 trigram candidates, then level 0 as a chain with each column's level 1 under its g0."""
    tree, layout = draft_tree([(1, 2), (3, 4)], window(COLUMNS), depth=8, max_nodes=64)
    assert paths_of(tree) == [[1, 2], [3, 4], [10, 20], [10, 11, 21], [10, 11, 12, 22]]
    assert tree.num_nodes == 2 * 2 + 3 * 2
    node = {t: i for i, t in enumerate(tree.token_ids)}  # every token here is distinct
    assert layout == [[node[10], node[20]], [node[11], node[21]], [node[12], node[22]]]
    depth = dict(zip(tree.token_ids, tree.depths()))
    # Node (level j, column i) at depth i + 1 + j.
    assert [depth[t] for t in (10, 11, 12)] == [1, 2, 3] and [depth[t] for t in (20, 21, 22)] == [2, 3, 4]
    # It sees the root, g0[0..i] and its own column's earlier levels, nothing else.
    mask = tree.attention_mask()
    seen = {t: {tree.token_ids[m - 1] for m in range(1, tree.num_nodes + 1) if mask[node[t] + 1, m]} for t in node}
    assert seen[22] == {10, 11, 12, 22} and seen[21] == {10, 11, 21} and seen[20] == {10, 20}
    assert seen[12] == {10, 11, 12} and seen[2] == {1, 2}
    assert mask[:, 0].all()


def test_nodes_with_the_same_path_merge():
    """A candidate that starts like level 0, and a column's level 1 equal to the next column's
    g0, share nodes: same path, same context, same prediction."""
    tree, layout = draft_tree([(10, 5), (10, 11)], window([[10, 11], [11, 21]]), depth=8, max_nodes=64)
    assert paths_of(tree) == [[10, 5], [10, 11, 21]]
    assert tree.num_nodes == 4
    ten, eleven = tree.token_ids.index(10), tree.token_ids.index(11)
    assert layout[0] == [ten, eleven] and layout[1][0] == eleven  # (1, 0) is the node of (0, 1)
    assert tree.children()[0] == [ten]  # one child of the root per token


def test_budgets_cut_columns_then_candidates():
    cands, w = [(1, 2), (3, 4)], window(COLUMNS)
    # Depth 3: column 2 (depth 4) does not fit.
    tree, layout = draft_tree(cands, w, depth=3, max_nodes=64)
    assert len(layout) == 2 and tree.max_depth == 3 and tree.num_nodes == 8
    # 7 nodes: candidates (4) then column 0 (2); column 1 would need 2 more.
    tree, layout = draft_tree(cands, w, depth=8, max_nodes=7)
    assert len(layout) == 1 and tree.num_nodes == 6 and paths_of(tree)[:2] == [[1, 2], [3, 4]]
    # 3 nodes: candidates first, the second cut; no column fits.
    tree, layout = draft_tree(cands, w, depth=8, max_nodes=3)
    assert layout == [] and paths_of(tree) == [[1, 2], [3]]
    # Depth 1: no whole column; level 0's chain as far as it goes.
    tree, layout = draft_tree(cands, w, depth=1, max_nodes=64)
    assert layout == [] and paths_of(tree) == [[1], [3], [10]]
    for depth in range(1, 7):
        for nodes in range(depth, 12):
            t, _ = draft_tree(cands, w, depth, nodes)
            assert t.num_nodes <= nodes and t.max_depth <= depth


def test_num_draft_nodes_is_the_whole_tree_at_each_depth():
    p = LookaheadProposer(window=3, ngram=3, candidates=2)
    assert [p.num_draft_nodes(k) for k in (1, 2, 3, 4, 8)] == [3, 6, 8, 10, 10]
    assert LookaheadProposer(window=1, ngram=2, candidates=0).num_draft_nodes(5) == 5  # at least k


# ---- the Jacobi step, the pool and the slide ----------------------------------------------------

def test_pool_keeps_the_most_recent_per_key():
    pool = NgramPool(per_key=2)
    for g in ([1, 2, 3], [1, 4, 5], [1, 2, 3], [1, 6, 7], [9, 9, 9]):
        pool.add(g)
    assert pool.candidates(1, 5) == [(6, 7), (2, 3)]  # (4, 5) least recently used: out
    assert pool.candidates(9, 1) == [(9, 9)] and pool.candidates(8, 3) == []


def spec_request(rid, tokens, k, max_nodes=None):
    return SpecRequest(rid, tokens, k, SamplingParams(temperature=0.0), None, max_nodes)


def test_jacobi_step_feeds_the_pool_and_moves_levels_down():
    p = LookaheadProposer(window=3, ngram=3, candidates=2)
    p.add_request("a", [7, 8])  # too short for any trigram: the pool starts empty
    state = p.states["a"]
    state.window.columns = [list(c) for c in COLUMNS]
    tree = p.propose([spec_request("a", [7, 8], 4, max_nodes=64)]).trees[0]
    node = {t: i for i, t in enumerate(tree.token_ids)}
    preds = [0] * (1 + tree.num_nodes)
    preds[0] = 99  # the root's prediction is no column's
    for deepest, new in ((20, 30), (21, 31), (22, 32)):
        preds[1 + node[deepest]] = new
    p.observe(VerifyFeedback(["a"], [tree.num_nodes], [0], [[99]], [[]], [preds]))
    # One token committed: every column's levels moved down, its new top level appended.
    assert state.window.columns == [[20, 30], [21, 31], [22, 32]]
    assert [state.pool.candidates(t, 2) for t in (10, 11, 12)] == [[(20, 30)], [(21, 31)], [(22, 32)]]
    # The root is now 99: nothing keyed by it yet, so the next tree is the window's alone.
    tree = p.propose([spec_request("a", [7, 8, 99], 4, max_nodes=64)]).trees[0]
    assert paths_of(tree) == [[20, 30], [20, 21, 31], [20, 21, 22, 32]]


def test_candidates_keyed_by_the_root_come_first():
    p = LookaheadProposer(window=2, ngram=3, candidates=2)
    prompt = [5, 1, 2, 5, 3, 4, 5]  # trigrams (5, 1, 2) then (5, 3, 4): most recent first
    p.add_request("a", prompt)
    p.states["a"].window.columns = [[40, 41], [42, 43]]
    tree = p.propose([spec_request("a", prompt, 3, max_nodes=8)]).trees[0]
    assert paths_of(tree) == [[3, 4], [1, 2], [40, 41], [40, 42, 43]]


def test_window_slides_by_what_was_committed():
    w = window([[1, 2], [3, 4], [5, 6], [7, 8]])
    context = [50]
    # Columns 0..2 made a Jacobi step; 3 tokens committed: updated columns move c - 1 = 2 to
    # the left, the column that did not step moves 3; the right is filled from the context.
    w.advance({0: [2, 20], 1: [4, 40], 2: [6, 60]}, 3, context)
    assert w.columns == [[6, 60], [50, 50], [50, 50], [50, 50]]
    w = window([[1, 2], [3, 4]])
    w.advance({0: [2, 20], 1: [4, 40]}, 1, context)  # one token: the paper's shift, in place
    assert w.columns == [[2, 20], [4, 40]]
    w.advance({}, 1, context)  # a step without drafts: one position passed
    assert w.columns == [[4, 40], [50, 50]]


def test_a_request_without_predictions_only_slides():
    p = LookaheadProposer(window=2, ngram=2, candidates=1)
    p.add_request("a", [3, 4, 3])
    state = p.states["a"]
    state.window.columns = [[10], [11]]
    p.propose([spec_request("a", [3, 4, 3], 2, max_nodes=8)])
    p.observe(VerifyFeedback(["a"], [3], [0], [[4]], [[]], None))
    assert state.window.columns[0] == [11] and state.layout is None


def test_feedback_row_keeps_node_predictions():
    fb = VerifyFeedback(["a", "b"], [1, 0], [1, 0], [[5, 6], [7]], [[0], []], [[5, 6], [7]])
    assert fb.row(1).node_predictions == [[7]]
    assert VerifyFeedback(["a"], [0], [0], [[1]], [[]]).row(0).node_predictions is None


# ---- settings ----------------------------------------------------------------------------------

@pytest.mark.parametrize("key, value, allowed", [
    ("lookahead_window", 0, r"\[1, 16\]"), ("lookahead_window", 17, r"\[1, 16\]"),
    ("lookahead_ngram", 1, r"\[2, 8\]"), ("lookahead_ngram", 2.5, r"\[2, 8\]"),
    ("lookahead_candidates", -1, r"\[0, 16\]"), ("lookahead_candidates", True, r"\[0, 16\]"),
])
def test_lookahead_settings_are_checked(key, value, allowed):
    with pytest.raises(InvalidParameterError, match=f"{key}.*{allowed}"):
        SpeculativeConfig.from_dict({"method": "lookahead", key: value})
    with pytest.raises(InvalidParameterError, match=allowed):
        check_lookahead_params(**{"window": 2, "ngram": 3, "candidates": 2,
                                  key.removeprefix("lookahead_"): value})


def test_lookahead_settings_apply_to_lookahead_only():
    with pytest.raises(InvalidParameterError, match="lookahead_ngram.*method 'lookahead' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "lookahead_ngram": 4})
    cfg = SpeculativeConfig.from_dict({"method": "lookahead", "lookahead_window": 4})
    assert cfg.lookahead_params == (4, 3, 2) and cfg.adaptive
    assert cfg.k == 4 + 3 - 2  # auto's cap: the whole tree's depth
    assert SpeculativeConfig(method="lookahead").k == AUTO_MAX_SPECULATIVE_TOKENS["lookahead"]
    assert SpeculativeConfig(method="lookahead", max_speculative_tokens=5).k == 5


# ---- end to end --------------------------------------------------------------------------------

def test_smollm_lookahead_greedy_equals_plain(smollm_native):
    """The embedded model, the default W, N, G at the depth of their whole tree (a fixed depth:
    under "auto" how much is drafted depends on the machine's timings), three requests in
    flight in the paged engine."""
    llm = assert_smollm_greedy_equals_plain(smollm_native, {"method": "lookahead", "num_speculative_tokens": 2},
                                            max_num_seqs=3, max_tokens=24)
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def prompts8():
    return ragged_prompts(8, seed=5)


@pytest.fixture(scope="module")
def expected8(tiny, prompts8):
    return alone(tiny, prompts8)


@pytest.mark.parametrize("setting", ["batch", "preemption", "chunked_prefill"])
def test_tiny_batches_equal_each_alone(tiny, prompts8, expected8, setting):
    kwargs = {"batch": {}, "preemption": {"num_kv_blocks": 8},
              "chunked_prefill": {"max_num_batched_tokens": 12, "max_num_seqs": 4}}[setting]
    spec = {"method": "lookahead", "num_speculative_tokens": 4, "lookahead_window": 3}  # wider than the default
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec, **{"max_num_seqs": 8, "max_model_len": 128, **kwargs})
    assert generate_ids(llm, prompts8, GREEDY) == expected8
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def full_logits(loaded, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] the target's logits over a whole sequence, one dense pass from scratch."""
    from specserve.model.attention import DenseKVCache

    cfg = loaded.config
    cache = DenseKVCache(cfg.num_layers, 1, len(ids), cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        meta = cache.metadata([0], [0], [len(ids)])
        return loaded.model.compute_logits(loaded.model(torch.tensor([ids]), meta, cache))[0]


def test_node_predictions_are_the_targets_argmax(tiny):
    """Every prediction the proposer receives is the target's argmax after the root's or the
    node's path, as a plain pass over that whole sequence computes it; greedy and sampled."""
    seen = []  # (context, tree, predictions)

    class Recording(LookaheadProposer):
        def __init__(self):
            super().__init__(window=2, ngram=3, candidates=2)
            self.last = {}  # request id -> (its committed tokens, the tree) of its last proposal

        def propose(self, batch):
            out = super().propose(batch)
            self.last = {r.request_id: (list(r.token_ids), t) for r, t in zip(batch, out.trees)}
            return out

        def observe(self, feedback):
            for i, rid in enumerate(feedback.request_ids):
                if rid in self.last:
                    seen.append((*self.last.pop(rid), feedback.node_predictions[i]))
            super().observe(feedback)

    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "lookahead", "num_speculative_tokens": 3},
              max_num_seqs=4)
    llm.engine.proposer = recording = Recording()
    params = [replace(GREEDY, max_tokens=10), SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True)]
    llm.generate(ragged_prompts(4, seed=2, hi=30), [params[i % 2] for i in range(4)], use_tqdm=False)
    assert recording.states == {}  # every request removed when it finished
    assert len(seen) > 10 and any(t.num_nodes for _, t, _ in seen)
    for context, tree, preds in seen:
        assert len(preds) == 1 + tree.num_nodes
        paths = [[]] + [[tree.token_ids[n] for n in p] for p in _ancestry(tree)]
        for path, pred in zip(paths, preds):
            assert full_logits(tiny["loaded"], context + path)[-1].argmax().item() == pred


def _ancestry(tree) -> list[list[int]]:
    """[N] each node's path from the root (its ancestors then itself)."""
    out: list[list[int]] = []
    for i, p in enumerate(tree.parents):
        out.append((out[p] if p >= 0 else []) + [i])
    return out


def test_a_failing_request_fails_alone(tiny):
    """The proposer's observe failing for one request (its node predictions in a batch's
    feedback) fails that request alone; the others end as they do alone."""
    from tests.test_engine_faults import BAD_PROMPT, GOOD, raise_if

    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "lookahead", "num_speculative_tokens": 3},
              max_num_seqs=4, max_model_len=64)
    expected = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p, params in GOOD]
    engine = llm.engine
    good = [engine.add_request(f"good{i}", p, params) for i, (p, params) in enumerate(GOOD)]
    bad = engine.add_request("bad", BAD_PROMPT, SamplingParams(temperature=0.7, max_tokens=12))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.proposer, "observe", raise_if(lambda fb: "bad" in fb.request_ids,
                                                        engine.proposer.observe, "injected"))
        while engine.has_unfinished_requests():
            engine.step()
    assert [r.output_token_ids for r in good] == expected
    assert bad.finish_reason == "error" and "injected" in bad.error
    assert_all_blocks_free(llm)


def test_lookahead_sampling_has_the_target_distribution(micro):  # noqa: F811
    """Sampled verification of lookahead trees (deterministic nodes, q one-hot) keeps the joint
    law of the first 3 tokens the target's; seeded, p > 1e-3 as in the other statistical tests."""
    loaded, _ = micro
    llm = LLM(loaded=loaded, max_num_seqs=512,
              speculative_config={"method": "lookahead", "num_speculative_tokens": 3, "lookahead_window": 2})
    outs, pvalue = sample_first_tokens(llm, [3, 5, 2, 3, 5],
                                       SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True))
    stats = LLM.aggregate_spec_stats(outs)
    assert 0 < stats.num_accepted < stats.num_drafted
    assert pvalue > 1e-3


def test_command_line_flags(tiny, capsys):
    from specserve.bench.cli import speculative_configs
    from specserve.cli import main
    from tests.test_engine_args import resolve

    _, spec, _ = resolve("serve", "--speculative", "lookahead", "--lookahead-window", "3", "--lookahead-ngram", "4",
                         "--lookahead-candidates", "1", "--prompt-lookup-max", "2")
    assert spec == {"method": "lookahead", "num_speculative_tokens": "auto", "lookahead_window": 3,
                    "lookahead_ngram": 4, "lookahead_candidates": 1}  # the ngram flag is not lookahead's
    _, spec, _ = resolve("generate", "hi", "--speculative", "ngram", "--lookahead-window", "3")
    assert spec == {"method": "ngram", "num_speculative_tokens": "auto"}
    configs = speculative_configs([("lookahead", None)], ["auto", 3], {"lookahead_ngram": 2})
    assert [s for _, s in configs] == [{"method": "lookahead", "num_speculative_tokens": k, "lookahead_ngram": 2}
                                       for k in ("auto", 3)]
    assert main(["generate", "t5 t9 t12 t5 t9", "--model", tiny["target"], "--speculative", "lookahead",
                 "--num-speculative-tokens", "3", "--max-tokens", "6", "--ignore-eos"]) == 0  # fixed k: auto may plan no drafts
    assert "drafted" in capsys.readouterr().err
    assert main(["generate", "t5", "--model", tiny["target"], "--speculative", "lookahead",
                 "--lookahead-window", "0"]) == 2
    assert "lookahead_window=0" in capsys.readouterr().err
