"""Micro-benchmark of one layer's paged attention: the native kernel at each CPU level against the
torch path (PagedKVCache.attend), ms per call.

Cases are decoding (1 query token) and verification (T query tokens of one sequence) at a given
context, for one layer of the embedded model's shapes (9 query heads, 3 kv heads, head_dim 64,
block size 16). The torch path is timed on a block table of consecutive blocks (reads are views
of the pool) and on a scattered one (reads gather); it also writes the step's T keys and values,
which the native kernel leaves to its caller (a few microseconds). Cases and paths are measured
interleaved, round after round, and the median is reported, because the machines are shared.

    python -m specserve.bench.attention [--threads 1] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from specserve import hardware, native
from specserve.model.paged_attention import PagedKVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = [("decode", 100, 1), ("decode", 1000, 1), ("verify", 1000, 5), ("verify", 1000, 9), ("verify", 1000, 17)]
LEVEL_NAMES = {0: "generic", 1: "avx2", 2: "avx512"}


def per_call_ms(fn: Callable[[], object], budget_s: float = 0.02) -> float:
    """Mean ms of fn over as many calls as fill `budget_s` (at least 3)."""
    fn()
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < budget_s:
        fn()
        calls += 1
    return (time.perf_counter() - start) * 1e3 / calls


def case_calls(ext, context: int, t: int, levels: list[int]) -> dict[str, Callable[[], object]]:
    """The paths to time for t query tokens at positions [context, context + t)."""
    g = torch.Generator().manual_seed(context + t)
    blocks = -(-(context + t) // BLOCK)
    cache = PagedKVCache(1, 2 * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    q = torch.randn(1, t, HEADS, HEAD_DIM, generator=g)
    k, v = torch.randn(1, t, KV_HEADS, HEAD_DIM, generator=g), torch.randn(1, t, KV_HEADS, HEAD_DIM, generator=g)
    consecutive = list(range(1, blocks + 1))
    scattered = torch.randperm(2 * blocks, generator=g)[:blocks].tolist()
    meta_views = cache.metadata([consecutive], [context], [t])
    meta_gather = cache.metadata([scattered], [context], [t])
    calls: dict[str, Callable[[], object]] = {
        "torch views": lambda: cache.attend(0, q, k, v, meta_views),
        "torch gather": lambda: cache.attend(0, q, k, v, meta_gather),
    }
    # The native kernels read float16 pools (the native model's kv_dtype): the same keys and
    # values rounded to half, half the bytes the torch paths' float32 pools take.
    args = dict(q=q[0], k_pool=cache.k[0].half(), v_pool=cache.v[0].half(), q_start=torch.tensor([0, t]),
                block_table=torch.tensor([scattered]), prefix_len=torch.arange(context + 1, context + t + 1))
    for level in levels:
        calls[LEVEL_NAMES[level]] = lambda level=level: ext.paged_attention(level, **args)
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    ext = native.load()
    if ext is None:
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    levels = [lv for lv in LEVEL_NAMES if lv <= hardware.machine().isa]
    cases = {(name, context, t): case_calls(ext, context, t, levels) for name, context, t in CASES}
    times: dict[tuple, dict[str, list[float]]] = {c: {p: [] for p in calls} for c, calls in cases.items()}
    for _ in range(args.rounds):
        for case, calls in cases.items():
            for path, fn in calls.items():
                times[case][path].append(per_call_ms(fn))
    paths = list(next(iter(cases.values())))
    print(f"# {hardware.machine().describe()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"H={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} block {BLOCK}, ms per call, median of {args.rounds} rounds")
    print(f"{'case':<22}" + "".join(f"{p:>14}" for p in paths))
    for (name, context, t), by_path in times.items():
        print(f"{f'{name} T={t} ctx={context}':<22}" + "".join(f"{statistics.median(by_path[p]):>14.3f}" for p in paths))


if __name__ == "__main__":
    main()
