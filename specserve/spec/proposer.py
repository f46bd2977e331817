"""The interface every drafting method implements, and the dataclasses that cross it.

One speculative step reads: propose -> verify -> accept -> commit. The engine hands a proposer
one `SpecRequest` per speculating request and gets back either a `DraftProposal` (one chain of
drafts per request) or a `DraftTreeProposal` (one `DraftTree` per request, see drafts/tree.py);
the target scores the last committed token plus every draft in one pass, and the engine reports
what verification kept in a `VerifyFeedback`, which adaptive proposers use to tune themselves.

The contract, per request, in the order the engine keeps:
  - `propose` sees only committed tokens. A chain has at most `num_speculative_tokens` drafts; a
    tree at most `max_nodes` nodes and depth `num_speculative_tokens`. A proposer that returns
    trees declares its node budget per step through `num_draft_nodes`. The engine proposes at
    the end of a step, for the next: the request carries the drafts, and the next step takes
    exactly their KV slots.
  - Hidden states, only for proposers with `needs_hidden_states = True` (EAGLE, Medusa):
    `observe_hidden(request_id, start_position, hidden)` with hidden [T, H] (model dtype, on the
    target's device; may be views of a step's buffer) = the target's final hidden states
    (after its last norm: the LM head's input) at token positions start_position ..
    start_position + T - 1 of the request; for a proposer that sets `hidden_layers`, hidden is
    [T, len(hidden_layers) * H] instead: the residual streams entering those decoder layers,
    concatenated in that order, captured by the same pass (EAGLE-3). It is called
      (a) for every prompt chunk the target computes, whole chunk, in order: with a
          prefix-cache hit the first call starts after 0 (for a preempted request that comes
          back, possibly past its original prompt: its generated tokens are prompt then);
      (b) after every decode/verify step: the root (the last committed token, at position
          start = the request's computed length) plus the accepted path, a + 1 rows at positions
          start .. start + a, in path order; always before that step's `observe(feedback)`.
    Positions reported are exactly those the target's cache holds as committed (except when a
    stop condition ends the request inside the accepted path; it is removed right after). A
    request may reach `propose` before any hidden state (its whole prompt but the last token
    came from the prefix cache, so its first computation is a decode step): draft nothing then.
  - Node predictions, only for proposers with `needs_node_predictions = True` (lookahead):
    every `VerifyFeedback` then carries `node_predictions[b]` = the target's argmax of its
    logits (after the request's logits processors: logit_bias, penalties, a grammar) at the root
    and at every node of the tree it verified for request b, 1 + num_draft ints (root first,
    then nodes in proposal order; [root] alone after a step without drafts; a processor may
    have pruned the proposed tree). A node's prediction is the target's greedy next token after
    the node's path, whatever the request's sampling: what a Jacobi iteration needs, computed from logits the step has anyway.
  - `remove_request` when a request finishes, is aborted or is preempted; a preempted request
    comes back later with a fresh prefill (and fresh `observe_hidden` calls from its start).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from specserve.drafts import DraftProposal, DraftTreeProposal, SpecRequest, VerifyFeedback


class Proposer(ABC):
    """A drafting method: `propose(batch) -> DraftProposal | DraftTreeProposal`, then
    `observe(feedback)` after verification. `add_request` / `remove_request` bracket a request's
    life so that methods with per-request state (indexes, draft KV caches) can set it up and
    free it. See the module note for the whole contract."""

    name: str
    needs_hidden_states: bool = False  # True: the engine calls observe_hidden (module note)
    needs_node_predictions: bool = False  # True: feedback carries node_predictions (module note)
    # With needs_hidden_states: target layers whose entering residual streams observe_hidden
    # reports instead of the final hidden state (module note); empty: the final hidden state.
    hidden_layers: tuple[int, ...] = ()

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """A request starts speculating. Stateless proposers need nothing."""

    def remove_request(self, request_id: str) -> None:
        """A request finished, was aborted or preempted: drop whatever is held for it."""

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        """The most nodes one draft of a request with this k may have: k for chains; a tree
        proposer returns its node budget (at least k, the tree's depth)."""
        return num_speculative_tokens

    @abstractmethod
    def propose(self, batch: list[SpecRequest]) -> DraftProposal | DraftTreeProposal:
        """Drafts for each request of `batch`, in order: num_draft[b] <= batch[b].num_speculative_tokens,
        or trees of depth <= num_speculative_tokens and at most max_nodes nodes."""

    def observe_hidden(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        """The target's final hidden states [T, H] at positions start_position.. (module note)."""

    def observe(self, feedback: VerifyFeedback) -> None:
        """Verification results of the last step; adaptive methods tune themselves on them."""
