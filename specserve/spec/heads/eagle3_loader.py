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

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from gguf import GGMLQuantizationType
from torch import nn

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.model.loader import LoadedModel
from specserve.spec.heads.config import TargetIdentity
from specserve.spec.heads.eagle3 import Eagle3Head
from specserve.spec.heads.eagle3_config import DRAFT_IDS, Eagle3Config
from specserve.spec.heads.eagle_kv import DraftPass, FlatDraftAttention

# The EAGLE-3 drafter shipped for the embedded model, named by model "default".
DEFAULT_EAGLE3_DRAFTER = "eagle3-smollm2-135m"


def eagle3_path(folder: str | Path | None) -> Path:
    if folder is None or str(folder) == "default":
        return Path(str(resources.files("specserve") / "assets" / DEFAULT_EAGLE3_DRAFTER))
    return Path(folder).expanduser()


@dataclass(slots=True)
class Eagle3Drafter:
    config: Eagle3Config
    head: Eagle3Head  # float32 torch module (training, and the torch path's drafting)
    embed_tokens: nn.Module  # the target's embedding, or the checkpoint's own
    native: object | None  # spec.heads.native_eagle3.NativeEagle3Drafter next to a native target
    extra: dict = field(default_factory=dict)  # the checkpoint's specserve record (target, training); {} elsewhere

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
        out = head(embeds, feature, p.positions.to(feature.device), p, FlatDraftAttention(k_rows, v_rows))
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
    return Eagle3Drafter(ckpt.config, head, embed, native, ckpt.extra)
