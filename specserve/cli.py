"""specserve command line: generate | bench | serve | serve-ray | bench-serve | tune | verify | train-draft | self-spec-search."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from specserve import engine_args
from specserve.errors import SpecserveError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="LLM inference with lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streaming it")
    g.add_argument("prompt", help="the prompt (with --chat: the user message)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--system", default=None, help="system message for --chat")
    g.add_argument("--file", default=None, metavar="FILE",
                   help="a text or code file appended to the prompt after a blank line: what the prompt asks about")
    g.add_argument("--no-color", action="store_true",
                   help="plain text; otherwise, on a terminal, tokens are coloured by how they came (accepted draft, "
                        "corrected, bonus); NO_COLOR in the environment does the same")
    engine_args.add_config_arg(g)
    engine_args.add_model_args(g)
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtracted from the logit of each token the output already has, in [-2, 2] (default 0)")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="times each token's count in the output, subtracted from its logit, in [-2, 2] (default 0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divides positive logits (multiplies negative ones) of tokens in the prompt or output, "
                        "in (0, 2] (default 1: off)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    engine_args.add_spec_args(g)
    engine_args.add_engine_args(g)
    g.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding of the same request (3 runs of each, alternated) and print the "
                        "speedup of the median decode speeds and whether all outputs match")

    from specserve.bench.cli import add_bench_parser
    add_bench_parser(sub)
    from specserve.server.launcher import add_serve_parser
    add_serve_parser(sub)
    from specserve.server.ray_launcher import add_serve_ray_parser
    add_serve_ray_parser(sub)
    from specserve.bench.serve_load import add_bench_serve_parser
    add_bench_serve_parser(sub)
    from specserve.train.cli import add_train_parser
    add_train_parser(sub)
    from specserve.bench.tune import add_tune_parser
    add_tune_parser(sub)
    from specserve.verify import add_verify_parser
    add_verify_parser(sub)

    s = sub.add_parser("self-spec-search", help="find the layers self_spec's draft skips; write them next to the model",
                       description="Runs the model greedily on calibration prompts, then removes decoder layers one "
                                   "at a time while the expected speedup of drafting with the rest grows (agreement "
                                   "with the full model, measured pass costs). A few minutes for a 135M model.")
    engine_args.add_model_args(s)
    s.add_argument("--output", default=None, metavar="FILE",
                   help="the layer set to write (default: <model>.self_spec.json next to the model file or folder, "
                        "where --speculative self_spec finds it)")
    s.add_argument("--prompts", default=None, metavar="FILE",
                   help="a JSON list of calibration prompts (default: specserve's own, not benchmark prompts)")
    s.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per calibration prompt (default 32)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _generate(args)
        if args.command == "bench":
            from specserve.bench.cli import run_bench
            return run_bench(args)
        if args.command == "bench-serve":
            from specserve.bench.serve_load import run_bench_serve
            return run_bench_serve(args)
        if args.command == "serve":
            from specserve.server.launcher import run_serve
            return run_serve(args)
        if args.command == "serve-ray":
            from specserve.server.ray_launcher import run_serve_ray
            return run_serve_ray(args)
        if args.command == "tune":
            from specserve.bench.tune import run_tune
            return run_tune(args)
        if args.command == "verify":
            from specserve.verify import run_verify
            return run_verify(args)
        if args.command == "self-spec-search":
            return _self_spec_search(args)
        if args.command == "train-draft":
            from specserve.train.cli import run_train
            return run_train(args, sys.argv[1:] if argv is None else argv)
    except SpecserveError as e:
        print(f"specserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nspecserve: interrupted", file=sys.stderr)
        return 130
    return 0


def _generate(args) -> int:
    from specserve.config import SpeculativeConfig
    from specserve.config_file import load_config_file
    from specserve.errors import PromptError
    from specserve.llm import LLM
    from specserve.model.loader import load_model
    from specserve.sampling_params import SamplingParams

    # Validate everything the user typed before spending seconds on loading the model.
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty)
    file = load_config_file(args.config)
    spec = engine_args.speculative_config(args, file)
    if args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise PromptError(f"--file {args.file}: no such file")
        try:
            args.prompt = f"{args.prompt}\n\n{path.read_text(encoding='utf-8').strip()}"
        except UnicodeDecodeError as e:
            raise PromptError(f"--file {args.file} is not UTF-8 text ({e.reason} at byte {e.start})") from e
    if not args.prompt.strip():
        raise PromptError("the prompt is empty; give some text")
    if (sc := SpeculativeConfig.from_dict(spec)) is not None and sc.lossy:
        print("note: --acceptance-method typical_acceptance_sampler is lossy: sampled output is not exactly the "
              "target model's distribution (greedy output is unchanged)", file=sys.stderr)

    load = engine_args.load_kwargs(args, file)
    print(f"Loading {load['model']} ...", file=sys.stderr)
    t = time.perf_counter()
    loaded = load_model(**load)
    engine = engine_args.engine_kwargs(args, file) | {"max_num_seqs": 1}  # one request
    llm = LLM(loaded=loaded, speculative_config=spec, **engine)
    print(f"Loaded {loaded.name} in {time.perf_counter() - t:.1f}s ({loaded.kernels})", file=sys.stderr)
    for note in (loaded.notice, llm.context_note):
        if note:
            print(note, file=sys.stderr)
    tok = llm.tokenizer
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [{"role": "user", "content": args.prompt}]
        ids = tok.encode_chat(messages)
    else:
        ids = tok.encode(args.prompt)

    paint = _use_color(args, sys.stdout)
    if paint and spec is not None:
        print("colours: " + " ".join(_paint(name, src) for src, name in _SOURCE_NAMES.items()), file=sys.stderr)
    final = None
    for out in llm.stream(ids, params, args.prompt):
        sys.stdout.write("".join(_paint(p.text, p.source) for p in out.new_pieces) if paint else out.new_text)
        sys.stdout.flush()
        final = out
    sys.stdout.write("\n")
    print(_figures_line(final), file=sys.stderr)
    if args.compare_plain and spec is not None:
        _compare_plain(LLM(loaded=loaded, **engine), llm, ids, params, args.prompt, final)
    return 0


COMPARE_ROUNDS = 3  # runs of each, alternated: plain, speculative, plain, ...


def _compare_plain(plain, llm, ids, params, prompt, first) -> None:
    """Plain decoding of the same request, alternated with more speculative runs so that a
    moment of load on a shared machine hits both sides; the speedup is the ratio of the
    median decode speeds (the streamed run is the speculative side's first)."""
    def run(engine):
        out = None
        for out in engine.stream(ids, params, prompt):
            pass
        return out

    spec_runs, base_runs = [first], []
    for i in range(COMPARE_ROUNDS):
        base_runs.append(run(plain))
        if i + 1 < COMPARE_ROUNDS:
            spec_runs.append(run(llm))
    spec_speed = statistics.median(o.metrics.decode_tokens_per_s for o in spec_runs)
    base_speed = statistics.median(o.metrics.decode_tokens_per_s for o in base_runs)
    same = all(o.outputs[0].token_ids == first.outputs[0].token_ids for o in base_runs + spec_runs)
    # Greedy runs must match, and so must seeded sampled ones (a seed fixes each position's
    # noise, whatever was drafted); unseeded sampled runs keep the distribution, not the draws.
    comparable = params.greedy or params.seed is not None
    verdict = ("yes" if same else "no") if comparable else "n/a when sampling without --seed (specserve verify tests the distribution)"
    print(f"plain decoding: {base_speed:.1f} tok/s, speculative {spec_speed:.1f} (medians of {COMPARE_ROUNDS} runs "
          f"each, alternated) | speculative speedup {spec_speed / max(base_speed, 1e-9):.2f}x | "
          f"outputs identical: {verdict}", file=sys.stderr)


def _self_spec_search(args) -> int:
    import json

    from specserve.errors import InvalidParameterError
    from specserve.model.loader import load_model
    from specserve.spec.layer_search import search_layers
    from specserve.spec.layer_set import layer_set_path, save_layer_set

    if args.max_new_tokens < 2:
        raise InvalidParameterError("max-new-tokens", args.max_new_tokens, "must be >= 2")
    prompts = None
    if args.prompts is not None:
        try:
            prompts = json.loads(open(args.prompts).read())
        except (OSError, ValueError) as e:
            raise InvalidParameterError("prompts", args.prompts, f"cannot be read as JSON: {e}") from None
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
            raise InvalidParameterError("prompts", args.prompts, "must hold a JSON list of non-empty prompt strings")
    loaded = load_model(**engine_args.load_kwargs(args, {}))
    output = args.output or str(layer_set_path(loaded.path))
    print(f"Searching the layers of {loaded.name} ({loaded.config.num_layers}, {loaded.kernels}) ...", file=sys.stderr)
    result, figures = search_layers(loaded, prompts, max_new=args.max_new_tokens,
                                    log=lambda line: print(line, file=sys.stderr))
    best = result.best
    save_layer_set(output, loaded, best.skip_layers, figures)
    print(f"skip layers {','.join(map(str, best.skip_layers))}: agreement {best.agreement:.3f}, draft step "
          f"{best.draft_cost:.2f}x a target step, k={best.k}: expected speedup {best.speedup:.2f}x "
          f"({figures['seconds']:.0f} s); wrote {output}")
    if best.speedup < 1:
        print("note: no layer set is expected to beat plain decoding on this model and machine: the draft agrees "
              "too rarely for what its steps cost", file=sys.stderr)
    return 0


# ANSI colours of token sources in a terminal (outputs.TOKEN_SOURCES); plain steps stay uncoloured.
_SOURCE_COLORS = {"draft": "32", "corrected": "33", "bonus": "36"}
_SOURCE_NAMES = {"draft": "accepted draft", "corrected": "corrected by the target", "bonus": "bonus token",
                 "plain": "plain step"}


def _use_color(args, stream) -> bool:
    """Colour only a terminal, and not when asked not to (--no-color, or NO_COLOR set, as
    no-color.org has it)."""
    return not args.no_color and not os.environ.get("NO_COLOR") and stream.isatty()


def _paint(text: str, source: str) -> str:
    color = _SOURCE_COLORS.get(source)
    return f"\x1b[{color}m{text}\x1b[0m" if color and text else text


def _figures_line(out) -> str:
    m, s = out.metrics, out.spec
    line = (f"[prompt tokens {m.num_prompt_tokens} | generated {m.num_generated_tokens} | "
            f"time to first token {1000 * (m.time_to_first_token or 0):.0f} ms | decode {m.decode_tokens_per_s:.1f} tok/s")
    if s.num_drafted:
        line += (f" | drafted {s.num_drafted}, accepted {s.num_accepted} ({100 * s.acceptance_rate:.1f}%) | "
                 f"mean accepted length {s.mean_accepted_length:.2f}")
    return line + f" | finish: {out.outputs[0].finish_reason}]"


if __name__ == "__main__":
    sys.exit(main())
