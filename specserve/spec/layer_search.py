"""Which decoder layers self_spec's draft should skip: a greedy search on calibration prompts.

The objective is the expected speedup of speculative decoding over plain decoding with a draft of
acceptance rate a and relative cost c per draft step, verifying k drafts in a target pass over
k + 1 tokens (Leviathan et al.'s estimate, with the verify pass priced as measured):

    speedup(a, k) = (1 - a^(k+1)) / ((1 - a) (k c + T(k+1) / T(1)))

- a: teacher-forced top-1 agreement of the layer subset with the full model on the full model's
  own greedy continuations of the calibration prompts. It is the chance that a greedy draft
  token is accepted given that the ones before it were: the draft then holds exactly the
  committed tokens, as it does under teacher forcing.
- c: a draft step's cost relative to a 1-token target pass, the kept layers plus the fixed cost
  of a pass (embedding, final norm, LM head, the call itself), both measured here.
- T(n): the target's measured cost of a pass over n tokens.

Greedy removal: starting from every layer, each round removes the layer whose removal lowers
the agreement least (every layer costs the same, so that is also the best speedup of the round),
and the best set of every round seen is kept. It stops when `patience` rounds in a row have not
improved on the best, or the agreement falls under `min_agreement`. Each candidate is one pass
over the calibration tokens.

The calibration prompts (specserve/data/calibration_prompts.json) were written for this purpose
and are not benchmark prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib import resources

import torch

from specserve.model.flat_batch import flat_batch
from specserve.model.loader import LoadedModel
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.spec.self_spec import layer_view

BLOCK = 16  # KV block size of the search's own passes


def calibration_prompts() -> list[str]:
    path = resources.files("specserve") / "data" / "calibration_prompts.json"
    return [p["text"] for p in json.loads(path.read_text())["prompts"]]


# ---- the objective -----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PassCosts:
    """Seconds of the passes the speedup estimate prices."""

    draft_fixed: float  # a draft step apart from its layers: embedding, final norm, LM head, call
    draft_per_layer: float  # each kept layer
    target: tuple[float, ...]  # target[n - 1]: a target pass computing n tokens, n = 1 .. max_k + 1

    @property
    def max_k(self) -> int:
        return len(self.target) - 1

    def draft_step(self, num_kept: int) -> float:
        """c: a draft step over `num_kept` layers relative to a 1-token target pass."""
        return (self.draft_fixed + num_kept * self.draft_per_layer) / self.target[0]

    def verify(self, k: int) -> float:
        """T(k + 1) / T(1)."""
        return self.target[k] / self.target[0]


def expected_speedup(agreement: float, k: int, c: float, verify: float) -> float:
    """Expected tokens per step over the step's cost, in units of a plain decoding step."""
    tokens = k + 1 if agreement >= 1.0 else (1 - agreement ** (k + 1)) / (1 - agreement)
    return tokens / (k * c + verify)


@dataclass(frozen=True, slots=True)
class Candidate:
    skip_layers: tuple[int, ...]
    agreement: float  # a
    draft_cost: float  # c
    k: int  # the draft length that maximises the expected speedup
    speedup: float  # expected, at that k


def price(skip: tuple[int, ...], agreement: float, num_layers: int, costs: PassCosts) -> Candidate:
    """The candidate at its best k in 1..costs.max_k."""
    c = costs.draft_step(num_layers - len(skip))
    k = max(range(1, costs.max_k + 1), key=lambda k: expected_speedup(agreement, k, c, costs.verify(k)))
    return Candidate(skip, agreement, c, k, expected_speedup(agreement, k, c, costs.verify(k)))


@dataclass(frozen=True, slots=True)
class SearchResult:
    best: Candidate  # the highest expected speedup among the sets each round kept
    rounds: list[Candidate]  # the set kept after each round, one layer more skipped each time
    evaluations: int  # agreement measurements made


def greedy_layer_search(num_layers: int, agreement: Callable[[tuple[int, ...]], float], costs: PassCosts,
                        patience: int = 3, min_agreement: float = 0.05,
                        log: Callable[[str], None] = lambda _: None) -> SearchResult:
    """Greedy removal (module note). `agreement(skip)` -> a of the model without layers `skip`."""
    if num_layers < 2:
        raise ValueError(f"a model of {num_layers} layer(s) has no layer to skip")
    skip: tuple[int, ...] = ()
    rounds: list[Candidate] = []
    best: Candidate | None = None
    evaluations = since_best = 0
    while len(skip) < num_layers - 1:
        scores = {}
        for layer in range(num_layers):
            if layer not in skip:
                scores[layer] = agreement(tuple(sorted(skip + (layer,))))
                evaluations += 1
        removed = max(scores, key=lambda i: (scores[i], -i))  # ties: the lower layer index goes
        skip = tuple(sorted(skip + (removed,)))
        kept = price(skip, scores[removed], num_layers, costs)
        rounds.append(kept)
        log(f"skip {len(skip):2d} layers (+{removed}): agreement {kept.agreement:.3f}, draft step "
            f"{kept.draft_cost:.2f}x, k={kept.k}: expected speedup {kept.speedup:.3f}")
        if best is None or kept.speedup > best.speedup:
            best, since_best = kept, 0
        else:
            since_best += 1
        if since_best >= patience or kept.agreement < min_agreement:
            break
    return SearchResult(best, rounds, evaluations)


# ---- measurements on a real model ----------------------------------------------------------------

def greedy_continuations(loaded: LoadedModel, prompts: Sequence[Sequence[int]], max_new: int) -> list[list[int]]:
    """The full model's greedy continuation of each prompt (batched, up to max_new tokens, cut
    after an end-of-sequence token: the engine never drafts past one)."""
    lengths = [len(p) + max_new for p in prompts]
    tables = _tables(lengths)
    runner = ModelRunner.paged(loaded.model, sum(map(len, tables)), BLOCK)
    eos = set(loaded.tokenizer.eos_token_ids)
    outs: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    starts, feeds = [0] * len(prompts), [list(p) for p in prompts]
    for _ in range(max_new):
        batch = ForwardBatch([tables[i] for i in live], [starts[i] for i in live], [feeds[i] for i in live], False)
        picked = runner.execute_last(batch)[:, 0].argmax(-1).tolist()
        for i, t in zip(live, picked):
            starts[i] += len(feeds[i])
            feeds[i] = [t]
            outs[i].append(t)
        live = [i for i in live if outs[i][-1] not in eos]
        if not live:
            break
    return outs


class TeacherForcedAgreement:
    """agreement(skip) -> the fraction of continuation tokens that the model without layers
    `skip` predicts (argmax) from the true context, in one pass over every sequence."""

    def __init__(self, loaded: LoadedModel, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]]):
        self.loaded = loaded
        self.inputs = [list(p) + list(c[:-1]) for p, c in zip(prompts, continuations)]
        self.targets = torch.tensor([t for c in continuations for t in c])  # [M]
        self.num_logits = [len(c) for c in continuations]
        lens = [len(x) for x in self.inputs]
        self.tables = _tables(lens)
        self.flat = flat_batch(self.inputs, self.tables, BLOCK, [0] * len(lens))
        ends = self.flat.q_start.tolist()[1:]
        self.rows = torch.tensor([j for e, n in zip(ends, self.num_logits) for j in range(e - n, e)])
        self.num_rows = sum(map(len, self.tables)) * BLOCK

    @torch.inference_mode()
    def __call__(self, skip: tuple[int, ...]) -> float:
        model = layer_view(self.loaded, skip).model if skip else self.loaded.model
        cfg = model.config
        shape = (cfg.num_layers, self.num_rows, cfg.num_kv_heads, cfg.head_dim)
        k = torch.zeros(shape, dtype=model.kv_dtype, device=model.device)
        v = torch.zeros_like(k)
        hidden = model.forward_flat(self.flat, k, v)  # [N, hidden]
        logits = model.compute_logits(hidden.index_select(0, self.rows.to(hidden.device)))  # [M, V]
        return float((logits.argmax(-1).cpu() == self.targets).float().mean())


def measure_pass_costs(loaded: LoadedModel, context: Sequence[int], max_k: int, repeats: int = 12) -> PassCosts:
    """Target passes over 1 .. max_k + 1 tokens and draft steps over 1 and all layers, each
    after `context`, measured in interleaved rounds (a busy machine slows them alike); each
    figure is its fastest quarter's bound, the usual cost of a quiet step."""
    num_layers = loaded.config.num_layers
    ctx = list(context)
    if len(ctx) < max_k + 1:
        raise ValueError(f"the context has {len(ctx)} tokens; pricing passes of {max_k + 1} needs at least that many")
    table = _tables([len(ctx) + max_k + 1])
    runners = {"target": ModelRunner.paged(loaded.model, len(table[0]), BLOCK),
               "one": ModelRunner.paged(layer_view(loaded, range(1, num_layers)).model, len(table[0]), BLOCK)}
    for runner in runners.values():
        runner.execute_last(ForwardBatch(table, [0], [ctx], False))
    shapes = [("target", n) for n in range(1, max_k + 2)] + [("one", 1)]
    times: dict[tuple[str, int], list[float]] = {s: [] for s in shapes}
    for _ in range(repeats):
        for name, n in shapes:
            runner = runners[name]
            batch = ForwardBatch(table, [len(ctx)], [ctx[:n]], all_logits=True)
            t = time.perf_counter()
            runner.execute(batch).argmax(-1)
            runner.synchronize()
            times[(name, n)].append(time.perf_counter() - t)
    q = {s: sorted(ts)[len(ts) // 4] for s, ts in times.items()}
    target = tuple(q[("target", n)] for n in range(1, max_k + 2))
    per_layer = max(0.0, (target[0] - q[("one", 1)]) / (num_layers - 1))
    return PassCosts(draft_fixed=max(0.0, q[("one", 1)] - per_layer), draft_per_layer=per_layer, target=target)


def search_layers(loaded: LoadedModel, prompts: Sequence[str] | None = None, max_new: int = 32, max_k: int = 6,
                  patience: int = 3, log: Callable[[str], None] = lambda _: None) -> tuple[SearchResult, dict]:
    """The whole search on a loaded model -> (result, figures to store with the layer set)."""
    t0 = time.perf_counter()
    texts = list(prompts) if prompts is not None else calibration_prompts()
    ids = [loaded.tokenizer.encode_chat([{"role": "user", "content": p}]) for p in texts]
    conts = greedy_continuations(loaded, ids, max_new)
    agreement = TeacherForcedAgreement(loaded, ids, conts)
    costs = measure_pass_costs(loaded, ids[0] + conts[0], max_k)
    log(f"{len(ids)} calibration prompts, {len(agreement.targets)} continuation tokens; target pass "
        f"{1e3 * costs.target[0]:.2f} ms (1 token) / {1e3 * costs.target[-1]:.2f} ms ({max_k + 1}); draft step "
        f"{1e3 * costs.draft_fixed:.2f} ms + {1e3 * costs.draft_per_layer:.3f} ms a layer")
    result = greedy_layer_search(loaded.config.num_layers, agreement, costs, patience=patience, log=log)
    figures = {"agreement": round(result.best.agreement, 4), "draft_cost": round(result.best.draft_cost, 4),
               "k": result.best.k, "expected_speedup": round(result.best.speedup, 4),
               "pass_ms": {"target": [round(1e3 * t, 3) for t in costs.target],
                           "draft_fixed": round(1e3 * costs.draft_fixed, 3),
                           "draft_per_layer": round(1e3 * costs.draft_per_layer, 4)},
               "calibration": {"prompts": len(ids), "tokens": len(agreement.targets), "max_new": max_new},
               "rounds": [asdict(c) | {"skip_layers": list(c.skip_layers)} for c in result.rounds],
               "evaluations": result.evaluations, "seconds": round(time.perf_counter() - t0, 1)}
    return result, figures


def _tables(lengths: Sequence[int]) -> list[list[int]]:
    """Consecutive blocks for sequences of these lengths."""
    out, nxt = [], 0
    for n in lengths:
        m = -(-n // BLOCK)
        out.append(list(range(nxt, nxt + m)))
        nxt += m
    return out
