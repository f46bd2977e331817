"""`specserve bench`: workload selection, figures, JSON output, clear errors. No timing asserts."""

import argparse
import importlib.util
import json

import pytest

from specserve.bench.cli import add_bench_parser, parse_ks, parse_methods, parse_peers, run_bench
from specserve.bench.runner import Config, Sample, figures, measure, report
from specserve.bench.workload import Selection, load_workload, select
from specserve.errors import InvalidParameterError, SpecserveError
from specserve.outputs import SpecStats
from specserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_checkpoint

RESULT_KEYS = {"method", "label", "draft", "num_speculative_tokens", "temperature", "tokens_per_s", "decode_tokens_per_s",
               "speedup", "acceptance_rate", "mean_accepted_length", "acceptance_by_position", "identical_to_baseline",
               "num_prompts", "num_tokens", "per_category"}


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return run_bench(parser.parse_args(["bench", *argv]))


# ---- workloads ----------------------------------------------------------------------------------

def test_spec_bench_is_shipped_whole():
    prompts = load_workload("spec_bench")
    assert len(prompts) == 480
    cats = {p.category for p in prompts}
    assert len(cats) == 13 and {"summarization", "rag", "translation", "qa", "math_reasoning", "coding"} <= cats
    assert prompts[0].text.startswith("Compose an engaging travel blog post")  # the first turn only
    picked = select(prompts, Selection(per_category=2))
    assert len(picked) == 26 and all(sum(p.category == c for p in picked) == 2 for c in cats)
    assert [p.category for p in select(prompts, Selection.from_text("rag,qa", 1, None))] == ["qa", "rag"]
    assert len(select(prompts, Selection(limit=7))) == 7
    assert len(select(prompts, Selection(("translation",), per_category=100, limit=30))) == 30


def test_jsonl_workload_with_field(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello there", "category": "a"}\n\n{"prompt": ["first turn", "second"]}\n')
    prompts = load_workload(str(f), "prompt")
    assert [(p.category, p.text) for p in prompts] == [("a", "hello there"), ("all", "first turn")]
    with pytest.raises(InvalidParameterError, match="field='question'.*line 1 of w.jsonl"):
        load_workload(str(f), "question")
    with pytest.raises(InvalidParameterError, match="unknown; available: a,all"):
        select(prompts, Selection(("b",)))


def test_workload_errors(tmp_path):
    with pytest.raises(SpecserveError, match="neither 'spec_bench' nor an existing JSONL file"):
        load_workload(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\nnot json\n')
    with pytest.raises(SpecserveError, match="bad.jsonl:2 is not valid JSON"):
        load_workload(str(bad))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecserveError, match="holds no prompts"):
        load_workload(str(empty))
    for kwargs, match in [({"per_category": 0}, "per_category"), ({"limit": 0}, "limit"), ({"categories": ()}, "categories")]:
        with pytest.raises(InvalidParameterError, match=match):
            Selection(**kwargs)


# ---- figures ------------------------------------------------------------------------------------

def _spec(drafted: int, accepted: int, emitted: int, passes: int) -> SpecStats:
    s = SpecStats()
    for _ in range(passes):
        s.record(drafted // passes, accepted // passes, emitted // passes)
    return s


def test_figures_compare_prompt_by_prompt():
    base = [Sample([1, 2, 3, 4], 2.0, 0.5), Sample([5, 6], 1.0, 0.5)]
    spec = [Sample([1, 2, 3, 4], 1.0, 0.5, _spec(6, 3, 6, 3)), Sample([5, 7], 1.0, 0.5, _spec(2, 0, 1, 1))]
    f = figures(spec, base, greedy=True)
    assert f.tokens_per_s == 3.0 and f.speedup == 1.5 and f.decode_tokens_per_s == 4 / 1.0
    assert f.acceptance_rate == 3 / 8 and f.mean_accepted_length == 7 / 4
    assert f.acceptance_by_position == [3 / 4, 0 / 2]
    assert f.identical_to_baseline == 0.5
    assert figures(spec, base, greedy=False).identical_to_baseline is None
    assert figures(base, base, greedy=True).acceptance_rate is None  # no acceptance figures for plain or peers

    r = report(Config("ngram", 2), spec, base, ["x", "y"], temperature=0.0).as_dict()
    assert set(r) == RESULT_KEYS and r["label"] == "ngram k=2"
    assert r["per_category"]["x"]["speedup"] == 2.0 and r["per_category"]["y"]["identical_to_baseline"] == 0.0


class _Recorder:
    """A runner that notes the order it is called in and echoes the prompt."""

    def __init__(self, name: str, log: list):
        self.config, self.log = Config(name), log

    def run(self, prompt_ids, params):
        self.log.append((self.config.method, prompt_ids[0], params.max_tokens))
        return Sample(list(prompt_ids), 1.0, 0.1)


def test_measure_warms_up_then_interleaves_in_rotating_order():
    log: list = []
    runners = [_Recorder("a", log), _Recorder("b", log), _Recorder("c", log)]
    ticks = []
    samples = measure(runners, [[10], [11], [12]], lambda i: SamplingParams(max_tokens=5),
                      SamplingParams(max_tokens=1), lambda: ticks.append(1))
    assert log[:3] == [("a", 10, 1), ("b", 10, 1), ("c", 10, 1)]
    assert [(m, p) for m, p, _ in log[3:]] == [("a", 10), ("b", 10), ("c", 10), ("b", 11), ("c", 11), ("a", 11),
                                                ("c", 12), ("a", 12), ("b", 12)]
    assert len(ticks) == 9 and [[s.token_ids[0] for s in row] for row in samples] == [[10, 11, 12]] * 3


# ---- the command --------------------------------------------------------------------------------

def test_parse_errors():
    with pytest.raises(InvalidParameterError, match="none, ngram, draft_model:PATH"):
        parse_methods("none,medusa")
    with pytest.raises(InvalidParameterError, match="needs a path"):
        parse_methods("draft_model")
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        parse_ks("2,x")
    with pytest.raises(InvalidParameterError, match="transformers, llama.cpp"):
        parse_peers("transformers,vllm")
    assert parse_ks("2,4,6,4") == [2, 4, 6]
    assert parse_methods("none,ngram,draft_model:/d") == [("none", None), ("ngram", None), ("draft_model", "/d")]


@pytest.mark.parametrize("argv, match", [
    (["--methods", "none,eagle"], "methods='eagle'"),
    (["--num-speculative-tokens", "0"], "num_speculative_tokens=0"),
    (["--peers", "vllm"], "peers='vllm'"),
    (["--categories", "poetry"], "available: coding,extraction"),
    (["--workload", "/no/such/file.jsonl"], "neither 'spec_bench'"),
    (["--methods", "draft_model:/no/such/draft"], "does not exist"),
    (["--json", "/no/such/folder/r.json"], "its folder does not exist"),
])
def test_bad_input_is_refused_before_loading(argv, match):
    with pytest.raises(SpecserveError, match=match) as e:
        bench(argv)
    assert "\n" not in str(e.value)


def test_bench_end_to_end_writes_json(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"turns": [f"t{3 + i} t4 t5 t{3 + i} t4 t5"], "category": c}) + "\n"
                            for i, c in enumerate(["a", "b", "a"])))
    out = tmp_path / "r.json"
    assert bench(["--model", str(model), "--workload", str(work), "--methods", f"none,ngram,draft_model:{model}",
                  "--num-speculative-tokens", "2,3", "--max-tokens", "12", "--json", str(out),
                  "--peers", "transformers,llama.cpp"]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cores"] >= 1 and doc["model"] == "m"
    assert doc["workload"]["num_prompts"] == 3 and doc["workload"]["categories"] == {"a": 2, "b": 1}
    labels = [r["label"] for r in doc["results"]]
    assert labels == ["none", "ngram k=2", "ngram k=3", "draft_model(m) k=2", "draft_model(m) k=3", "transformers",
                      "transformers:prompt_lookup k=2", "transformers:prompt_lookup k=3",
                      "transformers:assistant(m) k=2", "transformers:assistant(m) k=3"]
    for r in doc["results"]:
        assert set(r) == RESULT_KEYS and set(r["per_category"]) == {"a", "b"}
        # Lossless speculation, and transformers on the same float32 weights, give plain's tokens.
        assert r["identical_to_baseline"] == 1.0
        assert (r["acceptance_rate"] is None) == (r["method"] not in ("ngram", "draft_model"))
    assert doc["results"][3]["acceptance_rate"] == 1.0  # the draft is the target itself
    captured = capsys.readouterr()
    assert "configuration" in captured.out and "transformers:assistant(m) k=3" in captured.out
    # The tiny target is no GGUF, so llama.cpp is skipped either way, with a reason.
    reason = "is not installed" if importlib.util.find_spec("llama_cpp") is None else "not one"
    assert "peer llama.cpp skipped: " in captured.err and reason in captured.err


def test_sampled_bench_has_no_identity_figure(tmp_path):
    model = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    work = tmp_path / "w.jsonl"
    work.write_text(json.dumps({"q": "t3 t4 t5 t3 t4 t5"}) + "\n")
    out = tmp_path / "r.json"
    assert bench(["--model", str(model), "--workload", str(work), "--field", "q", "--temperature", "0.8",
                  "--max-tokens", "6", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["identical_to_baseline"] for r in results] == [None, None]
    assert results[1]["acceptance_rate"] is not None and list(results[1]["per_category"]) == ["all"]
    with pytest.raises(InvalidParameterError, match="no selected prompt leaves room for 6 new tokens"):
        bench(["--model", str(model), "--workload", str(work), "--field", "q", "--max-tokens", "6",
               "--max-model-len", "8"])


def test_bench_on_the_embedded_model_through_the_chat_template(tmp_path, capsys, smollm):
    out = tmp_path / "r.json"
    assert bench(["--workload", "spec_bench", "--categories", "writing", "--limit", "2", "--max-tokens", "8",
                  "--methods", "none,ngram", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["categories"] == {"writing": 2}
    texts = [p.text for p in load_workload("spec_bench")[:2]]
    chat = [smollm.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    assert doc["workload"]["prompt_tokens"] == sum(map(len, chat))
    assert [r["identical_to_baseline"] for r in doc["results"]] == [1.0, 1.0]
    assert "machine: cpu" in capsys.readouterr().out
