"""Micro-benchmark of one target forward pass: ms per step for T query tokens at a given context.

T = 1 is plain decoding; T = k + 1 is the verification of k draft tokens, whose cost relative to
T = 1 decides whether speculation pays. Each step computes T tokens at positions
[context, context + T) after a prefill of `context` tokens, with logits at every position, as the
engine's verification step does. Sizes are measured interleaved, round after round, and the
median is reported, because the machines this runs on are shared and noisy.

    python -m specserve.bench.forward [--model default] [--context 300] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specserve.engine.runner import ForwardBatch, ModelRunner
from specserve.hardware import machine
from specserve.model.loader import load_model


def step_times(runner: ModelRunner, context: int, sizes: list[int], rounds: int, vocab: int) -> dict[int, list[float]]:
    """Prefill `context` tokens, then time steps of each size in `sizes`, interleaved; -> ms per step."""
    ids = torch.randint(0, vocab, (context + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    runner.execute(ForwardBatch(locations=[0], start_positions=[0], token_ids=[ids[:context]], all_logits=False))
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for r in range(rounds + 1):
        for t in sizes:
            batch = ForwardBatch(locations=[0], start_positions=[context], token_ids=[ids[context:context + t]],
                                 all_logits=True)
            start = time.perf_counter()
            runner.execute(batch)
            runner.synchronize()
            if r:  # round 0 warms up every size
                times[t].append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 5, 8])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    print(f"# {machine().describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {args.device}, model {args.model}, context {args.context}, median of {args.rounds} rounds")
    print(f"{'dtype':<10}" + "".join(f"{f'T={t} ms':>10}" for t in args.sizes) + f"{'T=max/T=1':>11}")
    for dtype in args.dtypes:
        loaded = load_model(args.model, dtype=dtype, device=args.device)
        runner = ModelRunner.dense(loaded.model, num_slots=1, max_len=args.context + max(args.sizes))
        times = step_times(runner, args.context, args.sizes, args.rounds, loaded.config.vocab_size)
        med = {t: statistics.median(v) for t, v in times.items()}
        print(f"{dtype:<10}" + "".join(f"{med[t]:>10.1f}" for t in args.sizes)
              + f"{med[max(args.sizes)] / med[min(args.sizes)]:>11.2f}")
        del loaded, runner


if __name__ == "__main__":
    main()
