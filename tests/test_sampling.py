"""processed_probs and the sampler: each filter on hand-built logits, the filters combined, greedy
rows, batch mixes, an independent per-row oracle, seeded reproducibility and batch independence;
the noise's stream against its definition, and the native race against the full one."""

from __future__ import annotations

import math

import pytest
import torch

from specserve import hardware, native
from specserve.sample import PositionNoise, SamplingTensors, argmax_rows, processed_probs, sample, verify
from specserve.sample import logits as logits_module
from specserve.sample import sampler
from specserve.sample.noise import signed64, stream_bits, stream_exponentials
from specserve.sample.sampler import race, race_rows
from specserve.sampling_params import SamplingParams as SP

P4 = torch.tensor([0.5, 0.3, 0.15, 0.05])
L4 = P4.log()  # logits whose softmax is P4


def probs_of(logits: torch.Tensor, **kw) -> torch.Tensor:
    return processed_probs(logits.unsqueeze(0), SamplingTensors.from_params([SP(**kw)], "cpu"))[0]


def renorm(p: torch.Tensor, keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(p)
    out[keep] = p[keep] / p[keep].sum()
    return out


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, -1.0, 0.5])
    for t in (0.3, 1.0, 2.5):
        torch.testing.assert_close(probs_of(logits, temperature=t), (logits / t).softmax(-1))


def test_greedy_is_one_hot_at_first_maximum():
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0])
    assert probs_of(logits, temperature=0.0).tolist() == [0.0, 1.0, 0.0, 0.0]
    # Filters do not matter to a greedy row.
    assert probs_of(logits, temperature=0.0, top_k=1, top_p=0.1, min_p=0.9).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k():
    torch.testing.assert_close(probs_of(L4, top_k=2), renorm(P4, [0, 1]))
    torch.testing.assert_close(probs_of(L4, top_k=1), renorm(P4, [0]))
    torch.testing.assert_close(probs_of(L4, top_k=100), P4)  # k > V keeps everything
    torch.testing.assert_close(probs_of(L4, top_k=-1), P4)  # -1 and 0 disable


def test_top_k_keeps_every_token_tied_with_the_kth():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0, 3.0])
    assert (probs_of(logits, top_k=1) > 0).tolist() == [False, True, True, False, True]
    assert (probs_of(logits, top_k=3) > 0).tolist() == [False, True, True, False, True]
    assert (probs_of(logits, top_k=4) > 0).tolist() == [False, True, True, True, True]


def test_top_p():
    torch.testing.assert_close(probs_of(L4, top_p=0.4), renorm(P4, [0]))
    torch.testing.assert_close(probs_of(L4, top_p=0.75), renorm(P4, [0, 1]))
    torch.testing.assert_close(probs_of(L4, top_p=0.81), renorm(P4, [0, 1, 2]))
    torch.testing.assert_close(probs_of(L4, top_p=1.0), P4)


def test_top_p_keeps_every_token_tied_at_the_boundary():
    p = torch.tensor([0.2, 0.4, 0.2, 0.2])
    assert (probs_of(p.log(), top_p=0.5) > 0).all()
    assert (probs_of(p.log(), top_p=0.3) > 0).tolist() == [False, True, False, False]


def test_top_p_one_keeps_a_long_tail():
    # Cumulative sums of many small float32 values can round to 1 before the end.
    logits = torch.cat([torch.tensor([12.0]), torch.zeros(50_000)])
    assert (probs_of(logits, top_p=1.0) > 0).all()


def test_min_p_is_relative_to_the_max():
    torch.testing.assert_close(probs_of(L4, min_p=0.35), renorm(P4, [0, 1]))  # threshold 0.175
    torch.testing.assert_close(probs_of(L4, min_p=0.2), renorm(P4, [0, 1, 2]))  # threshold 0.1
    torch.testing.assert_close(probs_of(L4, min_p=1.0), renorm(P4, [0]))


def test_order_temperature_top_k_top_p_min_p():
    # top_p works on the distribution renormalised after top_k: [0.5, 0.3, 0.15] / 0.95 reaches
    # 0.8 at the second token, while the raw P4 needs a third token to pass 0.8 + eps.
    torch.testing.assert_close(probs_of(L4, top_k=3, top_p=0.805), renorm(P4, [0, 1]))
    torch.testing.assert_close(probs_of(L4, top_p=0.805), renorm(P4, [0, 1, 2]))
    # Temperature comes first: at 0.5 the distribution is P4**2 / sum = [0.685, 0.247, ...].
    torch.testing.assert_close(probs_of(L4, top_p=0.6), renorm(P4, [0, 1]))
    torch.testing.assert_close(probs_of(L4, temperature=0.5, top_p=0.6), renorm(P4, [0]))
    # min_p after top_k: renormalised top-2 at temperature 0.5 is [0.735, 0.265]; min_p 0.3 cuts
    # below 0.22 (nothing), min_p 0.4 below 0.29 (the second token).
    sharp = renorm(P4**2, [0, 1])
    torch.testing.assert_close(probs_of(L4, temperature=0.5, top_k=2, min_p=0.3), sharp)
    torch.testing.assert_close(probs_of(L4, temperature=0.5, top_k=2, min_p=0.4), renorm(P4, [0]))


def oracle_probs(logits: list[float], p: SP) -> list[float]:
    """The documented rules, one token at a time in float64 (independent of the tensor code)."""
    v = len(logits)
    if p.greedy:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [float(i == best) for i in range(v)]
    x = [z / p.temperature for z in logits]
    keep = set(range(v))
    if p.top_k:
        kth = sorted(x, reverse=True)[min(p.top_k, v) - 1]
        keep = {i for i in keep if x[i] >= kth}

    def softmax(ids):
        m = max(x[i] for i in ids)
        w = {i: math.exp(x[i] - m) for i in ids}
        s = sum(w.values())
        return {i: w[i] / s for i in ids}

    pr = softmax(keep)
    if p.top_p < 1:
        keep = {i for i in keep if sum(q for q in pr.values() if q > pr[i]) < p.top_p}
    top = max(pr.values())
    keep = {i for i in keep if pr[i] >= p.min_p * top}
    pr = softmax(keep)
    return [pr.get(i, 0.0) for i in range(v)]


def random_params(gen: torch.Generator, n: int) -> list[SP]:
    out = []
    for _ in range(n):
        r = torch.rand(5, generator=gen).tolist()
        out.append(SP(
            temperature=0.0 if r[0] < 0.2 else round(0.2 + 1.6 * r[1], 2),
            top_k=int(torch.randint(0, 9, (1,), generator=gen)) if r[2] < 0.6 else 0,
            top_p=round(0.3 + 0.7 * r[3], 2) if r[3] < 0.7 else 1.0,
            min_p=round(0.3 * r[4], 2) if r[4] < 0.5 else 0.0,
        ))
    return out


def test_matches_independent_oracle_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        params = random_params(gen, 6)
        # Integer logits half the time, so that ties at every boundary occur.
        logits = torch.randn(6, 12, generator=gen) * 2
        if trial % 2:
            logits = logits.round()
        got = processed_probs(logits, SamplingTensors.from_params(params, "cpu"))
        want = torch.tensor([oracle_probs(row, p) for row, p in zip(logits.double().tolist(), params)])
        torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-5)


def test_batch_mixes_and_time_axis_are_row_independent():
    gen = torch.Generator().manual_seed(1)
    params = random_params(gen, 8)
    st = SamplingTensors.from_params(params, "cpu")
    logits = torch.randn(8, 3, 50, generator=gen)
    batched = processed_probs(logits, st)  # [B, T, V]
    assert batched.shape == (8, 3, 50) and batched.dtype == torch.float32
    torch.testing.assert_close(batched.sum(-1), torch.ones(8, 3))
    for b in range(8):
        alone = processed_probs(logits[b : b + 1], st.select([b]))
        assert torch.equal(batched[b : b + 1], alone)
        for t in range(3):
            assert torch.equal(batched[b, t], processed_probs(logits[b : b + 1, t], st.select([b]))[0])


def test_sampling_tensors_flags_skip_unused_filters():
    st = SamplingTensors.from_params([SP(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2), SP()], "cpu")
    assert not (st.all_greedy or st.any_top_k or st.any_top_p or st.any_min_p)
    st = SamplingTensors.from_params([SP(top_k=5), SP(top_p=0.9, min_p=0.1)], "cpu")
    assert st.any_top_k and st.any_top_p and st.any_min_p and st.max_top_k == 5
    assert SamplingTensors.from_params([SP(temperature=0.0)] * 2, "cpu").all_greedy
    assert st.select([1]).params == (SP(top_p=0.9, min_p=0.1),) and not st.select([1]).any_top_k


def test_bfloat16_logits_give_float32_probs():
    probs = processed_probs(torch.randn(2, 30).bfloat16(), SamplingTensors.from_params([SP(), SP(top_k=3)], "cpu"))
    assert probs.dtype == torch.float32


def noise(seeds):
    return [PositionNoise(s) for s in seeds]


def test_position_noise_depends_on_seed_and_position_only():
    a, b = PositionNoise(7), PositionNoise(7)
    assert torch.equal(a.exponentials(5, 16, "cpu"), b.exponentials(5, 16, "cpu"))
    assert not torch.equal(a.exponentials(5, 16, "cpu"), a.exponentials(6, 16, "cpu"))
    assert not torch.equal(a.exponentials(5, 16, "cpu"), PositionNoise(8).exponentials(5, 16, "cpu"))
    # The largest seeds and positions give keys inside the 64-bit words.
    assert PositionNoise(2**63 - 1).exponentials(2**40, 4, "cpu").min() > 0


def test_greedy_sample_is_argmax():
    logits = torch.randn(5, 40)
    st = SamplingTensors.from_params([SP(temperature=0.0)] * 5, "cpu")
    assert torch.equal(sample(logits, st, [None] * 5, [0] * 5), logits.argmax(-1))
    mixed = SamplingTensors.from_params([SP(temperature=0.0), SP(), SP(temperature=0.0), SP(), SP()], "cpu")
    got = sample(logits, mixed, noise(range(5)), [3] * 5)
    assert got[0] == logits[0].argmax() and got[2] == logits[2].argmax()


def test_same_seed_same_tokens():
    logits = torch.randn(1, 100)
    st = SamplingTensors.from_params([SP(temperature=1.3, top_p=0.95)], "cpu")

    def run(seed):
        return [int(sample(logits, st, noise([seed]), [t])) for t in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_sampling_is_independent_of_the_rest_of_the_batch():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 64, generator=gen)
    params = [SP(temperature=0.9, top_k=20), SP(temperature=0.0), SP(top_p=0.8), SP(min_p=0.05),
              SP(temperature=1.5), SP()]
    st = SamplingTensors.from_params(params, "cpu")
    seeded = [0, 2, 3, 4]
    positions = [10, 11, 12, 13, 14, 15]
    batched = sample(logits, st, [PositionNoise(10 + b) if b in seeded else None for b in range(6)], positions)
    for b in seeded + [1]:
        alone = sample(logits[b : b + 1], st.select([b]), noise([10 + b]), [positions[b]])
        assert int(alone) == int(batched[b])


def test_sample_is_verify_with_no_draft():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 32, generator=gen)
    st = SamplingTensors.from_params([SP(), SP(temperature=0.0), SP(top_k=5), SP(top_p=0.7)], "cpu")
    for seed in range(20):
        sampled = sample(logits, st, noise(range(seed * 4, seed * 4 + 4)), [seed] * 4)
        out = verify(torch.empty(4, 0, dtype=torch.long), torch.zeros(4, dtype=torch.long),
                     logits.unsqueeze(1), st, noise(range(seed * 4, seed * 4 + 4)), [seed] * 4)
        assert torch.equal(out.output_token_ids[:, 0], sampled)


@pytest.mark.parametrize("temperature", [1e-38, 1e-20, 1e-6, 9.99e-6])
def test_temperatures_below_the_floor_are_greedy(temperature):
    """Regression (issue 28, M2): 1e-38 divided logits to inf in float32, NaN probabilities and
    token 0s; 1e-37 already changed the answer. Below 1e-5 a request is greedy."""
    assert SP(temperature=temperature).greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 10
    st = SamplingTensors.from_params([SP(temperature=temperature)] * 3, "cpu")
    probs = processed_probs(logits, st)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
    assert torch.equal(sample(logits, st, noise([1, 2, 3]), [0, 0, 0]), logits.argmax(-1))


def test_temperature_just_above_the_floor_samples_without_nan():
    assert not SP(temperature=1e-4).greedy
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 10
    st = SamplingTensors.from_params([SP(temperature=1e-4)] * 3, "cpu")
    probs = processed_probs(logits, st)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(3))
    got = sample(logits, st, noise([1, 2, 3]), [0, 0, 0])
    assert all(probs[b, t] > 0 for b, t in enumerate(got.tolist()))


@pytest.mark.parametrize("kw", [dict(), dict(temperature=0.6, top_k=4), dict(top_p=0.7, min_p=0.1)])
def test_sample_frequencies_match_processed_probs(kw):
    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0, 1.1, -2.0]])
    st = SamplingTensors.from_params([SP(**kw)], "cpu")
    probs = processed_probs(logits, st)[0].double()
    n = 60_000
    with torch.random.fork_rng():
        torch.manual_seed(0)
        tokens = sample(logits.expand(n, -1), st.select([0] * n), [None] * n, [0] * n)
    counts = torch.bincount(tokens, minlength=7).double()
    assert counts[probs == 0].sum() == 0
    used = probs > 0
    expected = probs[used] * n
    chi2 = float(((counts[used] - expected) ** 2 / expected).sum())
    dof = int(used.sum()) - 1
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert pvalue > 1e-3, (chi2, dof, pvalue)


def test_argmax_rows_is_torch_argmax_ties_and_nans_included():
    """The host fast path (numpy) picks what torch.argmax picks: the lowest id among equal
    maxima, a row's first NaN; other dtypes go through torch."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=gen)
    logits[1, [7, 40, 299]] = 9.0  # a three-way tie
    logits[2, [3, 250]] = float("nan")
    logits[3] = 0.0  # every id ties
    logits[4, 100] = float("inf")
    want = logits.argmax(-1).tolist()
    assert argmax_rows(logits) == want == [want[0], 7, 3, 0, 100, want[5]]
    assert argmax_rows(logits.bfloat16()) == logits.bfloat16().argmax(-1).tolist()


# ---- the stream and the native race ---------------------------------------------------------


def splitmix_stream(key: int, n: int) -> list[int]:
    """The definition in plain Python integers: token i's 53 bits of the splitmix64 stream."""
    mask, out = (1 << 64) - 1, []
    for i in range(n):
        z = (key + (i + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        out.append((z ^ (z >> 31)) >> 11)
    return out


def test_stream_is_splitmix64_in_torch_integers():
    for key in (0, 1, 2**63 - 1, 2**63, 2**64 - 1, PositionNoise(5).key(9)):
        assert stream_bits(key, 300, "cpu").tolist() == splitmix_stream(key, 300)
    e = PositionNoise(5).exponentials(9, 300, "cpu")
    assert torch.equal(e, -(torch.tensor(splitmix_stream(PositionNoise(5).key(9), 300), dtype=torch.float64)
                            * 2.0**-53).log())


def race_cases() -> list[torch.Tensor]:
    """Rows the race must get right: peaked and flat, with zeros, ties, one token, odd widths."""
    gen = torch.Generator().manual_seed(6)
    rows = [torch.softmax(torch.randn(4, 5003, generator=gen) * 3 / t, -1) for t in (0.2, 0.7, 1.5, 50.0)]
    tied = torch.zeros(3, 37)
    tied[:, [3, 9, 30]] = 1 / 3  # equal probabilities: the noise alone decides
    one_hot = torch.nn.functional.one_hot(torch.tensor([0, 6, 12]), 13).float()
    top_k = torch.softmax(torch.randn(2, 1000, generator=gen), -1)
    top_k[top_k < top_k.topk(5, -1).values[:, -1:]] = 0  # a filter's zeros
    return [*rows, tied, one_hot, top_k, torch.full((2, 7), 1 / 7), torch.ones(1, 1)]


@pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")
def test_native_race_is_the_full_race_at_every_level():
    """The native race scores only the tokens that could win; its winner must be the full race's
    (every token's exponential, in torch) at every level this machine runs."""
    levels = sorted({0, min(2, hardware.native_level()), hardware.native_level()})
    for probs in race_cases():
        for first in range(0, 40, 8):
            keys = [PositionNoise(first + b).key(first) for b in range(probs.shape[0])]
            full = race(probs, torch.stack([stream_exponentials(k, probs.shape[1], "cpu") for k in keys]))
            keys_t = torch.tensor([signed64(k) for k in keys])
            for level in levels:
                assert torch.equal(native.load().race(level, probs, keys_t), full), (level, probs.shape)


def test_race_without_native_kernels_is_the_same(monkeypatch):
    probs = race_cases()[1]
    noise_ = noise(range(4))
    native_or_not = race_rows(probs, [False] * 4, noise_, [3] * 4)
    # A mixed batch: a greedy row takes its argmax, the others their own races.
    greedy = [False, True, False, False]
    mixed = race_rows(probs, greedy, noise_, [3] * 4)
    assert int(mixed[1]) == int(probs[1].argmax()) and torch.equal(mixed[[0, 2, 3]], native_or_not[[0, 2, 3]])
    monkeypatch.setattr(sampler, "_native_race_level", lambda probs: None)
    assert torch.equal(race_rows(probs, [False] * 4, noise_, [3] * 4), native_or_not)
    assert torch.equal(race_rows(probs, greedy, noise_, [3] * 4), mixed)


def test_seeded_frequencies_match_the_distribution():
    """Each seed's race over a 5,000-token distribution: token counts over 20,000 seeds fit p
    (chi-square over the tokens expected 20+ times, the rest pooled)."""
    gen = torch.Generator().manual_seed(9)
    p = torch.softmax(torch.randn(5000, generator=gen) * 2.5, -1)
    n = 20_000
    tokens = race_rows(p.expand(n, -1), [False] * n, noise(range(n)), [17] * n)
    counts = torch.bincount(tokens, minlength=5000).double()
    expected = p.double() * n
    big = expected >= 20
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = int(big.sum())
    pvalue = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                           torch.tensor(chi2 / 2, dtype=torch.float64)))
    assert pvalue > 1e-3, (chi2, dof, pvalue)


def full_sort_top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The definition: the whole row sorted, the first token at which the mass reaches top_p."""
    ordered = probs.sort(dim=-1, descending=True).values
    before = (ordered.cumsum(-1) < top_p).sum(-1, keepdim=True).clamp(max=probs.shape[-1] - 1)
    return torch.where(top_p >= 1.0, 0.0, ordered.gather(-1, before))


@pytest.mark.parametrize("widths", [logits_module.TOP_P_WIDTHS, (2, 16), ()])
def test_top_p_from_partial_sorts_is_the_full_sorts(monkeypatch, widths):
    """top-p's boundary from each row's most probable K tokens (growing K, then the whole row)
    is the full sort's bit for bit: peaked and flat rows, ties, zeros, top_p from 0.01 to 1."""
    monkeypatch.setattr(logits_module, "TOP_P_WIDTHS", widths)
    g = torch.Generator().manual_seed(0)
    for vocab in (7, 100, 3000):
        for scale in (0.1, 1.0, 3.0, 8.0):
            for top_p in (0.01, 0.5, 0.9, 0.999, 0.9999999, 1.0):
                x = torch.softmax(torch.randn(5, vocab, generator=g) * scale, -1)
                tied = torch.round(x[1] * 50) / 50  # ties (and zeros)
                if tied.sum() > 0:
                    x[1] = tied / tied.sum()
                x[2, vocab // 2:] = 0  # a filter's zeros
                x[2] = x[2] / x[2].sum()
                p = torch.tensor([[top_p], [top_p], [top_p], [1.0], [top_p / 2]])
                assert torch.equal(logits_module._top_p_threshold(x, p), full_sort_top_p_threshold(x, p))
