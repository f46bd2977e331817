"""`specserve verify`: check speculation's guarantee on your model and prompts.

Two checks, one verdict:
- greedy identity: each prompt decoded greedily with and without speculation must give the same
  tokens, every one;
- the sampled distribution (unless --temperature 0): per prompt, `--samples` seeded requests
  with speculation and as many without sample the first `--sample-tokens` tokens; the two
  empirical laws of that token tuple are compared by Pearson's chi-square test of homogeneity
  (tuples expected fewer than 5 times in either run are pooled into one cell) and their total
  variation distance is reported. Speculation that keeps the target's distribution leaves the
  p-values uniform; a broken acceptance rule drives them to 0. A prompt fails when its p-value
  is under `--alpha` divided by the number of prompts (Bonferroni: one verdict for all).

With --json-schema FILE or --regex, both checks run under that structured output (every
request's logits masked by the grammar, drafts cut where it rejects them).

The first token of a request comes from its prompt's pass, before any draft, so the tuple spans
at least 3 tokens by default: the later ones are drafted and verified.

Memory stays flat in --samples: the samples run in rounds of SAMPLE_ROUND requests, only their
tuple counts kept, and each engine's KV pool is sized for what verify asks of it (a context of
the longest prompt plus the tokens generated, SAMPLE_BATCH requests at a time, at most
KV_POOL_BYTES) instead of the serving default (max_num_seqs requests at a full context, up to
half the machine's memory: two such pools once took 18 GB).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve import engine_args
from specserve.errors import InvalidParameterError
from specserve.outputs import SpecStats

BUILT_IN_PROMPTS = (
    "Repeat this list twice: red, green, blue, yellow.",
    "Write a short poem about the sea.",
    "Explain what a linked list is in two sentences.",
    "def fibonacci(n):",
)
VERIFY_K = 4  # drafts per step when --num-speculative-tokens is not given
MIN_EXPECTED = 5.0  # Pearson's rule of thumb: cells expected fewer times are pooled
SAMPLE_BATCH = 64  # sampled requests an engine runs at once (they share the prompt's cached blocks)
SAMPLE_ROUND = 8 * SAMPLE_BATCH  # requests submitted per generate call; only their counts are kept
KV_POOL_BYTES = 256 << 20  # each engine's KV pool at most (fewer requests run at once if it is short)
BLOCK_SIZE = 16


def add_verify_parser(sub) -> None:
    v = sub.add_parser("verify", help="check that speculation keeps the target's output: greedy identity and "
                                      "the sampled distribution (chi-square); PASS or FAIL",
                       description="Greedy output with and without speculation must be identical; sampled output "
                                   "must have the same distribution (a chi-square test per prompt). Exits 1 on FAIL.")
    engine_args.add_model_args(v)
    engine_args.add_spec_args(v)
    v.add_argument("--prompts", default=None, metavar="FILE",
                   help="prompts: a JSONL file (its 'turns' or --field) or a text file, one prompt per line "
                        f"(default: {len(BUILT_IN_PROMPTS)} built-in prompts)")
    v.add_argument("--field", default=None,
                   help="JSONL field holding the prompt (a string or a list of turns; default: turns, prompt or text, "
                        "the first a row holds)")
    v.add_argument("--max-tokens", type=int, default=64, help="greedy tokens compared per prompt (default 64)")
    v.add_argument("--temperature", type=float, default=1.0,
                   help="the sampled check's temperature (default 1.0; 0: the greedy check only)")
    v.add_argument("--top-p", type=float, default=1.0)
    v.add_argument("--top-k", type=int, default=0)
    v.add_argument("--presence-penalty", type=float, default=0.0, help="both checks' presence penalty (default 0)")
    v.add_argument("--frequency-penalty", type=float, default=0.0, help="both checks' frequency penalty (default 0)")
    v.add_argument("--repetition-penalty", type=float, default=1.0, help="both checks' repetition penalty (default 1)")
    v.add_argument("--samples", type=int, default=2000, help="sampled requests per prompt, each way (default 2000)")
    v.add_argument("--sample-tokens", type=int, default=3,
                   help="length of the sampled token tuple compared (default 3: the first token precedes any draft)")
    v.add_argument("--alpha", type=float, default=1e-3, help="the test's level, shared by all prompts (default 1e-3)")
    grammar = v.add_mutually_exclusive_group()
    grammar.add_argument("--json-schema", default=None, metavar="FILE",
                         help="run both checks under structured output: every output a JSON value this schema accepts")
    grammar.add_argument("--regex", default=None, help="run both checks with every output matching this regex")


@dataclass(slots=True)
class SampledCheck:
    prompt: int
    pvalue: float
    tvd: float  # total variation distance of the two empirical laws
    cells: int  # tuples compared (after pooling)
    acceptance_rate: float


def homogeneity(a: Counter, b: Counter) -> tuple[float, float, int]:
    """Chi-square test that two samples come from one law -> (p-value, total variation distance
    of their empirical laws over those cells, cells used). Outcomes expected < MIN_EXPECTED times in either sample
    are pooled into one cell (dropped if even that cell expects too few)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b))
    n = na + nb
    big, rest = [], [0, 0]
    for k in keys:
        total = a[k] + b[k]
        if min(total * na / n, total * nb / n) >= MIN_EXPECTED:
            big.append((a[k], b[k]))
        else:
            rest[0] += a[k]
            rest[1] += b[k]
    if min(sum(rest) * na / n, sum(rest) * nb / n) >= MIN_EXPECTED:
        big.append(tuple(rest))
    if len(big) < 2:
        return 1.0, 0.0, len(big)  # one cell: nothing to tell apart
    obs = torch.tensor(big, dtype=torch.float64)  # [cells, 2]
    # Over the cells compared: over raw tuples, unseen ones would make two samples of one
    # high-entropy law look far apart.
    tvd = 0.5 * float((obs[:, 0] / na - obs[:, 1] / nb).abs().sum())
    col = obs.sum(0)
    exp = obs.sum(1, keepdim=True) * col / col.sum()
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = len(big) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(chi2 / 2, dtype=torch.float64)))
    return p, tvd, len(big)


def read_prompts(path: str | None, field: str | None) -> list[str]:
    if path is None:
        return list(BUILT_IN_PROMPTS)
    if path.endswith(".jsonl"):
        from specserve.bench.workload import load_workload

        return [p.text for p in load_workload(path, field)]
    file = Path(path).expanduser()
    if not file.is_file():
        raise InvalidParameterError("prompts", path, "is not a file (a JSONL file, or a text file of one prompt per line)")
    prompts = [line.strip() for line in file.read_text().splitlines() if line.strip()]
    if not prompts:
        raise InvalidParameterError("prompts", path, "holds no prompt (one per line)")
    return prompts


def read_constraint(args: argparse.Namespace):
    """The StructuredOutputsParams of --json-schema or --regex, or None."""
    from specserve.sampling_params import StructuredOutputsParams

    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.json_schema is None:
        return None
    file = Path(args.json_schema).expanduser()
    try:
        schema = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidParameterError("json_schema", args.json_schema, f"must be a readable JSON file ({e})") from e
    return StructuredOutputsParams(json=schema)


def _check_args(args: argparse.Namespace) -> None:
    if args.speculative in (None, "none"):
        raise InvalidParameterError("speculative", args.speculative, "name the method to verify, one of "
                                    + ", ".join(engine_args.SPECULATIVE_METHODS[1:]))
    for name, lo, hi in (("max_tokens", 1, 4096), ("samples", 50, 1_000_000), ("sample_tokens", 2, 8)):
        value = getattr(args, name)
        if not lo <= value <= hi:
            raise InvalidParameterError(name, value, f"must be an integer in [{lo}, {hi}]")
    if not 0 < args.alpha < 1:
        raise InvalidParameterError("alpha", args.alpha, "must be in (0, 1)")
    from specserve.sampling_params import SamplingParams

    SamplingParams(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                   repetition_penalty=args.repetition_penalty)  # their ranges


def pool_size(loaded, prompt_lens: list[int], args: argparse.Namespace) -> dict[str, int]:
    """LLM arguments sizing the KV pool for what verify runs at once, SAMPLE_BATCH requests:
    greedy ones of --max-tokens or sampled ones of --sample-tokens, within KV_POOL_BYTES but
    holding at least one request at the whole context."""
    from specserve.model.paged_kv import PagedKVCache

    cfg = loaded.config
    longest = max(prompt_lens)
    context = args.max_model_len or min(cfg.max_position_embeddings, longest + max(args.max_tokens, args.sample_tokens))

    def blocks(tokens: int) -> int:
        return -(-min(tokens, context) // BLOCK_SIZE)

    need = max(min(len(prompt_lens), SAMPLE_BATCH) * blocks(longest + args.max_tokens),
               SAMPLE_BATCH * blocks(longest + args.sample_tokens))
    block_bytes = PagedKVCache.bytes_per_block(cfg.num_layers, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim,
                                               loaded.model.kv_dtype)
    return {"max_model_len": context, "num_kv_blocks": max(blocks(context), min(need, KV_POOL_BYTES // block_bytes))}


def sample_tuples(llm, ids: list[int], params, first_seed: int, n: int) -> tuple[Counter, SpecStats]:
    """The first tokens of n seeded samples of one prompt, counted, and their speculation
    figures; in rounds, so that only the counts of earlier rounds are held."""
    counts, stats = Counter(), SpecStats()
    for start in range(0, n, SAMPLE_ROUND):
        seeds = range(first_seed + start, first_seed + min(n, start + SAMPLE_ROUND))
        outs = llm.generate([ids] * len(seeds), [params.copy(seed=s) for s in seeds], use_tqdm=False)
        for o in outs:
            counts[tuple(o.outputs[0].token_ids)] += 1
            stats.merge(o.spec)
    return counts, stats


def run_verify(args: argparse.Namespace) -> int:
    from specserve.llm import LLM
    from specserve.model.loader import load_model
    from specserve.sampling_params import SamplingParams

    _check_args(args)
    texts = read_prompts(args.prompts, args.field)  # bad input is refused before the model loads
    constraint = read_constraint(args)
    spec = engine_args.speculative_config(args, {})
    if args.num_speculative_tokens is None:
        # Adaptive depth may draft little on a given machine; a fixed depth puts every step
        # through the verifier.
        spec["num_speculative_tokens"] = VERIFY_K
    loaded = load_model(**engine_args.load_kwargs(args, {}))
    tok = loaded.tokenizer
    # An instruct model is asked through its own chat template; a model without one, raw text.
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) if tok.chat_template else tok.encode(t) for t in texts]
    size = pool_size(loaded, [len(p) for p in prompts], args)
    plain = LLM(loaded=loaded, max_num_seqs=SAMPLE_BATCH, block_size=BLOCK_SIZE, **size)
    fast = LLM(loaded=loaded, max_num_seqs=SAMPLE_BATCH, block_size=BLOCK_SIZE, speculative_config=spec, **size)
    print(f"verify: {loaded.name} ({loaded.kernels}), speculative_config {spec}, {len(prompts)} prompts"
          + (f", under structured output ({constraint.kind})" if constraint else ""))
    if constraint is not None:
        plain.engine.check_params(SamplingParams(structured_outputs=constraint))  # a bad schema fails before any run

    penalties = dict(presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                     repetition_penalty=args.repetition_penalty)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs=constraint, **penalties)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy, use_tqdm=False)]
    got = fast.generate(prompts, greedy, use_tqdm=False)
    mismatched = []
    for i, (w, o) in enumerate(zip(want, got)):
        g = o.outputs[0].token_ids
        if g != w:
            at = next((j for j, (x, y) in enumerate(zip(w, g)) if x != y), min(len(w), len(g)))
            mismatched.append(i)
            print(f"  greedy prompt {i}: DIFFERS at token {at} (plain {w[at:at + 3]}, speculative {g[at:at + 3]})")
    stats = LLM.aggregate_spec_stats(got)
    print(f"greedy: {len(prompts) - len(mismatched)}/{len(prompts)} prompts identical over {args.max_tokens} tokens "
          f"(acceptance {stats.acceptance_rate:.2f}, {stats.num_drafted} drafted)")

    checks: list[SampledCheck] = []
    if args.temperature > 0:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.sample_tokens, ignore_eos=True, structured_outputs=constraint, **penalties)
        n = args.samples
        for i, ids in enumerate(prompts):
            a, _ = sample_tuples(plain, ids, params, 0, n)  # independent draws each way
            b, stats = sample_tuples(fast, ids, params, n, n)
            p, tvd, cells = homogeneity(a, b)
            checks.append(SampledCheck(i, p, tvd, cells, stats.acceptance_rate))
            c = checks[-1]
            print(f"  sampled prompt {i}: p-value {c.pvalue:.4f}, total variation {c.tvd:.4f} over {c.cells} cells "
                  f"({n} samples each way, acceptance {c.acceptance_rate:.2f})")
    level = args.alpha / max(1, len(checks))
    failed = [c for c in checks if c.pvalue < level]
    if checks:
        print(f"sampled: {len(checks) - len(failed)}/{len(checks)} prompts pass at p >= {level:.2g} "
              f"(alpha {args.alpha:g} over {len(checks)} prompts), temperature {args.temperature:g}, "
              f"first {args.sample_tokens} tokens")
    ok = not mismatched and not failed
    print("PASS: speculation kept the target's output" if ok else
          "FAIL: " + "; ".join(filter(None, [f"greedy output differs for prompts {mismatched}" if mismatched else "",
                                             f"sampled distribution differs for prompts {[c.prompt for c in failed]}"
                                             if failed else ""])))
    sys.stdout.flush()
    return 0 if ok else 1
