"""`specserve bench`: plain decoding, each speculative method and the peers on the same prompts,
in one run, with one line of figures per configuration."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

from specserve.errors import InvalidParameterError

METHODS = ("none", "ngram", "draft_model")


def add_bench_parser(sub) -> None:
    from specserve.cli import _add_model_args

    b = sub.add_parser("bench", help="measure plain decoding, speculative methods and peers side by side")
    b.add_argument("--workload", default="spec_bench", help="'spec_bench' (480 prompts, 13 categories) or a JSONL file")
    b.add_argument("--field", default="turns", help="JSONL field holding the prompt (a string or a list of turns)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts")
    b.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    b.add_argument("--categories", default=None, help="comma list of categories")
    b.add_argument("--methods", default="none,ngram", help="comma list: none, ngram, draft_model:PATH")
    b.add_argument("--num-speculative-tokens", default="4", help="k, or a comma list to sweep (e.g. 2,4,6)")
    b.add_argument("--prompt-lookup-max", type=int, default=4)
    b.add_argument("--prompt-lookup-min", type=int, default=1)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--seed", type=int, default=0, help="base seed; prompt i samples with seed + i")
    b.add_argument("--peers", default="", help="comma list: transformers, llama.cpp")
    b.add_argument("--json", default=None, help="write the figures to this JSON file")
    _add_model_args(b)


def _parse_methods(text: str) -> list[tuple[str, str | None]]:
    out = []
    for item in filter(None, (m.strip() for m in text.split(","))):
        name, _, path = item.partition(":")
        if name not in METHODS:
            raise InvalidParameterError("methods", item, f"each must be one of none, ngram, draft_model:PATH")
        if name == "draft_model" and not path:
            raise InvalidParameterError("methods", item, "draft_model needs a path: draft_model:PATH")
        out.append((name, path or None))
    return out


def _parse_ks(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidParameterError("num_speculative_tokens", text, "must be an integer or a comma list of integers") from None
    if not ks:
        raise InvalidParameterError("num_speculative_tokens", text, "must name at least one k")
    return ks


def machine_info(device: torch.device) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "device": str(device)}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_bench(args) -> int:
    from specserve.bench.measure import Result, SpecserveRunner
    from specserve.bench.peer_runs import PEERS, build_peers
    from specserve.bench.prompts import load_workload, select
    from specserve.config import SpeculativeConfig
    from specserve.model.loader import load_model
    from specserve.sampling_params import SamplingParams

    methods, ks = _parse_methods(args.methods), _parse_ks(args.num_speculative_tokens)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise InvalidParameterError("peers", ",".join(bad), f"each must be one of {', '.join(PEERS)}")
    base_params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    spec_configs = []
    for name, path in methods:
        for k in ([None] if name == "none" else ks):
            cfg = None
            if name == "ngram":
                cfg = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.prompt_lookup_max,
                       "prompt_lookup_min": args.prompt_lookup_min}
            elif name == "draft_model":
                cfg = {"method": "draft_model", "model": path, "num_speculative_tokens": k}
            SpeculativeConfig.from_dict(cfg)  # refuse bad settings before loading anything
            spec_configs.append((name, k, cfg))
    categories = [c.strip() for c in args.categories.split(",")] if args.categories else None
    prompts = select(load_workload(args.workload, args.field), categories, args.per_category, args.limit)

    loaded = load_model(args.model, dtype=args.dtype, device=args.device)
    runners = [SpecserveRunner(loaded, "none", None, None, args.max_model_len)]  # the baseline comes first
    runners += [SpecserveRunner(loaded, n, k, c, args.max_model_len) for n, k, c in spec_configs if n != "none"]
    max_len = runners[0].llm.engine_config.max_model_len
    runners += build_peers(peers, loaded, ks, args.prompt_lookup_max, [p for n, p in methods if n == "draft_model"],
                           max_len, log=print)
    tok = loaded.tokenizer
    encoded = [(p.category, tok.encode_chat([{"role": "user", "content": p.text}])) for p in prompts]
    too_long = sum(len(ids) >= max_len for _, ids in encoded)
    encoded = [(c, ids) for c, ids in encoded if len(ids) < max_len]
    if not encoded:
        raise InvalidParameterError("max_model_len", max_len, "every selected prompt is longer than the context")

    device = loaded.model.device
    print(f"model {loaded.name} ({args.dtype}, {device}) | workload {args.workload}: {len(encoded)} prompts"
          + (f" ({too_long} longer than the context skipped)" if too_long else "")
          + f" | max_tokens {args.max_tokens} | temperature {args.temperature}", file=sys.stderr)
    machine = machine_info(device)
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()), file=sys.stderr)

    warm = SamplingParams(temperature=args.temperature, max_tokens=8, seed=args.seed)
    for r in runners:
        r.run(encoded[0][0], encoded[0][1], warm)
    results = [Result(r) for r in runners]
    # Interleaved: each prompt runs through every configuration before the next prompt, so
    # drift in the machine's speed (other tenants, thermal) hits all configurations alike.
    t0 = time.perf_counter()
    with tqdm(total=len(encoded) * len(runners), desc="bench", unit="run") as bar:
        for i, (cat, ids) in enumerate(encoded):
            params = base_params if base_params.seed is None else _with_seed(base_params, args.seed + i)
            for res in results:
                res.samples.append(res.runner.run(cat, ids, params))
                bar.update(1)
    reports = [res.report(results[0], args.temperature) for res in results]
    _print_table(reports, time.perf_counter() - t0)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "model": loaded.name, "dtype": args.dtype, "workload": args.workload,
                       "num_prompts": len(encoded), "max_tokens": args.max_tokens, "results": reports}, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _with_seed(params, seed: int):
    from specserve.sampling_params import SamplingParams

    return SamplingParams(**{**{f: getattr(params, f) for f in params.__slots__}, "seed": seed})


def _fmt(x, spec="{:.2f}", suffix=""):
    return "-" if x is None else spec.format(x) + suffix


def _print_table(reports: list[dict], seconds: float) -> None:
    print(f"{'configuration':<32} {'tok/s':>8} {'decode':>8} {'speedup':>8} {'accept':>7} {'tau':>6} {'identical':>9}")
    for r in reports:
        print(f"{r['label']:<32} {r['tokens_per_s']:>8.1f} {r['decode_tokens_per_s']:>8.1f} {_fmt(r['speedup'], suffix='x'):>8} "
              f"{_fmt(r['acceptance_rate']):>7} {_fmt(r['mean_accepted_length']):>6} {_fmt(r['identical_to_baseline']):>9}")
    cats = list(reports[0]["per_category"])
    if len(cats) > 1:
        print("\nspeedup over plain by category:")
        print(f"{'configuration':<32} " + " ".join(f"{c[:10]:>10}" for c in cats))
        for r in reports[1:]:
            print(f"{r['label']:<32} " + " ".join(f"{_fmt(r['per_category'][c]['speedup'], suffix='x'):>10}" for c in cats))
    print(f"(measured in {seconds:.0f}s)")
