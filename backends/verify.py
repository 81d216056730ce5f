"""Verification rules that make speculation lossless.

- Greedy: accept a proposal iff it equals the target's argmax; at the first
  mismatch the target's argmax is the next token.
- Draft-model speculative sampling: Leviathan, Kalman & Matias 2023,
  "Fast Inference from Transformers via Speculative Decoding", Algorithm 1;
  Chen et al. 2023, "Accelerating LLM decoding with speculative sampling".
  Accept draft x ~ q with probability min(1, p(x)/q(x)); at the first rejection
  sample from norm(max(0, p - q)); after K acceptances sample a bonus token
  from the target's (K+1)-th distribution.
- Deterministic proposals (n-gram pool, prompt lookup, several candidates at
  one position): SpecInfer's multi-step speculative sampling (Miao et al. 2024,
  Alg. 2) with one-hot draft distributions, as in lookahead decoding (Fu et al.
  2024): accept candidate t with probability p(t); on rejection set p(t) = 0
  and renormalise; try the next candidate; if none is accepted, sample from
  what is left.

The target's distributions are requested lazily (`target_probs(i)`) because
a full-vocabulary transform is not free and rows past a rejection are unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from backends.sampling import sample


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


def choose_among_candidates(p: np.ndarray, candidates: Sequence[int], rng: np.random.Generator) -> int:
    """SpecInfer's rule for one position with one-hot (deterministic) candidates.

    Returns the accepted candidate, or a token sampled from the residual when
    every candidate was refused. The result is distributed exactly as `p`.
    """
    residual = p.copy()
    for token in dict.fromkeys(candidates):  # each distinct candidate once, in order
        mass = residual.sum()
        if mass <= 0.0:
            break
        if rng.random() * mass < residual[token]:
            return int(token)
        residual[token] = 0.0
    return sample(residual if residual.sum() > 0.0 else p, rng)


def verify_one_hot_chain(
    proposals: Sequence[int],
    target_probs: Callable[[int], np.ndarray],
    rng: np.random.Generator,
) -> Verdict:
    """A single chain of deterministic proposals: `choose_among_candidates` with one candidate per position."""
    for i, token in enumerate(proposals):
        chosen = choose_among_candidates(target_probs(i), (token,), rng)
        if chosen != token:
            return Verdict(i, chosen)
    return Verdict(len(proposals), sample(target_probs(len(proposals)), rng))
