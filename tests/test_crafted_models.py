"""Untrusted model files: every file of the crafted corpus (tests/crafted_models.py) gets one
clear error naming the bad field, and loading the whole corpus stays small.

The corpus is loaded in one child process, so that its peak resident memory measures what the
loads allocated (a file claiming a context of 2**31 tokens once built a RoPE table of gigabytes
before any check) and the suite pays one interpreter start for all of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.crafted_models import write_corpus

# What loading the corpus may add to the child's peak RSS, above what it had after its imports:
# the valid models are kilobytes, so this is Python's and torch's own growth, and far below what
# one table sized by a crafted context would take (2**24 positions x 8 x 4 bytes = 512 MiB each).
MAX_GROWTH_KB = 512 * 1024

_CHILD = r"""
import json, resource, sys
from specserve.config_file import load_config_file
from specserve.errors import SpecserveError
from specserve.model.loader import load_model

cases = json.loads(sys.stdin.read())
baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, path, kind in cases:
    try:
        if kind == "config_file":
            load_config_file(path)
            out[name] = {"loaded": True}
        else:
            loaded = load_model(path)
            short = load_model(path, max_model_len=100)
            out[name] = {"loaded": True, "context": loaded.config.max_position_embeddings,
                         "positions": loaded.model.max_positions, "short_positions": short.model.max_positions,
                         "native": bool(getattr(loaded.model, "native", False))}
    except SpecserveError as e:
        out[name] = {"loaded": False, "type": type(e).__name__, "message": str(e)}
    except BaseException as e:  # reported to the parent, which fails the case
        out[name] = {"loaded": False, "type": type(e).__name__, "message": repr(e)[:500]}
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"results": out, "baseline_kb": baseline, "peak_kb": peak}))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("crafted")
    cases = write_corpus(root)
    request = json.dumps([(c.name, str(c.path), c.kind) for c in cases])
    proc = subprocess.run([sys.executable, "-c", _CHILD], input=request, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return {c.name: c for c in cases}, report


def _case_names() -> dict[str, list[str]]:
    """The corpus's case names, bad files and valid controls (written once to a scratch folder
    to list them: they do not depend on the folder)."""
    with tempfile.TemporaryDirectory() as d:
        cases = write_corpus(Path(d))
    return {"bad": [c.name for c in cases if c.field is not None], "good": [c.name for c in cases if c.field is None]}


_CASE_NAMES = _case_names()


@pytest.mark.parametrize("name", _CASE_NAMES["bad"])
def test_each_crafted_file_gets_one_clear_error_naming_the_field(corpus, name):
    cases, report = corpus
    case, got = cases[name], report["results"][name]
    assert not got["loaded"], f"{name} loaded"
    expected_type = "InvalidParameterError" if case.kind == "config_file" else "ModelLoadError"
    assert got["type"] == expected_type, got
    message = got["message"]
    assert case.field in message, message
    assert case.path.name in message, message  # names the file
    assert "\n" not in message and "Traceback" not in message and len(message) < 600, message


@pytest.mark.parametrize("name", _CASE_NAMES["good"])
def test_valid_files_of_the_corpus_load_with_tables_sized_by_max_model_len(corpus, name):
    """A context of 2**24 positions is allowed, but the RoPE tables cover the engine's
    max_model_len (by default 4096), capped by the model's context."""
    got = corpus[1]["results"][name]
    assert got["loaded"], got
    assert got["positions"] == min(got["context"], 4096)
    assert got["short_positions"] == min(got["context"], 100)


def test_loading_the_corpus_allocates_nothing_large(corpus):
    _, report = corpus
    assert report["peak_kb"] - report["baseline_kb"] < MAX_GROWTH_KB, report
