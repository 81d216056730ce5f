"""Verification rules that make speculation lossless.

- Greedy: accept a proposal iff it equals the target's argmax; at the first
  mismatch the target's argmax is the next token.
- Draft-model speculative sampling: Leviathan, Kalman & Matias 2023,
  "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
  Chen et al. 2023, "Accelerating LLM decoding with speculative sampling".
  Accept draft x ~ q with probability min(1, p(x)/q(x)); at the first rejection
  sample from norm(max(0, p - q)); after K acceptances sample a bonus token
  from the target's (K+1)-th distribution.
- Deterministic proposals (n-gram pool, prompt lookup, the memory, several
  candidates at one position): the target draws its own token with the noise
  of that place (backends.sampling.draw, Gumbel-max), and a proposal is
  accepted iff it is that token. Each candidate is accepted with chance p(t),
  as under SpecInfer's multi-step rule with one-hot drafts (Miao et al. 2024,
  Alg. 2; lookahead decoding, Fu et al. 2024), and the token is distributed as
  p; unlike that rule, the token does not depend on what was proposed, so the
  answer is the one plain decoding draws with the same seed (Daliri, Musco &
  Suresh 2024, arXiv 2408.07978).

The target's distributions are requested lazily (`target_probs(i)`) because
a full-vocabulary transform is not free and rows past a rejection are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.sampling import Noise, draw_dense, sample


@dataclass(frozen=True)
class Verdict:
    """`n_accepted` leading proposals were accepted; `next_token` is the target's own token after them."""

    n_accepted: int
    next_token: int


def verify_greedy(proposals: Sequence[int], target_argmax: Callable[[int], int]) -> Verdict:
    """Longest prefix of `proposals` equal to the target's argmax at each position."""
    for i, token in enumerate(proposals):
        best = target_argmax(i)
        if best != token:
            return Verdict(i, best)
    return Verdict(len(proposals), target_argmax(len(proposals)))


def verify_draft_sampling(
    proposals: Sequence[int],
    draft_probs: Sequence[np.ndarray],
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> Verdict:
    """Leviathan et al. Algorithm 1 for proposals drawn from `draft_probs`."""
    for i, token in enumerate(proposals):
        p = target_probs(i)
        q = draft_probs[i]
        p_x, q_x = p[token], q[token]
        if q_x > 0 and rng.random() * q_x < p_x:  # u < p/q without dividing
            continue
        residual = np.maximum(p - q, 0.0)
        if residual.sum() <= 0.0:  # p == q up to rounding: the residual is p itself
            residual = p
        return Verdict(i, sample(residual, rng))
    return Verdict(len(proposals), sample(target_probs(len(proposals)), rng))


def verify_one_hot_chain(
    proposals: Sequence[int],
    target_probs: Callable[[int], np.ndarray],
    noise: Noise,
    place: int,
) -> Verdict:
    """A chain of deterministic proposals, the first at `place`: accepted while each is the target's draw there."""
    for i, token in enumerate(proposals):
        drawn = draw_dense(target_probs(i), noise, place + i)
        if drawn != token:
            return Verdict(i, drawn)
    return Verdict(len(proposals), draw_dense(target_probs(len(proposals)), noise, place + len(proposals)))
