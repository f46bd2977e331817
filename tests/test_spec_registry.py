"""Each drafting method owns its options (spec/registry.py): a flat speculative_config routes to
the method's dataclass, another method's key is refused naming that method, an unknown key lists
the allowed ones, and a method registered from outside specserve works end to end."""

from dataclasses import dataclass, fields

import pytest

from specserve.config import SHARED_KEYS, SPEC_METHODS, SpeculativeConfig
from specserve.drafts import DraftProposal
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec, method_names, method_spec, register, unregister

# One non-default value per built-in option key (each valid for its method).
NON_DEFAULT = {"prompt_lookup_max": 6, "prompt_lookup_min": 2, "num_branches": 3, "suffix_tree_depth": 12,
               "suffix_cache_tokens": 0, "suffix_spec_factor": 2.0, "suffix_min_token_prob": 0.2,
               "num_draft_nodes": 10, "draft_topk": 3, "lookahead_window": 2, "lookahead_ngram": 4,
               "lookahead_candidates": 3, "skip_layers": (5, 9), "catch_up_window": 8,
               "quantization": "q8_0", "enable_suffix_decoding": True, "suffix_threshold": 2.0}
PATHS = {"draft_model": "draft", "eagle": "eagle_dir", "eagle3": "eagle3_dir", "medusa": "medusa_dir"}


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_each_method_options_round_trip_from_a_flat_dict(method):
    keys = [f.name for f in fields(method_spec(method).options_cls)]
    d = {"method": method, "num_speculative_tokens": 3, **{k: NON_DEFAULT[k] for k in keys}}
    if method in PATHS:
        d["model"] = PATHS[method]
    spec = SpeculativeConfig.from_dict(d)
    assert isinstance(spec.options, method_spec(method).options_cls)
    assert {k: getattr(spec.options, k) for k in keys} == {k: NON_DEFAULT[k] for k in keys}
    assert {k: getattr(spec, k) for k in keys} == {k: NON_DEFAULT[k] for k in keys}  # flat reads still work
    assert spec.num_speculative_tokens == 3 and spec.model == PATHS.get(method)
    flat = {k: getattr(spec, k) for k in (*SHARED_KEYS, *keys)}
    assert SpeculativeConfig.from_dict(flat) == spec


@pytest.mark.parametrize("key", sorted(NON_DEFAULT))
def test_a_key_of_another_method_is_refused_naming_the_key_and_its_method(key):
    owners = [m for m in SPEC_METHODS if key in {f.name for f in fields(method_spec(m).options_cls)}]
    other = next(m for m in ("ngram", "suffix", "lookahead") if m not in owners)
    with pytest.raises(InvalidParameterError, match=rf"{key}.*applies to method .*'{owners[0]}'.* only.*'{other}'"):
        SpeculativeConfig.from_dict({"method": other, key: NON_DEFAULT[key]})


def test_an_unknown_key_lists_the_allowed_ones():
    with pytest.raises(InvalidParameterError, match=r"bogus_key.*unknown keys; allowed: .*prompt_lookup_max.*") as e:
        SpeculativeConfig.from_dict({"method": "ngram", "bogus_key": 1})
    for key in (*SHARED_KEYS, *NON_DEFAULT):
        assert key in str(e.value)


@dataclass(frozen=True, slots=True)
class ToyOptions:
    toy_marker: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.toy_marker, int) or self.toy_marker < 1:
            raise InvalidParameterError("toy_marker", self.toy_marker, "must be an integer >= 1")


class ToyProposer(Proposer):
    """Drafts nothing: every step is a plain decoding step."""

    name = "toy"

    def __init__(self, marker: int):
        self.marker = marker
        self.calls = 0

    def propose(self, batch):
        self.calls += 1
        return DraftProposal.from_lists([[] for _ in batch], 0, "cpu")


@pytest.fixture
def toy_method():
    register(MethodSpec("toy", ToyOptions, lambda options, model, target, engine: ToyProposer(options.toy_marker),
                        auto_max_k=2))
    yield
    unregister("toy")


def test_a_method_registered_outside_specserve_runs_end_to_end(tiny, toy_method):
    assert "toy" in method_names()
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = LLM(loaded=tiny["loaded"], max_num_seqs=1).generate(prompts, params, use_tqdm=False)
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=2, speculative_config={"method": "toy", "toy_marker": 7})
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    proposer = llm.engine.proposer
    assert isinstance(proposer, ToyProposer) and proposer.marker == 7 and proposer.calls > 0
    assert llm.spec_config.k == 2  # its own "auto" cap
    with pytest.raises(InvalidParameterError, match="toy_marker.*>= 1"):
        SpeculativeConfig.from_dict({"method": "toy", "toy_marker": 0})
    with pytest.raises(InvalidParameterError, match="toy_marker.*applies to method 'toy' only"):
        SpeculativeConfig.from_dict({"method": "ngram", "toy_marker": 3})


def test_an_unregistered_method_is_refused_naming_the_methods():
    with pytest.raises(InvalidParameterError, match="method.*toy.*must be one of ngram, suffix"):
        SpeculativeConfig.from_dict({"method": "toy"})


@pytest.mark.parametrize("key, value, allowed", [("enable_suffix_decoding", 1, "true or false"),
                                                 ("suffix_threshold", -0.5, r"\[0, 64"),
                                                 ("suffix_threshold", "high", r"\[0, 64")])
def test_suffix_decoding_beside_a_drafter_refuses_bad_values_naming_them(key, value, allowed):
    with pytest.raises(InvalidParameterError, match=rf"{key}.*{allowed}"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "d", key: value})
