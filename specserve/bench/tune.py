"""`specserve tune`: which drafting method and which knobs pay for a workload on this machine
at a given concurrency, measured side by side in one run, and a config file that `generate`,
`serve`, `bench` and `LLM(config=...)` take.

Every candidate runs the same sample of the user's prompts through its own engine with N
requests in flight (bench's throughput mode); the winner is the fastest whose greedy outputs
equal plain decoding's on every prompt (a candidate that differs would be a bug, and is shown).
Plain decoding is a candidate: where nothing pays, the config says so.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace

from specserve import engine_args
from specserve.bench.runner import Config
from specserve.errors import InvalidParameterError

DEFAULT_METHODS = "none,ngram,suffix,eagle:default"
SAMPLE = 16


def add_tune_parser(sub) -> None:
    t = sub.add_parser("tune", help="measure drafting methods and knobs on your prompts; write the best as a config",
                       description="Runs a sample of the workload through each candidate at the given concurrency, "
                                   "prints the table and writes the fastest lossless one as a --config file.")
    t.add_argument("--workload", default="spec_bench", help="a JSONL file of prompts, or 'spec_bench'")
    t.add_argument("--field", default=None,
                   help="JSONL field holding the prompt (a string or a list of turns; default: turns, prompt or text, "
                        "the first a row holds)")
    t.add_argument("--num-prompts", type=int, default=SAMPLE, help="prompts sampled evenly from the workload")
    t.add_argument("--concurrency", type=int, default=1, help="requests in flight, as the server will run them")
    t.add_argument("--max-tokens", type=int, default=64)
    t.add_argument("--methods", default=DEFAULT_METHODS,
                   help=f"comma list of {engine_args.methods_help()} ('default' for the "
                        "embedded EAGLE drafter); each is tried with 'auto' and fixed k, and its tree knobs")
    t.add_argument("--output", default="specserve-tuned.json", help="the config file to write")
    engine_args.add_model_args(t)


def candidates(methods: list[tuple[str, str | None]]) -> list[tuple[Config, dict | None]]:
    """Plain decoding, then each method with adaptive k, a sweep of fixed k and its tree knobs."""
    from specserve.config import SpeculativeConfig

    out: list[tuple[Config, dict | None]] = [(Config("none"), None)]
    for name, path in methods:
        specs: list[tuple[Config, dict]] = []
        if name == "ngram":
            for k in ("auto", 2, 4, 8):
                specs.append((Config("ngram", k), {"method": "ngram", "num_speculative_tokens": k}))
            specs.append((Config("ngram", 4, variant="branches=3"),
                          {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 3}))
        elif name == "suffix":  # long remembered continuations: deeper fixed k than n-gram's
            for k in ("auto", 4, 8, 16):
                specs.append((Config("suffix", k), {"method": "suffix", "num_speculative_tokens": k}))
        elif name == "draft_model":
            for k in ("auto", 2, 4):
                specs.append((Config(name, k, path), {"method": name, "model": path, "num_speculative_tokens": k}))
        elif name in ("eagle", "eagle3"):
            for k, nodes in (("auto", None), (3, 6), (4, 8), (5, 16)):
                spec = {"method": name, "model": path, "num_speculative_tokens": k}
                if nodes:
                    spec["num_draft_nodes"] = nodes
                specs.append((Config(name, k, path, f"nodes={nodes}" if nodes else ""), spec))
        elif name == "lookahead":
            # Adaptive at the defaults; each fixed setting drafts its whole tree (depth W + N - 2).
            for k, (w, n, g) in (("auto", (None, None, None)), (2, (1, 3, 2)), (3, (2, 3, 2)), (3, (1, 4, 3))):
                spec = {"method": name, "num_speculative_tokens": k}
                if w is not None:
                    spec |= {"lookahead_window": w, "lookahead_ngram": n, "lookahead_candidates": g}
                specs.append((Config(name, k, variant=f"W={w},N={n},G={g}" if w is not None else ""), spec))
        else:  # adaptive and a short sweep of k; a path only for the methods that take one
            for k in ("auto", 2, 4):
                spec = {"method": name, "num_speculative_tokens": k} | ({"model": path} if path else {})
                specs.append((Config(name, k, path), spec))
        for _, spec in specs:
            SpeculativeConfig.from_dict(spec)  # refuse bad settings before loading anything
        out += specs
    return out


def spread(items: list, n: int) -> list:
    """n items taken evenly across the list (all of them when it has no more)."""
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def best(results) -> object:
    """The fastest candidate whose outputs all equal plain decoding's (plain itself qualifies)."""
    ok = [r for r in results if r.identical_to_baseline in (None, 1.0)]
    return max(ok, key=lambda r: r.tokens_per_s)


def run_tune(args) -> int:
    from specserve.bench.cli import machine_info, parse_methods
    from specserve.bench.throughput import run_throughput
    from specserve.bench.workload import Selection, load_workload, select
    from specserve.llm import DEFAULT_MAX_MODEL_LEN
    from specserve.model.loader import load_model
    from specserve.sampling_params import SamplingParams

    if not 1 <= args.concurrency <= 4096:
        raise InvalidParameterError("concurrency", args.concurrency, "must be in [1, 4096]")
    if args.num_prompts < 1:
        raise InvalidParameterError("num-prompts", args.num_prompts, "must be >= 1")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise InvalidParameterError("output", args.output, "its folder does not exist")
    methods = parse_methods(args.methods)
    configs = candidates([m for m in methods if m[0] != "none"])
    prompts = spread(select(load_workload(args.workload, args.field), Selection()), args.num_prompts)

    load = engine_args.load_kwargs(args, {})
    loaded = load_model(**load)
    limit = min(args.max_model_len or DEFAULT_MAX_MODEL_LEN, loaded.config.max_position_embeddings)
    ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": p.text}]) for p in prompts]
    ids = [x for x in ids if len(x) + args.max_tokens <= limit]
    if not ids:
        raise InvalidParameterError("max-tokens", args.max_tokens, "no sampled prompt leaves room for it in the context")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    warmup = replace(params, max_tokens=8)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine_info(loaded.model.device, loaded.kernels).items()))
    print(f"workload: {args.workload}, {len(ids)} prompts | model: {loaded.name} | concurrency {args.concurrency} | "
          f"max_tokens {args.max_tokens} | {len(configs)} candidates")
    t0 = time.perf_counter()
    results = run_throughput(loaded, [c for c, _ in configs], {c: s for c, s in configs if s is not None}, ids,
                             [args.concurrency], lambda i: params, warmup, 0.0,
                             min(limit, max(map(len, ids)) + args.max_tokens))
    winner = best(results)
    width = max(len(r.config.label) for r in results) + 2
    print(f"\n{'candidate':<{width}} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'k':>5} {'identical':>9}")
    for r in sorted(results, key=lambda r: -r.tokens_per_s):
        mark = "  <- best" if r is winner else ""
        fmt = lambda x, spec="{:.2f}": "-" if x is None else spec.format(x)  # noqa: E731
        print(f"{r.config.label:<{width}} {r.tokens_per_s:>8.1f} {fmt(r.speedup) + 'x':>8} "
              f"{fmt(r.mean_accepted_length):>6} {fmt(r.mean_chosen_depth):>5} {fmt(r.identical_to_baseline):>9}{mark}")
    spec = dict(configs)[winner.config]
    doc = {"model": load["model"], "speculative_config": spec, "max_num_seqs": args.concurrency,
           "tuned": {"workload": args.workload, "num_prompts": len(ids), "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "seconds": round(time.perf_counter() - t0, 1),
                     "results": [r.as_dict() for r in results]}}
    with open(args.output, "w") as f:
        json.dump(doc, f, indent=2)
    print(f"\nbest: {winner.config.label} at {winner.tokens_per_s:.1f} tok/s "
          f"({winner.speedup:.2f}x plain); wrote {args.output} (use it with --config {args.output})", file=sys.stderr)
    return 0
