"""`specserve bench --plot`: the figure of a bench result, drawn from result dicts made by bench's
own report code (no model loads), plus one tiny run through the command. No timing asserts."""

import json
import re
import sys

import pytest

from specserve.bench.plot import MISSING_MATPLOTLIB, draw, load_result, plot_data
from specserve.bench.runner import Config, Sample, report
from specserve.bench.throughput import Completion, ConcurrentRun, throughput_figures
from specserve.cli import main
from specserve.errors import InvalidParameterError, SpecserveError
from specserve.outputs import SpecStats
from tests.helpers import make_tiny_checkpoint

MACHINE = {"cpu": "Test CPU", "arch": "x86_64", "cores": 2, "cpu_path": "avx2", "cpu_detected": "avx2",
           "kernels": "torch float32", "torch": "2.13.0", "torch_threads": 2, "python": "3.11", "device": "cpu"}
SETTINGS = {"dtype": "auto", "max_tokens": 8, "temperature": 0.0, "top_p": 1.0, "seed": 0, "max_model_len": 512}


def _spec(steps: list[tuple[int, int]]) -> SpecStats:
    """Target passes as (drafted, accepted), the accepted tokens the first ones of the draft."""
    s = SpecStats()
    for drafted, accepted in steps:
        s.record(drafted, accepted, accepted + 1)
    return s


def _doc(results: list[dict], settings: dict | None = None) -> dict:
    return {"machine": MACHINE, "model": "tiny", "model_path": "/m", "settings": settings or SETTINGS,
            "workload": {"name": "w.jsonl", "num_prompts": 3, "skipped_too_long": 0,
                         "categories": {"a": 2, "b": 1}, "prompt_tokens": 30},
            "results": results}


def latency_doc() -> dict:
    """Plain, n-gram k=2 and a draft tree of depth 3, on three prompts in categories a, a, b."""
    cats = ["a", "a", "b"]
    plain = [Sample([1, 2, 3, 4], 2.0, 0.5), Sample([5, 6], 1.0, 0.5), Sample([7, 8, 9], 3.0, 0.5)]
    ngram = [Sample([1, 2, 3, 4], 1.0, 0.5, _spec([(2, 2), (2, 0)])), Sample([5, 6], 1.0, 0.5, _spec([(2, 1)])),
             Sample([7, 8, 9], 2.0, 0.5, _spec([(2, 1), (2, 0)]))]
    tree = [Sample(s.token_ids, s.seconds * 0.8, 0.5, _spec([(3, 3), (3, 1)])) for s in plain]
    runs = [(Config("none"), plain), (Config("ngram", 2), ngram), (Config("eagle", 3, "/drafters/e"), tree)]
    return _doc([report(c, s, plain, cats, 0.0).as_dict() for c, s in runs])


def throughput_doc() -> dict:
    """Plain and n-gram k=2 at concurrency 1 and 4, as bench's throughput mode writes them."""
    def run(config, c, wall, spec):
        done = [Completion([1, 2, 3], 0.1, 0.2, 0.4, spec), Completion([4, 5], 0.2, 0.3, 0.3, spec)]
        return ConcurrentRun(config, c, done, wall, 0.0, 0)

    results = []
    for c, plain_wall, spec_wall, steps in ((1, 2.0, 1.0, [(2, 2), (2, 1)]), (4, 0.5, 0.8, [(2, 1), (2, 0)])):
        plain = run(Config("none"), c, plain_wall, None)
        ngram = run(Config("ngram", 2), c, spec_wall, _spec(steps))
        results += [throughput_figures(r, plain, 0.0).as_dict() for r in (plain, ngram)]
    return _doc(results, SETTINGS | {"concurrency": [1, 4]})


def bench(argv: list[str]) -> int:
    return main(["bench", *argv])


# ---- what the panels show -----------------------------------------------------------------------

def test_latency_run_gives_speedup_and_acceptance_panels(tmp_path):
    doc = latency_doc()
    data = plot_data(doc)
    assert data.num_panels == 2 and not data.throughput
    assert data.group_by == "category" and data.groups == ["a", "b", "overall"]
    ngram = doc["results"][1]
    assert data.speedup["ngram k=2"] == [ngram["per_category"]["a"]["speedup"], ngram["per_category"]["b"]["speedup"],
                                        ngram["speedup"]]
    assert data.acceptance == {"ngram k=2": [0.6, 0.2], "eagle(e) k=3": [1.0, 0.5, 0.5]}

    path = tmp_path / "fig.png"
    fig = draw(doc, str(path))
    assert len(fig.axes) == 2
    speedup_ax, acceptance_ax = fig.axes
    # Bars in legend order, each configuration one bar per group, at the speedups given.
    for container, label in zip(speedup_ax.containers, ["ngram k=2", "eagle(e) k=3"]):
        assert container.get_label() == label
        assert [bar.get_height() for bar in container] == data.speedup[label]
    assert [tick.get_text() for tick in speedup_ax.get_xticklabels()] == ["a", "b", "overall"]
    dashed = [line for line in speedup_ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == [1.0, 1.0]
    lines = {line.get_label(): list(line.get_ydata()) for line in acceptance_ax.get_lines()}
    assert lines == data.acceptance
    assert "tiny" in fig.texts[0].get_text() and "Test CPU" in fig.texts[0].get_text()  # the title
    _assert_png(path)


def test_throughput_run_gives_three_panels(tmp_path):
    doc = throughput_doc()
    data = plot_data(doc)
    assert data.num_panels == 3
    by = {(r["label"], r["concurrency"]): r for r in doc["results"]}
    # No categories in throughput mode: the speedup bars are grouped by concurrency.
    assert data.group_by == "concurrency" and data.groups == ["c=1", "c=4"]
    assert data.speedup == {"ngram k=2": [by["ngram k=2", 1]["speedup"], by["ngram k=2", 4]["speedup"]]}
    assert data.throughput == {label: [(c, by[label, c]["tokens_per_s"]) for c in (1, 4)]
                               for label in ("none", "ngram k=2")}
    # Rates cannot be pooled across runs: the acceptance lines are the lowest concurrency's.
    assert data.acceptance == {"ngram k=2": by["ngram k=2", 1]["acceptance_by_position"]}
    assert data.acceptance_note == " (concurrency 1)"
    # A sweep typed as --concurrency 4,1 runs (and is written) in that order; the lines still go left to right.
    assert plot_data(doc | {"results": doc["results"][::-1]}).throughput == data.throughput

    path = tmp_path / "fig.png"
    fig = draw(doc, str(path))
    assert len(fig.axes) == 3
    speedup_ax, acceptance_ax, throughput_ax = fig.axes
    assert [bar.get_height() for bar in speedup_ax.containers[0]] == data.speedup["ngram k=2"]
    assert [tick.get_text() for tick in speedup_ax.get_xticklabels()] == ["c=1", "c=4"]
    assert "concurrency 1" in acceptance_ax.get_title()
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in throughput_ax.get_lines()}
    assert lines == {label: ([1, 4], [by[label, c]["tokens_per_s"] for c in (1, 4)]) for label in ("none", "ngram k=2")}
    assert throughput_ax.get_xlabel() == "requests in flight (concurrency)"
    _assert_png(path)


def test_one_concurrency_and_plain_only(tmp_path):
    doc = throughput_doc()
    doc["results"] = [r for r in doc["results"] if r["concurrency"] == 4]
    data = plot_data(doc)
    assert data.num_panels == 3 and data.groups == ["c=4"] and data.acceptance_note == ""
    # Plain alone in throughput mode still has its tok/s; in latency mode there is nothing to draw.
    doc["results"] = doc["results"][:1]
    assert plot_data(doc).num_panels == 1 and len(draw(doc, str(tmp_path / "t.png")).axes) == 1
    plain_only = _doc([latency_doc()["results"][0]])
    assert plot_data(plain_only).num_panels == 0
    with pytest.raises(SpecserveError, match="nothing to plot"):
        draw(plain_only, str(tmp_path / "x.png"))
    assert not (tmp_path / "x.png").exists()


def test_one_category_has_no_overall_group():
    doc = latency_doc()
    for r in doc["results"]:
        r["per_category"] = {"all": r["per_category"]["a"] | {"speedup": r["speedup"]}}
    data = plot_data(doc)
    assert data.groups == ["all"] and data.speedup["ngram k=2"] == [doc["results"][1]["speedup"]]


def test_peers_stay_out_of_the_figure():
    doc = latency_doc()
    peer = dict(doc["results"][0], method="llama.cpp", label="llama.cpp", speedup=0.5)
    doc["results"].append(peer)
    data = plot_data(doc)
    assert list(data.speedup) == ["ngram k=2", "eagle(e) k=3"] and "llama.cpp" not in data.acceptance


def _assert_png(path) -> None:
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    height, width = image.shape[:2]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 600 <= width <= 1200 and height > 300


# ---- the command: refused before anything loads -------------------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Any model load fails the test: these paths must stop before one."""
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr("specserve.model.loader.load_model", load_model)


def test_missing_matplotlib_is_refused_before_loading(monkeypatch, capsys, tmp_path, no_model_load):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert bench(["--plot", str(tmp_path / "f.png"), "--methods", "none,ngram"]) == 2
    assert capsys.readouterr().err.strip() == f"specserve: error: {MISSING_MATPLOTLIB}"
    assert MISSING_MATPLOTLIB == "--plot needs matplotlib: pip install 'specserve[plot]'"
    results = tmp_path / "r.json"
    results.write_text(json.dumps(latency_doc()))
    assert bench(["--plot-from", str(results), "--plot", str(tmp_path / "f.png")]) == 2
    assert MISSING_MATPLOTLIB in capsys.readouterr().err
    assert not (tmp_path / "f.png").exists()


@pytest.mark.parametrize("argv, match", [
    (["--plot", "{tmp}/f.jpg"], r"plot='.*f.jpg': must name a .png file"),
    (["--plot", "{tmp}/no/such/folder/f.png"], "its folder does not exist"),
    (["--plot-from", "{tmp}/r.json"], "needs --plot FILE.png"),
    (["--plot-from", "{tmp}/missing.json", "--plot", "{tmp}/f.png"], "plot_from=.*cannot be read as JSON"),
    (["--plot-from", "{tmp}/r.json", "--plot", "{tmp}/f.png", "--json", "{tmp}/out.json"], "--plot-from runs nothing"),
    (["--plot", "{tmp}/f.png", "--methods", "none"], "name one in --methods, or sweep --concurrency"),
])
def test_bad_plot_arguments_are_refused_before_loading(argv, match, tmp_path, capsys, no_model_load):
    (tmp_path / "r.json").write_text(json.dumps(latency_doc()))
    assert bench([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specserve: error: ") and err.count("\n") == 1
    assert re.search(match, err)
    assert not (tmp_path / "f.png").exists()


def test_load_result_wants_what_json_wrote(tmp_path):
    f = tmp_path / "r.json"
    for text in ("not json", "[]", '{"results": []}', '{"machine": {}}'):
        f.write_text(text)
        with pytest.raises(InvalidParameterError, match="plot_from"):
            load_result(str(f))
    f.write_text(json.dumps(latency_doc()))
    assert load_result(str(f)) == latency_doc()


# ---- one tiny run, then the same figure re-drawn from its JSON ----------------------------------

def test_bench_plots_then_redraws_from_its_json(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "m", vocab_size=64)
    work = tmp_path / "w.jsonl"
    work.write_text("".join(json.dumps({"turns": [f"t{3 + i} t4 t5 t{3 + i} t4 t5"], "category": c}) + "\n"
                            for i, c in enumerate(["a", "b", "a"])))
    results, png = tmp_path / "r.json", tmp_path / "bench.png"
    assert bench(["--model", str(model), "--workload", str(work), "--methods", "none,ngram", "--num-speculative-tokens",
                  "2", "--max-tokens", "8", "--json", str(results), "--plot", str(png)]) == 0
    assert f"wrote {png}" in capsys.readouterr().err
    _assert_png(png)
    again = tmp_path / "again.png"
    assert bench(["--plot-from", str(results), "--plot", str(again)]) == 0
    _assert_png(again)
    fig = draw(load_result(str(results)), str(tmp_path / "third.png"))
    ngram = json.loads(results.read_text())["results"][1]
    assert len(fig.axes) == 2
    assert [bar.get_height() for bar in fig.axes[0].containers[0]] == [
        ngram["per_category"]["a"]["speedup"], ngram["per_category"]["b"]["speedup"], ngram["speedup"]]
