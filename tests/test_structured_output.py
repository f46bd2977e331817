"""Structured output (sample/grammar.py): grammar masks under speculation, and the request fields
that ask for them offline and over HTTP.

Units run on a toy byte vocabulary (llguidance reads it through its TokenizerWrapper), so trees
can be written by hand; end-to-end checks run on the embedded SmolLM2 and its 49152-token
tokenizer."""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch

from specserve.drafts.tree import DraftTree
from specserve.errors import InvalidParameterError
from specserve.sample.grammar import GrammarCompiler, GrammarProcessor
from specserve.sample.processors import apply_processors, node_paths
from specserve.sampling_params import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

TOKENS = [b"<s>", b"</s>", b"a", b"b", b"c", b"ab", b"{", b"}", b'"', b":", b"1", b"2", b" ", b"ba", b"x"]
A, B, C, AB, BA, X = 2, 3, 4, 5, 13, 14
EOS = 1


class _ToyTokenizer:
    """What llguidance.TokenizerWrapper reads: token bytes, EOS/BOS, and an encoder (byte by byte)."""

    eos_token_id = EOS
    bos_token_id = 0
    tokens = TOKENS
    special_token_ids = [0, 1]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [TOKENS.index(bytes([c])) for c in data]


def toy_compiler(vocab_size: int = len(TOKENS), cache_size: int = 8) -> GrammarCompiler:
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ToyTokenizer()), eos_token=EOS)
    return GrammarCompiler(ll, vocab_size, cache_size=cache_size)


REGEX = StructuredOutputsParams(regex="a(b|c)*a")  # a, then b/c any number of times, then a: complete


def allowed(proc: GrammarProcessor, width: int = len(TOKENS)) -> list[int]:
    logits = torch.zeros(1, width)
    proc.apply(logits, [], [[]])
    return torch.nonzero(logits[0] == 0).flatten().tolist()


# ---- parameters ------------------------------------------------------------------------------


def test_exactly_one_kind_is_set():
    assert StructuredOutputsParams(json={"type": "object"}).kind == "json"
    assert StructuredOutputsParams(choice=["x"], json_object=False).kind == "choice"
    for bad, field in ((dict(), "structured_outputs"), (dict(regex="a", choice=["a"]), "structured_outputs"),
                       (dict(choice=[]), "structured_outputs.choice"), (dict(regex=""), "structured_outputs.regex"),
                       (dict(json=3), "structured_outputs.json"), (dict(json_object=1), "structured_outputs.json_object"),
                       (dict(choice=["a", 2]), "structured_outputs.choice")):
        with pytest.raises(InvalidParameterError) as e:
            StructuredOutputsParams(**bad)
        assert e.value.param == field


def test_sampling_params_take_the_spec_and_the_older_name():
    spec = StructuredOutputsParams(regex="a+")
    assert SamplingParams(guided_decoding=GuidedDecodingParams(regex="a+")).structured_outputs == spec
    with pytest.raises(InvalidParameterError, match="guided_decoding"):
        SamplingParams(structured_outputs=spec, guided_decoding=spec)
    with pytest.raises(InvalidParameterError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a+"})


# ---- compiling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "structured_outputs.json"),
    (StructuredOutputsParams(json='{"type": "object"'), "structured_outputs.json"),
    (StructuredOutputsParams(json="[1, 2]"), "structured_outputs.json"),
    (StructuredOutputsParams(json={"properties": {"a": {"$ref": "#/nowhere"}}}), "structured_outputs.json"),
    (StructuredOutputsParams(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar='start: "a" ("b" | '), "structured_outputs.grammar"),
])
def test_a_spec_that_does_not_compile_names_its_field(spec, field):
    with pytest.raises(InvalidParameterError) as e:
        toy_compiler().compile(spec)
    assert e.value.param == field and "does not compile" in str(e.value)


def test_grammars_compile_once_per_spec_least_recently_used_first_out():
    comp = toy_compiler(cache_size=2)
    first = comp.compile(REGEX)
    assert comp.compile(StructuredOutputsParams(regex="a(b|c)*a")) is first
    other = comp.compile(StructuredOutputsParams(choice=["ab", "ba"]))
    assert comp.compile(REGEX) is first  # used again: now the most recent
    comp.compile(StructuredOutputsParams(grammar='root ::= "a" "b"'))  # GBNF: evicts the choice, not REGEX
    assert comp.compile(REGEX) is first
    assert comp.compile(StructuredOutputsParams(choice=["ab", "ba"])) is not other


def test_a_tokenizer_the_engine_cannot_read_is_a_parameter_error(tmp_path):
    from specserve.tokenizer import Tokenizer
    from tests.helpers import write_wordlevel_tokenizer

    write_wordlevel_tokenizer(tmp_path, 16)
    comp = GrammarCompiler(Tokenizer.from_hf_folder(tmp_path), 16)
    with pytest.raises(InvalidParameterError, match="not available for this model"):
        comp.compile(REGEX)


# ---- masks, prune, commit ----------------------------------------------------------------------


def test_commit_advances_and_a_complete_text_allows_only_eos():
    proc = toy_compiler().processor(REGEX)
    assert allowed(proc) == [A, AB]
    proc.commit([A, B])
    assert allowed(proc) == [A, B, C, BA]
    proc.commit([A])
    assert allowed(proc) == [EOS]
    proc.commit([EOS])  # end of text leaves the state as it was
    assert allowed(proc) == [EOS]


def test_prune_cuts_a_chain_at_the_first_rejected_token():
    comp = toy_compiler()
    proc = comp.processor(REGEX)
    for chain, kept in (([A, B, A, C], [A, B, A]), ([A, A, B], [A, A]), ([B, A], []), ([AB, C, A, EOS, A], [AB, C, A, EOS]),
                        ([A, EOS], [A]), ([A, B, 40], [A, B])):  # 40: past the vocabulary
        tree = proc.prune(DraftTree.chain(chain), [])
        assert tree.token_ids == kept and tree.is_chain
    assert allowed(proc) == [A, AB]  # nothing consumed


def test_prune_drops_rejected_nodes_and_their_subtrees_in_a_tree():
    proc = toy_compiler().processor(REGEX)
    proc.commit([A])
    # root -> b (0) -> a (1) -> c (2: rejected, text complete) -> a (3)
    #      -> { (4: rejected) -> a (5)
    #      -> c (6) -> ba (7) -> a (8: rejected, "acba" is complete)
    #      -> a (9) -> EOS (10) -> b (11: rejected after the complete text)
    tree = DraftTree([B, A, C, A, 6, A, C, BA, A, A, EOS, B], [-1, 0, 1, 2, -1, 4, -1, 6, 7, -1, 9, 10])
    pruned = proc.prune(tree, [])
    assert pruned.token_ids == [B, A, C, BA, A, EOS]
    assert pruned.parents == [-1, 0, -1, 2, -1, 4]


def test_apply_gives_each_node_the_mask_of_its_path_committed():
    comp = toy_compiler()
    proc = comp.processor(REGEX)
    proc.commit([A])
    tree = proc.prune(DraftTree([B, C, A, BA, C, A, EOS], [-1, -1, 0, 1, 3, 0, 2]), [])
    logits = torch.randn(1 + tree.num_nodes, len(TOKENS))
    want = logits.clone()
    for j, path in enumerate(node_paths(tree)):  # a fresh matcher that committed the path
        ref = comp.processor(REGEX)
        ref.commit([A] + path)
        ref.apply(want[j:j + 1], [], [[]])
    apply_processors([proc], logits, [], tree)
    assert torch.equal(logits, want)
    assert allowed(proc) == [A, B, C, BA]  # state as it was


def test_apply_masks_the_logit_columns_past_the_vocabulary():
    proc = toy_compiler(vocab_size=X).processor(StructuredOutputsParams(regex="(x|a)+"))
    logits = torch.zeros(1, 20)  # the model's rows are wider than the vocabulary it shares with the tokenizer
    proc.apply(logits, [], [[]])
    assert torch.nonzero(logits[0] == 0).flatten().tolist() == [A]  # "x" is past the ids the model knows


def test_a_grammar_with_no_token_the_model_can_produce_fails_loudly():
    proc = toy_compiler(vocab_size=X).processor(StructuredOutputsParams(regex="x"))
    with pytest.raises(RuntimeError, match="allows no token"):
        proc.apply(torch.zeros(1, X), [], [[]])


def test_verify_refuses_an_unreadable_schema_before_loading(tmp_path, capsys):
    from specserve.cli import main

    bad = tmp_path / "schema.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        assert main(["verify", "--speculative", "ngram", "--json-schema", str(path)]) == 2
        assert "json_schema" in capsys.readouterr().err


# ---- end to end on the embedded model ----------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
# The prompt holds JSON to copy, so n-gram drafts come often and some of them break the schema.
ASK = [{"role": "user", "content": 'Here is a person: {"name": "Ada", "age": 36, "city": "London"}. '
                                   "Write a JSON object with the name and age of another person."}]
CHAIN = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
TREE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "num_branches": 3}


@pytest.fixture(scope="module")
def engines(smollm_native):
    from specserve.llm import LLM

    return {"plain": LLM(loaded=smollm_native, max_num_seqs=2),
            "chain": LLM(loaded=smollm_native, max_num_seqs=2, speculative_config=CHAIN),
            "tree": LLM(loaded=smollm_native, max_num_seqs=2, speculative_config=TREE)}


def run(llm, spec: StructuredOutputsParams, max_tokens: int = 40, **sampling):
    params = SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **{"temperature": 0.0, **sampling})
    return llm.chat(ASK, params, use_tqdm=False)[0]


def test_outputs_belong_to_their_language(engines):
    out = run(engines["plain"], StructuredOutputsParams(json=SCHEMA)).outputs[0]
    value = json.loads(out.text)
    assert out.finish_reason == "stop" and set(value) == {"name", "age"}
    assert isinstance(value["name"], str) and isinstance(value["age"], int)
    out = run(engines["plain"], StructuredOutputsParams(regex=r"[A-Z][a-z]+, [0-9]{2}"), max_tokens=16).outputs[0]
    assert re.fullmatch(r"[A-Z][a-z]+, [0-9]{2}", out.text) and out.finish_reason == "stop"
    choices = ["London", "Paris", "somewhere else"]
    out = run(engines["plain"], StructuredOutputsParams(choice=choices), max_tokens=8).outputs[0]
    assert out.text in choices and out.finish_reason == "stop"
    assert isinstance(json.loads(run(engines["plain"], StructuredOutputsParams(json_object=True)).outputs[0].text), dict)


def test_greedy_with_speculation_equals_plain_under_a_grammar(engines):
    spec = StructuredOutputsParams(json=SCHEMA)
    want = run(engines["plain"], spec).outputs[0].token_ids
    for name in ("chain", "tree"):
        got = run(engines[name], spec)
        assert got.outputs[0].token_ids == want, name
        assert got.spec.num_drafted > 0 and got.spec.num_accepted > 0, name  # speculation ran


def test_seeded_sampling_is_the_same_with_and_without_speculation(engines):
    spec = StructuredOutputsParams(json=SCHEMA)
    for seed in (3,):
        want = run(engines["plain"], spec, temperature=1.0, seed=seed).outputs[0].token_ids
        assert run(engines["chain"], spec, temperature=1.0, seed=seed).outputs[0].token_ids == want
        assert run(engines["tree"], spec, temperature=1.0, seed=seed).outputs[0].token_ids == want


def test_a_bad_schema_is_refused_when_the_request_is_added(engines):
    with pytest.raises(InvalidParameterError) as e:
        run(engines["plain"], StructuredOutputsParams(json={"type": "nonsense"}))
    assert e.value.param == "structured_outputs.json"
    assert not engines["plain"].engine.has_unfinished_requests()


def test_response_format_over_http(engines):
    import httpx

    from tests.server_helpers import RunningServer

    body = {"messages": ASK, "max_tokens": 40, "temperature": 0}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    with RunningServer(engines["chain"], name="smollm2") as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body | {"response_format": fmt}, timeout=120)
        assert r.status_code == 200, r.text
        value = json.loads(r.json()["choices"][0]["message"]["content"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "Three letters:", "max_tokens": 8, "temperature": 0,
                                                         "guided_regex": "[a-c]{3}"}, timeout=120)
        assert r.status_code == 200 and re.fullmatch("[a-c]{3}", r.json()["choices"][0]["text"]), r.text
        # tool_choice naming a function forces a call through the same grammar: the 135M model
        # would rarely call a tool on its own, here it must, with arguments of the tool's schema.
        tool = {"type": "function", "function": {"name": "add_person", "description": "Store a person",
                                                 "parameters": SCHEMA}}
        forced = body | {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "add_person"}}}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=forced, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        (call,) = message["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "add_person" and set(args) == {"name", "age"}, message
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
        r = httpx.post(f"{s.url}/v1/chat/completions", json=forced | {"response_format": {"type": "json_object"}},
                       timeout=60)
        assert r.status_code == 400 and "forced tool call" in r.json()["error"]["message"], r.text
        bad = {"type": "json_schema", "json_schema": {"name": "person", "schema": {"type": "nonsense"}}}
        for extra, param, words in (
                ({"response_format": bad}, "response_format.json_schema.schema", "does not compile"),
                ({"response_format": {"type": "xml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
                ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs its json_schema"),
                ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "does not compile"),
                ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
                ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "only one")):
            r = httpx.post(f"{s.url}/v1/chat/completions", json=body | extra, timeout=60)
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and words in error["message"], (extra, error)
