"""Buffers in huge-page mappings (specserve/model/hugepages.py): what `hold` and `zeros` hand out,
the switch that keeps torch's allocator, and a model whose weights live there computing the same
bits as one whose weights do not."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from specserve import native
from specserve.model import hugepages
from specserve.model.hugepages import ALIGN, HUGE_PAGE, HUGEPAGES_ENV, HugeArena
from specserve.model.loader import load_model
from specserve.model.runner import ForwardBatch, ModelRunner
from tests.helpers import make_tiny_checkpoint

def advised(address: int) -> bool:
    """Whether the mapping holding `address` asked for huge pages (its VmFlags say hg)."""
    vma = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and line[0] in "0123456789abcdef":
                lo, hi = (int(x, 16) for x in head.split("-"))
                vma = lo <= address < hi
            elif vma and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


needs_madvise = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")


@needs_madvise
def test_hold_copies_into_aligned_shared_space(monkeypatch):
    monkeypatch.delenv(HUGEPAGES_ENV, raising=False)
    arena = HugeArena(chunk=4 * HUGE_PAGE)
    a, b = torch.randn(100, 3), torch.arange(7, dtype=torch.int16)
    # Where torch's allocator put the source is the process's business: numpy advises the large
    # arrays it allocates for huge pages, and where malloc served one from the heap that part of
    # the heap stays advised, small tensors landing there later (make test saw it); holding the
    # source must not change its state.
    source_advised = advised(a.data_ptr())
    ha, hb = arena.hold(a), arena.hold(b)
    assert torch.equal(ha, a) and torch.equal(hb, b)
    assert (ha.dtype, ha.shape, hb.dtype, hb.shape) == (a.dtype, a.shape, b.dtype, b.shape)
    assert ha.is_contiguous() and ha.data_ptr() % HUGE_PAGE == 0  # a fresh mapping starts on a huge page
    assert hb.data_ptr() - ha.data_ptr() == -(-a.numel() * 4 // ALIGN) * ALIGN  # the next 64 bytes on
    assert ha.data_ptr() != a.data_ptr() and advised(ha.data_ptr()) and advised(a.data_ptr()) == source_advised
    ha.add_(1.0)  # a copy: the source is untouched
    assert torch.equal(ha, a + 1.0)


@needs_madvise
def test_a_tensor_over_a_chunk_gets_a_mapping_of_its_own(monkeypatch):
    monkeypatch.delenv(HUGEPAGES_ENV, raising=False)
    arena = HugeArena(chunk=HUGE_PAGE)
    small = arena.hold(torch.ones(16, dtype=torch.uint8))
    big = arena.hold(torch.full((3 * HUGE_PAGE // 4,), 2.0))  # 1.5 huge pages
    after = arena.hold(torch.ones(16, dtype=torch.uint8))
    assert big.data_ptr() % HUGE_PAGE == 0 and bool((big == 2.0).all())
    assert after.data_ptr() - small.data_ptr() == ALIGN  # the chunk stays the current one
    assert arena.bytes_held == 16 + 3 * HUGE_PAGE + 16


@needs_madvise
def test_views_keep_their_mapping_alive(monkeypatch):
    monkeypatch.delenv(HUGEPAGES_ENV, raising=False)
    arena = HugeArena()
    kept = arena.hold(torch.arange(1000, dtype=torch.float64))[10:20]
    del arena
    gc.collect()
    for _ in range(3):  # other mappings made and dropped meanwhile
        HugeArena().hold(torch.zeros(1 << 16))
    assert torch.equal(kept, torch.arange(10, 20, dtype=torch.float64))


@needs_madvise
def test_zeros_are_zero_and_writable(monkeypatch):
    monkeypatch.delenv(HUGEPAGES_ENV, raising=False)
    arena = HugeArena(chunk=HUGE_PAGE)
    z = arena.zeros((3, 5, 2), torch.float16)
    assert z.shape == (3, 5, 2) and z.dtype == torch.float16 and not z.any()
    z[1, 2, 1] = 4.0
    assert z.sum().item() == 4.0
    assert arena.zeros((0, 4), torch.float32).shape == (0, 4)


def test_the_switch_keeps_torchs_allocator(monkeypatch):
    monkeypatch.setenv(HUGEPAGES_ENV, "0")
    arena = HugeArena()
    t = torch.randn(10)
    assert arena.hold(t) is t
    assert not arena.zeros((4,), torch.float32).any()
    assert arena.bytes_held == 0
    assert hugepages.describe() == f"huge pages: off ({HUGEPAGES_ENV}=0)"


def test_empty_tensors_are_returned_as_they_are():
    t = torch.empty(0, 3)
    assert HugeArena().hold(t) is t


@needs_madvise
def test_weights_in_huge_pages_compute_the_same_bits(monkeypatch, tmp_path):
    """The same tiny checkpoint on the native kernels, its packed weights and KV pool in huge
    pages or not: the same logits, bit for bit."""
    if native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    folder = make_tiny_checkpoint(tmp_path / "m", vocab_size=64, hidden=64, layers=2)
    ids = [3, 9, 27, 17, 5, 44, 12, 60, 1, 33]
    out = {}
    for flag in ("0", "1"):
        monkeypatch.setenv(HUGEPAGES_ENV, flag)
        loaded = load_model(folder, quantization="int4")
        runner = ModelRunner.paged(loaded.model, num_blocks=4, block_size=16)
        out[flag] = runner.execute(ForwardBatch(token_ids=[ids], locations=[[0]], start_positions=[0],
                                                all_logits=True))
        units = loaded.model.parts.lm_head.units
        if flag == "1":
            assert advised(units.data_ptr())
        else:  # torch's own allocation, not a mapping's view (whether the heap is advised: see above)
            assert units.untyped_storage().resizable()
    assert torch.equal(out["0"].view(torch.int32), out["1"].view(torch.int32))
