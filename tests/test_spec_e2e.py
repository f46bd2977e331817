"""End-to-end speculative decoding: greedy output equals plain greedy output token for token
(float32), a draft identical to the target accepts everything, and sampled output has the
target's exact distribution."""

import itertools
from dataclasses import replace

import pytest
import torch

from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from tests.helpers import chi_square_pvalue, make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=48)


def tiny_prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Repetitive prompts (a random phrase repeated) give the n-gram proposer something to find.
    out = []
    for i in range(n):
        phrase = torch.randint(2, 64, (3 + i % 4,), generator=g).tolist()
        out.append((phrase * 4)[: 5 + 3 * i])
    return out


def run(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
    {"method": "draft_model", "num_speculative_tokens": 4, "model": "draft"},
    {"method": "draft_model", "num_speculative_tokens": 2, "model": "target"},
])
@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_tiny_greedy_speculation_equals_plain(tiny, spec, max_num_seqs):
    spec = dict(spec)
    if "model" in spec:
        spec["model"] = str(tiny[spec["model"]])
    prompts = tiny_prompts()
    plain = run(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts)
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec, max_num_seqs=max_num_seqs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > 0
    if spec.get("model") == str(tiny["target"]):
        assert stats.acceptance_rate == 1.0
        assert stats.mean_accepted_length > 2.5


def test_draft_identical_to_target_accepts_everything_on_smollm(smollm_native):
    msgs = [{"role": "user", "content": "List three colours."}]
    plain = LLM(loaded=smollm_native, max_num_seqs=1).chat(msgs, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    llm = LLM(loaded=smollm_native, max_num_seqs=1,
              speculative_config={"method": "draft_model", "model": "default", "num_speculative_tokens": 3})
    out = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids
    assert out.spec.acceptance_rate == 1.0
    assert out.spec.acceptance_by_position == [1.0, 1.0, 1.0]


SMOLLM_PROMPTS = [
    "Repeat this list exactly, twice: apples, pears, plums, cherries, lemons.",
    "Summarize: The cat sat on the mat. The cat was happy because the mat was warm. The mat was red.",
    "Write a Python function that returns the sum of a list of numbers.",
]


_PLAIN: dict[int, list[list[int]]] = {}


def _smollm_plain(smollm) -> list[list[int]]:
    """Plain greedy tokens of SMOLLM_PROMPTS (48 at most), decoded once per process: a shorter
    greedy answer is a prefix of a longer one, so every test slices these."""
    if id(smollm) not in _PLAIN:
        msgs = [[{"role": "user", "content": p}] for p in SMOLLM_PROMPTS]
        outs = LLM(loaded=smollm, max_num_seqs=1).chat(msgs, SamplingParams(temperature=0, max_tokens=48),
                                                       use_tqdm=False)
        _PLAIN[id(smollm)] = [list(o.outputs[0].token_ids) for o in outs]
    return _PLAIN[id(smollm)]


def assert_smollm_greedy_equals_plain(smollm, spec: dict, max_num_seqs: int = 1, max_tokens: int = 48,
                                      rounds: int = 1) -> LLM:
    """SMOLLM_PROMPTS decoded greedily with `spec`, `rounds` times through one engine, equal
    plain decoding's tokens every time, and some drafts were accepted. -> the engine."""
    msgs = [[{"role": "user", "content": p}] for p in SMOLLM_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    plain = [ids[:max_tokens] for ids in _smollm_plain(smollm)]
    llm = LLM(loaded=smollm, max_num_seqs=max_num_seqs, speculative_config=spec)
    for _ in range(rounds):
        outs = llm.chat(msgs, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == plain
    assert LLM.aggregate_spec_stats(outs).num_accepted > 0
    return llm


def test_smollm_ngram_greedy_equals_plain(smollm_native):
    assert_smollm_greedy_equals_plain(smollm_native, {"method": "ngram", "num_speculative_tokens": 4})


def test_rejected_draft_entries_are_never_read(tiny):
    """Poison every cache row past each request's computed length after every step: if a stale
    (rolled-back) entry were ever read, the huge keys and values would change the output.
    (Finite poison, not NaN: a masked key gets weight exactly 0, and 0 * NaN is still NaN.)"""
    spec = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(tiny["draft"])}
    prompts = tiny_prompts(4, seed=3)
    plain = run(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts)
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec, max_num_seqs=4)
    engine, cache = llm.engine, llm.engine.runner.cache
    reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
    rejected = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        for r in reqs:
            if r.request_id in engine.scheduler.kv:  # poison every slot of its blocks past the computed length
                table = engine.scheduler.block_table(r)
                slots = torch.arange(len(table) * cache.block_size).view(len(table), -1)
                stale = (torch.tensor(table)[:, None] * cache.block_size + slots % cache.block_size).flatten()[r.num_computed_tokens:]
                for layer in range(cache.k.shape[0]):
                    cache.k_slots[layer][stale] = 1e3
                    cache.v_slots[layer][stale] = 1e3
        rejected += sum(o.spec.num_drafted - o.spec.num_accepted for o in outs if o.finished)
    assert [r.output_token_ids for r in reqs] == plain
    assert rejected > 0


def test_seeded_sampling_is_reproducible_with_speculation(tiny):
    spec = {"method": "draft_model", "num_speculative_tokens": 3, "model": str(tiny["draft"])}
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=20, seed=1234)
    a = run(LLM(loaded=tiny["loaded"], speculative_config=spec), tiny_prompts(3), params)
    b = run(LLM(loaded=tiny["loaded"], speculative_config=spec, max_num_seqs=1), tiny_prompts(3), params)
    assert a == b


# ---- the output distribution of speculative sampling is exactly the target's ------------------

V, LENGTH = 8, 3


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    """A vocabulary of 8 so that the distribution of the first 3 tokens can be enumerated."""
    root = tmp_path_factory.mktemp("micro")
    target = make_tiny_checkpoint(root / "t", vocab_size=V, hidden=32, heads=2, kv_heads=1, seed=5)
    draft = make_tiny_checkpoint(root / "d", vocab_size=V, hidden=32, heads=2, kv_heads=1, seed=6, layers=1)
    return load_model(target), draft


def exact_joint(loaded, prompt, params):
    """P(first 3 tokens) by enumeration, using the target's own processed distribution."""
    from specserve.model.attention import DenseKVCache
    from specserve.sample import SamplingTensors, processed_probs

    model, cfg = loaded.model, loaded.config
    seqs = [list(s) for s in itertools.product(range(V), repeat=LENGTH - 1)]
    ids = torch.tensor([prompt + s for s in seqs])  # [V^2, P + 2]
    cache = DenseKVCache(cfg.num_layers, len(seqs), 32, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    with torch.no_grad():
        meta = cache.metadata(list(range(len(seqs))), [0] * len(seqs), [ids.shape[1]] * len(seqs))
        logits = model.compute_logits(model(ids, meta, cache))[:, len(prompt) - 1:]  # [V^2, 3, V]
    st = SamplingTensors.from_params([params] * len(seqs), "cpu")
    p = processed_probs(logits, st).double()  # [V^2, 3, V]
    joint = torch.zeros(V, V, V, dtype=torch.float64)
    for i, (a, b) in enumerate(seqs):
        joint[a, b] = p[i, 0, a] * p[i, 1, b] * p[i, 2]
    return joint.reshape(-1)


def sample_first_tokens(llm, prompt, params, n=6000):
    """n requests of `prompt`, seeded 0..n-1 -> (outputs, chi-square p-value of their first
    LENGTH tokens' joint law against the target's exact one)."""
    outs = llm.generate([prompt] * n, [replace(params, seed=i) for i in range(n)], use_tqdm=False)
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])  # [n, LENGTH]
    cells = toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2]
    return outs, chi_square_pvalue(cells, exact_joint(llm.engine.target, prompt, params))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True),
    SamplingParams(temperature=0.7, max_tokens=LENGTH, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.8, max_tokens=LENGTH, ignore_eos=True),
], ids=["t1.0", "t0.7", "top_p0.8"])
def test_speculative_sampling_has_the_target_distribution(micro, params):
    loaded, draft = micro
    llm = LLM(loaded=loaded, max_num_seqs=512,
              speculative_config={"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    outs, pvalue = sample_first_tokens(llm, [3, 5, 2], params)
    # An imperfect draft: some drafts accepted, some not. (The draft is drawn with the target's
    # noise, a Gumbel-max coupling, which accepts a little less than min(1, p/q) would: 0.17-0.27
    # here against 0.21-0.31; the text is then plain sampling's for the same seed.)
    assert 0.1 < LLM.aggregate_spec_stats(outs).acceptance_rate < 0.95
    assert pvalue > 1e-3


def test_bad_speculative_configs_are_refused(tiny):
    loaded = tiny["loaded"]
    cases = [
        ({"method": "medusa2"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 1000}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({"method": "ngram", "k": 3}, "unknown keys"),
        ({"method": "draft_model"}, "draft model's path"),
    ]
    for cfg, needle in cases:
        with pytest.raises(InvalidParameterError, match=needle):
            LLM(loaded=loaded, speculative_config=cfg)


def test_adaptive_draft_lengths_keep_the_target_distribution(micro, monkeypatch):
    """With num_speculative_tokens "auto" the depth of each step depends on earlier steps'
    acceptance; each verification is still exact given that history, so the joint law of the
    first 3 tokens is the target's. A made-up machine where drafts are cheap keeps drafting on."""
    from specserve.engine import cost_model as cost_module
    from specserve.engine.cost_model import KNOTS, PassCostModel

    loaded, draft = micro
    params = SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True)
    monkeypatch.setattr(cost_module, "LEARNING_RATE", 0.0)
    llm = LLM(loaded=loaded, max_num_seqs=512, speculative_config={"method": "draft_model", "model": str(draft)})
    llm.engine.planner.cost = PassCostModel([1e-2 + 1e-5 * k for k in KNOTS])
    _, pvalue = sample_first_tokens(llm, [3, 5, 2], params)
    depths = llm.engine.stats().draft_depth_counts
    assert depths[1] + depths[2] > 0, depths  # it drafted
    assert pvalue > 1e-3


def test_a_shorter_draft_context_caps_the_default_max_model_len(tiny, tmp_path):
    """A draft model of 64 positions beside a 512-position target: with no max_model_len the
    engine takes 64 (as vLLM does); one given past it is refused naming the draft's context."""
    short = make_tiny_checkpoint(tmp_path / "short", vocab_size=64, seed=1, layers=1, hidden=32, heads=2, kv_heads=1,
                                 max_positions=64)
    spec = {"method": "draft_model", "model": str(short), "num_speculative_tokens": 2}
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=1, speculative_config=spec)
    assert llm.engine_config.max_model_len == 64
    assert llm.context_note == ("max_model_len 64: the draft model's context caps the target's (give "
                                "--max-model-len to choose it)")
    assert LLM(loaded=tiny["loaded"], max_num_seqs=1).context_note is None
    assert len(run(llm, [[3, 5, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]) == 8
    with pytest.raises(InvalidParameterError, match=r"max_model_len.*draft model's context \(64\)"):
        LLM(loaded=tiny["loaded"], max_num_seqs=1, speculative_config=spec, max_model_len=128)
