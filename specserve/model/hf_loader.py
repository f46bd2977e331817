"""Loading a Hugging Face model folder: config.json and one or many *.safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig
from specserve.model.llama import LlamaModel
from specserve.model.weights import (build_model, checkpoint_shape, expected_shapes, fused_parts, ignored_tensor,
                                     split_fused)

# The safetensors dtypes of weights (the model computes in float).
FLOAT_DTYPES = ("F32", "F16", "BF16")


def read_hf_config(folder: Path) -> ModelConfig:
    """config.json, every field checked, and then every weight file's tensors against it
    (check_hf_tensors): nothing is allocated from a bad folder."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; a Hugging Face model folder needs one")
    cfg = ModelConfig.from_hf_dict(read_json(path), where=str(path))
    check_hf_tensors(folder, cfg)
    return cfg


def read_json(path: Path) -> object:
    """A JSON file's document; ModelLoadError for one that is not UTF-8 JSON or nests too deep
    for the parser (a crafted file of a million brackets)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ModelLoadError(f"{path} nests too deeply to be a model's JSON file") from None


def check_hf_tensors(folder: Path, cfg: ModelConfig) -> None:
    """The weight files hold every tensor a model of `cfg` needs, with exactly its shape and a
    float dtype, and no other: read from the files' headers, before any tensor is loaded."""
    expected = expected_shapes(cfg)
    seen: set[str] = set()
    for f, handle in _open_all(safetensors_files(folder)):
        for name in handle.keys():
            if ignored_tensor(name):
                continue
            want, supplies = checkpoint_shape(expected, name)  # a fused tensor (Phi-3) supplies its parts
            if want is None and name == "lm_head.weight":  # saved although tied to the embedding
                want = (cfg.vocab_size, cfg.hidden_size)
            if want is None:
                raise ModelLoadError(f"{f}: unexpected tensor {name!r} for a {cfg.architecture} model of "
                                     f"{cfg.num_layers} layers (num_hidden_layers)")
            part = handle.get_slice(name)
            shape, dtype = tuple(part.get_shape()), part.get_dtype()
            if shape != want:
                raise ModelLoadError(f"{f}: tensor {name} has shape {shape}, expected {want} from config.json")
            if dtype not in FLOAT_DTYPES:
                raise ModelLoadError(f"{f}: tensor {name} has dtype {dtype}; allowed: {', '.join(FLOAT_DTYPES)}")
            twice = seen.intersection(supplies)
            if twice:
                raise ModelLoadError(f"{f}: tensor {name} gives {sorted(twice)[0]} a second time "
                                     "(a fused and an unfused copy, or two files)")
            seen.update(supplies)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ModelLoadError(f"{folder}: tensors missing for a model of this config.json: {', '.join(missing[:5])}"
                             + (" ..." if len(missing) > 5 else ""))


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: those named by model.safetensors.index.json, else all *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(read_json(index)["weight_map"].values()))
            files = [folder / n for n in names]
        except (KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index (an object whose \"weight_map\" maps "
                                 f"tensor names to file names): {type(e).__name__}: {e}") from None
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names weight files that are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (found {bins}: pickle checkpoints are not loaded; convert them to safetensors)" if bins else ""
        raise ModelLoadError(f"{folder} has no *.safetensors weight files{hint}")
    return files


def hf_tensors(folder: Path, cfg: ModelConfig) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """(name, tensor) pairs of a model folder's weight files (checked by check_hf_tensors), fused
    tensors split into their parts (weights.split_fused), and how many pairs there are. Gemma's
    norm weights w come as the float32 (1 + w) its RMSNorm multiplies by (what a GGUF stores)."""
    files = safetensors_files(folder)
    handles = [h for _, h in _open_all(files)]
    total = sum(len(fused_parts(name) or (name,)) for h in handles for name in h.keys())
    expected = expected_shapes(cfg)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f, h in zip(files, handles):
            for name in h.keys():
                try:
                    tensor = h.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise ModelLoadError(f"corrupt tensor {name} in {f}: {e}") from None
                if cfg.sandwich_norms and name.endswith("norm.weight"):
                    tensor = tensor.float() + 1.0
                yield from split_fused(expected, name, tensor)

    return tensors(), total


def _open_all(files: list[Path]) -> list[tuple[Path, object]]:
    """Each file with its safetensors handle (which has checked the header against the file's size)."""
    opened = []
    for f in files:
        try:
            opened.append((f, safe_open(str(f), framework="pt")))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"cannot read safetensors file {f}: {e}") from None
    return opened


def load_hf_model(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                  positions: int | None = None) -> LlamaModel:
    tensors, total = hf_tensors(folder, cfg)
    return build_model(cfg, tensors, total, dtype, device, positions=positions)
