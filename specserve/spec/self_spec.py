"""Self-speculative decoding: the target drafts with a subset of its own decoder layers.

The draft is a view of the target (`model.with_layers(kept)`) that shares every weight: the same
embeddings, kept layers, final norm and LM head, no second model file and no copied tensor. It
drafts exactly as a separate draft model does (DraftModelProposer): on its own small paged KV
pool holding the kept layers' keys and values, rolled back to the common prefix after each
verification. Its prompt prefill costs a pass of the kept layers over the prompt (about
len(kept) / num_layers of the target's prefill); drafting's catch-up tokens ride in the first
draft pass of each step, so a step pays k draft passes and nothing more.

Which layers to skip: spec/layer_set.py (where a layer set comes from), spec/layer_search.py
(how `specserve self-spec-search` finds one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.config import EngineConfig
from specserve.model.loader import LoadedModel
from specserve.spec.draft_model import DraftModelProposer, check_catch_up_window
from specserve.spec.layer_set import check_skip_layers
from specserve.spec.registry import MethodSpec


class SelfSpecProposer(DraftModelProposer):
    """DraftModelProposer over a layer-skipping view of the target."""

    name = "self_spec"

    def __init__(self, target: LoadedModel, skip_layers: Sequence[int], engine: EngineConfig,
                 catch_up_window: int | None = None):
        self.skip_layers = check_skip_layers(skip_layers, target.config.num_layers, "skip_layers")
        super().__init__(layer_view(target, self.skip_layers), target, engine, catch_up_window=catch_up_window)


def layer_view(target: LoadedModel, skip_layers: Sequence[int]) -> LoadedModel:
    """The target without the decoder layers `skip_layers`, as a model of its own (same
    tokenizer, config.num_layers the kept count) sharing the target's weights."""
    skip = set(skip_layers)
    keep = [i for i in range(target.config.num_layers) if i not in skip]
    view = target.model.with_layers(keep)
    return LoadedModel(model=view, tokenizer=target.tokenizer, config=view.config, path=target.path,
                       name=f"{target.name} ({len(keep)} of {target.config.num_layers} layers)", kernels=target.kernels)


@dataclass(frozen=True, slots=True)
class SelfSpecOptions:
    """speculative_config's self_spec keys. skip_layers: the target's decoder layers its draft
    skips; None: the model's layer set (spec/layer_set.py: next to the model, or shipped for the
    embedded one). catch_up_window: when drafting resumes more than this many tokens behind (the
    planner kept drafts off for a while, or the prompt), the draft reads only the last this-many
    tokens (DraftModelProposer.catch_up_window); None catches up on everything, which costs a pass
    of the kept layers over the whole prompt the first time and over every pause after."""

    skip_layers: tuple[int, ...] | None = None
    catch_up_window: int | None = 16

    def __post_init__(self) -> None:
        if self.skip_layers is not None:
            object.__setattr__(self, "skip_layers", check_skip_layers(self.skip_layers, None, "skip_layers"))
        check_catch_up_window(self.catch_up_window)


def _build(options: SelfSpecOptions, model: str | None, target: LoadedModel, engine: EngineConfig) -> SelfSpecProposer:
    from specserve.spec.layer_set import resolve_skip_layers
    return SelfSpecProposer(target, resolve_skip_layers(options.skip_layers, target), engine, options.catch_up_window)


METHOD = MethodSpec("self_spec", SelfSpecOptions, _build, auto_max_k=6)
