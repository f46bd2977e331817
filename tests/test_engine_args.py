"""The engine's command-line arguments and the --config file: one way for generate, bench, serve
and LLM(config=...) to resolve them (command line, then file, then default), and one clear
message for every bad file."""

import json

import pytest

from specserve.bench.cli import parse_ks, parse_methods, speculative_configs
from specserve.cli import build_parser, main
from specserve.config import DEFAULT_MAX_STEP_MS, EngineConfig
from specserve.config_file import CONFIG_FILE_KEYS, load_config_file
from specserve.engine_args import engine_kwargs, load_kwargs, speculative_config
from specserve.errors import InvalidParameterError
from specserve.llm import LLM

TUNED = {"model": "tuned-model", "speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 2},
         "max_num_seqs": 8, "max_num_batched_tokens": 512, "tuned": {"machine": "anything", "figures": [1, 2]}}


def write(tmp_path, doc, name="tuned.json") -> str:
    path = tmp_path / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def resolve(*argv):
    """(load_model's, speculative_config, LLM's engine keyword arguments) of a command line."""
    args = build_parser().parse_args(list(argv))
    file = load_config_file(args.config)
    return load_kwargs(args, file), speculative_config(args, file), engine_kwargs(args, file)


# ---- the file --------------------------------------------------------------------------------

def test_the_file_is_read_without_its_tuned_record(tmp_path):
    assert load_config_file(write(tmp_path, TUNED)) == {k: v for k, v in TUNED.items() if k != "tuned"}
    assert load_config_file(write(tmp_path, {})) == {} and load_config_file(None) == {}
    assert load_config_file(write(tmp_path, {"speculative_config": None})) == {"speculative_config": None}


@pytest.mark.parametrize("content, match", [
    ("{not json", "is not a JSON file"),
    (b"\xff\xfe{}", "is not a JSON file"),
    ("[1, 2]", "must hold one JSON object"),
    ({"max_num_seq": 4}, "unknown keys max_num_seq; allowed: " + ", ".join(CONFIG_FILE_KEYS)),
    ({"max_num_seqs": "16"}, r"max_num_seqs='16': must be an integer"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens=True: must be an integer"),
    ({"model": 3}, "model=3: must be a path or 'default'"),
    ({"speculative_config": {"method": "ngram", "k": 4}}, "speculative_config: .*unknown keys"),
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "speculative_config: .*num_speculative_tokens=0"),
    ({"speculative_config": "ngram"}, "speculative_config: .*must be a dict"),
])
def test_a_bad_file_is_refused_naming_it(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_bytes(content if isinstance(content, bytes) else
                     (content if isinstance(content, str) else json.dumps(content)).encode())
    with pytest.raises(InvalidParameterError, match=match) as e:
        load_config_file(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_a_missing_file_is_refused_naming_it(tmp_path):
    with pytest.raises(InvalidParameterError, match=r"config='.*nope.json': cannot read the file"):
        load_config_file(tmp_path / "nope.json")


# ---- precedence: command line, then file, then default -------------------------------------------

@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_the_file_fills_what_the_command_line_left_out(tmp_path, command):
    load, spec, engine = resolve(*command, "--config", write(tmp_path, TUNED))
    assert load["model"] == "tuned-model"
    assert spec == TUNED["speculative_config"]
    assert engine["max_num_batched_tokens"] == 512
    # generate runs one request and sets its own batch; a server takes the file's.
    assert engine.get("max_num_seqs") == (8 if command == ["serve"] else None)


def test_the_command_line_wins_key_by_key(tmp_path):
    load, spec, engine = resolve("serve", "--config", write(tmp_path, TUNED), "--model", "mine", "--max-num-seqs", "16",
                                 "--num-speculative-tokens", "5")
    assert load["model"] == "mine"
    assert engine["max_num_seqs"] == 16 and engine["max_num_batched_tokens"] == 512  # 16: given, though the default
    assert spec == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 2}  # the same method: merged
    _, spec, _ = resolve("serve", "--config", write(tmp_path, TUNED), "--speculative", "draft_model", "--draft-model", "d")
    assert spec == {"method": "draft_model", "model": "d", "num_speculative_tokens": "auto"}  # another method: replaced
    _, spec, _ = resolve("serve", "--config", write(tmp_path, TUNED), "--speculative", "none")
    assert spec is None


def test_defaults_without_a_file():
    load, spec, engine = resolve("serve", "--num-speculative-tokens", "4")
    assert load["model"] == "default" and spec is None  # no method given: no speculation
    assert engine == {"max_model_len": None, "max_num_seqs": 16}  # the rest: LLM's own defaults
    _, spec, _ = resolve("generate", "hi", "--speculative", "ngram", "--draft-model", "ignored")
    assert spec == {"method": "ngram", "num_speculative_tokens": "auto"}  # k: auto by default


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve"]])
def test_the_step_time_bound_is_a_flag_checked_at_the_edge(command):
    _, _, engine = resolve(*command, "--max-step-ms", "50")
    assert engine["max_step_ms"] == 50.0
    _, _, engine = resolve(*command, "--max-step-ms", "0")  # off
    assert engine["max_step_ms"] == 0.0
    assert "max_step_ms" not in resolve(*command)[2]  # the default: EngineConfig's
    for bad in (-1.0, float("nan"), True, "50"):
        with pytest.raises(InvalidParameterError, match="max_step_ms=.*milliseconds"):
            EngineConfig(max_model_len=64, max_num_seqs=1, max_step_ms=bad)
    assert EngineConfig(max_model_len=64, max_num_seqs=1).max_step_ms == DEFAULT_MAX_STEP_MS


def test_speculation_off_by_batch_size_is_a_flag_every_method_takes(tmp_path):
    _, spec, _ = resolve("serve", "--speculative", "suffix", "--speculative-disable-by-batch-size", "8")
    assert spec == {"method": "suffix", "num_speculative_tokens": "auto", "disable_by_batch_size": 8}
    _, spec, _ = resolve("serve", "--config", write(tmp_path, TUNED), "--speculative-disable-by-batch-size", "4")
    assert spec == {**TUNED["speculative_config"], "disable_by_batch_size": 4}  # over the file's, key by key
    with pytest.raises(InvalidParameterError, match="disable_by_batch_size=1: must be an integer >= 2"):
        LLM(loaded=None, speculative_config={"method": "ngram", "disable_by_batch_size": 1})


def test_a_null_speculative_config_means_plain_decoding(tmp_path):
    _, spec, _ = resolve("generate", "hi", "--config", write(tmp_path, {"speculative_config": None}),
                         "--num-speculative-tokens", "4")
    assert spec is None
    _, spec, _ = resolve("generate", "hi", "--config", write(tmp_path, {"speculative_config": None}),
                         "--speculative", "ngram", "--num-speculative-tokens", "4")
    assert spec == {"method": "ngram", "num_speculative_tokens": 4}


def test_num_speculative_tokens_is_an_integer_or_auto(capsys):
    assert resolve("generate", "hi", "--speculative", "ngram", "--num-speculative-tokens", "auto")[1][
        "num_speculative_tokens"] == "auto"
    assert resolve("generate", "hi", "--speculative", "ngram", "--num-speculative-tokens", "6")[1][
        "num_speculative_tokens"] == 6
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--num-speculative-tokens", "many"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--num-speculative-tokens" in err and "'many'" in err and "an integer" in err and "'auto'" in err
    assert parse_ks("auto,2,4,8,2") == ["auto", 2, 4, 8]
    with pytest.raises(InvalidParameterError, match="integer or 'auto', or a comma list"):
        parse_ks("auto,x")


def test_bench_runs_the_files_speculative_config_as_one_more_row(tmp_path):
    args = build_parser().parse_args(["bench", "--config", write(tmp_path, TUNED), "--prompt-lookup-max", "3"])
    assert args.num_speculative_tokens == "auto" and args.model is None
    configs = speculative_configs(parse_methods("none,ngram"), [2], {"prompt_lookup_max": 3},
                                  load_config_file(args.config).get("speculative_config"))
    assert [(c.label, s) for c, s in configs] == [
        ("ngram k=2", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}),
        ("config k=3", TUNED["speculative_config"])]  # the file's as it is: bench's flags are for its sweep


# ---- end to end --------------------------------------------------------------------------------

def test_generate_with_a_config_file(tmp_path, capsys, tiny):
    path = write(tmp_path, {"model": tiny["target"], "max_num_batched_tokens": 4,
                            "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    assert main(["generate", "t5 t9 t12 t5 t9", "--config", path, "--max-tokens", "6", "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert f"Loading {tiny['target']}" in err and "drafted" in err  # the file's model, with the file's speculation
    for command in (["generate", "t5"], ["serve", "--port", "0"], ["bench"]):  # refused before anything loads
        assert main([*command, "--config", write(tmp_path, {"max_num_seqs": "x"}, "bad.json")]) == 2
        assert "bad.json" in capsys.readouterr().err


def test_bench_with_a_config_file(tmp_path, tiny):
    work = write(tmp_path, json.dumps({"turns": ["t3 t4 t5 t3 t4 t5"]}), "w.jsonl")
    path = write(tmp_path, {"model": tiny["target"], "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}})
    out = tmp_path / "r.json"
    assert main(["bench", "--config", path, "--workload", work, "--methods", "none,ngram", "--num-speculative-tokens", "3",
                 "--max-tokens", "6", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == "target" and doc["settings"]["config"] == path
    assert [r["label"] for r in doc["results"]] == ["none", "ngram k=3", "config k=2"]
    assert all(r["identical_to_baseline"] == 1.0 for r in doc["results"])


def test_llm_takes_a_config_file_and_its_own_arguments_win(tmp_path, tiny):
    path = write(tmp_path, TUNED)
    llm = LLM(loaded=tiny["loaded"], config=path, max_model_len=64)
    assert llm.engine_config.max_num_seqs == 8 and llm.engine_config.max_num_batched_tokens == 512
    assert llm.spec_config.num_speculative_tokens == 3 and llm.spec_config.prompt_lookup_max == 2
    llm = LLM(loaded=tiny["loaded"], config=path, max_model_len=64, max_num_seqs=2, speculative_config=None)
    assert llm.engine_config.max_num_seqs == 2 and llm.spec_config is None
    llm = LLM(loaded=tiny["loaded"], max_model_len=64)
    assert llm.engine_config.max_num_seqs == 4 and llm.engine_config.max_num_batched_tokens == 2048
    with pytest.raises(InvalidParameterError, match="unknown keys max_num_seq"):
        LLM(loaded=tiny["loaded"], config=write(tmp_path, {"max_num_seq": 4}))


def test_the_file_specserve_tune_writes_loads_with_config(tmp_path, capsys, tiny):
    work = write(tmp_path, "".join(json.dumps({"turns": [f"t{3 + i} t4 t5 t{3 + i} t4 t5"]}) + "\n" for i in range(2)),
                 "w.jsonl")
    out = tmp_path / "tuned.json"
    assert main(["tune", "--model", tiny["target"], "--workload", work, "--num-prompts", "2", "--methods", "none,ngram",
                 "--max-tokens", "6", "--output", str(out)]) == 0
    file = load_config_file(out)
    assert file["model"] == tiny["target"] and file["max_num_seqs"] == 1
    capsys.readouterr()
    assert main(["generate", "t5 t9 t5 t9", "--config", str(out), "--max-tokens", "4"]) == 0
    assert f"Loading {tiny['target']}" in capsys.readouterr().err
