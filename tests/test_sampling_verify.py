"""The sampling transform and the verification rules, checked against exact distributions.

Statistical checks use a chi-square goodness-of-fit test at significance 1e-4
with fixed seeds: a correct rule fails with probability 1e-4 per check, a rule
that is off by a few percent of mass fails almost surely at these sample sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.sampling import (FEW, GenParams, Noise, _top_k_ids, draw, draw_dense, kept_few, kept_many, probabilities,
                               sample, sample_logits)
from backends.verify import Verdict, verify_draft_sampling, verify_greedy, verify_one_hot_chain
from stats_helpers import assert_fits

ALPHA = 1e-4


def _random_dist(rng: np.random.Generator, n: int, zeros: int = 0) -> np.ndarray:
    p = rng.dirichlet(np.ones(n) * 0.7)
    if zeros:
        p[rng.choice(n, zeros, replace=False)] = 0.0
    return p / p.sum()


def test_top_k_near_the_top_finds_the_same_ids_as_a_full_partition() -> None:
    rng = np.random.default_rng(3)
    for n, scale, k in [(49152, 3.0, 40), (49152, 0.2, 40), (49152, 50.0, 40), (300, 1.0, 299), (64, 1.0, 64), (1000, 8.0, 1)]:
        logits = (rng.standard_normal(n) * scale).astype(np.float32)  # distinct values: no ties at the k-th
        expected = set(np.argpartition(logits, n - k)[n - k:].tolist())
        assert set(_top_k_ids(logits, k).tolist()) == expected


def test_sample_logits_draws_the_token_the_dense_draw_draws() -> None:
    """The plain step's sparse draw is the dense rule's draw, token for token, for the same noise and place."""
    rng = np.random.default_rng(11)
    differing = 0
    for trial in range(600):
        n = int(rng.choice([40, 2000, 49152]))
        logits = (rng.standard_normal(n) * float(rng.choice([0.5, 4.0, 30.0]))).astype(np.float32)
        params = GenParams(temperature=float(rng.choice([0.0, 0.4, 1.0, 1.7])), top_k=int(rng.choice([0, 1, 40])),
                           top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])))
        noise, place = Noise.of(int(rng.integers(1 << 30))), int(rng.integers(4096))
        expected = int(np.argmax(logits)) if params.greedy else draw_dense(probabilities(logits, params), noise, place)
        differing += expected != sample_logits(logits, params, noise, place)
    assert differing == 0


def test_the_transform_on_a_few_candidates_is_the_transform_on_many() -> None:
    """kept_few (plain Python, up to FEW candidates) and kept_many (numpy) are one transform in two forms: on the
    same candidates, in any order and with ties, they keep the same tokens in the same order with the same
    probabilities, to rounding."""
    rng = np.random.default_rng(17)
    for trial in range(400):
        n = int(rng.integers(1, FEW + 1))
        logits = (rng.standard_normal(n) * float(rng.choice([0.3, 3.0, 40.0]))).astype(np.float32)
        if trial % 4 == 0:
            logits[rng.integers(n)] = logits[rng.integers(n)]  # a tie
        params = GenParams(temperature=float(rng.choice([0.3, 0.8, 1.5])), top_k=0,
                           top_p=float(rng.choice([1.0, 0.9, 0.5])), min_p=float(rng.choice([0.0, 0.05, 0.3])))
        ids = rng.permutation(n)
        few_ids, few_probs = kept_few(ids.tolist(), logits[ids].tolist(), params)
        many_ids, many_probs = kept_many(logits, ids, params)
        assert few_ids == many_ids.tolist()
        np.testing.assert_allclose(few_probs, many_probs, rtol=1e-12, atol=1e-300)


def test_the_draw_over_a_few_tokens_is_the_draw_over_many() -> None:
    """Noise.best (plain Python) draws the token argmax(log p + gumbel) draws with numpy, zeros never drawn."""
    rng = np.random.default_rng(23)
    for trial in range(400):
        n = int(rng.integers(1, FEW + 1))
        ids = rng.choice(262_144, n, replace=False)
        probs = _random_dist(rng, n, zeros=min(trial % 3, n - 1))
        noise, place = Noise.of(int(rng.integers(1 << 40))), int(rng.integers(1 << 20))
        kept = probs > 0
        expected = ids[kept][int(np.argmax(np.log(probs[kept]) + noise.gumbel(place, ids[kept])))]
        assert noise.best(place, ids.tolist(), probs.tolist()) == expected == draw(ids, probs, noise, place)


def test_the_draw_at_each_place_follows_the_distribution_and_places_are_independent() -> None:
    """Gumbel-max with the hashed noise is an exact draw: over the places of one answer (one key) and over the
    keys at one place, the tokens follow p; two neighbouring places' tokens follow the product law. The ids sit
    far apart in a large vocabulary, as the kept tokens of a real step do."""
    rng = np.random.default_rng(5)
    p = _random_dist(rng, 8, zeros=1)
    ids = np.array([3, 17, 4096, 4097, 65_000, 150_001, 262_143, 9])
    kept = p > 0
    index = {int(t): i for i, t in enumerate(ids)}
    one_key = Noise.of(7)
    counts = np.zeros(8, dtype=np.int64)
    for place in range(30000):
        counts[index[draw(ids[kept], p[kept], one_key, place)]] += 1
    assert_fits(counts, p, alpha=ALPHA)
    counts[:] = 0
    for seed in range(30000):
        counts[index[draw(ids[kept], p[kept], Noise.of(seed), 12)]] += 1
    assert_fits(counts, p, alpha=ALPHA)
    q = _random_dist(rng, 4)
    small = ids[:4]
    pairs = np.zeros((4, 4), dtype=np.int64)
    for seed in range(30000):
        noise = Noise.of(seed)
        pairs[index[draw(small, q, noise, 40)], index[draw(small, q, noise, 41)]] += 1
    assert_fits(pairs.ravel(), np.outer(q, q).ravel(), alpha=ALPHA)


def test_a_seed_fixes_the_noise_and_no_seed_gives_fresh_noise() -> None:
    ids = np.arange(1000)
    assert np.array_equal(Noise.of(3).gumbel(5, ids), Noise.of(3).gumbel(5, ids))
    assert not np.array_equal(Noise.of(3).gumbel(5, ids), Noise.of(4).gumbel(5, ids))
    assert not np.array_equal(Noise.of(3).gumbel(5, ids), Noise.of(3).gumbel(6, ids))
    assert not np.array_equal(Noise.of(None).gumbel(5, ids), Noise.of(None).gumbel(5, ids))
    with pytest.raises(ValueError, match="64 bits"):
        Noise(-1)


def test_probabilities_matches_hand_computation() -> None:
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    params = GenParams(temperature=0.5, top_k=4, top_p=0.9, min_p=0.05)
    x = logits.astype(np.float64) / 0.5
    soft = np.exp(x[:4] - x[:4].max())
    soft /= soft.sum()  # top-4 renormalised: about [0.844, 0.114, 0.042, 0.0]
    keep = int(np.searchsorted(np.cumsum(soft), 0.9)) + 1
    keep = min(keep, int((soft >= 0.05 * soft[0]).sum()))
    expected = np.zeros(6)
    expected[:keep] = soft[:keep] / soft[:keep].sum()
    np.testing.assert_allclose(probabilities(logits, params), expected, rtol=1e-12)


def test_probabilities_without_truncation_is_softmax() -> None:
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    got = probabilities(logits, GenParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0))
    x = logits.astype(np.float64) / 1.3
    want = np.exp(x - x.max())
    np.testing.assert_allclose(got, want / want.sum(), rtol=1e-9)


def test_greedy_probabilities_are_one_hot() -> None:
    logits = np.array([0.1, 3.0, 2.9], dtype=np.float32)
    assert probabilities(logits, GenParams(temperature=0.0)).tolist() == [0.0, 1.0, 0.0]


def test_sample_follows_distribution() -> None:
    rng = np.random.default_rng(1)
    p = _random_dist(rng, 8, zeros=2)
    counts = np.bincount([sample(p, rng) for _ in range(20000)], minlength=8)
    assert_fits(counts, p, alpha=ALPHA)


def test_verify_greedy_stops_at_first_mismatch() -> None:
    argmaxes = [5, 6, 7, 8]
    assert verify_greedy([5, 6, 9], argmaxes.__getitem__) == Verdict(2, 7)
    assert verify_greedy([5, 6, 7], argmaxes.__getitem__) == Verdict(3, 8)
    assert verify_greedy([1], argmaxes.__getitem__) == Verdict(0, 5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rejection_sampling_first_token_is_target_distributed(seed: int) -> None:
    """Leviathan et al. Alg. 1 with one draft: the emitted token is distributed as p, for any q."""
    rng = np.random.default_rng(seed)
    n = 10
    p = _random_dist(rng, n, zeros=2)
    q = _random_dist(rng, n, zeros=3)
    counts = np.zeros(n, dtype=np.int64)
    accepted = 0
    trials = 30000
    for _ in range(trials):
        x = sample(q, rng)
        verdict = verify_draft_sampling([x], [q], lambda i: p, rng)
        token = x if verdict.n_accepted == 1 else verdict.next_token
        accepted += verdict.n_accepted
        counts[token] += 1
    assert_fits(counts, p, alpha=ALPHA)
    # The acceptance rate is sum(min(p, q)) (Leviathan et al., Theorem 3.5).
    assert abs(accepted / trials - np.minimum(p, q).sum()) < 0.015


def test_rejection_sampling_two_positions_joint_distribution() -> None:
    """Two drafts: the joint law of the first two output tokens is p1(x) * p2(y | x)."""
    rng = np.random.default_rng(7)
    n = 5
    p1, q1 = _random_dist(rng, n), _random_dist(rng, n)
    p2 = [_random_dist(rng, n) for _ in range(n)]  # p2[x] = target's next-token law after x
    q2 = [_random_dist(rng, n) for _ in range(n)]
    counts = np.zeros((n, n), dtype=np.int64)
    for _ in range(40000):
        d1 = sample(q1, rng)
        d2 = sample(q2[d1], rng)
        verdict = verify_draft_sampling([d1, d2], [q1, q2[d1]], lambda i: p1 if i == 0 else p2[d1], rng)
        if verdict.n_accepted == 0:
            first = verdict.next_token
            second = sample(p2[first], rng)  # the next step would sample it from the target
        elif verdict.n_accepted == 1:
            first, second = d1, verdict.next_token
        else:
            first, second = d1, d2
        counts[first, second] += 1
    expected = np.array([[p1[x] * p2[x][y] for y in range(n)] for x in range(n)])
    assert_fits(counts.ravel(), expected.ravel(), alpha=ALPHA)


def test_deterministic_candidates_are_accepted_iff_the_target_draws_them() -> None:
    """A one-hot chain's verdict is the target's own draws place by place: its proposals are accepted exactly
    while they are the tokens plain decoding draws with the same noise, and its next token is the draw at the
    first place they part (so the answer is plain decoding's, whatever was proposed)."""
    rng = np.random.default_rng(3)
    laws = [_random_dist(rng, 8, zeros=1) for _ in range(4)]
    for seed in range(300):
        noise = Noise.of(seed)
        plain = [draw_dense(laws[i], noise, 20 + i) for i in range(4)]
        proposals = [int(t) for t in rng.integers(0, 8, 3)]
        verdict = verify_one_hot_chain(proposals, lambda i: laws[i], noise, 20)
        agree = next((i for i in range(3) if proposals[i] != plain[i]), 3)
        assert verdict == Verdict(agree, plain[agree])


def test_one_hot_chain_accepts_in_proportion_to_target_mass() -> None:
    rng = np.random.default_rng(4)
    p = _random_dist(rng, 6)
    accepted = sum(verify_one_hot_chain([3], lambda i: p, Noise.of(seed), 0).n_accepted for seed in range(20000))
    assert abs(accepted / 20000 - p[3]) < 0.015
