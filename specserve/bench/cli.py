"""`specserve bench`: plain decoding, each speculative method and the peers on the same prompts,
in one run, with one line of figures per configuration.

The models, the engine and the peers load only when a bench runs.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import fields, replace

from specserve import engine_args
from specserve.bench.plot import check_plot_path, draw, load_result, require_matplotlib
from specserve.bench.runner import Config
from specserve.config import PATH_METHODS
from specserve.errors import InvalidParameterError

METHODS = engine_args.SPECULATIVE_METHODS
WITH_PATH = PATH_METHODS  # methods named as METHOD:PATH
PEERS = ("transformers", "llama.cpp")
MAX_CONCURRENCY = 4096  # the engine's limit on max_num_seqs
MAX_REPEAT = 100


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="measure plain decoding, speculative methods and peers side by side",
                       description="Plain decoding always runs: it is the baseline of speedup and identity.")
    b.add_argument("--workload", default="spec_bench", help="'spec_bench' (480 prompts, 13 categories) or a JSONL file")
    b.add_argument("--field", default=None,
                   help="JSONL field holding the prompt (a string or a list of turns; default: turns, prompt or text, "
                        "the first a row holds)")
    b.add_argument("--limit", type=int, default=None, help="first N prompts (after the category filters)")
    b.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    b.add_argument("--categories", default=None, help="comma list of categories")
    b.add_argument("--methods", default="none,ngram",
                   help=f"comma list of {engine_args.methods_help()} (DIR: a train-draft folder); "
                        "a --config file's speculative_config runs as one more, named config")
    b.add_argument("--num-speculative-tokens", default="auto",
                   help="k or auto (the engine chooses k each step; the default), or a comma list to sweep (e.g. auto,2,4,8)")
    engine_args.add_tree_args(b)
    engine_args.add_lookup_args(b)
    engine_args.add_suffix_args(b)
    engine_args.add_self_spec_args(b)
    b.add_argument("--repeat", type=int, default=1,
                   help="ask the selected prompts this many times, pass after pass, in one engine per configuration "
                        "(what a method learns from earlier requests shows in the later passes; the report adds "
                        "figures by pass)")
    engine_args.add_lookahead_args(b)
    b.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--max-tokens", type=int, default=128)
    b.add_argument("--seed", type=int, default=0, help="base seed; prompt i samples with seed + i in every configuration")
    b.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) threads; default: torch's own")
    b.add_argument("--peers", default="", help=f"comma list of {', '.join(PEERS)} (latency mode only)")
    b.add_argument("--concurrency", default=None,
                   help="throughput mode: keep N requests in flight in one engine, or a comma list to sweep "
                        "(e.g. 1,4,16,64); without it, one request at a time (latency mode)")
    b.add_argument("--rounds", type=int, default=1,
                   help="throughput mode: measure every configuration at every concurrency this many times, the "
                        "order rotating each round, and report the medians with the range of the speedups (each "
                        "against plain in its own round): one run on a shared machine moves 10-20%%")
    b.add_argument("--json", default=None, help="write the figures to this JSON file")
    b.add_argument("--plot", default=None, metavar="FILE.png",
                   help="draw the figures into this PNG: speedup over plain by category (by concurrency with "
                        "--concurrency), acceptance by draft position, tok/s against concurrency; as measured "
                        "(pip install 'specserve[plot]')")
    b.add_argument("--plot-from", default=None, metavar="RESULTS.json",
                   help="with --plot: draw from a file --json wrote, without running anything")
    engine_args.add_config_arg(b)
    engine_args.add_model_args(b)
    engine_args.add_engine_args(b)


def parse_methods(text: str) -> list[tuple[str, str | None]]:
    """'none,ngram,draft_model:PATH,eagle:DIR' -> [(name, draft path or None)]."""
    allowed = f"each must be one of {engine_args.methods_help()}"
    out = []
    for item in filter(None, (m.strip() for m in text.split(","))):
        name, _, path = item.partition(":")
        if name not in METHODS:
            raise InvalidParameterError("methods", item, allowed)
        if name in WITH_PATH and not path:
            raise InvalidParameterError("methods", item, f"{name} needs a path: {name}:PATH")
        if name not in WITH_PATH and path:
            raise InvalidParameterError("methods", item, f"{name} takes no path")
        if (name, path or None) not in out:
            out.append((name, path or None))
    if not out:
        raise InvalidParameterError("methods", text, f"name at least one of {engine_args.methods_help()}")
    return out


def parse_ks(text: str) -> list[int | str]:
    try:
        ks = [engine_args.speculative_tokens(x) for x in text.split(",") if x.strip()]
    except InvalidParameterError:
        raise InvalidParameterError("num_speculative_tokens", text, "must be an integer or 'auto', or a comma list "
                                    "of them (e.g. auto,2,4,8)") from None
    if not ks:
        raise InvalidParameterError("num_speculative_tokens", text, "must name at least one k")
    return list(dict.fromkeys(ks))


def parse_peers(text: str) -> list[str]:
    peers = list(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    bad = [p for p in peers if p not in PEERS]
    if bad:
        raise InvalidParameterError("peers", ",".join(bad), f"each must be one of {', '.join(PEERS)}")
    return peers


def parse_concurrency(text: str | None) -> list[int] | None:
    """'1,4,16' -> [1, 4, 16]; None (no --concurrency) -> None, the latency mode."""
    if text is None:
        return None
    allowed = f"must be a positive integer or a comma list of them, each at most {MAX_CONCURRENCY} (e.g. 1,4,16,64)"
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise InvalidParameterError("concurrency", text, allowed) from None
    if not values or not all(1 <= v <= MAX_CONCURRENCY for v in values):
        raise InvalidParameterError("concurrency", text, allowed)
    return list(dict.fromkeys(values))


def speculative_configs(methods: list[tuple[str, str | None]], ks: list[int | str], flags: dict,
                        config: dict | None = None) -> list[tuple[Config, dict]]:
    """The speculative configurations (plain decoding is not one of them: it always runs): each
    method at each k, with the lookup and draft-tree settings given in `flags` where the method
    takes them; then a --config file's speculative_config as it is, named "config"."""
    from specserve.config import SpeculativeConfig
    from specserve.model.loader import resolve_model_path

    out = []
    for name, path in methods:
        if path is not None:
            resolve_model_path(path)  # a missing draft is reported before the target loads
        for k in ([] if name == "none" else ks):
            spec = engine_args.merge_speculative(flags | {"method": name, "model": path, "num_speculative_tokens": k}, None)
            out.append((Config(name, k, path), spec))
    if config is not None:
        spec = engine_args.merge_speculative({}, config)
        out.append((Config("config", spec["num_speculative_tokens"], spec.get("model")), spec))
    for _, spec in out:
        SpeculativeConfig.from_dict(spec)  # refuse bad settings before loading anything
    return out


def machine_info(device, kernels: str) -> dict:
    """The machine line of every report: CPU and the kernel path chosen on it (specserve.hardware)."""
    import torch

    from specserve.hardware import machine

    m = machine()
    info = {"cpu": m.cpu_name, "arch": m.arch, "cores": m.cores, "cpu_path": m.isa.label,
            "cpu_detected": m.detected.label, "kernels": kernels, "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "device": str(device)}
    if m.forced:
        info["forced_by"] = f"SPECSERVE_CPU_ISA={m.forced}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_bench(args) -> int:
    if args.plot is not None:  # before anything loads: a figure that cannot be drawn wastes the run
        check_plot_path(args.plot)
        require_matplotlib()
    if args.plot_from is not None:
        return redraw(args.plot_from, args.plot, args.json)

    import torch
    from tqdm import tqdm

    from specserve.bench.peers import PeerPlan, build_peers
    from specserve.bench.runner import SpecserveRunner, drafting_figures, measure, report
    from specserve.bench.throughput import run_throughput
    from specserve.bench.workload import Selection, load_workload, select
    from specserve.config_file import load_config_file
    from specserve.llm import LLM
    from specserve.model.loader import load_model
    from specserve.sampling_params import SamplingParams
    from specserve.spec.ngram import NgramOptions

    # Everything the user typed is checked before seconds go into loading models.
    methods, ks, peers = parse_methods(args.methods), parse_ks(args.num_speculative_tokens), parse_peers(args.peers)
    concurrency = parse_concurrency(args.concurrency)
    if isinstance(args.repeat, bool) or not 1 <= args.repeat <= MAX_REPEAT:
        raise InvalidParameterError("repeat", args.repeat, f"must be an integer in [1, {MAX_REPEAT}]")
    if not 1 <= args.rounds <= MAX_REPEAT:
        raise InvalidParameterError("rounds", args.rounds, f"must be an integer in [1, {MAX_REPEAT}]")
    if args.rounds > 1 and concurrency is None:
        raise InvalidParameterError("rounds", args.rounds, "applies with --concurrency (throughput mode); latency "
                                    "mode alternates configurations prompt by prompt already")
    file = load_config_file(args.config)
    flags = engine_args.given(args, engine_args.FLAG_KEYS)
    spec_configs = speculative_configs(methods, ks, flags, file.get("speculative_config"))
    if args.plot and not spec_configs and concurrency is None:
        raise InvalidParameterError("plot", args.plot, "draws speculative methods against plain decoding; name one "
                                    "in --methods, or sweep --concurrency")
    defaults = {f.name: f.default for f in fields(NgramOptions)}
    lookup = {k: flags.get(k, defaults[k]) for k in engine_args.LOOKUP_KEYS}
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    selection = Selection.from_text(args.categories, args.per_category, args.limit)
    prompts = select(load_workload(args.workload, args.field), selection)
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise InvalidParameterError("json", args.json, "its folder does not exist")
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidParameterError("threads", args.threads, "must be >= 1")
        torch.set_num_threads(args.threads)
    if concurrency is not None and peers:
        print(f"note: peers ({', '.join(peers)}) run in latency mode only; skipped with --concurrency", file=sys.stderr)
    elif peers and engine_args.AUTO in ks:
        print("note: peers draft a fixed k: their speculative lines run at the integer values of "
              "--num-speculative-tokens only", file=sys.stderr)

    loaded = load_model(**engine_args.load_kwargs(args, file))
    engine = engine_args.engine_kwargs(args, file) | {"max_num_seqs": 1}  # latency mode: one request at a time
    baseline = SpecserveRunner(Config("none"), LLM(loaded=loaded, **engine))
    max_len = baseline.llm.engine_config.max_model_len
    # Only prompts with room for max_tokens in the context, so that no configuration stops early
    # for lack of room where another would not.
    encoded = [(p.category, loaded.tokenizer.encode_chat([{"role": "user", "content": p.text}])) for p in prompts]
    fitting = [(c, ids) for c, ids in encoded if len(ids) + args.max_tokens <= max_len]
    if not fitting:
        raise InvalidParameterError("max_model_len", max_len, f"no selected prompt leaves room for {args.max_tokens} "
                                    "new tokens; raise --max-model-len or lower --max-tokens")
    machine = machine_info(loaded.model.device, loaded.kernels)
    categories = [c for c, _ in fitting]
    workload = {"name": args.workload, "num_prompts": len(fitting), "skipped_too_long": len(encoded) - len(fitting),
                "categories": {c: categories.count(c) for c in dict.fromkeys(categories)},
                "prompt_tokens": sum(len(ids) for _, ids in fitting)}
    settings = {"dtype": args.dtype, "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
                "seed": args.seed, "max_model_len": max_len, **lookup,
                **{k: v for k, v in flags.items() if k not in engine_args.LOOKUP_KEYS}}
    if "max_num_batched_tokens" in engine:
        settings["max_num_batched_tokens"] = engine["max_num_batched_tokens"]
    if args.config:
        settings["config"] = args.config
    if concurrency is not None:
        settings["concurrency"] = concurrency

    if args.repeat > 1:
        settings["repeat"] = args.repeat
    if args.rounds > 1:
        settings["rounds"] = args.rounds
    # Pass after pass; a prompt asked again samples with its own seed again.
    prompt_ids = [ids for _, ids in fitting] * args.repeat
    passes = [f"pass {i // len(fitting) + 1}" for i in range(len(prompt_ids))]
    categories = categories * args.repeat
    params_for = lambda i: replace(params, seed=args.seed + i % len(fitting))  # noqa: E731
    warmup = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=8, seed=args.seed)
    if concurrency is not None:
        del baseline  # only its max_model_len was needed: throughput mode builds an engine per run
        _print_header(loaded.name, machine, workload, settings)
        t0 = time.perf_counter()
        results = run_throughput(loaded, [Config("none")] + [c for c, _ in spec_configs], dict(spec_configs),
                                  prompt_ids, concurrency, params_for, warmup, args.temperature,
                                  min(max_len, max(map(len, prompt_ids)) + args.max_tokens),
                                  engine.get("max_num_batched_tokens"), args.rounds)
        _print_throughput_table(results, time.perf_counter() - t0)
    else:
        runners = [baseline] + [SpecserveRunner(c, LLM(loaded=loaded, speculative_config=s, **engine))
                                for c, s in spec_configs]
        plan = PeerPlan([k for k in ks if k != engine_args.AUTO], lookup["prompt_lookup_max"],
                        [p for n, p in methods if n == "draft_model"], max_len)
        runners += build_peers(peers, loaded, plan, log=lambda msg: print(msg, file=sys.stderr))
        _print_header(loaded.name, machine, workload, settings)
        t0 = time.perf_counter()
        with tqdm(total=len(prompt_ids) * len(runners), desc="bench", unit="run", file=sys.stderr) as bar:
            samples = measure(runners, prompt_ids, params_for, warmup, lambda: bar.update(1))
        results = [report(r.config, s, samples[0], categories, args.temperature,
                          passes if args.repeat > 1 else None) for r, s in zip(runners, samples)]
        for r, res in zip(runners, results):
            res.drafting = drafting_figures(r, results[0].overall)
        _print_table(results, time.perf_counter() - t0)
    doc = {"machine": machine, "model": loaded.name, "model_path": str(loaded.path), "settings": settings,
           "workload": workload, "results": [r.as_dict() for r in results]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        draw(doc, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def redraw(source: str, plot: str | None, json_path: str | None) -> int:
    """--plot-from: the figure of a saved run; nothing is measured, so nothing else is written."""
    if plot is None:
        raise InvalidParameterError("plot_from", source, "needs --plot FILE.png, the figure to draw")
    if json_path is not None:
        raise InvalidParameterError("json", json_path, "writes a run's figures; --plot-from runs nothing")
    draw(load_result(source), plot)
    print(f"wrote {plot}", file=sys.stderr)
    return 0


def _print_header(model: str, machine: dict, workload: dict, settings: dict) -> None:
    print("machine: " + ", ".join(f"{k} {v}" for k, v in machine.items()))
    cats = ", ".join(f"{c} {n}" for c, n in workload["categories"].items())
    skipped = f" ({workload['skipped_too_long']} too long for the context skipped)" if workload["skipped_too_long"] else ""
    print(f"workload: {workload['name']}, {workload['num_prompts']} prompts{skipped}: {cats}")
    print(f"model: {model} ({settings['dtype']}) | max_tokens {settings['max_tokens']} | "
          f"temperature {settings['temperature']} | top_p {settings['top_p']} | seed {settings['seed']}"
          + (f" | concurrency {','.join(map(str, settings['concurrency']))}" if "concurrency" in settings else "")
          + (f" | config {settings['config']}" if "config" in settings else "")
          + (f" | each prompt asked {settings['repeat']} times" if "repeat" in settings else ""))


def _fmt(x, spec: str = "{:.2f}", suffix: str = "") -> str:
    return "-" if x is None else spec.format(x) + suffix


def _print_table(reports, seconds: float) -> None:
    width = max(24, *(len(r.config.label) for r in reports)) + 1
    print(f"\n{'configuration':<{width}} {'tok/s':>8} {'decode':>8} {'prefill':>8} {'speedup':>8} {'accept':>7} {'tau':>6} "
          f"{'drafts':>6} {'identical':>9}")
    for r in reports:
        f = r.overall
        print(f"{r.config.label:<{width}} {f.tokens_per_s:>8.1f} {f.decode_tokens_per_s:>8.1f} {f.prefill_tokens_per_s:>8.1f} "
              f"{_fmt(f.speedup, suffix='x'):>8} {_fmt(f.acceptance_rate):>7} {_fmt(f.mean_accepted_length):>6} "
              f"{_fmt(f.drafts_per_pass):>6} {_fmt(f.identical_to_baseline):>9}")
    timed = [r for r in reports if r.drafting]
    if timed or any(r.overall.draft_ms_per_pass is not None for r in reports):
        plain = reports[0].overall.decode_tokens_per_s
        print(f"\nms per target pass (plain: {_fmt(1e3 / plain if plain else None)}):")
        print(f"{'configuration':<{width}} {'drafting':>9} {'target':>8} {'depth':>8} {'catch-up':>9} {'depth/pass':>10}")
        for r in reports[1:]:
            f, d = r.overall, r.drafting or {}
            print(f"{r.config.label:<{width}} {_fmt(f.draft_ms_per_pass, '{:.2f}'):>9} "
                  f"{_fmt(f.target_ms_per_pass, '{:.2f}'):>8} {_fmt(d.get('depth_ms'), '{:.3f}'):>8} "
                  f"{_fmt(d.get('catch_up_ms'), '{:.3f}'):>9} {_fmt(d.get('depth_over_plain_pass'), '{:.3f}'):>10}")
    for title, groups in (("category", lambda r: r.per_category), ("pass", lambda r: r.per_pass)):
        cats = list(groups(reports[0]))
        if len(cats) > 1 and len(reports) > 1:
            print(f"\nspeedup over plain by {title}:")
            print(f"{'configuration':<{width}} " + " ".join(f"{c[:11]:>11}" for c in cats))
            for r in reports[1:]:
                print(f"{r.config.label:<{width}} " + " ".join(f"{_fmt(groups(r)[c].speedup, suffix='x'):>11}" for c in cats))
    print(f"\n(tok/s: generated tokens over request time, prefill included; decode: after the first token; "
          f"prefill: prompt tokens over the time to the first token; "
          f"tau: tokens per target pass; drafts: drafts verified per target pass; drafting, target: ms per target "
          f"pass spent drafting and in the target's pass; depth, catch-up: ms per drafting depth and per catch-up "
          f"pass, where the method reports them; depth/pass: a depth over plain's one-token pass; "
          f"measured in {seconds:.0f}s)")


def _print_throughput_table(results, seconds: float) -> None:
    width = max(24, *(len(r.config.label) for r in results)) + 1
    ranged = any(r.rounds > 1 for r in results)
    print(f"\n{'configuration':<{width}} {'conc':>5} {'tok/s':>8} {'req/s':>7} {'speedup':>8}"
          f"{' ' + 'range'.rjust(9) if ranged else ''} {'ttft p50':>9} "
          f"{'ttft p99':>9} {'tpot p50':>9} {'tpot p99':>9} {'accept':>7} {'tau':>6} {'k':>5} {'drafts':>6} {'prefix':>7} "
          f"{'identical':>9}")
    for r in results:
        spread = (f" {_fmt(r.speedup_min)}-{_fmt(r.speedup_max)}" if r.speedup_min is not None else " -").rjust(10) \
            if ranged else ""
        print(f"{r.config.label:<{width}} {r.concurrency:>5} {r.tokens_per_s:>8.1f} {r.requests_per_s:>7.2f} "
              f"{_fmt(r.speedup, suffix='x'):>8}{spread} {_fmt(r.ttft_ms_p50, '{:.1f}'):>9} {_fmt(r.ttft_ms_p99, '{:.1f}'):>9} "
              f"{_fmt(r.tpot_ms_p50, '{:.1f}'):>9} {_fmt(r.tpot_ms_p99, '{:.1f}'):>9} {_fmt(r.acceptance_rate):>7} "
              f"{_fmt(r.mean_accepted_length):>6} {_fmt(r.mean_chosen_depth):>5} {_fmt(r.drafts_per_pass):>6} "
              f"{r.prefix_cache_hit_rate:>7.2f} {_fmt(r.identical_to_baseline):>9}")
    preempted = sum(r.num_preemptions for r in results)
    print(f"\n(conc: requests in flight; tok/s, req/s: all generated tokens and requests over wall time; speedup "
          f"and identical: against plain at the same concurrency; ttft, tpot: ms per request, time to first token "
          f"and per output token after it; tau: tokens per target pass; k: draft depth chosen per request and step "
          f"(adaptive); drafts: drafts verified per target pass; prefix: prefix-cache hit rate; "
          f"{preempted} preemptions; measured in {seconds:.0f}s"
          + (f"; medians of {results[0].rounds} rounds, range: the rounds' speedups)" if ranged else ")"))
