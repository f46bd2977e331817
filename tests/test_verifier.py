"""The verifier on hand-built logits, and token-for-token agreement with the per-row reference."""

from __future__ import annotations

import pytest
import torch

from specserve.sample import SamplingTensors, make_generator, processed_probs, reference_verify, verify
from specserve.sampling_params import SamplingParams as SP

NEG = float("-inf")


def gens(n: int, base: int = 0) -> list[torch.Generator]:
    return [make_generator(base + b, "cpu") for b in range(n)]


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    """[T][V] probabilities -> [1, T, V] logits whose softmax is exactly those probabilities' support."""
    return torch.tensor(probs).log().unsqueeze(0)


def run(drafts: list[list[int]], n: list[int], target: torch.Tensor, params: list[SP],
        draft_probs: torch.Tensor | None = None, seed: int = 0):
    st = SamplingTensors.from_params(params, "cpu")
    return verify(torch.tensor(drafts), torch.tensor(n), draft_probs, target, st, gens(len(params), seed))


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


def test_full_acceptance_when_q_equals_p_then_bonus_from_position_n():
    target = torch.eye(4).mul(5).unsqueeze(0) + torch.rand(1, 4, 4)  # [1, k+1=4, V=4]; argmax j at position j
    for params in (SP(), SP(temperature=0.6, top_p=0.9)):
        st = SamplingTensors.from_params([params], "cpu")
        q = processed_probs(target[:, :3], st)  # q = p: min(1, p/q) = 1 for every token in the support
        for seed in range(30):
            drafts = [[int(torch.multinomial(q[0, j], 1, generator=make_generator(seed * 3 + j, "cpu")))
                       for j in range(3)]]
            out = run(drafts, [3], target, [params], q, seed)
            assert out.num_accepted.tolist() == [3]
            assert out.output_token_ids[0, :3].tolist() == drafts[0]
            assert processed_probs(target[:, 3], st)[0, out.bonus_token_ids[0]] > 0
            check_consistent(out, torch.tensor([3]))
    # top_k=1 makes p one-hot at the argmax: a deterministic proposer drafting it is always
    # accepted, and the bonus comes from position n = 3.
    out = run([[0, 1, 2]], [3], target, [SP(top_k=1)])
    assert out.output_token_ids.tolist() == [[0, 1, 2, 3]] and out.bonus_token_ids.tolist() == [3]


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_rejection_at_each_position_samples_the_residual(reject_at):
    # p = [.5, .5, 0, 0] and q = [0, .5, .5, 0] at the rejected position: the draft token 2 has
    # p = 0, so it is always rejected, and max(0, p - q) = [.5, 0, 0, 0] forces token 0.
    k = 3
    p_rows = [[0.25, 0.25, 0.25, 0.25]] * (k + 1)
    p_rows[reject_at] = [0.5, 0.5, 0.0, 0.0]
    target = logits_of(p_rows)
    q = processed_probs(target[:, :k], SamplingTensors.from_params([SP()], "cpu")).clone()
    q[0, reject_at] = torch.tensor([0.0, 0.5, 0.5, 0.0])
    drafts = [[1] * k]
    drafts[0][reject_at] = 2
    for seed in range(30):
        out = run(drafts, [k], target, [SP()], q, seed)
        assert out.num_accepted.tolist() == [reject_at]
        assert out.recovered_token_ids.tolist() == [0] and out.bonus_token_ids.tolist() == [-1]
        assert out.output_token_ids[0].tolist() == [1] * reject_at + [0] + [-1] * (k - reject_at)


def test_deterministic_proposer_residual_excludes_the_rejected_token():
    # q one-hot at x: the residual is p with x removed, so the recovered token is never x.
    target = torch.zeros(1, 2, 3)  # p uniform over 3 tokens
    seen = set()
    for seed in range(200):
        out = run([[1]], [1], target, [SP()], None, seed)
        if out.num_accepted.item() == 0:
            seen.add(int(out.recovered_token_ids[0]))
    assert seen == {0, 2}


def test_empty_draft_is_a_plain_decoding_step():
    target = torch.tensor([[[0.0, 9.0, 0.0]]])
    for params in (SP(temperature=0.0), SP(top_k=1)):
        out = verify(torch.empty(1, 0, dtype=torch.long), torch.tensor([0]), None, target,
                     SamplingTensors.from_params([params], "cpu"), gens(1))
        assert out.output_token_ids.tolist() == [[1]] and out.num_accepted.tolist() == [0]
        assert out.bonus_token_ids.tolist() == [1] and out.recovered_token_ids.tolist() == [-1]
        assert out.accepted_mask.shape == (1, 0)


@pytest.mark.parametrize("params", [SP(top_k=2), SP(top_p=0.6), SP(min_p=0.3)])
def test_draft_token_filtered_out_of_p_is_always_rejected(params):
    # Token 3 is last in every filter's eyes; the proposer claims q(3) is tiny, so without the
    # filters p(3)/q(3) would be large and the token nearly always accepted.
    target = logits_of([[0.4, 0.3, 0.2, 0.1], [0.25] * 4])
    q = torch.tensor([[[0.33, 0.33, 0.33, 0.01]]])
    for seed in range(50):
        out = run([[3]], [1], target, [params], q, seed)
        assert out.num_accepted.tolist() == [0] and out.recovered_token_ids[0] in (0, 1)
    # A token inside every filter with q = p is always accepted.
    st = SamplingTensors.from_params([params], "cpu")
    q_in = processed_probs(target[:, :1], st)
    assert all(run([[0]], [1], target, [params], q_in, s).num_accepted.item() == 1 for s in range(20))


def test_greedy_rows_accept_while_draft_equals_argmax_and_ignore_q():
    target = torch.tensor([[[0, 5, 0, 0], [0, 0, 5, 0], [5, 0, 0, 0], [0, 0, 0, 5]]], dtype=torch.float)
    weird_q = torch.full((1, 3, 4), 0.25)
    cases = {(1, 2, 0): [1, 2, 0, 3], (1, 2, 3): [1, 2, 0, -1], (3, 2, 0): [1, -1, -1, -1]}
    for drafts, want in cases.items():
        for q in (None, weird_q):
            g = make_generator(0, "cpu")
            state = g.get_state()
            out = verify(torch.tensor([drafts]), torch.tensor([3]), q, target,
                         SamplingTensors.from_params([SP(temperature=0.0)], "cpu"), [g])
            assert out.output_token_ids[0].tolist() == want
            assert torch.equal(g.get_state(), state)  # greedy rows draw no random numbers
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
    out = verify(drafts, n, None, target, st, gens(5))
    check_consistent(out, n)
    assert out.output_token_ids.shape == (5, k + 1)
    assert out.num_accepted[1] == 1 and out.num_accepted[3] == 2
    assert out.bonus_token_ids[1] == target[1, 1].argmax() and out.bonus_token_ids[3] == target[3, 2].argmax()
    assert out.num_accepted[0] == 0 and out.bonus_token_ids[0] >= 0


def test_zero_residual_falls_back_to_p():
    # An inconsistent q (2 p, not a distribution) can reject while max(0, p - q) is all zeros.
    target = logits_of([[0.5, 0.5, 0.0], [1 / 3] * 3])
    q = torch.tensor([[[1.0, 1.0, 0.0]]])
    for seed in range(30):
        out = run([[0]], [1], target, [SP()], q, seed)
        check_consistent(out, torch.tensor([1]))
        if out.num_accepted.item() == 0:
            assert out.recovered_token_ids[0] in (0, 1)


def test_shape_errors():
    st = SamplingTensors.from_params([SP()], "cpu")
    with pytest.raises(ValueError, match="target_logits"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), None, torch.zeros(1, 2, 5), st, gens(1))
    with pytest.raises(ValueError, match="generators"):
        verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([2]), None, torch.zeros(1, 3, 5), st, [])


def random_case(seed: int, rows: int = 6, k: int = 4, vocab: int = 10):
    """Random sampling params (greedy rows included), draft lengths, draft distributions, and drafts
    sampled from them; target logits that are a noisy copy of the draft's so acceptance is mixed."""
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
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).reshape(rows, k)
    drafts = torch.where(torch.arange(k) < n.unsqueeze(-1), drafts, -1)
    return drafts, n, q, target, st


@pytest.mark.parametrize("deterministic", [False, True])
def test_matches_reference_token_for_token(deterministic):
    accepted = []
    for seed in range(150):
        drafts, n, q, target, st = random_case(seed)
        q = None if deterministic else q
        out = verify(drafts, n, q, target, st, gens(len(n), seed * 100))
        want = reference_verify(drafts, n, q, target, st, gens(len(n), seed * 100))
        got = [row[: e].tolist() for row, e in zip(out.output_token_ids, out.num_emitted.tolist())]
        assert got == want, seed
        check_consistent(out, n)
        accepted.append(out.num_accepted.float().mean())
    # The cases exercise partial acceptance, not only all-or-nothing.
    assert 0.5 < float(torch.stack(accepted).mean()) < 2.5


def test_seeded_rows_do_not_depend_on_the_batch():
    drafts, n, q, target, st = random_case(7, rows=6)
    batched = verify(drafts, n, q, target, st, gens(6, 40))
    for b in range(6):
        m = int(n[b])  # alone, the draft width is the row's own draft length
        alone = verify(drafts[b : b + 1, :m], n[b : b + 1], q[b : b + 1, :m], target[b : b + 1, : m + 1],
                       st.select([b]), [make_generator(40 + b, "cpu")])
        assert alone.output_token_ids[0].tolist() == batched.output_token_ids[b, : m + 1].tolist()


def test_same_seed_same_output():
    drafts, n, q, target, st = random_case(11)
    a = verify(drafts, n, q, target, st, gens(6, 3))
    b = verify(drafts, n, q, target, st, gens(6, 3))
    assert torch.equal(a.output_token_ids, b.output_token_ids)
