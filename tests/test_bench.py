"""`specserve bench`: workload selection, figures, JSON output, clear errors. No timing asserts."""

import argparse
import importlib.util
import json
import time

import pytest

from specserve.bench.cli import add_bench_parser, parse_concurrency, parse_ks, parse_methods, parse_peers, run_bench
from specserve.bench.runner import Config, Sample, figures, measure, report
from specserve.bench.throughput import (Completion, ConcurrentRun, combine_rounds, percentile, run_concurrent,
                                        throughput_figures)
from specserve.bench.workload import Selection, load_workload, select
from specserve.errors import InvalidParameterError, SpecserveError
from specserve.outputs import SpecStats
from specserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_checkpoint

RESULT_KEYS = {"method", "label", "draft", "num_speculative_tokens", "temperature", "tokens_per_s", "decode_tokens_per_s",
               "prefill_tokens_per_s",
               "speedup", "acceptance_rate", "mean_accepted_length", "acceptance_by_position", "identical_to_baseline",
               "num_prompts", "num_tokens", "per_category", "drafts_per_pass", "draft_ms_per_pass", "target_ms_per_pass"}
# Throughput mode: the same keys (figures over the whole run; no per-category split, since tokens/s
# is over the run's wall time), plus the serving figures.
THROUGHPUT_KEYS = (RESULT_KEYS - {"per_category", "prefill_tokens_per_s", "draft_ms_per_pass", "target_ms_per_pass"}) | {
    "concurrency", "wall_s", "requests_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99",
    "prefix_cache_hit_rate", "num_preemptions", "mean_chosen_depth", "rounds", "speedup_min", "speedup_max"}


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="specserve")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return run_bench(parser.parse_args(["bench", *argv]))


def bench_json(tmp_path, turns: list[str], *args: str) -> dict:
    """`specserve bench` on a tiny random model (tmp_path/m) over one-turn prompts (tmp_path/w.jsonl);
    -> the JSON it wrote."""
    model = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in turns))
    out = tmp_path / "r.json"
    assert bench(["--model", str(model), "--workload", str(work), *args, "--json", str(out)]) == 0
    return json.loads(out.read_text())


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
    # No field named: turns, prompt or text, whichever a row holds (vLLM's and most datasets' "prompt").
    assert load_workload(str(f)) == prompts
    mixed = tmp_path / "m.jsonl"
    mixed.write_text('{"turns": ["a turn"]}\n{"text": "some text"}\n{"question": "q?"}\n')
    with pytest.raises(InvalidParameterError, match="line 3 of m.jsonl holds a prompt under none of turns, prompt, "
                                                    "text, messages; name its field with --field"):
        load_workload(str(mixed))
    mixed.write_text('{"turns": ["a turn"]}\n{"text": "some text"}\n'
                     '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]}\n')
    assert [p.text for p in load_workload(str(mixed))] == ["a turn", "some text", "hi"]
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
    spec = [Sample([1, 2, 3, 4], 1.0, 0.5, _spec(6, 3, 6, 3), 30), Sample([5, 7], 1.0, 0.5, _spec(2, 0, 1, 1), 10)]
    f = figures(spec, base, greedy=True)
    assert f.tokens_per_s == 3.0 and f.speedup == 1.5 and f.decode_tokens_per_s == 4 / 1.0
    assert f.prefill_tokens_per_s == 40 / 1.0
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
    with pytest.raises(InvalidParameterError, match="none, ngram, suffix, .*draft_model:PATH, eagle:DIR, eagle3:DIR, medusa:DIR"):
        parse_methods("none,medusa2")
    for name in ("draft_model", "eagle", "medusa"):
        with pytest.raises(InvalidParameterError, match="needs a path"):
            parse_methods(name)
    with pytest.raises(InvalidParameterError, match="takes no path"):
        parse_methods("ngram:x")
    assert parse_methods("none,eagle:a,medusa:b") == [("none", None), ("eagle", "a"), ("medusa", "b")]
    assert parse_methods("suffix,ngram") == [("suffix", None), ("ngram", None)]
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        parse_ks("2,x")
    with pytest.raises(InvalidParameterError, match="transformers, llama.cpp"):
        parse_peers("transformers,vllm")
    assert parse_ks("2,4,6,4") == [2, 4, 6]
    assert parse_concurrency(None) is None  # latency mode
    assert parse_concurrency("1, 4,16,4") == [1, 4, 16] and parse_concurrency("64") == [64]
    assert parse_methods("none,ngram,draft_model:/d") == [("none", None), ("ngram", None), ("draft_model", "/d")]


@pytest.mark.parametrize("argv, match", [
    (["--methods", "none,eagle"], "methods='eagle'"),
    (["--num-speculative-tokens", "0"], "num_speculative_tokens=0"),
    (["--peers", "vllm"], "peers='vllm'"),
    (["--categories", "poetry"], "available: coding,extraction"),
    (["--workload", "/no/such/file.jsonl"], "neither 'spec_bench'"),
    (["--methods", "draft_model:/no/such/draft"], "does not exist"),
    (["--json", "/no/such/folder/r.json"], "its folder does not exist"),
    (["--concurrency", "0"], "concurrency='0': must be a positive integer or a comma list"),
    (["--concurrency", "1,four"], "concurrency='1,four'"),
    (["--concurrency", "4,-2"], "concurrency='4,-2'"),
    (["--concurrency", "5000"], "each at most 4096"),
    (["--concurrency", ","], "concurrency=','"),
    (["--repeat", "0"], r"repeat=0: must be an integer in \[1, 100\]"),
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


def test_repeated_prompts_are_reported_by_pass(tmp_path, capsys):
    """--repeat 2: the same prompts twice in one engine per configuration; suffix decoding
    remembers the first pass's answers, so the second pass accepts more."""
    doc = bench_json(tmp_path, [f"t{3 + i} t{9 + 2 * i} t5 t{7 + i}" for i in range(3)], "--methods", "none,suffix",
                     "--repeat", "2", "--num-speculative-tokens", "8", "--max-tokens", "16")
    assert doc["settings"]["repeat"] == 2 and doc["workload"]["num_prompts"] == 3
    plain, suffix = doc["results"]
    assert list(suffix["per_pass"]) == ["pass 1", "pass 2"] and suffix["per_pass"]["pass 1"]["num_prompts"] == 3
    assert suffix["identical_to_baseline"] == 1.0 and plain["per_pass"]["pass 2"]["identical_to_baseline"] == 1.0
    first, second = suffix["per_pass"]["pass 1"], suffix["per_pass"]["pass 2"]
    assert second["mean_accepted_length"] > first["mean_accepted_length"]
    assert "speedup over plain by pass:" in capsys.readouterr().out


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


def test_bench_on_the_embedded_model_through_the_chat_template(tmp_path, capsys, smollm_native):
    out = tmp_path / "r.json"
    assert bench(["--workload", "spec_bench", "--categories", "writing", "--limit", "2", "--max-tokens", "8",
                  "--methods", "none,ngram", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workload"]["categories"] == {"writing": 2}
    texts = [p.text for p in load_workload("spec_bench")[:2]]
    chat = [smollm_native.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
    assert doc["workload"]["prompt_tokens"] == sum(map(len, chat))
    assert [r["identical_to_baseline"] for r in doc["results"]] == [1.0, 1.0]
    assert "machine: cpu" in capsys.readouterr().out


# ---- throughput mode ----------------------------------------------------------------------------

def test_percentile_interpolates_between_ranks():
    assert percentile([], 50) is None and percentile([7.0], 99) == 7.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile(list(map(float, range(101))), 99) == 99.0


def test_throughput_figures():
    base = ConcurrentRun(Config("none"), 2, [Completion([1, 2, 3], 0.1, 0.5, 1.0, None),
                                             Completion([4], 0.3, None, 0.0, None)],
                         wall_s=2.0, prefix_cache_hit_rate=0.5, num_preemptions=0)
    spec = ConcurrentRun(Config("ngram", 2), 2, [Completion([1, 2, 3], 0.2, 0.25, 0.5, _spec(4, 2, 4, 2)),
                                                 Completion([5], 0.4, None, 0.0, _spec(0, 0, 0, 0))],
                         wall_s=1.0, prefix_cache_hit_rate=0.25, num_preemptions=1)
    f = throughput_figures(spec, base, temperature=0.0)
    assert f.tokens_per_s == 4.0 and f.requests_per_s == 2.0 and f.speedup == 2.0 and f.decode_tokens_per_s == 4.0
    assert f.ttft_ms_p50 == pytest.approx(300.0) and f.ttft_ms_p99 == pytest.approx(398.0)
    assert f.tpot_ms_p50 == f.tpot_ms_p99 == 250.0  # the one-token request has no time per output token
    assert f.acceptance_rate == 0.5 and f.mean_accepted_length == 2.0 and f.identical_to_baseline == 0.5
    assert throughput_figures(spec, base, temperature=0.7).identical_to_baseline is None
    assert throughput_figures(base, base, temperature=0.0).acceptance_rate is None
    d = f.as_dict()
    assert set(d) == THROUGHPUT_KEYS and d["concurrency"] == 2 and d["label"] == "ngram k=2"
    assert d["prefix_cache_hit_rate"] == 0.25 and d["num_preemptions"] == 1
    assert d["drafts_per_pass"] == 2.0 and d["mean_chosen_depth"] is None  # 4 drafts over 2 passes; k fixed


def test_rounds_combine_as_medians_with_the_speedups_range():
    """Three rounds of one configuration, each against its own round's plain: medians, the
    speedups' range, the least identical fraction; one round passes through unchanged."""
    def run(config, wall, tokens):
        return ConcurrentRun(config, 2, [Completion(tokens, 0.1 * wall, 0.01 * wall, wall, None)], wall_s=wall,
                             prefix_cache_hit_rate=0.0, num_preemptions=0)

    rounds = []
    for plain_wall, spec_wall, same in ((2.0, 1.0, True), (2.0, 2.0, False), (3.0, 2.0, True)):
        base = run(Config("none"), plain_wall, [1, 2, 3, 4])
        spec = run(Config("ngram", 2), spec_wall, [1, 2, 3, 4] if same else [1, 2, 3, 5])
        rounds.append(throughput_figures(spec, base, temperature=0.0))
    f = combine_rounds(rounds)
    assert [r.speedup for r in rounds] == [2.0, 1.0, 1.5]
    assert f.speedup == 1.5 and (f.speedup_min, f.speedup_max) == (1.0, 2.0) and f.rounds == 3
    assert f.tokens_per_s == 2.0 and f.identical_to_baseline == 0.0 and f.num_tokens == 12
    assert f.ttft_ms_p50 == pytest.approx(200.0)
    assert combine_rounds(rounds[:1]) is rounds[0] and rounds[0].rounds == 1 and rounds[0].speedup_min is None


class _FakeEngine:
    """Finishes the oldest running request every step; notes how many ran together."""

    def __init__(self):
        self.running, self.log, self.popped = [], [], []

    def stats(self):
        from specserve.engine.engine import EngineStats
        return EngineStats()

    def add_request(self, rid, ids, params):
        self.running.append((rid, ids, time.perf_counter()))

    def has_unfinished_requests(self):
        return bool(self.running)

    def step(self):
        from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecStats

        self.log.append([rid for rid, _, _ in self.running])
        rid, ids, t = self.running.pop(0)
        metrics = RequestMetrics(t, t + 0.01, t + 0.03, len(ids), 3)
        return [RequestOutput(rid, None, ids, [CompletionOutput(0, "", ids[:3], "length")], True, metrics, SpecStats())]

    def pop_finished(self, rid):
        self.popped.append(rid)

    def abort_request(self, rid):
        raise AssertionError("nothing is left to abort")


def test_run_concurrent_keeps_c_requests_in_flight():
    engine, ticks = _FakeEngine(), []
    prompts = [[10 + i, 1, 2] for i in range(5)]
    run = run_concurrent(engine, Config("none"), prompts, lambda i: SamplingParams(), 2, lambda: ticks.append(1), tag="x")
    # A new request goes in as soon as one finishes, so two are always in flight until the tail.
    assert engine.log == [["x0", "x1"], ["x1", "x2"], ["x2", "x3"], ["x3", "x4"], ["x4"]]
    assert engine.popped == [f"x{i}" for i in range(5)] and len(ticks) == 5
    assert [c.token_ids[0] for c in run.completions] == [10, 11, 12, 13, 14]
    assert all(c.tpot_s == pytest.approx(0.01) and c.spec is None for c in run.completions)
    assert run.concurrency == 2 and run.wall_s > 0 and run.num_preemptions == 0


def test_throughput_sweep_writes_one_entry_per_configuration_and_concurrency(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    work = tmp_path / "w.jsonl"
    # 16 shared tokens (one full KV block) then a distinct tail: later prompts can hit the cache.
    common = " ".join(f"t{2 + i}" for i in range(16))
    work.write_text("".join(json.dumps({"turns": [f"{common} t{30 + i} t{40 + i} t{50 + i} t{33 + i}"]}) + "\n"
                            for i in range(3)))
    out = tmp_path / "r.json"
    assert bench(["--model", str(model), "--workload", str(work), "--methods", f"none,ngram,draft_model:{model}",
                  "--num-speculative-tokens", "2", "--max-tokens", "10", "--concurrency", "1,4", "--json", str(out),
                  "--peers", "transformers"]) == 0
    doc = json.loads(out.read_text())
    assert doc["settings"]["concurrency"] == [1, 4]
    results = doc["results"]
    assert [(r["label"], r["concurrency"]) for r in results] == [
        (label, c) for c in (1, 4) for label in ("none", "ngram k=2", "draft_model(m) k=2")]
    for r in results:
        assert set(r) == THROUGHPUT_KEYS and r["num_prompts"] == 3 and r["num_tokens"] == results[0]["num_tokens"]
        assert r["tokens_per_s"] > 0 and r["requests_per_s"] > 0 and r["wall_s"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p99"] and 0 < r["tpot_ms_p50"] <= r["tpot_ms_p99"]
        assert r["identical_to_baseline"] == 1.0  # lossless speculation, batched or not
        assert (r["acceptance_rate"] is None) == (r["method"] == "none")
        assert 0.0 <= r["prefix_cache_hit_rate"] <= 1.0 and r["num_preemptions"] == 0
    assert results[2]["acceptance_rate"] == 1.0  # the draft is the target itself
    # One request at a time, prompts 2 and 3 find prompt 1's first block; the warm-up left nothing behind.
    assert [r["prefix_cache_hit_rate"] for r in results[:3]] == [pytest.approx(2 / 3, abs=1e-4)] * 3
    captured = capsys.readouterr()
    assert "ttft p50" in captured.out and "concurrency 1,4" in captured.out
    assert "peers (transformers) run in latency mode only; skipped with --concurrency" in captured.err


def test_throughput_rounds_report_medians_and_the_speedup_range(tmp_path, capsys):
    doc = bench_json(tmp_path, [f"t{3 + i} t{9 + i} t{3 + i} t{9 + i}" for i in range(2)], "--methods", "none,ngram",
                     "--max-tokens", "6", "--concurrency", "2", "--rounds", "3")
    assert doc["settings"]["rounds"] == 3
    plain, ngram = doc["results"]
    assert plain["rounds"] == ngram["rounds"] == 3 and plain["num_prompts"] == 2
    assert plain["speedup"] == plain["speedup_min"] == plain["speedup_max"] == 1.0
    assert ngram["speedup_min"] <= ngram["speedup"] <= ngram["speedup_max"]
    assert ngram["identical_to_baseline"] == 1.0
    assert "medians of 3 rounds" in capsys.readouterr().out
    with pytest.raises(InvalidParameterError, match="rounds.*throughput mode"):
        bench(["--model", str(tmp_path / "m"), "--workload", str(tmp_path / "w.jsonl"), "--methods", "none",
               "--rounds", "2"])


def test_bench_serve_level_prompts():
    from specserve.bench.serve_load import level_prompts

    pool = [f"p{i}" for i in range(7)]
    assert level_prompts(pool, 3, 2, distinct=False) == [["p0", "p1", "p2"]] * 2
    assert level_prompts(pool, 9, 1, distinct=False) == [pool + ["p0", "p1"]]  # cycled
    # Strided over the whole pool: each level samples all of it (a workload stored category by
    # category gives every level the same mix).
    assert level_prompts(pool, 3, 2, distinct=True) == [["p0", "p2", "p4"], ["p1", "p3", "p5"]]
    assert level_prompts(pool, 2, 3, distinct=True) == [["p0", "p3"], ["p1", "p4"], ["p2", "p5"]]
    with pytest.raises(InvalidParameterError, match="needs 9 prompts"):
        level_prompts(pool, 3, 3, distinct=True)
    with pytest.raises(InvalidParameterError, match="at least one prompt"):
        level_prompts([], 3, 1, distinct=False)
