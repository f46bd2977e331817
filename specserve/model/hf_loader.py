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
from specserve.model.weights import build_model


def read_hf_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; a Hugging Face model folder needs one")
    try:
        return ModelConfig.from_hf_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: those named by model.safetensors.index.json, else all *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from None
        files = [folder / n for n in names]
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


def hf_tensors(folder: Path) -> tuple[Iterator[tuple[str, torch.Tensor]], int]:
    """(name, tensor) pairs of a model folder's weight files, and how many there are."""
    files = safetensors_files(folder)
    handles = []
    try:
        for f in files:
            handles.append(safe_open(str(f), framework="pt"))
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(f"cannot read safetensors file {f}: {e}") from None
    total = sum(len(h.keys()) for h in handles)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for f, h in zip(files, handles):
            for name in h.keys():
                try:
                    yield name, h.get_tensor(name)
                except (SafetensorError, OSError) as e:
                    raise ModelLoadError(f"corrupt tensor {name} in {f}: {e}") from None

    return tensors(), total


def load_hf_model(folder: Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> LlamaModel:
    tensors, total = hf_tensors(folder)
    return build_model(cfg, tensors, total, dtype, device)
