"""`specserve train-draft`: argparse only at import; torch and the model load when it runs."""

from __future__ import annotations

import dataclasses
import shlex
import sys
from types import SimpleNamespace

from specserve.train.config import METHOD_DEFAULTS, TrainDraftConfig



def add_train_parser(sub) -> None:
    d = SimpleNamespace(**{f.name: f.default for f in dataclasses.fields(TrainDraftConfig)})
    t = sub.add_parser(
        "train-draft", help="train an EAGLE-3, EAGLE or Medusa drafter on the target's own outputs",
        description="Self-distillation: the target answers prompts (a JSONL file, or user turns it writes itself "
                    "from its chat template), its hidden states and greedy choices are recorded, and the heads are "
                    "trained on them. The output folder loads with speculative_config={'method': METHOD, 'model': OUT}.")
    t.add_argument("--method", required=True, choices=list(METHOD_DEFAULTS))
    t.add_argument("--target", default="default", help="target model: HF folder, .gguf file, or 'default' (embedded SmolLM2)")
    t.add_argument("--out", required=True, help="output folder (model.safetensors, config.json, data cache, checkpoints)")
    t.add_argument("--prompts", default=None,
                   help='JSONL of {"prompt": ...} or {"messages": [...]} rows; default: the target writes user turns')
    t.add_argument("--cache", default=None,
                   help="data cache folder (default OUT/cache); runs with the same data settings (target, prompts, "
                        "--num-prompts, --max-new-tokens, --chunk-size, --seed) share it, e.g. an EAGLE run and a Medusa run")
    t.add_argument("--num-prompts", type=int, default=d.num_prompts, help="prompts to answer")
    t.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="answer length cap")
    t.add_argument("--chunk-size", type=int, default=None,
                   help="prompts per data shard, answered together by one batched engine (larger: faster, more "
                        "memory; eagle3 64, others 32)")
    e, m, e3 = METHOD_DEFAULTS["eagle"], METHOD_DEFAULTS["medusa"], METHOD_DEFAULTS["eagle3"]
    t.add_argument("--epochs", type=int, default=None,
                   help=f"eagle3 {e3['epochs']}, eagle {e['epochs']}, medusa {m['epochs']}")
    t.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (eagle3 {e3['lr']}, eagle {e['lr']}, medusa {m['lr']})")
    t.add_argument("--seed", type=int, default=d.seed, help="seeds prompts, split, initialisation, batch order, noise")
    t.add_argument("--resume", action="store_true", help="continue an interrupted run in --out from its last checkpoint")
    t.add_argument("--depth", type=int, default=None,
                   help=f"eagle3/eagle: unrolled training steps ({e3['depth']}/{e['depth']}); medusa: heads ({m['depth']})")
    t.add_argument("--eval-depth", type=int, default=d.eval_depth, help="eagle: draft depth scored on the held-out split")
    t.add_argument("--draft-vocab", type=int, default=d.draft_vocab,
                   help="tokens the drafter can propose: the target's most frequent answers (0: the whole vocabulary)")
    t.add_argument("--batch-tokens", type=int, default=d.tokens_per_batch, help="padded tokens per optimizer step")
    t.add_argument("--held-out", type=float, default=d.held_out, help="fraction of sequences held back for the report")
    t.add_argument("--tree-nodes", type=int, default=d.tree_nodes, help="medusa: nodes of the static draft tree")
    t.add_argument("--save-dtype", default=d.save_dtype, choices=["bfloat16", "float32"])
    t.add_argument("--device", default=d.device, help="cpu, cuda, cuda:N or auto")
    t.add_argument("--generator", default=d.generator, choices=["auto", "engine", "batch"],
                   help="who answers the prompts: the batched engine, or each chunk as one dense batch (faster on a "
                        "GPU, where the engine's per-request work is the cost); auto: the batch on an accelerator")
    t.add_argument("--data-minutes", type=float, default=None,
                   help="begin no data chunk after this many minutes; train on what was made (--resume makes the rest)")
    t.add_argument("--train-minutes", type=float, default=None,
                   help="fit the number of training steps (and the learning-rate schedule) to this many minutes, "
                        "timed over the first steps; default: every epoch")
    t.add_argument("--init", default=None,
                   help="eagle3: start from this drafter folder's weights ('default': the shipped one) and "
                        "fine-tune it on this run's data; its draft vocabulary and target layers are kept")
    t.add_argument("--targets", default=d.targets, choices=["argmax", "probs"],
                   help="eagle3: train each position toward the target's argmax (one-hot) or its probabilities over "
                        "the draft vocabulary (EAGLE-3's reference training; the target's final hidden states are "
                        "recomputed beside the three layers')")
    t.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own); 1 on a CPU shared with other busy processes")


def run_train(args, argv: list[str]) -> int:
    """argv: the command line as typed (after the program name), recorded with the drafter."""
    import torch

    from specserve.errors import InvalidParameterError
    from specserve.train.run import train_draft

    cfg = TrainDraftConfig(
        method=args.method, target=args.target, out=args.out, prompts=args.prompts, num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, cache=args.cache, epochs=args.epochs, lr=args.lr, seed=args.seed,
        depth=args.depth, eval_depth=args.eval_depth, draft_vocab=args.draft_vocab, tokens_per_batch=args.batch_tokens,
        held_out=args.held_out, tree_nodes=args.tree_nodes, save_dtype=args.save_dtype, device=args.device,
        resume=args.resume, generator=args.generator, data_minutes=args.data_minutes, train_minutes=args.train_minutes,
        init=args.init, targets=args.targets,
        command=shlex.join(["specserve", *argv]))
    if args.threads is not None:
        if args.threads < 1:
            raise InvalidParameterError("threads", args.threads, "must be >= 1")
        # Two threads on two cores that another busy process shares wait on each other at
        # every barrier: measured here, a forward pass took 1.2 s instead of 64 ms on one thread.
        torch.set_num_threads(args.threads)
    train_draft(cfg, log=lambda msg: print(msg, file=sys.stderr))
    return 0
