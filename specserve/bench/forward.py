"""Micro-benchmark of one target forward pass: ms per step for T query tokens at a given context.

T = 1 is plain decoding; T = k + 1 is the verification of k draft tokens, whose cost relative to
T = 1 decides whether speculation pays. Each step computes T tokens at positions
[context, context + T) after a prefill of `context` tokens, with logits at every position, as the
engine's verification step does (--prompt: at the last position only, as a prompt chunk has
them; `--prompt --sizes 512` times a prompt chunk after each context; --tree: the T tokens as a
draft tree's root and T - 1 nodes, two children a node, as tree drafters verify them). Sizes are measured
interleaved, round after round, and the median is reported, because the machines this runs on are shared and noisy.

    python -m specserve.bench.forward [--model default] [--contexts 100 1000]
        [--paths gguf int8 float32 bfloat16] [--levels avx512_vnni avx2 generic]

A path is a --quantization (gguf, int8, int4, q8_0, q4_0, q4_1: specserve's native kernels on the
file's blocks or re-quantized at load, so an F16 file of `bench.synthetic` can be measured
without llama.cpp's quantizer) or a torch dtype (float32, bfloat16); native paths run at each
CPU level asked for (capped at the machine's).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from specserve.bench.llama_bench import find_llama_bench, llama_bench_ms, read_bandwidth_gbs, weight_bytes
from specserve.drafts.tree import DraftTree
from specserve.model import hugepages
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.hardware import Isa, machine, native_level
from specserve.model.loader import load_model
from specserve.model.native_llama import QUANT_FORMATS


def binary_tree_mask(tokens: int) -> torch.Tensor | None:
    """The attention mask of a root and tokens - 1 nodes, two children a node, breadth first
    (None for one token: no tree)."""
    if tokens < 2:
        return None
    nodes = tokens - 1
    return DraftTree([0] * nodes, [-1 if i < 2 else (i - 2) // 2 for i in range(nodes)]).attention_mask()


def step_times(runner: ModelRunner, context: int, sizes: list[int], rounds: int, vocab: int,
               all_logits: bool = True, tree: bool = False) -> dict[int, list[float]]:
    """Prefill `context` tokens, then time steps of each size in `sizes`, interleaved (as chains,
    or with `tree` as binary draft trees); -> ms per step."""
    ids = torch.randint(0, vocab, (context + max(sizes),), generator=torch.Generator().manual_seed(0)).tolist()
    runner.execute(ForwardBatch(locations=[0], start_positions=[0], token_ids=[ids[:context]], all_logits=False))
    times: dict[int, list[float]] = {t: [] for t in sizes}
    for r in range(rounds + 1):
        for t in sizes:
            batch = ForwardBatch(locations=[0], start_positions=[context], token_ids=[ids[context:context + t]],
                                 all_logits=all_logits, tree_masks=[binary_tree_mask(t)] if tree else None)
            start = time.perf_counter()
            runner.execute(batch)
            runner.synchronize()
            if r:  # round 0 warms up every size
                times[t].append((time.perf_counter() - start) * 1e3)
    return times


def _load(model: str, path: str, device: str, max_len: int):
    """The model on `path`, its position tables covering the longest context measured."""
    if path == "gguf" or path in QUANT_FORMATS:  # the native kernels: the file's blocks, or re-quantized at load
        return load_model(model, device=device, quantization=path, max_model_len=max_len)
    return load_model(model, dtype=path, device=device, quantization="none", max_model_len=max_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--contexts", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 5, 9, 17])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--paths", nargs="+", default=["gguf", "int8", "float32", "bfloat16"])
    ap.add_argument("--prompt", action="store_true", help="logits at each step's last position only (a prompt chunk)")
    ap.add_argument("--tree", action="store_true",
                    help="each step's T tokens as a draft tree (a root and T - 1 nodes, two children a node), not a chain")
    ap.add_argument("--levels", nargs="+", default=None,
                    help="CPU levels for the native paths (default: this machine's)")
    ap.add_argument("--peer", choices=["llama.cpp"], default=None,
                    help="also time llama.cpp's llama-bench on the same GGUF, in alternated pairs with the first path")
    ap.add_argument("--llama-bench", default=None, help="the llama-bench executable (default: the one on the PATH)")
    ap.add_argument("--pairs", type=int, default=5, help="--peer: alternated pairs per size (medians reported)")
    args = ap.parse_args()
    m = machine()
    levels = [Isa.parse(v) for v in args.levels] if args.levels else [m.isa]
    exe = None
    if args.peer:
        exe = find_llama_bench(args.llama_bench)
        if exe is None or not str(args.model).endswith(".gguf"):
            ap.error("--peer llama.cpp needs llama-bench (on the PATH or --llama-bench) and a .gguf --model")
    bandwidth = read_bandwidth_gbs()
    print(f"# measured read bandwidth {bandwidth:.1f} GB/s ({torch.get_num_threads()} threads, a 1 GiB sum)")
    print(f"# {m.describe()}, {hugepages.describe()}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"device {args.device}, "
          f"model {args.model}, median of {args.rounds} rounds; T tokens per pass with logits at "
          f"{'the last' if args.prompt else 'each'}{', as binary draft trees' if args.tree else ''}")
    head = f"{'path':<34}{'context':>8}" + "".join(f"{f'T={t} ms':>10}" for t in args.sizes)
    print(head + "".join(f"{f'T={t}/T=1':>9}" for t in args.sizes[1:]))
    for path in args.paths:
        loaded = _load(args.model, path, args.device, max(args.contexts) + max(args.sizes))
        native = getattr(loaded.model, "native", False)
        for level in (levels if native else [None]):
            if native:
                loaded.model.level = int(min(level, native_level()))
                label = f"{path} {loaded.model.description} {Isa(loaded.model.level).label}"
            else:
                label = loaded.kernels.split(",")[0]
            for context in args.contexts:
                runner = ModelRunner.dense(loaded.model, num_slots=1, max_len=context + max(args.sizes))
                times = step_times(runner, context, args.sizes, args.rounds, loaded.config.vocab_size, not args.prompt,
                                   args.tree)
                med = {t: statistics.median(v) for t, v in times.items()}
                one = med[args.sizes[0]]
                gbs = weight_bytes(loaded.model) / (one / 1e3) / 1e9
                print(f"{label:<34}{context:>8}" + "".join(f"{med[t]:>10.2f}" for t in args.sizes)
                      + "".join(f"{med[t] / one:>9.2f}" for t in args.sizes[1:])
                      + f"   T={args.sizes[0]}: {gbs:.1f} GB/s of weights, {gbs / bandwidth:.2f} of measured", flush=True)
                if exe is not None and path == args.paths[0] and (not native or level == levels[0]):
                    peer_pairs(runner, exe, Path(args.model), context, args.sizes, args.pairs, loaded.config.vocab_size)
        del loaded


def peer_pairs(runner: ModelRunner, exe: str, model: Path, context: int, sizes: list[int], pairs: int,
               vocab: int) -> None:
    """Each size timed `pairs` times as (specserve median of 5 passes, llama-bench) in turn;
    prints the medians and their ratio."""
    print(f"  vs llama.cpp ({exe}), {pairs} alternated pairs, ms per pass at context {context}:")
    for t in sizes:
        ours, theirs = [], []
        for _ in range(pairs):
            ours.append(statistics.median(step_times(runner, context, [t], 5, vocab)[t]))
            theirs.append(llama_bench_ms(exe, model, context, t, torch.get_num_threads()))
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"    T={t:<3} specserve {a:8.2f}  llama.cpp {b:8.2f}  specserve/llama.cpp {a / b:5.2f}x "
              f"(pairs: {', '.join(f'{x / y:.2f}' for x, y in zip(ours, theirs))})", flush=True)


if __name__ == "__main__":
    main()
