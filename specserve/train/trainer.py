"""The training loop: AdamW over the heads, a checkpoint after every epoch, and resumption
from the last one that gives the same weights as an uninterrupted run (batch order and noise
are seeded per epoch)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.errors import SpecserveError
from specserve.spec.heads import Drafter
from specserve.train.batches import collate, make_batches
from specserve.train.data import Recorded
from specserve.train.objectives import drafter_steps, mixed_precision

GRAD_CLIP = 1.0
MIN_LR_FRACTION = 0.1  # cosine decay ends at this fraction of the peak
WARMUP_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class TrainPlan:
    epochs: int
    lr: float
    seed: int
    depth: int  # EAGLE: unrolled steps; Medusa: heads
    tokens_per_batch: int  # padded tokens per optimizer step
    # Fit the step count to this many seconds (the schedule decays over the fitted count, and
    # the epoch it ends in is the last, cut short); None: every epoch in full.
    seconds: float | None = None


@dataclass(slots=True)
class Checkpoint:
    epochs_done: int
    step: int
    history: list[dict]  # per epoch: mean training loss and the held-out summary


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5% of steps, then cosine decay to 10% of the peak."""
    warm = max(1, int(total * WARMUP_FRACTION))
    if step < warm:
        return peak * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def new_optimizer(drafter: Drafter, lr: float) -> torch.optim.AdamW:
    params = [p for p in drafter.heads.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)


def train_epochs(drafter: Drafter, opt: torch.optim.AdamW, data: Recorded, train_ids: list[int], plan: TrainPlan,
                 index: torch.Tensor, state: Checkpoint, ckpt_dir: Path,
                 after_epoch: Callable[[int, float], dict]) -> Checkpoint:
    """Run epochs state.epochs_done .. plan.epochs - 1, checkpointing after each.
    after_epoch(epoch, mean loss) -> a summary dict for the history (e.g. held-out figures)."""
    device = drafter.vocab.ids.device
    per_epoch = len(make_batches(data, train_ids, plan.tokens_per_batch, seed=plan.seed))
    total = per_epoch * plan.epochs
    timer = _StepBudget(plan.seconds, state.step) if plan.seconds is not None else None
    drafter.heads.train()
    for epoch in range(state.epochs_done, plan.epochs):
        if state.step >= total:
            break
        batches = make_batches(data, train_ids, plan.tokens_per_batch, seed=plan.seed * 1000 + epoch)
        noise = torch.Generator(device=device).manual_seed(plan.seed * 1000 + epoch)
        losses = []
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{plan.epochs}", unit="batch")
        for batch_ids in bar:
            if state.step >= total:
                bar.close()
                break
            for group in opt.param_groups:
                group["lr"] = lr_at(state.step, total, plan.lr)
            batch = collate(data, batch_ids, plan.depth, index, device, finals=bool(data.finals))
            with mixed_precision(device):
                steps = drafter_steps(drafter, batch, noise)
                loss = torch.stack([s.loss for s in steps]).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.heads.parameters(), GRAD_CLIP)
            opt.step()
            state.step += 1
            losses.append(loss.item())
            if timer is not None:
                total = timer.fit(state.step, total)
            acc = [f"{float(s.correct.sum()) / max(1, int(s.valid.sum())):.2f}" for s in steps]
            bar.set_postfix_str(f"loss {losses[-1]:.3f} top-1 {' '.join(acc)}", refresh=False)
        state.epochs_done = epoch + 1
        drafter.heads.eval()
        state.history.append({"epoch": epoch + 1, "train_loss": round(sum(losses) / max(1, len(losses)), 4),
                              **after_epoch(epoch, sum(losses) / max(1, len(losses)))})
        drafter.heads.train()
        save_checkpoint(ckpt_dir, drafter, opt, state)
    drafter.heads.eval()
    return state


class _StepBudget:
    """Fits a run's step count to a time budget: the rate is timed over steps FIT_FROM..FIT_AT
    of this run (the first ones pay warm-up), and a fraction of the budget is kept for the
    held-out reports and checkpoints between epochs."""

    FIT_FROM, FIT_AT = 5, 30
    RESERVE = 0.15

    def __init__(self, seconds: float, first_step: int):
        self.seconds, self.first = seconds, first_step
        self.t0 = time.perf_counter()
        self.t_from: float | None = None

    def fit(self, step: int, total: int) -> int:
        done = step - self.first
        if done == self.FIT_FROM:
            self.t_from = time.perf_counter()
        elif done == self.FIT_AT and self.t_from is not None:
            now = time.perf_counter()
            rate = (self.FIT_AT - self.FIT_FROM) / max(1e-9, now - self.t_from)  # steps per second
            left = self.seconds * (1 - self.RESERVE) - (now - self.t0)
            fitted = min(total, step + max(0, int(left * rate)))
            print(f"training budget {self.seconds:.0f}s at {rate:.1f} steps/s: {fitted} steps "
                  f"(of {total} for every epoch)")
            return fitted
        return total


# ---- checkpoints -----------------------------------------------------------------------------

def save_checkpoint(folder: Path, drafter: Drafter, opt: torch.optim.AdamW, state: Checkpoint) -> None:
    """heads.safetensors (float32), optimizer.safetensors (AdamW moments) and state.json,
    each written under a temporary name and renamed, state.json last: a checkpoint whose
    state.json exists is complete."""
    folder.mkdir(parents=True, exist_ok=True)
    heads = {k: v.detach().float().cpu().contiguous() for k, v in drafter.heads.state_dict().items()}
    heads["draft_vocab"] = drafter.vocab.ids.cpu().contiguous()
    names = {id(p): n for n, p in drafter.heads.named_parameters()}
    moments = {}
    for p, s in opt.state.items():
        for k, v in s.items():
            moments[f"{names[id(p)]}.{k}"] = v.detach().cpu().reshape(v.shape).contiguous()
    for name, tensors in (("heads", heads), ("optimizer", moments)):
        save_file(tensors, str(folder / f"{name}.tmp"))
        os.replace(folder / f"{name}.tmp", folder / f"{name}.safetensors")
    (folder / "state.tmp").write_text(json.dumps(dataclasses.asdict(state), indent=2) + "\n")
    os.replace(folder / "state.tmp", folder / "state.json")


def has_checkpoint(folder: Path) -> bool:
    return (folder / "state.json").is_file()


def checkpoint_vocab(folder: Path) -> torch.Tensor:
    return load_file(str(folder / "heads.safetensors"))["draft_vocab"]


def load_checkpoint(folder: Path, drafter: Drafter, opt: torch.optim.AdamW) -> Checkpoint:
    """Restore heads and optimizer in place -> the training state."""
    try:
        state = Checkpoint(**json.loads((folder / "state.json").read_text()))
        heads = load_file(str(folder / "heads.safetensors"))
        moments = load_file(str(folder / "optimizer.safetensors"))
    except (OSError, ValueError, TypeError) as e:
        raise SpecserveError(f"cannot read the checkpoint in {folder}: {e}") from None
    heads.pop("draft_vocab")
    device = drafter.vocab.ids.device
    drafter.heads.load_state_dict({k: v.to(device) for k, v in heads.items()})
    for name, p in drafter.heads.named_parameters():
        keys = [k for k in moments if k.startswith(name + ".") and k.count(".") == name.count(".") + 1]
        if keys:
            # AdamW keeps its step count on the host unless capturable.
            opt.state[p] = {k.rsplit(".", 1)[1]: moments[k] if k.endswith(".step") else moments[k].to(device)
                            for k in keys}
    return state
