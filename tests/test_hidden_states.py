"""The hidden-state contract for learned drafters (Proposer.observe_hidden): every position the
target computes for a speculating request is reported once, in order, with the target's final
hidden states, from the prompt's first computed chunk (after any prefix-cache hit) through every
verify step's root and accepted path, before that step's feedback; a preempted request starts
again after remove_request. Checked under chunked prefill, preemption and prefix caching, for
chains and trees."""

from __future__ import annotations

import pytest
import torch

from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.config import EngineConfig
from specserve.engine.engine import LLMEngine
from specserve.sampling_params import SamplingParams
from specserve.spec import NgramProposer, VerifyFeedback
from tests.helpers import ragged_prompts
from tests.test_engine_paged import alone


class RecordingProposer(NgramProposer):
    """The n-gram proposer, asking for hidden states and recording every call in order."""

    needs_hidden_states = True

    def __init__(self, num_branches: int):
        super().__init__(1, 4, num_branches)
        self.events: list[tuple] = []

    def observe_hidden(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        self.events.append(("hidden", request_id, start_position, hidden.clone()))

    def observe(self, feedback: VerifyFeedback) -> None:
        self.events.append(("observe", list(feedback.request_ids)))

    def remove_request(self, request_id: str) -> None:
        super().remove_request(request_id)
        self.events.append(("remove", request_id))


def reference_hidden(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), H] final hidden states of one causal pass on a fresh dense cache."""
    runner = ModelRunner.dense(model, 1, 256)
    return runner.forward(ForwardBatch([0], [0], [ids], all_logits=True, keep_hidden=True)).hidden[0]


@pytest.mark.parametrize("num_branches", [1, 4], ids=["chains", "trees"])
def test_hidden_states_cover_every_computed_position_once(tiny, num_branches):
    system = ragged_prompts(1, seed=9, lo=40, hi=41)[0]
    prompts = [system + p for p in ragged_prompts(10, seed=4, lo=1, hi=30)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    proposer = RecordingProposer(num_branches)
    config = EngineConfig(max_model_len=128, max_num_seqs=8, num_kv_blocks=9, max_num_batched_tokens=24)
    engine = LLMEngine(tiny["loaded"], config, proposer, num_speculative_tokens=4)
    reqs = [engine.add_request(str(i), p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids for r in reqs] == alone(tiny, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.scheduler.pool.prefix_cache_stats().hit_blocks > 0
    assert sum(r.spec.num_accepted for r in reqs) > 0

    model, block = tiny["loaded"].model, engine.config.block_size
    late_starts = 0
    for r in reqs:
        events = [e for e in proposer.events if e[0] in ("hidden", "remove") and e[1] == r.request_id]
        last_remove = max((i for i, e in enumerate(events) if e[0] == "remove" and i < len(events) - 1), default=-1)
        life = [e for e in events[last_remove + 1:] if e[0] == "hidden"]  # since its last (re)start
        assert life and events[-1][0] == "remove"  # removed once finished
        first = life[0][2]
        # 0, or after a prefix-cache hit (for a preempted request possibly past its prompt:
        # it resumes with its generated tokens as prompt, and their full blocks stayed cached).
        assert first % block == 0
        late_starts += first > 0
        ref = reference_hidden(model, r.all_token_ids[:-1])  # the last token is never computed
        pos = first
        for _, _, start, hidden in life:
            assert start == pos  # contiguous, each position once
            torch.testing.assert_close(hidden, ref[start:start + hidden.shape[0]], atol=1e-4, rtol=1e-4)
            pos += hidden.shape[0]
        assert pos == r.num_tokens - 1
    assert late_starts > 0

    # Each step's hidden states come before its feedback.
    since_feedback: set[str] = set()
    for e in proposer.events:
        if e[0] == "hidden":
            since_feedback.add(e[1])
        elif e[0] == "observe":
            assert set(e[1]) <= since_feedback
            since_feedback = set()
