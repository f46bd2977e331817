"""EAGLE-3 proposer: a one-layer drafter over three fused target states grows a dynamic draft
tree per request (EAGLE-2's tree, EAGLE-3's drafter).

Per step, for every drafting request of the batch at once (L = the last position with target
states; the root is token L+1):
  1. catch-up: one pass over every row's new positions (the accepted path, or the whole prompt
     the first time): fc fuses the target's three captured states [3 Ht] into a feature, the
     layer writes the drafter's KV at those positions, and its output at L gives the logits of
     the root's children.
  2. growth: depth by depth, the `topk` candidates of highest cumulative log-probability of
     every row are expanded in one pass (input: the candidate's token and its parent's
     output; they attend to the context and to their own ancestors through a tree mask),
     each yielding its `topk` children.
  3. the tree: each row's `max_nodes` candidates of highest cumulative log-probability.
Each pass is one call into the drafter (native kernels next to a native target: fc, layer and
draft head as quantized products over the drafter's own paged KV; torch otherwise). Candidates
are deterministic (top-k), so the verifier's tree rule keeps every output exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.config import EngineConfig
from specserve.errors import InvalidParameterError
from specserve.model.loader import LoadedModel
from specserve.spec.eagle import EagleOptions, FeatureTreeProposer
from specserve.spec.heads.eagle3_loader import (DEFAULT_DRAFTER_FORMAT, DRAFTER_FORMATS, Eagle3Drafter,
                                                load_eagle3_drafter)
from specserve.spec.registry import MethodSpec


class Eagle3Proposer(FeatureTreeProposer):
    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, target: LoadedModel, engine: EngineConfig, **options):
        super().__init__(drafter, target, engine, **options)
        self.hidden_layers = drafter.config.aux_layers  # the target's states it reads (module note)


@dataclass(frozen=True, slots=True)
class Eagle3Options(EagleOptions):
    """eagle's options (the tree and its top-k), and the format of the drafter's matrices on the
    native kernels (vLLM's speculative_config "quantization" names the draft's): Q4_0 by
    default, half the bytes a drafting depth reads of Q8_0's (Spec-Bench, 65 prompts, on the
    2-core Xeon: a depth 0.60 ms against 0.76, 0.97x plain against 0.95x; tau at k=4 on 24
    prompts 1.567 against 1.584), or Q8_0 / Q4_1. Drafts are only proposals: the output is the
    target's whatever the format."""

    quantization: str = DEFAULT_DRAFTER_FORMAT

    def __post_init__(self) -> None:
        EagleOptions.__post_init__(self)
        if self.quantization not in DRAFTER_FORMATS:
            raise InvalidParameterError("quantization", self.quantization,
                                        f"must be one of {', '.join(DRAFTER_FORMATS)} (the EAGLE-3 drafter's format)")


def _build(options: Eagle3Options, model: str | None, target: LoadedModel, engine: EngineConfig) -> Eagle3Proposer:
    return Eagle3Proposer(load_eagle3_drafter(model, target, quantization=options.quantization), target, engine,
                          **options.companions())


# eagle's tree and its default, and the drafter's format.
METHOD = MethodSpec("eagle3", Eagle3Options, _build, auto_max_k=6,
                    needs_model="method 'eagle3' needs an EAGLE-3 drafter folder (its own, one from "
                                "`specserve train-draft --method eagle3`, or 'default' for the embedded model)")
