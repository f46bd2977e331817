"""A drafter bound to its target (the trained heads plus the target's frozen embedding and
vocabulary rows), and its files: model.safetensors + config.json."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.hardware import can_pack, drafter_dtype
from specserve.model.linear import pack_linears, quantize_linears
from specserve.model.loader import LoadedModel
from specserve.spec.heads.config import CONFIG_FILE, SAVE_DTYPES, WEIGHTS_FILE, DrafterConfig, TargetIdentity
from specserve.spec.heads.modules import DraftVocab, EagleHead, MedusaHeads

# The EAGLE drafter shipped for the embedded model (specserve/assets), named by model "default".
DEFAULT_DRAFTERS = {"eagle": "eagle-smollm2-135m"}
_VOCAB_KEY = "draft_vocab"  # [Vd] int64: the target token id of each draft-vocabulary row
_HEADS_PREFIX = "heads."


@dataclass(slots=True)
class Drafter:
    config: DrafterConfig
    heads: EagleHead | MedusaHeads  # the trained part, the only one saved
    vocab: DraftVocab  # the target's vocabulary projection at the draft vocabulary's rows
    embed: nn.Embedding  # the target's token embedding (EAGLE's token input)
    # What the heads and vocabulary rows compute in: float32 for training (under autocast),
    # the saved dtype for drafting. Inputs from the target are cast to it at the heads' door.
    dtype: torch.dtype


def vocab_projection_weight(target: LoadedModel) -> torch.Tensor:
    """The target's vocabulary projection [V, H]. A CPU-packed projection keeps no plain weight
    unless it is tied to the embedding; a linear map probed with the identity returns its
    weight exactly (every output is one product by 1 plus products by 0)."""
    head = target.model.lm_head
    weight = getattr(head, "weight", None)
    if weight is not None:
        return weight.detach()
    eye = torch.eye(target.config.hidden_size, dtype=target.model.dtype, device=target.model.device)
    with torch.inference_mode():
        return head(eye).t().contiguous()  # [H, V] -> [V, H]


def new_drafter(target: LoadedModel, method: str, draft_ids: torch.Tensor, *, num_heads: int = 0,
                dtype: str = "float32", tree_choices: list[list[int]] | None = None) -> Drafter:
    """Freshly initialised heads of `method` for `target` (EAGLE's layer takes the target's
    layer shape), scoring the draft vocabulary `draft_ids` [Vd]."""
    tc = target.config
    config = DrafterConfig(method=method, hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                           draft_vocab_size=len(draft_ids), target=TargetIdentity.of(target), dtype=dtype,
                           num_heads=num_heads, layer=DrafterConfig.eagle_layer(tc) if method == "eagle" else None,
                           tree_choices=tree_choices)
    return bind(config, new_heads(config, target), draft_ids, target)


def new_heads(config: DrafterConfig, target: LoadedModel) -> EagleHead | MedusaHeads:
    """The trainable heads of `config`; EAGLE's RoPE tables cover the positions the target's do."""
    if config.method == "medusa":
        return MedusaHeads(config.hidden_size, config.num_heads)
    return EagleHead(config.layer_config(), target.model.max_positions)


def bind(config: DrafterConfig, heads: EagleHead | MedusaHeads, draft_ids: torch.Tensor,
         target: LoadedModel) -> Drafter:
    """Attach heads to the target's frozen embedding and vocabulary rows, on the target's device."""
    if draft_ids.shape != (config.draft_vocab_size,):
        raise ModelLoadError(f"the draft vocabulary has {tuple(draft_ids.shape)} ids, config says {config.draft_vocab_size}")
    device = target.model.device
    ids = draft_ids.to(device)
    vocab = DraftVocab(ids, vocab_projection_weight(target)[ids]).to(device)
    return Drafter(config, heads.to(device), vocab, target.model.embed_tokens, torch.float32)


def save_drafter(folder: str | Path, drafter: Drafter) -> None:
    """model.safetensors (heads in config.dtype, plus the draft vocabulary ids) and config.json."""
    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    dtype = SAVE_DTYPES[drafter.config.dtype]
    tensors = {_HEADS_PREFIX + k: v.detach().to("cpu", dtype).contiguous()
               for k, v in drafter.heads.state_dict().items()}
    tensors[_VOCAB_KEY] = drafter.vocab.ids.to("cpu", torch.int64).contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(drafter.config.to_json())


def drafter_path(folder: str | Path, method: str) -> Path:
    """A drafter folder, or "default": the one shipped for the embedded model."""
    if str(folder) == "default" and method in DEFAULT_DRAFTERS:
        return Path(str(resources.files("specserve") / "assets" / DEFAULT_DRAFTERS[method]))
    return Path(folder).expanduser()


def load_drafter(folder: str | Path, target: LoadedModel, *, for_inference: bool = True) -> Drafter:
    """Load a trained drafter for `target` (refused if trained for another model). For
    inference the heads run in their saved dtype, frozen and, on a CPU, prepacked."""
    folder = Path(folder).expanduser()
    if not (folder / WEIGHTS_FILE).is_file():
        raise InvalidParameterError("speculative_config.model", str(folder),
                                    f"must be a folder with {WEIGHTS_FILE} and {CONFIG_FILE} made by `specserve train-draft`")
    config = DrafterConfig.read(folder)
    config.target.check(target, str(folder))
    config.check_layer(target.config, str(folder))
    try:
        tensors = load_file(str(folder / WEIGHTS_FILE))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read {folder / WEIGHTS_FILE}: {e}") from None
    draft_ids = tensors.pop(_VOCAB_KEY, None)
    if draft_ids is None:
        raise ModelLoadError(f"{folder / WEIGHTS_FILE} has no {_VOCAB_KEY} tensor")
    heads = new_heads(config, target)
    state = {k.removeprefix(_HEADS_PREFIX): v.float() for k, v in tensors.items()}
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ModelLoadError(f"{folder / WEIGHTS_FILE} does not match its config.json: {e}") from None
    drafter = bind(config, heads, draft_ids, target)
    if for_inference and getattr(target.model, "native", False):
        # Next to a native target the heads run on the same kernels, as Q8_0 blocks (a quarter
        # of float32's bytes; drafting time is the bytes moved).
        from specserve import native

        drafter.heads.eval().requires_grad_(False)
        quantize_linears(drafter.heads, native.load(), target.model.level)
        quantize_linears(drafter.vocab, native.load(), target.model.level)
    elif for_inference:
        # Drafting reads every drafter weight once per pass of a few rows, so the time is the
        # bytes moved: bfloat16 (the default save dtype) halves it, where the CPU has it. The
        # output stays exact: only the candidates change, and the target verifies them.
        device = target.model.device
        dtype = drafter_dtype(SAVE_DTYPES[config.dtype], device)
        drafter.heads.to(dtype).eval().requires_grad_(False)
        drafter.vocab.to(dtype)
        drafter.dtype = dtype
        if can_pack(device, dtype):
            pack_linears(drafter.heads)
            pack_linears(drafter.vocab)
    return drafter
