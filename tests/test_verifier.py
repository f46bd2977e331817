"""The verifier on hand-built logits, and token-for-token agreement with the per-row reference.

The rule (sample/verifier.py): the target's token at position t is race(p_t, E_t) with the
request's noise at t; a draft is accepted iff it equals it; the first mismatch (or the bonus
position) emits it. So every emitted token is the one plain sampling gives with that noise.
"""

from __future__ import annotations

import pytest
import torch

from specserve.sample import PositionNoise, SamplingTensors, processed_probs, reference_verify, sample, verify
from specserve.sampling_params import SamplingParams as SP


def noises(n: int, base: int = 0) -> list[PositionNoise]:
    return [PositionNoise(base + b) for b in range(n)]


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    """[T][V] probabilities -> [1, T, V] logits whose softmax is exactly those probabilities' support."""
    return torch.tensor(probs).log().unsqueeze(0)


def run(drafts: list[list[int]], n: list[int], target: torch.Tensor, params: list[SP], seed: int = 0, start: int = 0):
    st = SamplingTensors.from_params(params, "cpu")
    return verify(torch.tensor(drafts), torch.tensor(n), target, st, noises(len(params), seed), [start] * len(params))


def plain(target: torch.Tensor, params: SP, seed: int, start: int) -> list[int]:
    """target [T, V]: the token plain sampling draws from each row at positions start, start + 1, ..."""
    st = SamplingTensors.from_params([params], "cpu")
    return [int(sample(target[j : j + 1], st, [PositionNoise(seed)], [start + j])) for j in range(target.shape[0])]


def check_consistent(out, n: torch.Tensor) -> None:
    """Invariants every output must satisfy, whatever was accepted."""
    rows, width = out.output_token_ids.shape
    assert torch.equal(out.num_emitted, out.num_accepted + 1)
    assert (out.num_accepted <= n).all()
    for b in range(rows):
        a = int(out.num_accepted[b])
        assert out.accepted_mask[b].tolist() == [j < a for j in range(width - 1)]
        assert (out.output_token_ids[b, : a + 1] >= 0).all() and (out.output_token_ids[b, a + 1 :] == -1).all()
        last = int(out.output_token_ids[b, a])
        rejected = a < int(n[b])
        assert int(out.recovered_token_ids[b]) == (last if rejected else -1)
        assert int(out.bonus_token_ids[b]) == (-1 if rejected else last)


def test_drafts_equal_to_the_target_race_are_all_accepted_then_the_bonus_race():
    target = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(1))
    for params in (SP(), SP(temperature=0.6, top_p=0.9)):
        for seed in range(30):
            want = plain(target[0], params, seed, start=7)
            out = run([want[:3]], [3], target, [params], seed, start=7)
            assert out.num_accepted.tolist() == [3]
            assert out.output_token_ids[0].tolist() == want and out.bonus_token_ids.tolist() == [want[3]]
            check_consistent(out, torch.tensor([3]))


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_first_mismatch_emits_the_target_race_there(reject_at):
    target = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(2))
    for seed in range(30):
        want = plain(target[0], SP(), seed, start=3)
        drafts = want[:3]
        drafts[reject_at] = (want[reject_at] + 1) % 6
        out = run([drafts], [3], target, [SP()], seed, start=3)
        assert out.num_accepted.tolist() == [reject_at]
        assert out.recovered_token_ids.tolist() == [want[reject_at]] and out.bonus_token_ids.tolist() == [-1]
        assert out.output_token_ids[0].tolist() == want[: reject_at + 1] + [-1] * (3 - reject_at)


def test_a_one_hot_draft_is_accepted_iff_it_equals_the_race_so_with_probability_p():
    target = logits_of([[0.5, 0.3, 0.2], [1 / 3] * 3])
    st = SamplingTensors.from_params([SP()], "cpu")
    accepted = 0
    trials = 4000
    for seed in range(trials):
        y = int(sample(target[:, 0], st, [PositionNoise(seed)], [5]))
        out = run([[1]], [1], target, [SP()], seed, start=5)
        assert (out.num_accepted.item() == 1) == (y == 1)
        accepted += y == 1
    # Binomial(4000, 0.3): sd ~29; 5 sd either side.
    assert abs(accepted - 0.3 * trials) < 5 * (trials * 0.3 * 0.7) ** 0.5


def test_empty_draft_is_a_plain_decoding_step():
    target = torch.tensor([[[0.0, 9.0, 0.0]]])
    for params in (SP(temperature=0.0), SP(top_k=1)):
        out = verify(torch.empty(1, 0, dtype=torch.long), torch.tensor([0]), target,
                     SamplingTensors.from_params([params], "cpu"), noises(1), [0])
        assert out.output_token_ids.tolist() == [[1]] and out.num_accepted.tolist() == [0]
        assert out.bonus_token_ids.tolist() == [1] and out.recovered_token_ids.tolist() == [-1]
        assert out.accepted_mask.shape == (1, 0)


@pytest.mark.parametrize("params", [SP(top_k=2), SP(top_p=0.6), SP(min_p=0.3)])
def test_draft_token_filtered_out_of_p_is_always_rejected(params):
    target = logits_of([[0.4, 0.3, 0.2, 0.1], [0.25] * 4])
    p = processed_probs(target[:, 0], SamplingTensors.from_params([params], "cpu"))[0]
    assert p[3] == 0
    for seed in range(50):
        out = run([[3]], [1], target, [params], seed)
        assert out.num_accepted.tolist() == [0] and p[out.recovered_token_ids[0]] > 0


def test_greedy_rows_accept_while_draft_equals_argmax_and_draw_nothing():
    target = torch.tensor([[[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0], [0, 0, 0, 5]]], dtype=torch.float)
    cases = {(1, 2, 0): [1, 2, 0, 3], (1, 2, 3): [1, 2, 0, -1], (3, 2, 0): [1, -1, -1, -1]}
    for drafts, want in cases.items():
        state = torch.random.get_rng_state()
        out = verify(torch.tensor([drafts]), torch.tensor([3]), target,
                     SamplingTensors.from_params([SP(temperature=0.0)], "cpu"), [None], [0])
        assert out.output_token_ids[0].tolist() == want
        assert torch.equal(torch.random.get_rng_state(), state)  # greedy rows draw no random numbers
    out = run([[1, -1, -1]], [1], target, [SP(temperature=0.0)])
    assert out.output_token_ids.tolist() == [[1, 2, -1, -1]] and out.bonus_token_ids.tolist() == [2]


def test_padded_batch_with_different_draft_lengths():
    gen = torch.Generator().manual_seed(5)
    k, vocab = 4, 6
    n = torch.tensor([0, 1, 4, 2, 3])
    params = [SP(), SP(temperature=0.0), SP(top_k=3), SP(temperature=0.0), SP(top_p=0.8)]
    target = torch.randn(5, k + 1, vocab, generator=gen)
    st = SamplingTensors.from_params(params, "cpu")
    p = processed_probs(target, st)
    drafts = torch.full((5, k), -1)
    for b in range(5):  # greedy rows draft the target argmax, so they accept everything
        for j in range(int(n[b])):
            drafts[b, j] = p[b, j].argmax() if params[b].greedy else torch.randint(vocab, (1,), generator=gen)
    out = verify(drafts, n, target, st, noises(5), [9] * 5)
    check_consistent(out, n)
    assert out.output_token_ids.shape == (5, k + 1)
    assert out.num_accepted[1] == 1 and out.num_accepted[3] == 2
    assert out.bonus_token_ids[1] == target[1, 1].argmax() and out.bonus_token_ids[3] == target[3, 2].argmax()
    assert out.num_accepted[0] == 0 and out.bonus_token_ids[0] >= 0


def test_shape_errors():
    st = SamplingTensors.from_params([SP()], "cpu")
    with pytest.raises(ValueError, match="target_logits"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), torch.zeros(1, 2, 5), st, noises(1), [0])
    with pytest.raises(ValueError, match="noise"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), torch.zeros(1, 3, 5), st, [], [])


def random_case(seed: int, rows: int = 6, k: int = 4, vocab: int = 10, coupled: bool = False, start: int = 0):
    """Random sampling params (greedy rows included), draft lengths, and drafts from a draft
    distribution q: drawn independently, or coupled (race(q, E) with the rows' own noise, as the
    draft model draws them); target logits a noisy copy of the draft's, so acceptance is mixed."""
    gen = torch.Generator().manual_seed(seed)
    choices = [SP(), SP(temperature=0.0), SP(temperature=0.7), SP(top_k=3), SP(top_p=0.8),
               SP(min_p=0.2), SP(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05)]
    params = [choices[int(i)] for i in torch.randint(len(choices), (rows,), generator=gen)]
    st = SamplingTensors.from_params(params, "cpu")
    n = torch.randint(0, k + 1, (rows,), generator=gen)
    draft_logits = torch.randn(rows, k, vocab, generator=gen) * 2
    target = torch.cat([draft_logits, torch.randn(rows, 1, vocab, generator=gen)], 1)
    target = target + torch.randn(rows, k + 1, vocab, generator=gen)
    q = processed_probs(draft_logits, st)
    if coupled:
        drafts = torch.stack([sample(draft_logits[:, j], st, noises(rows, seed * 100), [start + j] * rows)
                              for j in range(k)], 1)
    else:
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(rows, k)
    drafts = torch.where(torch.arange(k) < n.unsqueeze(-1), drafts, -1)
    return drafts, n, target, st


@pytest.mark.parametrize("coupled", [False, True], ids=["independent", "coupled"])
def test_matches_reference_token_for_token(coupled):
    accepted = []
    for seed in range(150):
        drafts, n, target, st = random_case(seed, coupled=coupled, start=seed)
        out = verify(drafts, n, target, st, noises(len(n), seed * 100), [seed] * len(n))
        want = reference_verify(drafts, n, target, st, noises(len(n), seed * 100), [seed] * len(n))
        got = [row[: e].tolist() for row, e in zip(out.output_token_ids, out.num_emitted.tolist())]
        assert got == want, seed
        check_consistent(out, n)
        accepted.append(out.num_accepted.float().mean())
    # The cases exercise partial acceptance, not only all-or-nothing.
    assert 0.3 < float(torch.stack(accepted).mean()) < 2.5


def test_emitted_tokens_are_plain_samplings_whatever_was_drafted():
    for seed in range(40):
        drafts, n, target, st = random_case(seed)
        out = verify(drafts, n, target, st, noises(6, 7), [20] * 6)
        for b in range(6):
            want = plain(target[b], st.params[b], 7 + b, 20)
            e = int(out.num_emitted[b])
            assert out.output_token_ids[b, :e].tolist() == want[:e]


def test_seeded_rows_do_not_depend_on_the_batch():
    drafts, n, target, st = random_case(7, rows=6)
    batched = verify(drafts, n, target, st, noises(6, 40), [3, 4, 5, 6, 7, 8])
    for b in range(6):
        m = int(n[b])  # alone, the draft width is the row's own draft length
        alone = verify(drafts[b : b + 1, :m], n[b : b + 1], target[b : b + 1, : m + 1],
                       st.select([b]), [PositionNoise(40 + b)], [3 + b])
        assert alone.output_token_ids[0].tolist() == batched.output_token_ids[b, : m + 1].tolist()


def test_same_seed_same_output():
    drafts, n, target, st = random_case(11)
    a = verify(drafts, n, target, st, noises(6, 3), [0] * 6)
    b = verify(drafts, n, target, st, noises(6, 3), [0] * 6)
    assert torch.equal(a.output_token_ids, b.output_token_ids)
