"""`specserve bench`: workload selection, figures, JSON output, clear errors. No timing asserts."""

import json

import pytest

from specserve.bench.command import _parse_ks, _parse_methods
from specserve.bench.measure import Sample, figures
from specserve.bench.prompts import load_workload, select
from specserve.cli import main
from specserve.errors import InvalidParameterError, SpecserveError
from tests.helpers import make_tiny_checkpoint


def test_spec_bench_is_shipped_whole():
    prompts = load_workload("spec_bench")
    assert len(prompts) == 480
    cats = {p.category for p in prompts}
    assert len(cats) == 13 and {"summarization", "rag", "translation", "qa", "math_reasoning", "coding"} <= cats
    picked = select(prompts, per_category=2)
    assert len(picked) == 26 and all(sum(p.category == c for p in picked) == 2 for c in cats)
    assert [p.category for p in select(prompts, ["rag", "qa"], 1)] == ["qa", "rag"]
    assert len(select(prompts, limit=7)) == 7


def test_jsonl_workload_with_field(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text('{"prompt": "hello there", "category": "a"}\n{"prompt": ["first turn", "second"]}\n')
    prompts = load_workload(str(f), "prompt")
    assert [(p.category, p.text) for p in prompts] == [("a", "hello there"), ("all", "first turn")]
    with pytest.raises(InvalidParameterError, match="field"):
        load_workload(str(f), "question")
    with pytest.raises(SpecserveError, match="neither"):
        load_workload(str(tmp_path / "missing.jsonl"))
    with pytest.raises(InvalidParameterError, match="available: a,all"):
        select(prompts, ["b"])


def test_figures_compare_prompt_by_prompt():
    base = [Sample("x", [1, 2, 3, 4], 2.0, 0.5), Sample("y", [5, 6], 1.0, 0.5)]
    spec = [Sample("x", [1, 2, 3, 4], 1.0, 0.5, drafted=6, accepted=3, emitted=6, passes=3),
            Sample("y", [5, 7], 1.0, 0.5, 2, 0, 1, 1)]
    f = figures(spec, base, speculative=True, greedy=True)
    assert f.tokens_per_s == 3.0 and f.speedup == 1.5 and f.decode_tokens_per_s == 4 / 1.0
    assert f.acceptance_rate == 3 / 8 and f.mean_accepted_length == 7 / 4
    assert f.identical_to_baseline == 0.5
    assert figures(spec, base, speculative=True, greedy=False).identical_to_baseline is None


def test_parse_errors():
    with pytest.raises(InvalidParameterError, match="none, ngram, draft_model:PATH"):
        _parse_methods("none,medusa")
    with pytest.raises(InvalidParameterError, match="needs a path"):
        _parse_methods("draft_model")
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        _parse_ks("2,x")
    assert _parse_ks("2,4,6") == [2, 4, 6]


def test_bench_end_to_end_writes_json(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"turns": [f"t{3 + i} t4 t5 t{3 + i} t4 t5"], "category": c}) + "\n"
                            for i, c in enumerate(["a", "b", "a"])))
    out = tmp_path / "r.json"
    code = main(["bench", "--model", str(model), "--workload", str(work), "--methods", f"none,ngram,draft_model:{model}",
                 "--num-speculative-tokens", "2,3", "--max-tokens", "12", "--json", str(out), "--peers", "llama.cpp"])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["cores"] >= 1 and doc["num_prompts"] == 3
    labels = [r["label"] for r in doc["results"]]
    assert labels == ["none", "ngram k=2", "ngram k=3", "draft_model k=2", "draft_model k=3"]
    for r in doc["results"]:
        assert set(r) >= {"method", "num_speculative_tokens", "temperature", "tokens_per_s", "speedup", "acceptance_rate",
                          "mean_accepted_length", "identical_to_baseline", "per_category"}
        assert set(r["per_category"]) == {"a", "b"}
        assert r["identical_to_baseline"] == 1.0
    draft = doc["results"][3]
    assert draft["acceptance_rate"] == 1.0  # the draft is the target itself
    err = capsys.readouterr().err
    assert "llama.cpp skipped" in err or "llama.cpp" in "".join(labels)


def test_bench_bad_input_is_one_line(capsys):
    assert main(["bench", "--methods", "none,eagle"]) == 2
    assert main(["bench", "--peers", "vllm"]) == 2
    assert main(["bench", "--categories", "poetry"]) == 2
    err = capsys.readouterr().err
    assert err.count("specserve: error:") == 3 and "Traceback" not in err
