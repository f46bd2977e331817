"""Answering a chunk of prompts as one dense batch: train-draft's generator on an accelerator.

On a GPU one pass over a thousand sequences costs little more than a pass over a few, so what
the batched engine adds per request and step (scheduling, block tables, detokenizing, stop
checks) becomes the cost of making data. This loop has none of it: the chunk is prefilled in
ragged passes on a dense cache, then every unfinished sequence decodes one token per pass
until all have ended. It answers `LLM.generate`'s way (RequestOutput per prompt, in order), so
train/data.py and train/prompts.py take either.

Greedy rows are the target's own argmax, as the engine's are. Sampled rows (the self-written
user turns) race their temperature- and top-p-processed distribution against Gumbel noise from
one generator per call seeded by all the requests' seeds: a call's output is a function of its
prompts, settings and seeds, reproducible, but not the engine's (whose noise is per request),
so data made by one generator is never mixed with the other's (DataPlan.generator).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.model.loader import LoadedModel
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecStats
from specserve.sampling_params import SamplingParams

# Prompt tokens per prefill pass: enough rows to fill an accelerator, few enough that one
# pass's activations ([tokens, intermediate] float32) stay a few hundred MB.
PREFILL_TOKENS = 32768


def _check(p: SamplingParams) -> None:
    """The settings this loop honours; anything else would be silently dropped, so it is refused."""
    extra = {"top_k": p.top_k != 0, "min_p": p.min_p != 0, "stop": bool(p.stop), "logprobs": p.logprobs is not None,
             "n": p.n != 1, "presence_penalty": p.presence_penalty != 0,
             "frequency_penalty": p.frequency_penalty != 0, "repetition_penalty": p.repetition_penalty != 1,
             "logit_bias": bool(p.logit_bias), "structured_outputs": bool(p.structured_outputs or p.guided_decoding)}
    used = [k for k, v in extra.items() if v]
    if used:
        raise ValueError(f"the batch generator takes temperature, top_p, max_tokens, seed, stop_token_ids and "
                         f"ignore_eos only; got {', '.join(used)}")


def choose_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  noise: torch.Generator) -> torch.Tensor:
    """logits [n, V] float32, temperature and top_p [n] -> tokens [n] int64: the argmax where
    temperature is 0, else a draw from the smallest set of tokens whose probability reaches
    top_p (the most likely first), renormalized, by the Gumbel race argmax(log p - log(-log u))."""
    out = logits.argmax(-1)
    sampled = temperature > 0
    if not bool(sampled.any()):
        return out
    rows = sampled.nonzero().squeeze(1)
    probs = torch.softmax(logits[rows] / temperature[rows, None], dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep a token while the mass before it is below top_p: the first always stays.
    sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p >= top_p[rows, None], 0.0)
    u = torch.rand(sorted_p.shape, generator=noise, device=sorted_p.device).clamp_min_(1e-20)
    pick = (sorted_p.log() - (-u.log()).log()).argmax(-1)
    out[rows] = order.gather(1, pick[:, None]).squeeze(1)
    return out


def _seed(params: list[SamplingParams]) -> int:
    h = 0
    for i, p in enumerate(params):
        h = (h * 1_000_003 + (p.seed if p.seed is not None else i) + 1) % (1 << 62)
    return h


class BatchGenerator:
    """`LLM.generate` for one chunk at a time, on the target's device (see the module note)."""

    def __init__(self, target: LoadedModel):
        self.target = target
        self.tokenizer = target.tokenizer

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], sampling_params: SamplingParams | Sequence[SamplingParams],
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = [list(p) for p in prompts]
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p in params:
            _check(p)
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not prompts:
            return []
        model = self.target.model
        device = model.device
        n = len(prompts)
        runner = ModelRunner.dense(model, n, max(len(p) + q.max_tokens for p, q in zip(prompts, params)))
        temperature = torch.tensor([q.temperature for q in params], dtype=torch.float32, device=device)
        top_p = torch.tensor([q.top_p for q in params], dtype=torch.float32, device=device)
        noise = torch.Generator(device=device).manual_seed(_seed(params))
        eos = self.tokenizer.eos_token_ids
        stops = [set() if q.ignore_eos else set(eos) | set(q.stop_token_ids) for q in params]
        answers: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n

        # Prefill in passes of up to PREFILL_TOKENS prompt tokens: logits at each prompt's end.
        last = torch.empty(n, dtype=torch.int64, device=device)

        def prefill(group: list[int]) -> None:
            out = runner.forward(ForwardBatch(group, [0] * len(group), [prompts[i] for i in group], all_logits=False))
            idx = torch.tensor(group, device=device)
            last[idx] = choose_tokens(out.logits[:, 0], temperature[idx], top_p[idx], noise)

        group: list[int] = []
        tokens = 0
        for i in sorted(range(n), key=lambda i: len(prompts[i])):
            if group and tokens + len(prompts[i]) > PREFILL_TOKENS:
                prefill(group)
                group, tokens = [], 0
            group.append(i)
            tokens += len(prompts[i])
        prefill(group)

        alive = list(range(n))
        chosen = last.tolist()
        while alive:
            going = []
            for i in alive:
                t = chosen[i]
                answers[i].append(t)
                if t in stops[i]:
                    reasons[i] = "stop"
                elif len(answers[i]) >= params[i].max_tokens:
                    reasons[i] = "length"
                else:
                    going.append(i)
            alive = going
            if not alive:
                break
            out = runner.forward(ForwardBatch(alive, [len(prompts[i]) + len(answers[i]) - 1 for i in alive],
                                              [[answers[i][-1]] for i in alive], all_logits=False))
            idx = torch.tensor(alive, device=device)
            picked = choose_tokens(out.logits[:, 0], temperature[idx], top_p[idx], noise).tolist()
            for i, t in zip(alive, picked):
                chosen[i] = t
        return [self._output(str(i), prompts[i], answers[i], reasons[i], params[i]) for i in range(n)]

    def _output(self, rid: str, prompt: list[int], answer: list[int], reason: str | None,
                params: SamplingParams) -> RequestOutput:
        # The stop token's text is left out, as the engine leaves it out.
        shown = answer[:-1] if reason == "stop" else answer
        text = self.tokenizer.decode(shown, skip_special_tokens=params.skip_special_tokens)
        done = CompletionOutput(0, text, answer, reason, stop_reason=answer[-1] if reason == "stop" else None)
        return RequestOutput(rid, None, prompt, [done], True, RequestMetrics(0.0, num_prompt_tokens=len(prompt), num_generated_tokens=len(answer)),
                             SpecStats())
