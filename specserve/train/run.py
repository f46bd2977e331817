"""`specserve train-draft`, end to end: data (answer + record), draft vocabulary, training with
checkpoints, held-out report, and the drafter folder (model.safetensors + config.json)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import torch

from specserve.errors import InvalidParameterError
from specserve.model.loader import load_model
from specserve.spec.heads import Drafter, load_drafter, new_drafter, save_drafter
from specserve.train.config import TrainDraftConfig
from specserve.train.batches import choose_draft_vocab, split, vocab_coverage, vocab_index
from specserve.train.data import DataPlan, build_data, load_data
from specserve.train.evaluate import HeldOutReport, choose_tree, evaluate
from specserve.train.prompts import read_prompt_file
from specserve.train.trainer import (Checkpoint, TrainPlan, checkpoint_vocab, has_checkpoint, load_checkpoint,
                                     new_optimizer, train_epochs)

RUN_FILE = "run.json"  # the settings a --resume must match


def train_draft(cfg: TrainDraftConfig, log=print) -> tuple[Path, HeldOutReport]:
    out = Path(cfg.out).expanduser()
    _prepare_out(out, cfg)
    if cfg.method == "eagle3":
        from specserve.train.eagle3 import train_eagle3

        return train_eagle3(cfg, out, log)
    t0 = time.perf_counter()
    conversations = read_prompt_file(cfg.prompts) if cfg.prompts else None
    target = load_model(cfg.target, dtype="float32", device=cfg.device)
    prompts = None if cfg.prompts is None else str(Path(cfg.prompts).expanduser().resolve())
    plan = DataPlan(prompts, cfg.num_prompts, cfg.max_new_tokens, cfg.seed, cfg.prompt_max_tokens, cfg.chunk_size,
                    generator=cfg.generator_on(target.model.device.type))
    cache = Path(cfg.cache).expanduser() if cfg.cache else out / "cache"
    data = load_data(build_data(target, plan, conversations, cache, cfg.data_seconds))
    t_data = time.perf_counter() - t0
    train_ids, held_ids = split(len(data), cfg.held_out, cfg.seed)
    log(f"data: {len(data)} sequences ({data.num_answer_tokens(train_ids)} answer tokens to train on, "
        f"{len(held_ids)} sequences held back) in {t_data:.0f}s")

    ckpt = out / "checkpoint"
    vocab_size = target.config.vocab_size
    ids = checkpoint_vocab(ckpt) if has_checkpoint(ckpt) else choose_draft_vocab(
        data, train_ids, cfg.draft_vocab or vocab_size, vocab_size, target.tokenizer.eos_token_ids)
    coverage = vocab_coverage(data, train_ids, ids, vocab_size)
    log(f"draft vocabulary: {len(ids)} tokens covering {100 * coverage:.2f}% of the target's answer tokens")
    torch.manual_seed(cfg.seed)
    drafter = new_drafter(target, cfg.method, ids, num_heads=cfg.depth if cfg.method == "medusa" else 0,
                          dtype=cfg.save_dtype)
    index = vocab_index(ids, target.config.vocab_size).to(drafter.vocab.ids.device)
    opt = new_optimizer(drafter, cfg.lr)

    def held_out_report(d: Drafter) -> HeldOutReport:
        return evaluate(d, data, held_ids, cfg.score_depth, index, cfg.tokens_per_batch)

    if has_checkpoint(ckpt):
        state = load_checkpoint(ckpt, drafter, opt)
        log(f"resuming after epoch {state.epochs_done} (step {state.step})")
    else:
        untrained = held_out_report(drafter)
        log(f"untrained: {untrained.summary()}")
        state = Checkpoint(0, 0, [{"epoch": 0, "held_out": untrained.as_dict()}])

    def after_epoch(epoch: int, loss: float) -> dict:
        report = held_out_report(drafter)
        log(f"epoch {epoch + 1}: train loss {loss:.4f} | {report.summary()}")
        save_drafter(out, _with_training(drafter, cfg, report, state, coverage, len(data), t_data, t0))
        return {"held_out": report.as_dict()}

    t1 = time.perf_counter()
    train_plan = TrainPlan(cfg.epochs, cfg.lr, cfg.seed, cfg.depth, cfg.tokens_per_batch, cfg.train_seconds)
    state = train_epochs(drafter, opt, data, train_ids, train_plan, index, state, ckpt, after_epoch)
    log(f"trained {cfg.epochs} epochs in {time.perf_counter() - t1:.0f}s")

    # The figures of record are those of the saved weights (rounded to save_dtype), reloaded.
    report = held_out_report(drafter)
    save_drafter(out, _with_training(drafter, cfg, report, state, coverage, len(data), t_data, t0))
    saved = load_drafter(out, target, for_inference=False)
    final = held_out_report(saved)
    save_drafter(out, _with_training(saved, cfg, final, state, coverage, len(data), t_data, t0))
    log(f"saved {out} | {final.summary()}")
    return out, final


def _prepare_out(out: Path, cfg: TrainDraftConfig) -> None:
    run = out / RUN_FILE
    if cfg.resume:
        if run.is_file():
            before = json.loads(run.read_text())
            changed = sorted(k for k, v in cfg.identity().items() if before.get(k, cfg.default_of(k)) != v)
            if changed:
                raise InvalidParameterError("resume", str(out), f"was started with other settings ({', '.join(changed)}); "
                                            "resume with the same ones or use another --out")
            return
    elif out.exists() and any(out.iterdir()):
        raise InvalidParameterError("out", str(out), "exists and is not empty; pass --resume to continue that run, "
                                    "or choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "checkpoint", ignore_errors=True)
    run.write_text(json.dumps(cfg.identity(), indent=2) + "\n")


def _with_training(drafter: Drafter, cfg: TrainDraftConfig, report: HeldOutReport, state: Checkpoint,
                   coverage: float, num_sequences: int, t_data: float, t0: float) -> Drafter:
    """The drafter with its config's training record (and, for Medusa, its tree) filled in."""
    choices = None
    if cfg.method == "medusa":
        choices, estimate = choose_tree(report.rank_by_depth, cfg.tree_nodes)
    training = {"command": cfg.command, "seed": cfg.seed, "settings": cfg.identity(), "epochs": state.epochs_done,
                "num_sequences": num_sequences, "data_seconds": round(t_data),
                "total_seconds": round(time.perf_counter() - t0), "held_out": report.as_dict(),
                "history": state.history, "draft_vocab_coverage": round(coverage, 4)}
    if choices is not None:
        training["tree_estimated_accepted_length"] = round(estimate, 3)
    config = dataclasses.replace(drafter.config, tree_choices=choices, training=training)
    return dataclasses.replace(drafter, config=config)
