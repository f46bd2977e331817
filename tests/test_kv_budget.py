"""The KV pool's size against the memory actually available (read through
kv_budget.available_memory, replaced here): the default is cut to a share of it, an explicit
size that does not fit is refused with the figures, and the pool says where its size came from."""

import pytest
import torch

from specserve import native
from specserve.kv import budget as kv_budget
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.model.loader import load_model


@pytest.fixture
def block_bytes(tiny):
    cfg = tiny["loaded"].config
    return 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # float32, 16-token blocks


def with_memory(monkeypatch, num_bytes: int) -> None:
    monkeypatch.setattr(kv_budget, "available_memory", lambda device: num_bytes)


def test_default_pool_is_every_request_at_full_context_when_it_fits(tiny, block_bytes, monkeypatch):
    with_memory(monkeypatch, block_bytes * 1000)
    llm = LLM(loaded=tiny["loaded"], max_model_len=128, max_num_seqs=4)
    assert llm.engine.scheduler.pool.num_blocks == 4 * 8
    assert llm.kv_budget.describe().endswith("max_num_seqs=4 requests at max_model_len=128")


def test_default_pool_takes_at_most_half_the_available_memory(tiny, block_bytes, monkeypatch):
    """256 requests of 128 tokens would need 2048 blocks; 100 blocks' worth of memory gives 49
    (half of it, less the trash block), still more than one request at full context needs."""
    with_memory(monkeypatch, block_bytes * 100)
    llm = LLM(loaded=tiny["loaded"], max_model_len=128, max_num_seqs=256)
    assert llm.engine.scheduler.pool.num_blocks == 49
    assert llm.engine.runner.cache.nbytes() <= block_bytes * 50
    line = llm.kv_budget.describe()
    assert "KV pool of 49 blocks (784 tokens" in line and "0.5 of the" in line and "max_num_seqs=256" in line


def test_default_pool_keeps_one_full_context_request(tiny, block_bytes, monkeypatch):
    with_memory(monkeypatch, block_bytes * 10)  # half of it is 4 blocks; one request needs 8
    assert LLM(loaded=tiny["loaded"], max_model_len=128, max_num_seqs=16).engine.scheduler.pool.num_blocks == 8
    with_memory(monkeypatch, block_bytes * 5)  # not even one request fits
    with pytest.raises(InvalidParameterError, match=r"max_model_len=128: needs \d+ bytes .* only \d+ bytes"):
        LLM(loaded=tiny["loaded"], max_model_len=128)


@pytest.mark.parametrize("kwargs, param", [({"num_kv_blocks": 100}, "num_kv_blocks"),
                                           ({"kv_cache_memory": 10**12}, "kv_cache_memory")])
def test_explicit_pool_larger_than_available_memory_is_refused(tiny, block_bytes, monkeypatch, kwargs, param):
    with_memory(monkeypatch, block_bytes * 50)
    with pytest.raises(InvalidParameterError) as e:
        LLM(loaded=tiny["loaded"], max_model_len=128, **kwargs)
    assert e.value.param == param
    needed = (100 + 1) * block_bytes if param == "num_kv_blocks" else 10**12
    assert f"needs {needed} bytes" in str(e.value) and f"only {block_bytes * 50} bytes" in str(e.value)
    llm = LLM(loaded=tiny["loaded"], max_model_len=128, num_kv_blocks=40)  # one that fits is taken as given
    assert llm.engine.scheduler.pool.num_blocks == 40 and "num_kv_blocks=40 as given" in llm.kv_budget.describe()


def test_available_memory_is_read_from_the_os(tiny):
    assert kv_budget.available_memory(tiny["loaded"].model.device) > 0


@pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
def test_a_native_models_float16_pool_holds_twice_the_tokens(tiny, block_bytes, monkeypatch):
    """The native model keeps K and V as float16 (its kv_dtype): a block takes half the bytes of
    the torch path's float32 one, so the same memory holds twice the blocks, and the pool says
    what it stores."""
    with_memory(monkeypatch, block_bytes * 100)
    fp32 = LLM(loaded=tiny["loaded"], max_model_len=128, max_num_seqs=256)
    fp16 = LLM(loaded=load_model(tiny["target"], quantization="int8"), max_model_len=128, max_num_seqs=256)
    assert fp16.engine.runner.cache.k.dtype == torch.float16 and fp16.kv_budget.block_bytes * 2 == block_bytes
    assert fp32.engine.scheduler.pool.num_blocks == 49 and fp16.engine.scheduler.pool.num_blocks == 99
    assert fp16.engine.runner.cache.nbytes() <= block_bytes * 50
    assert "tokens, float16, " in fp16.kv_budget.describe() and "tokens, float32, " in fp32.kv_budget.describe()
