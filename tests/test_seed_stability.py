"""A seed means the same text with or without speculation (issue 28, M1 and M2).

Every sampled token at sequence position t races the target's processed distribution against
noise drawn from (seed, t) alone, and the verifier emits exactly that race's winner: so for
every method, at any draft length (fixed or adaptive), chain or tree, the text of a seeded
sampled request is plain sampling's, token for token. Temperatures below the documented floor
(1e-5) are greedy instead of underflowing.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec.heads import new_drafter, save_drafter
from tests.helpers import ragged_prompts
from tests.server_helpers import RunningServer

PARAMS = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)
MEDUSA_CHOICES = [[0], [0, 0], [1], [0, 0, 0], [0, 1], [2], [1, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def drafters(tiny, tmp_path_factory):
    """Untrained EAGLE and Medusa drafters for the tiny target (they draft poorly, which makes
    mismatches, the case under test, frequent)."""
    root = tmp_path_factory.mktemp("drafters")
    vocab = torch.arange(tiny["loaded"].config.vocab_size)
    save_drafter(root / "eagle", new_drafter(tiny["loaded"], "eagle", vocab))
    save_drafter(root / "medusa", new_drafter(tiny["loaded"], "medusa", vocab, num_heads=4, tree_choices=MEDUSA_CHOICES))
    return {"eagle": str(root / "eagle"), "medusa": str(root / "medusa")}


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(4, seed=5, lo=4, hi=30)  # repeated phrases: n-gram and suffix find matches


@pytest.fixture(scope="module")
def plain(tiny, prompts):
    """The texts of plain decoding: token ids per prompt, params by name."""
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4)
    return lambda params: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def method_config(method: str, tiny, drafters) -> dict:
    return {
        "ngram": {"method": "ngram"},
        "ngram_tree": {"method": "ngram", "num_branches": 3},
        "suffix": {"method": "suffix"},
        "lookahead": {"method": "lookahead"},
        "draft_model": {"method": "draft_model", "model": tiny["draft"]},
        "eagle": {"method": "eagle", "model": drafters["eagle"]},
        "medusa": {"method": "medusa", "model": drafters["medusa"]},
        "self_spec": {"method": "self_spec", "skip_layers": [1]},
    }[method]


METHODS = ["ngram", "ngram_tree", "suffix", "lookahead", "draft_model", "eagle", "medusa", "self_spec"]


@pytest.mark.parametrize("k", [1, 3, "auto"])
@pytest.mark.parametrize("method", METHODS)
def test_seeded_text_with_speculation_is_plain_samplings(tiny, drafters, prompts, plain, method, k):
    """Regression (M1): four identical seeded requests under adaptive k gave four texts."""
    spec = method_config(method, tiny, drafters) | {"num_speculative_tokens": k}
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, speculative_config=spec)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain(PARAMS)
    if k != "auto":  # the adaptive planner may choose not to draft on this machine
        assert LLM.aggregate_spec_stats(outs).num_drafted > 0


def test_one_request_alone_or_batched_with_different_draft_lengths(tiny, prompts, plain):
    """The same seeded request four times in one batch, each with its own draft length."""
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, speculative_config={"method": "draft_model", "model": tiny["draft"],
                                                                         "num_speculative_tokens": 5})
    for k, rid in zip([0, 1, 3, 5], "abcd"):
        llm.engine.add_request(rid, prompts[0], PARAMS, num_speculative_tokens=k)
    done = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done["a"] == done["b"] == done["c"] == done["d"] == plain(PARAMS)[0]


def test_unseeded_requests_differ_and_runs_reproduce(tiny, prompts):
    """Requests without a seed get one from the engine's seeded RNG: two such requests differ,
    and a new engine with the same seed repeats them."""
    unseeded = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True)

    def run():
        llm = LLM(loaded=tiny["loaded"], max_num_seqs=2, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        return [o.outputs[0].token_ids for o in llm.generate([prompts[0]] * 2, unseeded, use_tqdm=False)]

    first = run()
    assert first[0] != first[1]
    assert run() == first


def test_n_choices_with_speculation_are_single_requests_seeded_s_plus_j(tiny, prompts):
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec, max_num_seqs=4, max_model_len=256)
    text = " ".join(f"t{t}" for t in prompts[1])
    with RunningServer(llm) as s:
        r = httpx.post(f"{s.url}/v1/completions", json={
            "model": "tiny", "prompt": text, "max_tokens": 16, "temperature": 0.9, "seed": 11, "n": 3,
            "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    single = LLM(loaded=tiny["loaded"], max_num_seqs=1, max_model_len=256)  # no speculation
    for j, choice in enumerate(choices):
        want = single.generate([text], SamplingParams(temperature=0.9, seed=11 + j, max_tokens=16, ignore_eos=True),
                               use_tqdm=False)[0]
        assert choice["text"] == want.outputs[0].text
    assert len({c["text"] for c in choices}) == 3


@pytest.mark.parametrize("temperature", [1e-38, 1e-6])
def test_temperatures_below_the_floor_give_the_greedy_text(tiny, prompts, plain, temperature):
    """Regression (M2): 1e-38 underflowed to eight <|endoftext|> tokens and an empty text."""
    greedy = plain(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    tiny_t = SamplingParams(temperature=temperature, seed=3, max_tokens=24, ignore_eos=True)
    assert plain(tiny_t) == greedy
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, tiny_t, use_tqdm=False)] == greedy


def test_temperature_above_the_floor_samples_valid_tokens(tiny, prompts, plain):
    out = plain(SamplingParams(temperature=1e-4, seed=3, max_tokens=24, ignore_eos=True))
    vocab = tiny["loaded"].config.vocab_size
    assert all(len(ids) == 24 and all(0 <= t < vocab for t in ids) for ids in out)
