"""Build the proposer a speculative config asks for: its method's builder (spec/registry.py)."""

from __future__ import annotations

from specserve.config import EngineConfig, SpeculativeConfig
from specserve.model.loader import LoadedModel
from specserve.spec.proposer import Proposer
from specserve.spec.registry import method_spec


def build_proposer(spec: SpeculativeConfig | None, target: LoadedModel, engine: EngineConfig) -> Proposer | None:
    if spec is None:
        return None
    return method_spec(spec.method).build(spec.options, spec.model, target, engine)
