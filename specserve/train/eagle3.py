"""`specserve train-draft --method eagle3`: an EAGLE-3 drafter trained on the target's own answers.

  1. data: the target (as it serves: the native kernels on a quantized GGUF) answers prompts
     with the batched engine, `chunk_size` at a time; shards keep token ids only (train/data.py).
  2. states: the target's three captured residual streams per token, recomputed teacher-forced
     in batched prefill passes and cached beside the shards (train/features.py).
  3. training: training-time test over `depth` unrolled steps (train/objectives.eagle3_steps),
     AdamW with warm-up and cosine decay, bfloat16 autocast where the CPU has it, a checkpoint
     after every epoch (train/trainer.py), held-out accuracy by depth after each.
  4. the drafter folder, in the layout SafeAILab's EAGLE and SGLang's SpecForge write (so vLLM
     and SGLang can read it too), with specserve's target identity and training record.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specserve.errors import InvalidParameterError
from specserve.model.llama import softcap
from specserve.model.loader import LoadedModel, load_model
from specserve.spec.heads.config import SAVE_DTYPES, TargetIdentity
from specserve.spec.heads.drafter import vocab_projection_weight
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_config import DRAFT_IDS, Eagle3Config, default_aux_layers
from specserve.train.batches import choose_draft_vocab, split, vocab_coverage, vocab_index
from specserve.train.config import TrainDraftConfig
from specserve.train.data import DataPlan, build_data, load_data
from specserve.train.evaluate import HeldOutReport, evaluate
from specserve.train.features import attach_states
from specserve.train.prompts import read_prompt_file
from specserve.train.trainer import (Checkpoint, TrainPlan, checkpoint_vocab, has_checkpoint, load_checkpoint,
                                     new_optimizer, train_epochs)


@dataclass(frozen=True, slots=True)
class _Method:
    """The part of a drafter's config the shared trainer and evaluator read."""

    draft_vocab_size: int
    method: str = "eagle3"


class _DraftHead(nn.Module):
    """What the shared training code calls `drafter.vocab`: rows -> draft logits, and the ids."""

    def __init__(self, head: Eagle3Head):
        super().__init__()
        self.head = head

    @property
    def ids(self) -> torch.Tensor:
        return self.head.draft_ids

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        return self.head.logits(rows)


def target_head_rows(target: LoadedModel, draft_ids: torch.Tensor) -> torch.Tensor:
    """The target's vocabulary projection at the draft ids [Vd, Ht], float32 on the CPU."""
    return vocab_projection_weight(target)[draft_ids.to(target.model.device)].float().cpu()


class TargetHead(nn.Module):
    """The target's own head over the draft vocabulary, frozen: final hidden states [..., Ht] ->
    its logits at the draft ids [..., Vd] (soft-capped as the target caps them), what training
    toward the target's probabilities reads (`--targets probs`)."""

    def __init__(self, target: LoadedModel, draft_ids: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", target_head_rows(target, draft_ids))  # [Vd, Ht]
        self.cap = target.config.final_logit_softcapping

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(hidden @ self.weight.t().to(hidden.dtype), self.cap)


@dataclass(slots=True)
class Eagle3Trainee:
    """An EAGLE-3 head in training, shaped as the shared trainer and evaluator read a drafter."""

    heads: Eagle3Head
    vocab: _DraftHead
    embed: nn.Module  # the target's frozen embedding
    config: _Method
    teacher: TargetHead | None = None  # --targets probs: the target's head over the draft vocabulary


def eagle3_config(target: LoadedModel, draft_vocab_size: int) -> Eagle3Config:
    """A drafter with the target's layer shape, reading its default three layers."""
    tc = target.config
    return Eagle3Config(hidden_size=tc.hidden_size, target_hidden_size=tc.hidden_size, num_heads=tc.num_heads,
                        num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, intermediate_size=tc.intermediate_size,
                        rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta, rope_scaling=tc.rope_scaling,
                        max_position_embeddings=tc.max_position_embeddings, vocab_size=tc.vocab_size,
                        draft_vocab_size=draft_vocab_size, aux_layers=default_aux_layers(tc.num_layers))


def new_trainee(target: LoadedModel, draft_ids: torch.Tensor) -> Eagle3Trainee:
    """A fresh head whose draft head starts as the target's own vocabulary rows (the target's
    final norm before them): step 1 then only has to learn features the target's head reads."""
    cfg = eagle3_config(target, len(draft_ids))
    head = Eagle3Head(cfg, target.model.max_positions)
    with torch.no_grad():
        head.draft_ids.copy_(draft_ids.long())
        head.lm_head.weight.copy_(target_head_rows(target, draft_ids))
        head.norm.weight.copy_(_final_norm(target))
    return _trainee(target, head)


def _trainee(target: LoadedModel, head: Eagle3Head) -> Eagle3Trainee:
    head = head.to(target.model.device).train().requires_grad_(True)  # a loaded drafter comes frozen
    return Eagle3Trainee(head, _DraftHead(head), target.model.embed_tokens, _Method(len(head.draft_ids)))


def _initial_drafter(cfg: TrainDraftConfig, target: LoadedModel):
    """--init: a drafter whose weights, draft vocabulary and target layers the run starts from
    (fine-tuning it on this run's data), or None."""
    if cfg.init is None:
        return None
    from specserve.spec.heads.eagle3_loader import eagle3_path, load_eagle3_drafter

    drafter = load_eagle3_drafter(cfg.init, target, for_inference=False)
    if drafter.embed_tokens is not target.model.embed_tokens:
        raise InvalidParameterError("init", str(eagle3_path(cfg.init)),
                                    "must read the target's own embedding (this drafter carries its own, "
                                    "which training here keeps frozen at the target's)")
    return drafter


def _init_record(cfg: TrainDraftConfig, init) -> dict:
    """What the run started from, for the training record: the folder and a summary of its own record."""
    before = init.extra.get("training") if isinstance(init.extra.get("training"), dict) else {}
    return {"drafter": cfg.init, "command": before.get("command"), "answer_tokens": before.get("answer_tokens"),
            "epochs": before.get("epochs")}


def _final_norm(target: LoadedModel) -> torch.Tensor:
    model = target.model
    norm = getattr(model, "norm", None)
    if norm is not None:
        return norm.weight.detach().float().cpu()
    return model.parts.final_norm.float().cpu()  # the native model keeps it with its kernels' parts


def train_eagle3(cfg: TrainDraftConfig, out: Path, log=print) -> tuple[Path, HeldOutReport]:
    from specserve.spec.heads.eagle3_checkpoint import write_eagle3

    t0 = time.perf_counter()
    conversations = read_prompt_file(cfg.prompts) if cfg.prompts else None
    # The target as it serves (default loading: a quantized GGUF on the native kernels).
    target = load_model(cfg.target, device=cfg.device)
    init = _initial_drafter(cfg, target)  # before the data: a wrong --init is said at once, not hours later
    prompts = None if cfg.prompts is None else str(Path(cfg.prompts).expanduser().resolve())
    plan = DataPlan(prompts, cfg.num_prompts, cfg.max_new_tokens, cfg.seed, cfg.prompt_max_tokens, cfg.chunk_size,
                    record=False, generator=cfg.generator_on(target.model.device.type))
    cache = Path(cfg.cache).expanduser() if cfg.cache else out / "cache"
    shards = build_data(target, plan, conversations, cache, cfg.data_seconds)
    data = load_data(shards)
    layers = init.config.aux_layers if init is not None else default_aux_layers(target.config.num_layers)
    started_from = _init_record(cfg, init) if init is not None else None
    probs = cfg.targets == "probs"
    attach_states(target, data, shards, layers, final=probs)
    t_data = time.perf_counter() - t0
    train_ids, held_ids = split(len(data), cfg.held_out, cfg.seed)
    log(f"data: {len(data)} sequences ({data.num_answer_tokens(train_ids)} answer tokens to train on, "
        f"{len(held_ids)} sequences held back) in {t_data:.0f}s")

    ckpt = out / "checkpoint"
    vocab_size = target.config.vocab_size
    if has_checkpoint(ckpt):
        ids = checkpoint_vocab(ckpt).long()
    elif init is not None:
        ids = init.draft_ids.long().cpu()
    else:
        ids = choose_draft_vocab(data, train_ids, cfg.draft_vocab or vocab_size, vocab_size,
                                 target.tokenizer.eos_token_ids)
    coverage = vocab_coverage(data, train_ids, ids, vocab_size)
    log(f"draft vocabulary: {len(ids)} tokens covering {100 * coverage:.2f}% of the target's answer tokens")
    torch.manual_seed(cfg.seed)
    trainee = _trainee(target, init.head) if init is not None else new_trainee(target, ids)
    if probs:
        trainee.teacher = TargetHead(target, trainee.vocab.ids).to(trainee.vocab.ids.device)
    index = vocab_index(ids, vocab_size).to(trainee.vocab.ids.device)
    opt = new_optimizer(trainee, cfg.lr)

    def held_out_report() -> HeldOutReport:
        return evaluate(trainee, data, held_ids, cfg.score_depth, index, cfg.tokens_per_batch)

    def save(report: HeldOutReport, state: Checkpoint) -> None:
        dtype = SAVE_DTYPES[cfg.save_dtype]
        tensors = {k: v.detach().cpu() for k, v in trainee.heads.state_dict().items()}
        training = {"command": cfg.command, "seed": cfg.seed, "settings": cfg.identity(), "epochs": state.epochs_done,
                    "num_sequences": len(data), "answer_tokens": data.num_answer_tokens(train_ids),
                    "data_seconds": round(t_data), "total_seconds": round(time.perf_counter() - t0),
                    "held_out": report.as_dict(), "history": state.history,
                    "draft_vocab_coverage": round(coverage, 4)}
        if started_from is not None:
            training["init"] = started_from
        write_eagle3(out, trainee.heads.config, tensors,
                     {"target": dataclasses.asdict(TargetIdentity.of(target)), "training": training}, dtype=dtype)

    if has_checkpoint(ckpt):
        state = load_checkpoint(ckpt, trainee, opt)
        log(f"resuming after epoch {state.epochs_done} (step {state.step})")
    else:
        untrained = held_out_report()
        log(f"{'untrained' if init is None else 'as --init left it'}: {untrained.summary()}")
        state = Checkpoint(0, 0, [{"epoch": 0, "held_out": untrained.as_dict()}])

    def after_epoch(epoch: int, loss: float) -> dict:
        report = held_out_report()
        log(f"epoch {epoch + 1}: train loss {loss:.4f} | {report.summary()}")
        save(report, state)
        return {"held_out": report.as_dict()}

    t1 = time.perf_counter()
    plan_t = TrainPlan(cfg.epochs, cfg.lr, cfg.seed, cfg.depth, cfg.tokens_per_batch, cfg.train_seconds)
    state = train_epochs(trainee, opt, data, train_ids, plan_t, index, state, ckpt, after_epoch)
    log(f"trained {cfg.epochs} epochs in {time.perf_counter() - t1:.0f}s")
    # The figures of record are those of the saved weights (rounded to save_dtype), reloaded.
    with torch.no_grad():
        for p in trainee.heads.parameters():
            p.copy_(p.to(SAVE_DTYPES[cfg.save_dtype]).float())
    final = held_out_report()
    save(final, state)
    log(f"saved {out} | {final.summary()}")
    return out, final
