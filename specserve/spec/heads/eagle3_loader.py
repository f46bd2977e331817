"""An EAGLE-3 drafter bound to its target, ready to draft: the checkpoint read (any supported
layout, eagle3_checkpoint.py), checked against the target, and run either on the native kernels
(next to a native target: fc, layer and draft head as Q8_0 products, one call per pass) or in
torch (float32, the reference path every device runs).

Both run the same pass (`step`) over flattened rows described by a DraftPass:
  embeds  [N, H] float32   the token inputs
  feature [N, H] or [N, 3 Ht] float32 (fc applied first)
  -> out [N, H] (the next depth's feature), logits [N, Vd] float32
and write the rows' keys and values into the drafter's one-layer cache k_rows, v_rows
[1, rows, Hkv, D] (float16 on the native path, float32 in torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.model.loader import LoadedModel
from specserve.spec.heads.config import TargetIdentity
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_config import DRAFT_IDS, Eagle3Config

# The EAGLE-3 drafter shipped for the embedded model, named by model "default".
DEFAULT_EAGLE3_DRAFTER = "eagle3-smollm2-135m"


@dataclass(slots=True)
class DraftPass:
    """One drafting pass over flattened rows, in the native layer's terms (on the host).

    Sequence s owns rows [q_start[s], q_start[s + 1]); row i writes its key and value to cache
    row `write_rows[i]` and sees the sequence's slots [kv_start[s], prefix_len[i]) and, when
    tree_row is set, the slots tree_start[s] + m with tree_mask[tree_row[i] + m] != 0."""

    positions: torch.Tensor  # [N] int64 (RoPE)
    write_rows: torch.Tensor  # [N] int64 physical cache rows
    q_start: torch.Tensor  # [B + 1] int64
    block_table: torch.Tensor  # [B, blocks] int64
    block_size: int
    prefix_len: torch.Tensor  # [N] int64
    kv_start: torch.Tensor  # [B] int64
    tree_row: torch.Tensor | None = None  # [N] int64 byte offset of each row's mask
    tree_start: torch.Tensor | None = None  # [B]
    tree_size: torch.Tensor | None = None  # [B]
    tree_mask: torch.Tensor | None = None  # flat uint8


def eagle3_path(folder: str | Path | None) -> Path:
    if folder is None or str(folder) == "default":
        return Path(str(resources.files("specserve") / "assets" / DEFAULT_EAGLE3_DRAFTER))
    return Path(folder).expanduser()


class _FlatDraftAttention:
    """The attention interface (`attend(layer, q, k, v, meta)`) over a DraftPass: writes the
    rows' keys and values to the cache, then each sequence's rows attend to their visible slots."""

    def __init__(self, k_rows: torch.Tensor, v_rows: torch.Tensor):
        self.k, self.v = k_rows[0], v_rows[0]  # [rows, Hkv, D]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: DraftPass) -> torch.Tensor:
        """q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq * D]."""
        device = q.device
        rows = p.write_rows.to(device)
        self.k.index_copy_(0, rows, k.to(self.k.dtype))
        self.v.index_copy_(0, rows, v.to(self.v.dtype))
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        block = p.block_size
        starts = p.q_start.tolist()
        for s in range(len(starts) - 1):
            a, b = starts[s], starts[s + 1]
            if a == b:
                continue
            prefix = p.prefix_len[a:b]
            span = int(prefix.max())
            if p.tree_row is not None:
                span = max(span, int(p.tree_start[s] + p.tree_size[s]))
            # Slots before kv_start were never written (they may hold anything): not even read.
            first = int(p.kv_start[s])
            slots = torch.arange(first, span)
            phys = p.block_table[s, slots // block] * block + slots % block
            keys, values = self.k[phys.to(device)].float(), self.v[phys.to(device)].float()  # [S, Hkv, D]
            visible = slots[None, :] < prefix[:, None]  # [n, S]
            if p.tree_row is not None:
                size, t0 = int(p.tree_size[s]), int(p.tree_start[s]) - first
                for j, i in enumerate(range(a, b)):
                    r = int(p.tree_row[i])
                    if r >= 0:
                        visible[j, t0:t0 + size] |= p.tree_mask[r:r + size].bool()
            groups = q.shape[1] // keys.shape[1]
            kk = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, S, D]
            vv = values.repeat_interleave(groups, dim=1).transpose(0, 1)
            mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf")).to(device)
            o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), kk, vv, attn_mask=mask[None])
            out[a:b] = o.transpose(0, 1).reshape(b - a, -1).to(out.dtype)
        return out


@dataclass(slots=True)
class Eagle3Drafter:
    config: Eagle3Config
    head: Eagle3Head  # float32 torch module (training, and the torch path's drafting)
    embed_tokens: nn.Module  # the target's embedding, or the checkpoint's own
    native: object | None  # spec.heads.native_eagle3.NativeEagle3Drafter next to a native target

    @property
    def draft_ids(self) -> torch.Tensor:
        return self.head.draft_ids

    @property
    def device(self) -> torch.device:
        return self.head.fc.weight.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.float16 if self.native is not None else torch.float32

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] target token ids -> float32 [N, H]."""
        return self.embed_tokens(ids).float()

    def step(self, embeds: torch.Tensor, feature: torch.Tensor, p: DraftPass, k_rows: torch.Tensor,
             v_rows: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting pass (module note) -> (out [N, H], logits [N, Vd]); last_only (a
        catch-up): every row writes its key and value, and only each sequence's last row is
        returned -> out [B, H], logits [B, Vd] (the native layer computes nothing more for the
        others)."""
        if self.native is not None:
            return self.native.step(embeds.contiguous(), feature.contiguous(), p.positions, p.write_rows, k_rows,
                                    v_rows, p.block_size, p.q_start, p.block_table, p.prefix_len, p.kv_start,
                                    p.tree_row, p.tree_start, p.tree_size, p.tree_mask, last_only=last_only)
        head = self.head
        if feature.shape[-1] == 3 * self.config.target_hidden_size:  # the target's states: depth 1
            feature = head.fuse(feature)
        out = head(embeds, feature, p.positions.to(feature.device), p, _FlatDraftAttention(k_rows, v_rows))
        if last_only:
            out = out.index_select(0, (p.q_start[1:] - 1).to(out.device))
        return out, head.logits(out)


# speculative_config's eagle3 "quantization": the format of the native drafter's matrices.
# Q4_0 by default: half the bytes a drafting depth reads of Q8_0's, for a little acceptance
# (spec/eagle3.py's Eagle3Options has the figures).
DRAFTER_FORMATS = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
                   "q4_1": GGMLQuantizationType.Q4_1}
DEFAULT_DRAFTER_FORMAT = "q4_0"


def load_eagle3_drafter(folder: str | Path | None, target: LoadedModel, *, for_inference: bool = True,
                        quantization: str = DEFAULT_DRAFTER_FORMAT) -> Eagle3Drafter:
    """The drafter in `folder` ("default": the one shipped for the embedded model) for `target`;
    next to a native target its matrices are quantized to `quantization` (DRAFTER_FORMATS)."""
    from specserve.spec.heads.eagle3_checkpoint import read_eagle3

    path = eagle3_path(folder)
    if not path.is_dir():
        raise InvalidParameterError("speculative_config.model", str(path),
                                    "must be an EAGLE-3 drafter folder (config.json and safetensors weights)")
    ckpt = read_eagle3(path, target.config)
    if isinstance(ckpt.extra.get("target"), dict):
        try:
            identity = TargetIdentity(**ckpt.extra["target"])
        except TypeError as e:
            raise ModelLoadError(f"{path}/config.json: its specserve target record is malformed ({e})") from None
        identity.check(target, str(path))
    head = Eagle3Head(ckpt.config, target.model.max_positions)
    state = dict(ckpt.tensors)
    state[DRAFT_IDS] = state[DRAFT_IDS].long()
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{path}: the weights do not match its config: {e}") from None
    device = target.model.device
    head = head.to(device).eval().requires_grad_(False)
    if ckpt.own_embedding is not None:
        embed = nn.Embedding.from_pretrained(ckpt.own_embedding.float(), freeze=True).to(device)
    else:
        embed = target.model.embed_tokens
    native = None
    if for_inference and getattr(target.model, "native", False):
        from specserve import native as native_ext
        from specserve.spec.heads.native_eagle3 import NativeEagle3Drafter

        native = NativeEagle3Drafter.from_head(head, native_ext.load(), target.model.level,
                                               DRAFTER_FORMATS[quantization])
    return Eagle3Drafter(ckpt.config, head, embed, native)
