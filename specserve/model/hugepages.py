"""Large, long-lived buffers (packed weights, the KV pool) in transparent huge pages.

A one-token pass streams every packed weight once. In 4 KiB pages that is a new TLB entry every
4 KiB, and the hardware prefetchers stop at each page's end; in 2 MiB pages neither happens.
Linux backs an anonymous mapping with 2 MiB pages where the mapping asks for them
(madvise(MADV_HUGEPAGE)); with transparent huge pages in "madvise" mode, the default of many
distributions, nothing else gets them, and torch's allocator does not ask. Measured on a Zen 4
EPYC (2 threads, a 8192 x 2048 Q4_0 product streamed from 151 MB of copies, three alternated
pairs): one token 0.327 / 0.309 / 0.268 -> 0.284 / 0.278 / 0.238 ms, nine tokens 0.527 / 0.511 /
0.527 -> 0.481 / 0.496 / 0.504 ms; a whole one-token pass of a 1.7B-shaped Q4_0 file ~0.92x the
time (docs/figures.md). The KV pools too: at long contexts every pass streams them.

`HugeArena.hold` copies a tensor into 64-byte aligned space of 2 MiB-aligned mappings of at
least CHUNK bytes (a larger tensor gets a mapping of its own), so that a model's many small
matrices share huge pages; pages are only backed once written, so a chunk's unused tail costs
no memory. `SPECSERVE_HUGEPAGES=0`, or a platform without MADV_HUGEPAGE, keeps torch's
allocator: `hold` returns the tensor as it is. Whether the kernel grants the pages (THP
"never", or no free 2 MiB page) changes speed only, never a value.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

HUGEPAGES_ENV = "SPECSERVE_HUGEPAGES"
HUGE_PAGE = 2 << 20
CHUNK = 32 << 20
ALIGN = 64


def enabled() -> bool:
    """Whether buffers go into huge-page mappings here (see the module note)."""
    return os.environ.get(HUGEPAGES_ENV, "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class _Mapping:
    """One anonymous mapping, its 2 MiB-aligned part advised for huge pages, handed out from
    `offset` on (byte offsets into the mapping)."""

    def __init__(self, size: int):
        self.map = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(self.map, dtype=torch.uint8, count=1).data_ptr()
        self.offset = _round_up(base, HUGE_PAGE) - base  # a multiple of the 4 KiB page: madvise's unit
        self.end = self.offset + size
        try:
            self.map.madvise(mmap.MADV_HUGEPAGE, self.offset, size)
        except OSError:  # a kernel without transparent huge pages: plain pages, still correct
            pass

    def take(self, nbytes: int) -> torch.Tensor | None:
        """nbytes of uint8 from the free space, or None where they do not fit."""
        if self.offset + nbytes > self.end:
            return None
        out = torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=self.offset)
        self.offset = _round_up(self.offset + nbytes, ALIGN)
        return out


class HugeArena:
    """Space for CPU tensors in huge pages (module note); each tensor handed out keeps its
    mapping alive."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._current: _Mapping | None = None
        self.bytes_held = 0

    def _take(self, nbytes: int) -> torch.Tensor | None:
        """nbytes of never-written (so zero) uint8 huge-page space; None where no mapping can
        be made (the callers then use torch's allocator)."""
        raw = self._current.take(nbytes) if self._current is not None else None
        if raw is None:
            try:
                mapping = _Mapping(max(self.chunk, _round_up(nbytes, HUGE_PAGE)))
            except (OSError, ValueError):
                return None
            raw = mapping.take(nbytes)
            if nbytes < self.chunk:  # a tensor with a mapping of its own leaves the current one open
                self._current = mapping
        self.bytes_held += nbytes
        return raw

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of CPU tensor `t` (same shape and dtype, contiguous) in huge-page space; `t`
        itself where huge pages are not used or `t` is not on the CPU."""
        if not enabled() or t.device.type != "cpu" or t.numel() == 0:
            return t
        raw = self._take(t.numel() * t.element_size())
        if raw is None:
            return t
        out = raw.view(t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zero-filled tensor of `shape`, on the CPU in huge-page space (torch.zeros elsewhere
        or where not used), written now as torch.zeros writes it: a page first touched inside a
        pass would cost that pass the clearing of 2 MiB (a KV pool backed only as its blocks are
        first written)."""
        numel = math.prod(shape)
        if not enabled() or torch.device(device).type != "cpu" or numel == 0:
            return torch.zeros(shape, dtype=dtype, device=device)
        raw = self._take(numel * dtype.itemsize)
        return torch.zeros(shape, dtype=dtype) if raw is None else raw.view(dtype).view(shape).zero_()


def describe() -> str:
    """Whether buffers ask for huge pages here, and the kernel's transparent huge page mode, for
    benchmark headers."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "huge pages: not on this platform"
    if not enabled():
        return f"huge pages: off ({HUGEPAGES_ENV}=0)"
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        mode = "unknown"
    return f"huge pages: asked for (the kernel's THP mode: {mode})"
