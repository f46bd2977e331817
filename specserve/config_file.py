"""The --config file: settings chosen for a model and a machine, as `specserve tune` writes them,
read by `generate`, `serve`, `bench` and `LLM(config=...)`.

    {"model": "default", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4} | null,
     "max_num_seqs": 16, "max_num_batched_tokens": 2048, "tuned": {...}}

Every key is optional. A value given on the command line (or as an LLM keyword argument) wins
over the file's, and the file's over the default (`pick`).
"""

from __future__ import annotations

import json
import os

from specserve.config import SpeculativeConfig
from specserve.errors import InvalidParameterError

# "tuned" is the tuner's own record of how it chose, which nothing here reads.
CONFIG_FILE_KEYS = ("model", "speculative_config", "max_num_seqs", "max_num_batched_tokens", "tuned")


def load_config_file(path: str | os.PathLike | None) -> dict:
    """The settings in a --config file, without its "tuned" record; {} for no file. Every
    mistake is refused here, naming the file."""
    if path is None:
        return {}
    name = os.fspath(path)
    try:
        with open(name, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise InvalidParameterError("config", name, f"cannot read the file ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidParameterError("config", name, f"is not a JSON file ({e})") from None
    except RecursionError:  # brackets nested deeper than the parser goes: no settings file looks so
        raise InvalidParameterError("config", name, "nests too deeply; it must hold one flat JSON object of settings") from None
    if not isinstance(doc, dict):
        raise InvalidParameterError("config", name, 'must hold one JSON object such as {"max_num_seqs": 16}')
    unknown = sorted(set(doc) - set(CONFIG_FILE_KEYS))
    if unknown:
        raise InvalidParameterError("config", name, f"unknown keys {', '.join(unknown)}; allowed: {', '.join(CONFIG_FILE_KEYS)}")
    if "model" in doc and not isinstance(doc["model"], str):
        raise InvalidParameterError("config", name, f"model={doc['model']!r}: must be a path or 'default'")
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if key in doc and (isinstance(doc[key], bool) or not isinstance(doc[key], int)):
            raise InvalidParameterError("config", name, f"{key}={doc[key]!r}: must be an integer")
    try:
        SpeculativeConfig.from_dict(doc.get("speculative_config"))
    except InvalidParameterError as e:
        raise InvalidParameterError("config", name, f"speculative_config: {e}") from None
    return {k: v for k, v in doc.items() if k != "tuned"}


def pick(given, file: dict, key: str, default):
    """The precedence: a value given (not None), else the config file's, else the default."""
    return given if given is not None else file.get(key, default)
