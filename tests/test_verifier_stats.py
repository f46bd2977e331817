"""Statistical test that speculative sampling is lossless: with an imperfect draft, the first three
emitted tokens follow the target's processed distribution exactly.

A toy "model" is a table of logits indexed by the last two tokens of the prefix (BOS = V where
the prefix is shorter): [V+1, V+1, V]. The draft is a noisy copy of the target. Many sequences
run propose -> verify -> commit as one big batch until each has 3 tokens; their empirical joint
distribution over V**3 outcomes is compared, by a chi-square test, with the exact one computed by
enumeration: P(t1, t2, t3) = p(t1 | BOS BOS) p(t2 | BOS t1) p(t3 | t1 t2).

Seeds are fixed, so each test is deterministic; the threshold p > 1e-3 leaves room for the seeds
to be changed without flakiness. Deliberately wrong verifiers fail the same test by a wide
margin, which shows the test has power.
"""

from __future__ import annotations

import pytest
import torch


from specserve.sample import PositionNoise, SamplingTensors, VerifyOutput, processed_probs, sample, verify
from specserve.sampling_params import SamplingParams as SP
from tests.helpers import chi_square_pvalue

V, K, LENGTH = 8, 3, 3  # vocabulary, max draft tokens per step, tokens compared per sequence
BOS = V
ROWS = 100_000

_gen = torch.Generator().manual_seed(1234)
TARGET = torch.randn(V + 1, V + 1, V, generator=_gen) * 1.5  # [prev2, prev1] -> logits [V]
DRAFT = TARGET + torch.randn(V + 1, V + 1, V, generator=_gen)  # imperfect: acceptance well below 1


def table_probs(table: torch.Tensor, params: SP) -> torch.Tensor:
    """[V+1, V+1, V] logits -> processed probabilities of the same shape."""
    flat = table.reshape(-1, V)
    return processed_probs(flat, SamplingTensors.from_params([params] * flat.shape[0], "cpu")).reshape(table.shape)


def exact_joint(params: SP) -> torch.Tensor:
    """[V**3] float64: probability of each (t1, t2, t3), index t1 * V*V + t2 * V + t3."""
    p = table_probs(TARGET, params).double()
    t = torch.arange(V)
    first = p[BOS, BOS]  # [V]
    second = p[BOS, t]  # [t1, V]
    third = p[t.unsqueeze(1), t.unsqueeze(0)]  # [t1, t2, V]
    return (first[:, None, None] * second[:, :, None] * third).reshape(-1)


def simulate(verifier, params: SP, rows: int, deterministic_proposer: bool, seed: int,
             seeded_rows: bool = False) -> torch.Tensor:
    """Run speculative decoding on `rows` sequences; returns [rows] outcome indices (see exact_joint)."""
    st = SamplingTensors.from_params([params] * rows, "cpu")
    q_table = table_probs(DRAFT, params)
    noise = [PositionNoise(seed * rows + b) for b in range(rows)] if seeded_rows else [None] * rows
    out = torch.full((rows, LENGTH), -1)
    count = torch.zeros(rows, dtype=torch.long)
    everyone = torch.arange(rows)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for _ in range(LENGTH):  # every step emits >= 1 token
            padded = torch.cat([torch.full((rows, 2), BOS), out], 1)
            prev2, prev1 = padded[everyone, count], padded[everyone, count + 1]
            num_draft = torch.randint(0, K + 1, (rows,))  # mixed draft lengths: padded batches
            drafts, target = [], []
            a, b = prev2, prev1
            for j in range(K + 1):
                target.append(TARGET[a, b])
                if j == K:
                    break
                qj = q_table[a, b]  # [rows, V]
                x = DRAFT[a, b].argmax(-1) if deterministic_proposer else torch.multinomial(qj, 1).squeeze(1)
                drafts.append(x)
                a, b = b, x
            drafts = torch.where(torch.arange(K) < num_draft.unsqueeze(1), torch.stack(drafts, 1), -1)
            # Each row's next token comes at position count[b] of its output.
            res = verifier(drafts, num_draft, torch.stack(target, 1), st, noise, count.tolist())
            for j in range(K + 1):
                take = (j < res.num_emitted) & (count < LENGTH)
                out[take, count[take]] = res.output_token_ids[take, j]
                count += take.long()
    assert (count == LENGTH).all()
    return out[:, 0] * V * V + out[:, 1] * V + out[:, 2]


PARAMS = {
    "t1.0": SP(temperature=1.0),
    "t0.7": SP(temperature=0.7),
    "top_p": SP(temperature=0.9, top_p=0.8),
    "top_k": SP(temperature=1.0, top_k=3),
    "all": SP(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1),
}


@pytest.mark.parametrize("deterministic_proposer", [False, True], ids=["draft_q", "one_hot_q"])
@pytest.mark.parametrize("name", list(PARAMS))
def test_speculative_sampling_reproduces_the_target_distribution(name, deterministic_proposer):
    params = PARAMS[name]
    outcomes = simulate(verify, params, ROWS, deterministic_proposer, seed=1)
    assert chi_square_pvalue(outcomes, exact_joint(params)) > 1e-3


def test_with_per_request_generators():
    params = PARAMS["top_p"]
    outcomes = simulate(verify, params, 30_000, deterministic_proposer=False, seed=2, seeded_rows=True)
    assert chi_square_pvalue(outcomes, exact_joint(params)) > 1e-3


# ---- the same test must fail on wrong verifiers ------------------------------------------------

def accept_always(drafts, num_draft, target, st, noise, positions) -> VerifyOutput:
    """Keeps every draft token and adds a bonus token from p at position num_draft."""
    rows = drafts.shape[0]
    bonus = sample(target[torch.arange(rows), num_draft], st, noise, [t + n for t, n in zip(positions, num_draft.tolist())])
    out = torch.cat([drafts, torch.full((rows, 1), -1)], 1).scatter_(1, num_draft.unsqueeze(1), bonus.unsqueeze(1))
    return VerifyOutput(out, num_draft, num_draft + 1, drafts >= 0, torch.full_like(bonus, -1), bonus)


def resample_from_p(drafts, num_draft, target, st, noise, positions) -> VerifyOutput:
    """Accepts as `verify` does but replaces the recovered token by a fresh sample of p."""
    res = verify(drafts, num_draft, target, st, noise, positions)
    rows = drafts.shape[0]
    fresh = sample(target[torch.arange(rows), res.num_accepted], st, noise, positions)
    rejected = res.recovered_token_ids >= 0
    recovered = torch.where(rejected, fresh, -1)
    out = res.output_token_ids.clone()
    out[rejected, res.num_accepted[rejected]] = fresh[rejected]
    return VerifyOutput(out, res.num_accepted, res.num_emitted, res.accepted_mask, recovered, res.bonus_token_ids)


def bonus_from_last_column(drafts, num_draft, target, st, noise, positions) -> VerifyOutput:
    """Takes the bonus token from position k (the padded width) instead of num_draft."""
    res = verify(drafts, num_draft, target, st, noise, positions)
    fresh = sample(target[:, -1], st, noise, positions)
    bonus = torch.where(res.bonus_token_ids >= 0, fresh, -1)
    out = res.output_token_ids.clone()
    has_bonus = bonus >= 0
    out[has_bonus, res.num_accepted[has_bonus]] = fresh[has_bonus]
    return VerifyOutput(out, res.num_accepted, res.num_emitted, res.accepted_mask, res.recovered_token_ids, bonus)


def unfiltered_target(drafts, num_draft, target, st, noise, positions) -> VerifyOutput:
    """Verifies against the target at the request's temperature but without top-k/top-p/min-p."""
    distinct = {id(p): p for p in st.params}  # (the rows share a few params objects)
    unfiltered = {key: SP(temperature=p.temperature) for key, p in distinct.items()}
    plain = SamplingTensors.from_params([unfiltered[id(p)] for p in st.params], "cpu")
    return verify(drafts, num_draft, target, plain, noise, positions)


@pytest.mark.parametrize("verifier,name,deterministic_proposer", [
    (accept_always, "t1.0", False),
    (resample_from_p, "t1.0", False),
    (resample_from_p, "t0.7", True),
    (resample_from_p, "top_p", False),
    (bonus_from_last_column, "t1.0", False),
    (unfiltered_target, "top_p", False),
    (unfiltered_target, "top_k", True),
])
def test_wrong_verifiers_fail(verifier, name, deterministic_proposer):
    params = PARAMS[name]
    # A quarter of the rows the right verifiers get: every wrong one here scores p < 1e-300 on
    # them (the subtlest, resample_from_p at t1.0, 9e-304), p = 0 in float64 on all of them.
    outcomes = simulate(verifier, params, ROWS // 4, deterministic_proposer, seed=1)
    assert chi_square_pvalue(outcomes, exact_joint(params)) < 1e-6
