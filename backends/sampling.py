"""Sampling parameters and the one logits -> probabilities transform.

Every strategy, for the target and for the draft, goes through `probabilities`
so that speculative verification compares like with like.
The order is the one Hugging Face's `generate` uses: temperature, then top-k,
then top-p (nucleus, Holtzman et al. 2020), then min-p (Nguyen et al. 2024).
Temperature 0 means greedy decoding: argmax of the raw logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from backends.grammar import Grammar
    from backends.reasoning import ReasoningFormat

# Logits further than this below the maximum have a probability under e^-30
# relative to the top token (their total mass is < 1e-7 even over a 262k vocab).
# Cutting them before sorting keeps top-p fast on large vocabularies.
_NEGLIGIBLE_LOGIT_GAP = 30.0


@dataclass(frozen=True)
class GenParams:
    """What the user asks of one generation. Defaults follow llama.cpp's."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Never end at an end-of-generation token (llama.cpp's --ignore-eos): they are removed from every
    # distribution drawn from, so a benchmark gets exactly max_tokens tokens of each request.
    ignore_eos: bool = False
    # Log-probabilities of the output tokens (Token.logprob) and of this many likeliest tokens at each place;
    # None: none computed.
    logprobs: int | None = None
    # What the output must follow (backends.grammar): None for free text.
    grammar: Grammar | None = None
    # Drafters propose under the grammar too (the default). False, a measurement knob (`bench --unmasked-drafts`):
    # they propose freely and only the target is masked, as llama.cpp does; still lossless, fewer accepted.
    mask_drafts: bool = True
    # A thinking model's format (backends.reasoning): its output is split into reasoning and answer, and the
    # thinking ends after `reasoning_budget` tokens (None: no bound) with `reasoning_message` before the end tag.
    reasoning: ReasoningFormat | None = None
    reasoning_budget: int | None = None
    reasoning_message: str = ""
    # Set by backends.reasoning on the thinking phase of an answer: what `auto` learns there is kept apart.
    reasoning_phase: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p < 1.0:
            raise ValueError("min_p must be in [0, 1)")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be between 0 and 20")
        if self.reasoning_budget is not None and self.reasoning_budget < 0:
            raise ValueError("the reasoning budget must be >= 0 tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_rng(seed: int | None) -> np.random.Generator:
    return np.random.default_rng(seed)


def argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def top_probability(logits: np.ndarray) -> float:
    """Probability of the most likely token under softmax(logits): the draft's confidence.

    float32 on purpose: it is only compared with a threshold, and it runs once
    per drafted token (4x cheaper than float64 over a 262k vocabulary).
    """
    return float(1.0 / np.exp(logits - logits.max()).sum(dtype=np.float64))


def _top_k_ids(logits: np.ndarray, k: int, stride: int = 64) -> np.ndarray:
    """Ids of the k largest logits (unordered), as np.argpartition gives them, about ten times faster.

    A full argpartition over a large vocabulary costs a sizeable share of a
    small model's step (docs/results.md, "Figures behind design choices"),
    which every sampled token paid. Instead, a threshold is read off every `stride`-th
    logit (its r-th largest, r chosen so that about 4k logits of the whole
    lie above it), and the partition runs over the logits at or above it.
    Exact: the k largest of a subset that holds at least k of them are the k
    largest of all (ties at the k-th value may pick other ids of that same
    value, as argpartition's own order would); a threshold that lets fewer
    than k through falls back to the full partition.
    """
    n = logits.shape[0]
    if n >= 8 * stride and 4 * k * stride < n:
        sub = logits[::stride]
        r = max(2, -(-4 * k // stride))
        threshold = np.partition(sub, sub.size - r)[sub.size - r]
        near = np.flatnonzero(logits >= threshold)
        if near.size >= k:
            return near[np.argpartition(logits[near], near.size - k)[near.size - k :]]
    return np.argpartition(logits, n - k)[n - k :]


def kept_tokens(logits: np.ndarray, params: GenParams) -> tuple[np.ndarray, np.ndarray]:
    """The sampling transform, sparse: the kept token ids (most likely first) and their probabilities (float64,
    summing to 1). `probabilities` is its dense form; `sample_logits` draws from it without the dense vector."""
    if params.greedy:
        return np.array([argmax(logits)]), np.ones(1)
    # Select candidates on the raw float32 logits (temperature does not change
    # their order), then work in float64 on the few that remain.
    n = logits.shape[0]
    if 0 < params.top_k < n:
        ids = _top_k_ids(logits, params.top_k)
    else:
        ids = np.flatnonzero(logits >= logits.max() - _NEGLIGIBLE_LOGIT_GAP * params.temperature)
    vals = logits[ids].astype(np.float64) / params.temperature
    order = np.argsort(-vals, kind="stable")
    ids, vals = ids[order], vals[order]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    keep = len(probs)
    if params.top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (at least one token).
        keep = min(keep, int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1)
    if params.min_p > 0.0:
        keep = min(keep, int(np.count_nonzero(probs >= params.min_p * probs[0])))
    ids, probs = ids[:keep], probs[:keep]
    return ids, probs / probs.sum()


def probabilities(logits: np.ndarray, params: GenParams) -> np.ndarray:
    """Dense probability vector (float64, zeros outside the kept candidates)."""
    ids, probs = kept_tokens(logits, params)
    out = np.zeros(logits.shape[0], dtype=np.float64)
    out[ids] = probs
    return out


def sample_logits(logits: np.ndarray, params: GenParams, rng: np.random.Generator) -> int:
    """`sample(probabilities(logits, params), rng)`, the same token for the same generator state, without the
    dense vector (what plain decoding draws every token with)."""
    if params.greedy:
        return argmax(logits)
    ids, probs = kept_tokens(logits, params)
    order = np.argsort(ids)  # `sample` walks the dense vector's nonzero entries in id order
    ids, probs = ids[order], probs[order]
    nonzero = probs > 0.0
    if not nonzero.all():
        ids, probs = ids[nonzero], probs[nonzero]
    if ids.size == 1:
        return int(ids[0])
    cdf = np.cumsum(probs)
    j = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(j, ids.size - 1)])


def log_probabilities(logits: np.ndarray, token: int, top: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """log softmax(logits) of `token`, and the `top` likeliest tokens with theirs, best first (float64)."""
    peak = float(logits.max())
    log_z = peak + float(np.log(np.exp((logits - peak).astype(np.float64)).sum()))
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        ids = _top_k_ids(logits, top) if top < logits.shape[0] else np.arange(logits.shape[0])
        ids = ids[np.argsort(-logits[ids], kind="stable")]
        best = tuple((int(i), float(logits[i]) - log_z) for i in ids if np.isfinite(logits[i]))
    return float(logits[token]) - log_z, best


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token id from a (not necessarily normalised) non-negative vector."""
    ids = np.flatnonzero(probs)
    if ids.size == 1:
        return int(ids[0])
    cdf = np.cumsum(probs[ids])
    j = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(ids[min(j, ids.size - 1)])
