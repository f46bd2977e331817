"""The scheduler in pure Python: token budget, chunked prefill, preemption and resumption,
fairness. Requests are stand-ins with only what the scheduler reads; a fake step moves them
forward the way the engine does (compute the scheduled tokens, sample when the last one is
reached, commit)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.cost_model import PassShape
from specserve.engine.request import Status
from specserve.engine.scheduler import MIN_PROMPT_CHUNK, Scheduler


@dataclass(eq=False)
class FakeRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_new: int
    num_speculative_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING

    @property
    def all_token_ids(self):
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    num_pending_drafts: int = 0  # the engine's proposer sets it at the end of a step that sampled

    def propose(self, max_model_len):
        room = min(self.max_new - len(self.output_token_ids), max_model_len - self.num_tokens) - 1
        self.num_pending_drafts = max(0, min(self.num_speculative_tokens, room))


def make(config: EngineConfig, num_blocks: int) -> Scheduler:
    return Scheduler(config, num_blocks)


def fake_step(s: Scheduler, accept_drafts: int = 0, check=None, predict=None):
    """One schedule -> execute -> update round; `check` sees the scheduler output before the
    step runs; `predict` is the pass cost the engine would hand the scheduler. Returns the
    output and the requests that finished."""
    out = s.schedule(predict)
    if check:
        check(out)
    done = []
    for sr in out.prefill + out.decode:
        r = sr.request
        committed = 0
        if sr.samples:
            accepted = min(accept_drafts, sr.num_draft)
            for _ in range(accepted + 1):
                r.output_token_ids.append(7 + len(r.output_token_ids) % 5)
                committed += 1
                if len(r.output_token_ids) >= r.max_new:
                    break
        s.update(sr, committed)  # the scheduler moves the request's progress
        if sr.samples:  # drafts for the next step, as the engine proposes them
            r.propose(s.config.max_model_len)
        if len(r.output_token_ids) >= r.max_new:
            r.status = Status.FINISHED
            s.finish(r)
            done.append(r)
    return out, done


def run_all(s: Scheduler, reqs, max_steps=10_000, accept_drafts=0, check=None, predict=None):
    for r in reqs:
        s.add(r)
    finished, steps = [], 0
    while s.has_unfinished():
        out, done = fake_step(s, accept_drafts, check, predict)
        finished += done
        steps += 1
        assert steps < max_steps, "a request starved"
        s.kv.check_invariants()
    return finished, steps


def prompt(n, seed=0):
    return [(seed * 31 + i * 7) % 50 + 2 for i in range(n)]


def test_budget_is_respected_and_long_prompts_are_chunked():
    cfg = EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, enable_prefix_caching=False)
    s = make(cfg, 64)
    reqs = [FakeRequest(str(i), prompt(100 if i % 2 else 7, seed=i), max_new=10) for i in range(6)]
    chunks = []

    def check(out):
        assert 0 < out.num_batched_tokens <= 32
        assert len(s.running) <= 8
        chunks.extend(sr.num_new_tokens for sr in out.prefill if sr.request.request_id == "1")

    finished, _ = run_all(s, reqs, check=check)
    assert len(finished) == 6
    assert len(chunks) >= 4 and sum(chunks) == 100  # the 100-token prompt took several chunks
    assert s.pool.num_available_blocks == 64


def test_decodes_go_first_and_mix_with_a_prefill_chunk():
    cfg = EngineConfig(max_model_len=512, max_num_seqs=8, max_num_batched_tokens=16, enable_prefix_caching=False)
    s = make(cfg, 64)
    a = FakeRequest("a", prompt(5), max_new=50)
    s.add(a)
    fake_step(s)  # a's prompt, first token
    s.add(FakeRequest("b", prompt(300, seed=1), max_new=5))
    out, _ = fake_step(s)
    assert [sr.request.request_id for sr in out.decode] == ["a"]
    assert [(sr.request.request_id, sr.num_new_tokens) for sr in out.prefill] == [("b", 15)]


def test_speculative_decodes_take_their_drafts_within_the_budget():
    cfg = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, enable_prefix_caching=False)
    s = make(cfg, 32)
    reqs = [FakeRequest(str(i), prompt(9, seed=i), max_new=20, num_speculative_tokens=4) for i in range(3)]
    seen = []

    def check(out):
        assert out.num_batched_tokens <= 64
        for sr in out.decode:
            seen.append(sr.num_draft)
            table = s.kv.block_table(sr.request.request_id)
            assert len(table) * cfg.block_size >= sr.request.num_computed_tokens + 1 + sr.num_draft

    finished, _ = run_all(s, reqs, accept_drafts=2, check=check)
    assert len(finished) == 3 and max(seen) == 4 and min(seen) < 4  # drafts stop at max_tokens
    assert s.pool.num_available_blocks == 32


def test_preemption_by_recompute_and_resumption():
    # 8 blocks of 16: one request at full context (128) fits; four growing ones do not.
    cfg = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=256, enable_prefix_caching=False)
    s = make(cfg, 8)
    reqs = [FakeRequest(str(i), prompt(20, seed=i), max_new=60) for i in range(4)]
    preempted = []
    finished, _ = run_all(s, reqs, check=lambda out: preempted.extend(r.request_id for r in out.preempted))
    assert preempted and s.num_preemptions == len(preempted)
    assert sorted(r.request_id for r in finished) == ["0", "1", "2", "3"]
    assert all(len(r.output_token_ids) == 60 for r in reqs)  # resumed requests kept their tokens
    assert s.pool.num_available_blocks == 8
    # The victim is always the most recently admitted running request, never the oldest.
    assert "0" not in preempted


def test_admission_is_first_come_first_served():
    cfg = EngineConfig(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=512, enable_prefix_caching=False)
    s = make(cfg, 64)
    reqs = [FakeRequest(str(i), prompt(10, seed=i), max_new=3 + (i % 3)) for i in range(9)]
    order = []

    def check(out):
        for sr in out.prefill:
            if sr.request.num_computed_tokens == 0 and sr.request.request_id not in order:
                order.append(sr.request.request_id)

    finished, steps = run_all(s, reqs, check=check)
    assert order == [str(i) for i in range(9)]
    assert len(finished) == 9


def test_a_large_request_at_the_head_is_not_overtaken_forever():
    # The big prompt needs most of the pool; small ones keep arriving behind it. FCFS admission
    # stops at the head, so the big one runs as soon as the running small ones drain.
    cfg = EngineConfig(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, enable_prefix_caching=False)
    s = make(cfg, 9)
    smalls = [FakeRequest(f"s{i}", prompt(10, seed=i), max_new=20) for i in range(3)]
    for r in smalls:
        s.add(r)
    fake_step(s)
    big = FakeRequest("big", prompt(120, seed=9), max_new=4)
    s.add(big)
    late = [FakeRequest(f"l{i}", prompt(5, seed=20 + i), max_new=2) for i in range(10)]
    for r in late:
        s.add(r)
    admitted = []

    def check(out):
        admitted.extend(sr.request.request_id for sr in out.prefill + out.decode
                        if sr.request.request_id not in admitted)

    finished, _ = run_all(s, [], max_steps=500, check=check)
    assert len(finished) == 14
    assert admitted.index("big") < min(admitted.index(r.request_id) for r in late)


def test_prefix_hits_skip_computed_blocks():
    cfg = EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=512)
    s = make(cfg, 64)
    system = prompt(48, seed=3)
    first = FakeRequest("first", system + [5, 6], max_new=2)
    run_all(s, [first])
    second = FakeRequest("second", system + [9, 9, 9], max_new=2)
    s.add(second)
    out, _ = fake_step(s)
    assert out.prefill[0].num_new_tokens == 3  # the 3 cached system blocks (48 tokens) were skipped
    assert s.pool.prefix_cache_stats().hit_blocks == 3


# ---- the step-time bound ---------------------------------------------------------------------

def attention_heavy(shape: PassShape) -> float:
    """A made-up machine where prompt tokens are dear and dearer with context: 2 ms a pass,
    0.1 ms a token, 1 us a query-key pair."""
    return 2e-3 + 1e-4 * shape.num_tokens + 1e-6 * shape.query_keys


def step_shape(out) -> PassShape:
    shape = PassShape(0)
    for sr in out.scheduled:
        shape.add(sr.num_new_tokens + sr.num_draft, sr.request.num_computed_tokens)
    return shape


def bounded(max_step_ms: float, budget: int = 2048) -> Scheduler:
    cfg = EngineConfig(max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=budget,
                       enable_prefix_caching=False, max_step_ms=max_step_ms)
    return make(cfg, 600)


def start_decoding(s: Scheduler, **kw) -> FakeRequest:
    d = FakeRequest("d", prompt(5), max_new=10_000, **kw)
    s.add(d)
    fake_step(s, predict=attention_heavy)  # its prompt and first token: it decodes from now on
    return d


def test_prompt_chunks_keep_a_decoding_step_within_the_bound_and_shrink_with_context():
    s = bounded(max_step_ms=50)
    start_decoding(s)
    long = FakeRequest("long", prompt(3000, seed=1), max_new=1)
    s.add(long)
    chunks = []

    def check(out):
        assert out.decode[0].request.request_id == "d"  # the stream gets a token every step
        if not out.prefill:  # the prompt's last token alone (a chunk left one): it samples as a decode does
            chunks.append(1)
            return
        (chunk,) = out.prefill
        n, left = chunk.num_new_tokens, 3000 - long.num_computed_tokens
        chunks.append(n)
        shape = step_shape(out)
        assert n == MIN_PROMPT_CHUNK or attention_heavy(shape) <= 0.050
        if n < left:  # not the prompt's last chunk: the largest that fits
            shape.add(1, long.num_computed_tokens + n)
            assert n == MIN_PROMPT_CHUNK or attention_heavy(shape) > 0.050

    while long.status is not Status.FINISHED:
        fake_step(s, check=check, predict=attention_heavy)
        s.kv.check_invariants()
    assert sum(chunks) == 3000
    assert chunks[:-1] == sorted(chunks[:-1], reverse=True)  # dearer with context: each chunk no larger
    assert chunks[0] > 8 * chunks[-2]
    assert chunks[-2] == MIN_PROMPT_CHUNK  # late in the prompt even the minimum is over the bound


def test_without_a_decoding_request_the_whole_token_budget_is_used():
    s = bounded(max_step_ms=50, budget=512)
    long = FakeRequest("long", prompt(1200, seed=1), max_new=1)
    s.add(long)
    out, _ = fake_step(s, predict=attention_heavy)
    assert [sr.num_new_tokens for sr in out.prefill] == [512]  # predicted ~0.2 s: no stream waits on it
    # The same with the bound off, or without a cost prediction, and a stream decoding.
    for ms, predict in ((0, attention_heavy), (50, None)):
        s = bounded(max_step_ms=ms, budget=512)
        start_decoding(s)
        s.add(FakeRequest("long", prompt(1200, seed=1), max_new=1))
        out, _ = fake_step(s, predict=predict)
        assert [sr.num_new_tokens for sr in out.prefill] == [511] and len(out.decode) == 1


def test_a_prompt_always_progresses_by_the_minimum_chunk_and_later_prompts_wait():
    def everything_is_too_dear(shape: PassShape) -> float:
        return 10.0

    s = bounded(max_step_ms=50)
    start_decoding(s)
    first = FakeRequest("first", prompt(100, seed=1), max_new=2)
    second = FakeRequest("second", prompt(100, seed=2), max_new=2)
    s.add(first)
    s.add(second)
    out, _ = fake_step(s, predict=everything_is_too_dear)
    assert [(sr.request.request_id, sr.num_new_tokens) for sr in out.prefill] == [("first", MIN_PROMPT_CHUNK)]
    assert second.status is Status.WAITING  # the step was full: admission stops there, in order
    for _ in range(30):  # 100 tokens in chunks of 16, then 2 decodes: each well within 30 steps
        fake_step(s, predict=everything_is_too_dear)
        s.kv.check_invariants()
    assert first.status is Status.FINISHED and second.status is Status.FINISHED


def test_drafts_count_in_the_step_and_a_second_prompt_gets_what_is_left():
    s = bounded(max_step_ms=20)
    start_decoding(s, num_speculative_tokens=8)
    a = FakeRequest("a", prompt(400, seed=1), max_new=2)
    b = FakeRequest("b", prompt(400, seed=2), max_new=2)
    s.add(a)
    s.add(b)
    shapes = []
    out, _ = fake_step(s, predict=attention_heavy, check=lambda o: shapes.append(step_shape(o)))
    assert out.decode[0].num_draft == 8
    chunks = {sr.request.request_id: sr.num_new_tokens for sr in out.prefill}
    # d: 9 tokens; a: its chunk n costs 0.1 ms + ~n/2 us per token, so 2 + 0.9 + 0.1 n + n^2/2000 ms <= 20.
    assert chunks["a"] == 109 and chunks["b"] == 1  # b: the 0.1 ms left
    (shape,) = shapes
    assert attention_heavy(shape) <= 0.020
    shape.add(1, 1)
    assert attention_heavy(shape) > 0.020


def test_a_decode_takes_exactly_its_draft_and_no_slot_for_drafts_that_do_not_exist():
    """Drafts live on the request: a step takes 1 + the nodes its draft has (none: 1), and a
    draft larger than what the budget leaves is cut to it."""
    cfg = EngineConfig(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=6, enable_prefix_caching=False)
    s = make(cfg, 32)
    d = FakeRequest("d", prompt(5), max_new=50, num_speculative_tokens=8)
    s.add(d)
    fake_step(s)  # prompt and first token; the fake proposer drafts 8
    d.num_pending_drafts = 0  # the proposer found nothing this time
    out, _ = fake_step(s)
    assert [(sr.num_new_tokens, sr.num_draft) for sr in out.decode] == [(1, 0)]
    assert len(s.kv.block_table("d")) * cfg.block_size >= d.num_computed_tokens + 1
    d.num_pending_drafts = 3
    out, _ = fake_step(s)
    assert [(sr.num_new_tokens, sr.num_draft) for sr in out.decode] == [(1, 3)]
    d.num_pending_drafts = 8  # more than the budget of 6 leaves: cut to 5
    out, _ = fake_step(s)
    assert [(sr.num_new_tokens, sr.num_draft) for sr in out.decode] == [(1, 5)]


def test_a_draft_cut_by_the_budget_keeps_its_first_nodes_as_a_tree():
    from specserve.drafts import DraftTree
    from specserve.engine.engine import _scheduled_tree
    from specserve.engine.scheduler import ScheduledRequest

    r = FakeRequest("t", prompt(5), max_new=9, num_speculative_tokens=3, num_computed_tokens=4)
    r.draft = DraftTree([10, 11, 12, 13, 14], [-1, -1, 0, 1, 2])  # two branches, topological order
    assert _scheduled_tree(ScheduledRequest(r, 1, 5, decode=True)) == r.draft
    cut = _scheduled_tree(ScheduledRequest(r, 1, 3, decode=True))
    assert (cut.token_ids, cut.parents) == ([10, 11, 12], [-1, -1, 0])
    assert _scheduled_tree(ScheduledRequest(r, 1, 0, decode=True)).num_nodes == 0
