"""How much each quantized path changes the model: KL divergence and top-1 agreement of the
next-token distribution against the float32 torch path, teacher-forced over answers.

The answers are the float32 model's own greedy answers to Spec-Bench prompts (first turns,
through the chat template), so every position is one the reference would reach. For each path
the same sequences are scored in one pass each and compared position by position over the
answer tokens, as llama.cpp's `perplexity --kl-divergence` compares a quantized model with its
base. For a quantized GGUF the float32 reference is its own blocks dequantized, so the figures
measure what specserve's path adds (int8 activations, and any re-quantization of the weights).

    python -m specserve.bench.quality [--model default] [--per-category 2] [--max-tokens 128]
        [--paths gguf q8_0 q4_1 q4_0]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.bench.workload import SPEC_BENCH, Selection, load_workload, select
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.hardware import machine
from specserve.llm import LLM
from specserve.model.loader import LoadedModel, load_model
from specserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Quality:
    path: str
    kernels: str
    weight_bytes: int  # bytes of the matrices as the path holds them (0 for the reference)
    kl_mean: float
    kl_p99: float
    top1_agreement: float
    ppl_ratio: float  # perplexity of the answers under the path / under the reference
    positions: int


def answer_logits(loaded: LoadedModel, sequences: list[tuple[list[int], int]]) -> list[torch.Tensor]:
    """Per (tokens, prompt length): log-probabilities [A, V] at the positions that predict the
    A answer tokens."""
    out = []
    for ids, prompt_len in sequences:
        runner = ModelRunner.dense(loaded.model, 1, len(ids))
        logits = runner.execute(ForwardBatch([0], [0], [ids], all_logits=True))[0]  # [T, V]
        out.append(F.log_softmax(logits[prompt_len - 1:len(ids) - 1].float(), -1))
    return out


def compare(path: str, loaded: LoadedModel, ref: list[torch.Tensor], sequences) -> Quality:
    test = answer_logits(loaded, sequences)
    kls, agree, nll_ref, nll_test = [], [], [], []
    for p, q, (ids, prompt_len) in zip(ref, test, sequences):
        kls.append((p.exp() * (p - q)).sum(-1))
        agree.append(p.argmax(-1) == q.argmax(-1))
        target = torch.tensor(ids[prompt_len:])
        nll_ref.append(-p.gather(-1, target[:, None]).squeeze(-1))
        nll_test.append(-q.gather(-1, target[:, None]).squeeze(-1))
    kl = torch.cat(kls)
    weight_bytes = getattr(loaded.model, "weight_bytes", 0)
    return Quality(path, loaded.kernels, weight_bytes, kl.mean().item(), kl.quantile(0.99).item(),
                   torch.cat(agree).float().mean().item(),
                   math.exp(torch.cat(nll_test).mean().item() - torch.cat(nll_ref).mean().item()), kl.numel())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--paths", nargs="+", default=["gguf", "q8_0", "q4_1", "q4_0"],
                    help="--quantization values to compare with the float32 torch path")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ref_model = load_model(args.model, dtype="float32", quantization="none")
    prompts = select(load_workload(SPEC_BENCH), Selection(per_category=args.per_category))
    encoded = [ref_model.tokenizer.encode_chat([{"role": "user", "content": p.text}]) for p in prompts]
    llm = LLM(loaded=ref_model, max_num_seqs=8)
    outs = llm.generate(encoded, SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
    sequences = [(ids + list(o.outputs[0].token_ids), len(ids)) for ids, o in zip(encoded, outs)]
    ref = answer_logits(ref_model, sequences)
    print(f"# {machine().describe()}; model {args.model}; {len(sequences)} Spec-Bench answers of the float32 "
          f"model ({sum(len(i) - n for i, n in sequences)} positions, teacher-forced); reference: {ref_model.kernels}")
    print(f"{'path':<8}{'weights MB':>11}{'KL mean':>10}{'KL p99':>9}{'top-1 agree':>13}{'PPL ratio':>11}  kernels")
    for path in args.paths:
        loaded = load_model(args.model, quantization=path)
        q = compare(path, loaded, ref, sequences)
        print(f"{q.path:<8}{q.weight_bytes / 1e6:>11.1f}{q.kl_mean:>10.5f}{q.kl_p99:>9.4f}{q.top1_agreement:>13.4f}"
              f"{q.ppl_ratio:>11.4f}  {q.kernels}", flush=True)
    print(f"# {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
