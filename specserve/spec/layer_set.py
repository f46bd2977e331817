"""Layer sets: which decoder layers self_spec's draft skips, stored as a small JSON file.

A layer set comes from a search on calibration prompts (spec/layer_search.py, run by `specserve
self-spec-search`). The engine takes the first of: speculative_config's `skip_layers`, the
layer set next to the model file or folder (`<model>.self_spec.json`), the layer set shipped in
the package for the embedded model (specserve/data/self_spec/, keyed by the model file's name
and size).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from specserve.errors import InvalidParameterError, ModelLoadError

if TYPE_CHECKING:
    from specserve.model.loader import LoadedModel

LAYER_SET_SUFFIX = ".self_spec.json"
SEARCH_COMMAND = "specserve self-spec-search --model"
LAYER_SET_VERSION = 1


def check_skip_layers(skip: object, num_layers: int | None, where: str) -> tuple[int, ...]:
    """`skip` as sorted layer indices: a list of distinct integers in [0, num_layers), leaving at
    least one layer (num_layers None: only the form is checked, the model is not known yet)."""
    if isinstance(skip, (str, bytes)) or not isinstance(skip, Sequence):
        raise InvalidParameterError(where, skip, "must be a list of layer indices to skip, e.g. [3, 5, 7]")
    bad = [i for i in skip if isinstance(i, bool) or not isinstance(i, int) or i < 0]
    if bad:
        raise InvalidParameterError(where, list(skip), f"must hold non-negative integer layer indices; {bad[0]!r} is not one")
    if len(set(skip)) != len(skip):
        raise InvalidParameterError(where, list(skip), "names a layer twice")
    if num_layers is not None:
        if any(i >= num_layers for i in skip):
            raise InvalidParameterError(where, list(skip), f"must be layer indices in [0, {num_layers}): the model "
                                                           f"has {num_layers} decoder layers")
        if len(skip) >= num_layers:
            raise InvalidParameterError(where, list(skip), f"skips every one of the model's {num_layers} layers; "
                                                           "the draft needs at least one")
    return tuple(sorted(skip))


def layer_set_path(model_path: Path) -> Path:
    """Where the search writes a model's layer set by default: next to the model, named after
    it (`m.gguf` -> `m.self_spec.json`, folder `m` -> `m.self_spec.json`)."""
    model_path = Path(model_path)
    name = model_path.name if model_path.is_dir() else model_path.stem
    return model_path.with_name(name + LAYER_SET_SUFFIX)


def shipped_layer_set_path(model_path: Path) -> Path | None:
    """The layer set shipped in the package for this model file, if any: keyed by the file's
    name, and used only when its size matches too (the same file, wherever it was copied)."""
    model_path = Path(model_path)
    if not model_path.is_file():
        return None
    path = Path(str(resources.files("specserve") / "data" / "self_spec" / (model_path.name + ".json")))
    if not path.is_file():
        return None
    model = json.loads(path.read_text()).get("model", {})
    return path if model.get("bytes") == model_path.stat().st_size else None


def save_layer_set(path: Path, target: LoadedModel, skip_layers: Sequence[int], figures: dict) -> None:
    """Write a layer set: the layers to skip, what model they are for, and the search's figures."""
    doc = {"version": LAYER_SET_VERSION,
           "model": {"name": target.name, "file": target.path.name, "num_layers": target.config.num_layers,
                     "bytes": target.path.stat().st_size if target.path.is_file() else None},
           "skip_layers": sorted(skip_layers), "search": figures}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def load_layer_set(path: Path, num_layers: int) -> tuple[int, ...]:
    """The layers to skip from a layer set file, checked against the model's layer count."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the self_spec layer set {path}: {e}") from None
    if not isinstance(doc, dict) or "skip_layers" not in doc:
        raise ModelLoadError(f"{path} is not a self_spec layer set (no 'skip_layers'); write one with {SEARCH_COMMAND} PATH")
    want = (doc.get("model") or {}).get("num_layers")
    if want is not None and want != num_layers:
        raise ModelLoadError(f"the self_spec layer set {path} was searched for a model of {want} layers, but this "
                             f"model has {num_layers}; search again with {SEARCH_COMMAND} PATH")
    return check_skip_layers(doc["skip_layers"], num_layers, f"skip_layers in {path}")


def resolve_skip_layers(skip_layers: Sequence[int] | None, target: LoadedModel) -> tuple[int, ...]:
    """The layers self_spec skips: given explicitly, else the layer set next to the model, else
    the one shipped for it; else an error that names the search command."""
    num_layers = target.config.num_layers
    if skip_layers is not None:
        return check_skip_layers(skip_layers, num_layers, "skip_layers")
    for path in (layer_set_path(target.path), shipped_layer_set_path(target.path)):
        if path is not None and path.is_file():
            return load_layer_set(path, num_layers)
    raise InvalidParameterError(
        "speculative_config.skip_layers", None,
        f"method 'self_spec' needs the layers to skip: none given, and no layer set at {layer_set_path(target.path)}; "
        f"find them with `{SEARCH_COMMAND} {target.path}` (a few minutes), or give skip_layers / --skip-layers")
