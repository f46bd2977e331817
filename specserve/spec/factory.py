"""Build the proposer a speculative config asks for."""

from __future__ import annotations

from specserve.config import DEFAULT_EAGLE_NODES, EngineConfig, SpeculativeConfig
from specserve.model.loader import LoadedModel, load_model
from specserve.spec.proposer import Proposer


def build_proposer(spec: SpeculativeConfig | None, target: LoadedModel, engine: EngineConfig) -> Proposer | None:
    if spec is None:
        return None
    if spec.method == "ngram":
        from specserve.spec.ngram import NgramProposer
        return NgramProposer(prompt_lookup_min=spec.prompt_lookup_min, prompt_lookup_max=spec.prompt_lookup_max,
                             num_branches=spec.num_branches)
    if spec.method == "suffix":
        from specserve.spec.suffix import SuffixProposer
        return SuffixProposer(max_depth=spec.suffix_tree_depth, cache_tokens=spec.suffix_cache_tokens,
                              spec_factor=spec.suffix_spec_factor, min_token_prob=spec.suffix_min_token_prob)
    if spec.method == "lookahead":
        from specserve.spec.lookahead import LookaheadProposer
        return LookaheadProposer(*spec.lookahead_params)
    if spec.method == "eagle":
        from specserve.spec.eagle import EagleProposer
        from specserve.spec.heads.drafter import drafter_path, load_drafter
        return EagleProposer(load_drafter(drafter_path(spec.model, "eagle"), target), target, engine,
                             max_nodes=spec.num_draft_nodes or DEFAULT_EAGLE_NODES, topk=spec.draft_topk)
    if spec.method == "medusa":
        from specserve.spec.heads import load_drafter
        from specserve.spec.medusa import MedusaProposer
        return MedusaProposer(load_drafter(spec.model, target), max_nodes=spec.num_draft_nodes)
    if spec.method == "self_spec":
        from specserve.spec.layer_set import resolve_skip_layers
        from specserve.spec.self_spec import SelfSpecProposer
        return SelfSpecProposer(target, resolve_skip_layers(spec.skip_layers, target), engine)
    from specserve.spec.draft_model import DraftModelProposer
    # The draft runs on the target's path: the native kernels for a native target (its own
    # blocks if it is a quantized GGUF, else the target's int8 / int4), else the torch path in
    # the target's dtype.
    if getattr(target.model, "native", False):
        mode = target.model.quantization
        draft = load_model(spec.model, device=target.model.device, quantization="auto" if mode == "gguf" else mode,
                           max_model_len=engine.max_model_len)
    else:
        draft = load_model(spec.model, dtype=target.model.dtype, device=target.model.device, quantization="none",
                           max_model_len=engine.max_model_len)
    return DraftModelProposer(draft, target, engine)
