"""Self-speculative decoding (method self_spec): the layer-skipping view shares the target's
weights and computes what running only its layers computes; layer sets load, save and refuse
bad input with clear messages; the layer search picks sensible sets; greedy output equals plain
decoding's and sampled output keeps the target's distribution."""

import json
import os
from dataclasses import replace

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.sampling_params import SamplingParams
from specserve.spec.layer_search import PassCosts, expected_speedup, greedy_layer_search, price, search_layers
from specserve.spec.layer_set import (check_skip_layers, layer_set_path, load_layer_set, resolve_skip_layers,
                                      save_layer_set, shipped_layer_set_path)
from specserve.spec.self_spec import SelfSpecProposer, layer_view
from tests.helpers import generate_ids, make_tiny_checkpoint, ragged_prompts
from tests.test_spec_e2e import LENGTH, V, sample_first_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def native():
    """The embedded model on the native kernels (its own Q4_1 blocks)."""
    return load_model("default")


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """A tiny random 4-layer Llama model folder and its load (torch path, float32)."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny4") / "m", vocab_size=64, layers=4, seed=3)
    return path, load_model(path)


def logits_of(model, tokens: list[int]) -> torch.Tensor:
    """All-position logits [T, V] of one sequence, on a fresh paged cache."""
    runner = ModelRunner.paged(model, -(-len(tokens) // 16), 16)
    return runner.execute(ForwardBatch([list(range(-(-len(tokens) // 16)))], [0], [tokens], all_logits=True))[0]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- the view shares the target's weights ---------------------------------------------------------

def test_native_view_shares_the_targets_weights(native):
    model = native.model
    before = rss_bytes()
    views = [model.with_layers(range(30)) for _ in range(3)]  # a copy would add ~96 MB each
    assert rss_bytes() - before < 16 << 20
    view = model.with_layers([0, 5, 29])
    assert view.config.num_layers == 3 and model.config.num_layers == 30
    assert view.parts is model.parts and view.keep == (0, 5, 29)
    assert view.embed_tokens is model.embed_tokens and view.lm_head is model.lm_head
    assert view.lm_head.units.data_ptr() == model.parts.lm_head.units.data_ptr()
    assert view.weight_bytes < model.weight_bytes and views[0].weight_bytes == model.weight_bytes


def test_torch_view_shares_the_targets_weights(tiny4):
    _, loaded = tiny4
    view = loaded.model.with_layers([1, 3])
    assert view.config.num_layers == 2
    target_ptrs = {p.data_ptr() for p in loaded.model.parameters()}
    assert {p.data_ptr() for p in view.parameters()} <= target_ptrs
    assert view.layers[0] is loaded.model.layers[1] and view.layers[1] is loaded.model.layers[3]


@pytest.mark.parametrize("keep", [[], [2, 1], [0, 0], [0, 4], [-1], [True]])
def test_bad_layer_subsets_are_refused(tiny4, keep):
    with pytest.raises(ValueError, match="distinct increasing indices in \\[0, 4\\)"):
        tiny4[1].model.with_layers(keep)


# ---- numerics -------------------------------------------------------------------------------------

def test_native_view_of_every_layer_is_the_target(native):
    tokens = native.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    assert torch.equal(logits_of(native.model.with_layers(range(30)), tokens), logits_of(native.model, tokens))


def test_native_view_equals_a_model_built_from_its_layers_alone(native):
    """A model loaded with only layers `keep` (renumbered 0..) computes bit for bit what the view does."""
    from specserve import native as ext
    from specserve.hardware import native_level
    from specserve.model.gguf_loader import gguf_weights, open_gguf
    from specserve.model.native_llama import build_native_model

    keep = [0, 1, 4, 9, 17, 28, 29]
    weights = gguf_weights(open_gguf(native.path), native.path, native.config)
    renamed = {}
    for name, w in weights.items():
        if name.startswith("model.layers."):
            i, rest = name.removeprefix("model.layers.").split(".", 1)
            if int(i) in keep:
                renamed[f"model.layers.{keep.index(int(i))}.{rest}"] = w
        else:
            renamed[name] = w
    cfg = replace(native.config, num_layers=len(keep))
    alone = build_native_model(cfg, renamed, "gguf", ext.load(), native_level(), permute_qk=True)
    tokens = native.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    assert torch.equal(logits_of(native.model.with_layers(keep), tokens), logits_of(alone, tokens))


def test_torch_view_equals_transformers_with_those_layers(tiny4):
    import transformers

    path, loaded = tiny4
    tokens = [5, 9, 2, 33, 17, 8, 41, 3, 12]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert torch.allclose(logits_of(loaded.model.with_layers(range(4)), tokens), logits_of(loaded.model, tokens),
                          atol=0, rtol=0)
    keep = [0, 2, 3]
    hf.model.layers = torch.nn.ModuleList(hf.model.layers[i] for i in keep)
    for j, layer in enumerate(hf.model.layers):
        layer.self_attn.layer_idx = j
    hf.config.num_hidden_layers = len(keep)
    with torch.no_grad():
        want = hf(torch.tensor([tokens]), use_cache=False).logits[0]
    torch.testing.assert_close(logits_of(loaded.model.with_layers(keep), tokens), want, atol=1e-5, rtol=0)


# ---- layer sets -----------------------------------------------------------------------------------

@pytest.mark.parametrize("skip, message", [
    ("3,5", "must be a list of layer indices"),
    ([1, -2], "non-negative integer"),
    ([1, True], "non-negative integer"),
    ([2.0], "non-negative integer"),
    ([3, 3], "names a layer twice"),
    ([1, 4], r"in \[0, 4\): the model has 4 decoder layers"),
    ([0, 1, 2, 3], "skips every one of the model's 4 layers"),
])
def test_bad_skip_layers_are_refused(skip, message):
    with pytest.raises(InvalidParameterError, match=message):
        check_skip_layers(skip, 4, "skip_layers")


def test_speculative_config_takes_skip_layers_for_self_spec_only():
    spec = SpeculativeConfig.from_dict({"method": "self_spec", "skip_layers": [7, 3]})
    assert spec.skip_layers == (3, 7) and spec.k == 6
    with pytest.raises(InvalidParameterError, match="applies to method 'self_spec' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "skip_layers": [1]})
    with pytest.raises(InvalidParameterError, match="names a layer twice"):
        SpeculativeConfig.from_dict({"method": "self_spec", "skip_layers": [1, 1]})


def test_layer_sets_save_load_and_resolve_in_order(tiny4, tmp_path):
    path, loaded = tiny4
    assert layer_set_path(path) == path.with_name("m.self_spec.json")
    assert layer_set_path(tmp_path / "x.Q4_0.gguf") == tmp_path / "x.Q4_0.self_spec.json"
    assert shipped_layer_set_path(path) is None
    with pytest.raises(InvalidParameterError, match="self-spec-search --model .*/m`"):
        resolve_skip_layers(None, loaded)
    save_layer_set(layer_set_path(path), loaded, [2, 1], {"agreement": 0.5})
    try:
        assert load_layer_set(layer_set_path(path), 4) == (1, 2)
        assert resolve_skip_layers(None, loaded) == (1, 2)
        assert resolve_skip_layers([3], loaded) == (3,)  # given explicitly: wins
        with pytest.raises(ModelLoadError, match="searched for a model of 4 layers, but this model has 6"):
            load_layer_set(layer_set_path(path), 6)
    finally:
        layer_set_path(path).unlink()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read the self_spec layer set"):
        load_layer_set(bad, 4)
    bad.write_text(json.dumps({"layers": [1]}))
    with pytest.raises(ModelLoadError, match="no 'skip_layers'"):
        load_layer_set(bad, 4)
    bad.write_text(json.dumps({"skip_layers": [9]}))
    with pytest.raises(InvalidParameterError, match=r"skip_layers in .*bad.json"):
        load_layer_set(bad, 4)


def test_the_embedded_model_has_a_shipped_layer_set(native):
    shipped = shipped_layer_set_path(native.path)
    assert shipped is not None and json.loads(shipped.read_text())["model"]["num_layers"] == 30
    skip = resolve_skip_layers(None, native)
    assert 1 <= len(skip) < 30


# ---- the search -----------------------------------------------------------------------------------

def test_expected_speedup_formula():
    assert expected_speedup(1.0, 3, 0.0, 1.0) == 4.0  # free, perfect drafts: k + 1 tokens a step
    assert expected_speedup(0.0, 2, 0.5, 1.0) == 1 / 2.0  # never accepted: one token for 2 drafts + a pass
    assert expected_speedup(0.5, 1, 0.1, 1.0) == pytest.approx(1.5 / 1.1)
    costs = PassCosts(draft_fixed=0.0, draft_per_layer=0.01, target=(1.0, 1.0, 1.0, 1.0))
    assert price((), 0.9, 10, costs).k == 3  # cheap, good drafts: the longest chain
    assert price((), 0.1, 10, costs).k == 1


def test_greedy_search_skips_the_layers_that_matter_least():
    """A made-up model of 8 layers: skipping layer i keeps a fraction keep[i] of the agreement;
    layers 2, 5 and 6 barely matter. The search removes them first and stops where the next
    removal costs more agreement than its saving brings."""
    keep = [0.3, 0.6, 0.99, 0.7, 0.65, 0.98, 0.97, 0.5]
    calls = []

    def agreement(skip):
        calls.append(skip)
        a = 0.95
        for i in skip:
            a *= keep[i]
        return a

    costs = PassCosts(draft_fixed=0.2, draft_per_layer=0.1, target=(1.0, 1.02, 1.05, 1.1, 1.2))
    result = greedy_layer_search(8, agreement, costs, patience=2)
    assert [r.skip_layers for r in result.rounds[:3]] == [(2,), (2, 5), (2, 5, 6)]
    assert result.best.skip_layers == (2, 5, 6)
    assert result.best.speedup > 1 and result.best.speedup == max(r.speedup for r in result.rounds)
    assert len(result.rounds) == 5 and result.evaluations == len(calls) == 8 + 7 + 6 + 5 + 4


def test_search_on_a_tiny_model_gives_a_usable_layer_set(tiny4, tmp_path):
    _, loaded = tiny4
    result, figures = search_layers(loaded, ["t5 t9 t2 t33", "t7 t7 t8 t40 t41", "t3"], max_new=6, max_k=3)
    assert 1 <= len(result.best.skip_layers) <= 3
    assert all(0 <= r.agreement <= 1 for r in result.rounds)
    assert figures["evaluations"] == result.evaluations and len(figures["pass_ms"]["target"]) == 4
    out = tmp_path / "set.json"
    save_layer_set(out, loaded, result.best.skip_layers, figures)
    assert load_layer_set(out, 4) == result.best.skip_layers


# ---- end to end -----------------------------------------------------------------------------------

def test_native_greedy_self_spec_equals_plain(native):
    prompts = [native.tokenizer.encode_chat([{"role": "user", "content": p}])
               for p in ("Write a limerick about a cat.", "What is 12 times 7?", "List three fruits.",
                         "Describe the sea in one sentence.", "Say hello in French.")]
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = generate_ids(LLM(loaded=native, max_num_seqs=1, max_model_len=256), prompts, params)
    llm = LLM(loaded=native, max_num_seqs=4, max_model_len=256, speculative_config={"method": "self_spec"})
    assert isinstance(llm.engine.proposer, SelfSpecProposer)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > 0 and stats.num_accepted > 0
    assert llm.engine.proposer.pool.num_free_blocks == llm.engine.proposer.pool.num_blocks


@pytest.fixture(scope="module")
def tiny_prompts_and_plain(tiny4):
    prompts = ragged_prompts(6, seed=5, hi=30)
    return prompts, generate_ids(LLM(loaded=tiny4[1], max_num_seqs=1, max_model_len=128), prompts, GREEDY)


@pytest.mark.parametrize("skip, k", [([0], 3), ([2, 3], "auto"), ([], 4)])
def test_tiny_greedy_self_spec_equals_plain(tiny4, tiny_prompts_and_plain, skip, k):
    _, loaded = tiny4
    prompts, expected = tiny_prompts_and_plain
    # The identity draft accepts everything only when it reads the whole context.
    spec = {"method": "self_spec", "skip_layers": skip, "num_speculative_tokens": k}
    if not skip:
        spec["catch_up_window"] = None
    llm = LLM(loaded=loaded, max_num_seqs=8, block_size=4, max_model_len=128, speculative_config=spec)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > 0
    if not skip:  # the draft is the target: every draft is accepted
        assert stats.acceptance_rate == 1.0


def test_a_windowed_catch_up_reads_only_the_last_tokens_and_stays_lossless(tiny4, tiny_prompts_and_plain):
    """With a window of 4 every first draft restarts the draft cache from the prompt's last 4
    tokens (the prompts are longer), so the draft cache holds at most window + k tokens more
    than the committed ones since; output is plain greedy's."""
    _, loaded = tiny4
    prompts, expected = tiny_prompts_and_plain
    spec = {"method": "self_spec", "skip_layers": [0], "num_speculative_tokens": 3, "catch_up_window": 4}
    llm = LLM(loaded=loaded, max_num_seqs=8, block_size=4, max_model_len=128, speculative_config=spec)
    proposer = llm.engine.proposer
    assert proposer.catch_up_window == 4
    bases = []
    catch_up = proposer._catch_up

    def recorded(r):
        out = catch_up(r)
        bases.append((proposer.base[r.request_id], len(r.token_ids), out))
        return out

    proposer._catch_up = recorded
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert any(base > 0 for base, _, _ in bases)
    assert all(n - base <= 4 + 3 for base, n, out in bases if out is not None and out[0] == 0)
    assert LLM.aggregate_spec_stats(outs).num_drafted > 0
    assert proposer.pool.num_free_blocks == proposer.pool.num_blocks
    with pytest.raises(InvalidParameterError, match="catch_up_window"):
        LLM(loaded=loaded, max_model_len=128, speculative_config={"method": "self_spec", "catch_up_window": 0})


def test_self_spec_sampling_has_the_target_distribution(tmp_path):
    """Temperature 1, k=2: the joint law of the first 3 tokens is the target's (exact enumeration)."""
    loaded = load_model(make_tiny_checkpoint(tmp_path / "t", vocab_size=V, hidden=32, heads=2, kv_heads=1, seed=5))
    llm = LLM(loaded=loaded, max_num_seqs=512,
              speculative_config={"method": "self_spec", "skip_layers": [1], "num_speculative_tokens": 2})
    outs, pvalue = sample_first_tokens(llm, [3, 5, 2], SamplingParams(temperature=1.0, max_tokens=LENGTH, ignore_eos=True),
                                       n=4000)
    assert 0.2 < LLM.aggregate_spec_stats(outs).acceptance_rate < 0.95  # an imperfect draft
    assert pvalue > 1e-3


def test_self_spec_builds_from_the_layer_view(tiny4):
    from specserve.config import EngineConfig

    _, loaded = tiny4
    proposer = SelfSpecProposer(loaded, [1], EngineConfig(max_model_len=64, max_num_seqs=2))
    assert proposer.draft.config.num_layers == 3 and proposer.runner.cache.k.shape[0] == 3
    assert layer_view(loaded, [0, 1]).config.num_layers == 2
