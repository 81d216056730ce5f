"""Sampling parameters, the one logits -> probabilities transform, and the target's draws.

Every strategy, for the target and for the draft, goes through `probabilities`
so that speculative verification compares like with like.
The order is the one Hugging Face's `generate` uses: temperature, then top-k,
then top-p (nucleus, Holtzman et al. 2020), then min-p (Nguyen et al. 2024).
Temperature 0 means greedy decoding: argmax of the raw logits.

The target draws its token at each place of the output by Gumbel-max with
noise the seed fixes for that place and each token id (`Noise`, `draw`):
argmax over the kept tokens x of log p(x) + g(place, x), an exact draw from
p. Plain decoding draws so, and so does the verification of deterministic
proposals (lookup, the memory, lookahead's n-grams, trees: backends.verify),
where a proposal is accepted iff it is the token the target draws. The
target's token at each place is then the same whoever proposed: a seeded
answer is the one `ar` gives, whatever those strategies proposed and however
`auto` chose between them (Daliri, Musco & Suresh 2024, "Coupling without
Communication and Drafter-Invariant Speculative Decoding", arXiv 2408.07978,
its Gumbel sampling). The chance of accepting a deterministic proposal is
p(x), as with SpecInfer's rule, so nothing is lost; what is gained is an
answer that the same seed reproduces (OpenAI's `seed`), and a speculation
memory whose record of a seeded answer is that answer when the same request
comes again. A draft model's sampled proposals are still verified by
rejection sampling (Leviathan et al.), which accepts more than a coupled draw
would (1 - TV against at least (1 - TV)/(1 + TV), the paper's bound), with a
generator of its own (`make_rng`).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

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
    # The place in the whole answer of this generation's first token (a thinking model's later phase goes on
    # counting from its earlier ones): the target's draws are indexed by it (`Noise`).
    first_place: int = 0

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
        if self.first_place < 0:
            raise ValueError("an answer's first place is >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def make_rng(seed: int | None) -> np.random.Generator:
    """The generator a draft model samples its proposals with, and rejection sampling decides with."""
    return np.random.default_rng(seed)


_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_ULP = 1.0 / (1 << 53)
# Up to this many tokens, the sampling transform's last steps and the draw run in plain Python floats. A step's
# Python runs cold, right after a decode streamed the weights through the caches, where each numpy call costs
# several microseconds whatever its size: on the few tokens a sampled step keeps, plain Python is the cheaper
# (docs/results.md, "auto's host time a step halved").
FEW = 64


def _mix(x: int) -> int:
    """SplitMix64's finaliser (Steele, Lea & Flood 2014) on a Python int: 64 well-mixed bits."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """`_mix` over a uint64 array (numpy's array products wrap modulo 2^64, as the finaliser wants)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class Noise:
    """Gumbel noise fixed by a key for each place of an answer and each token id: g(place, x) =
    -log(-log u), u uniform in (0, 1) from SplitMix64 over (key, place, x). Counter-based, so a draw at a place
    costs only the kept tokens' noise, and every strategy that draws at that place reads the same."""

    key: int

    def __post_init__(self) -> None:
        if not 0 <= self.key <= _MASK:
            raise ValueError(f"a noise key is 64 bits, got {self.key}")

    @staticmethod
    def of(seed: int | None) -> "Noise":
        """The seed's noise; without a seed, fresh noise."""
        return Noise(_mix((seed + _GOLDEN) & _MASK) if seed is not None else secrets.randbits(64))

    def _base(self, place: int) -> int:
        return _mix((self.key ^ _mix((place * _GOLDEN + 1) & _MASK)) & _MASK)

    def gumbel(self, place: int, ids: np.ndarray) -> np.ndarray:
        bits = _mix_array(np.asarray(ids, dtype=np.uint64) * np.uint64(_GOLDEN) + np.uint64(self._base(place)))
        u = ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * _ULP
        return -np.log(-np.log(u))

    def best(self, place: int, ids: Sequence[int], probs: Sequence[float]) -> int:
        """`draw` over a few tokens in plain Python: the same uniforms as `gumbel`, bit for bit (Python ints)."""
        base, best, token = self._base(place), -math.inf, -1
        for x, p in zip(ids, probs):
            if p > 0.0:
                bits = _mix((x * _GOLDEN + base) & _MASK)
                score = math.log(p) - math.log(-math.log((float(bits >> 11) + 0.5) * _ULP))
                if score > best:
                    best, token = score, x
        return token


def draw(ids: Sequence[int] | np.ndarray, probs: Sequence[float] | np.ndarray, noise: Noise, place: int) -> int:
    """The target's token at `place` among `ids` with probabilities `probs` (zeros are never drawn): Gumbel-max,
    an exact draw. Up to FEW tokens in plain Python (Noise.best), more with numpy: which, only the number of
    tokens decides, so every caller drawing from the same tokens draws alike."""
    if len(ids) <= FEW:
        return noise.best(place, ids.tolist() if isinstance(ids, np.ndarray) else ids,
                          probs.tolist() if isinstance(probs, np.ndarray) else probs)
    ids, probs = np.asarray(ids), np.asarray(probs, dtype=np.float64)
    nonzero = probs > 0.0
    if not nonzero.all():
        ids, probs = ids[nonzero], probs[nonzero]
    if ids.size == 1:
        return int(ids[0])
    return int(ids[int(np.argmax(np.log(probs) + noise.gumbel(place, ids)))])


def draw_dense(p: np.ndarray, noise: Noise, place: int) -> int:
    """`draw` from a dense probability vector (zeros outside the kept tokens)."""
    ids = np.flatnonzero(p)
    return draw(ids, p[ids], noise, place)


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
    ids, probs = _kept(logits, params)
    return np.asarray(ids, dtype=np.int64), np.asarray(probs, dtype=np.float64)


def _kept(logits: np.ndarray, params: GenParams) -> tuple[Sequence[int], Sequence[float]]:
    """kept_tokens' work (params not greedy). The candidates are selected on the raw float32 logits (temperature
    does not change their order); the rest runs in float64 on the few that remain: in plain Python up to FEW of
    them (lists), with numpy beyond (arrays)."""
    n = logits.shape[0]
    if 0 < params.top_k < n:
        ids = _top_k_ids(logits, params.top_k)
    else:
        ids = np.flatnonzero(logits >= logits.max() - _NEGLIGIBLE_LOGIT_GAP * params.temperature)
    if ids.size <= FEW:
        return kept_few(ids.tolist(), logits[ids].tolist(), params)
    return kept_many(logits, ids, params)


def kept_few(ids: list[int], logits: list[float], params: GenParams) -> tuple[list[int], list[float]]:
    """`kept_many`'s transform on a few candidates, in plain Python floats."""
    t = params.temperature
    order = sorted(range(len(ids)), key=logits.__getitem__, reverse=True)  # stable, as argsort's "stable"
    top = logits[order[0]] / t
    probs = [math.exp(logits[i] / t - top) for i in order]
    total = sum(probs)
    probs = [p / total for p in probs]
    keep = len(probs)
    if params.top_p < 1.0:  # the smallest prefix whose mass reaches top_p (at least one token)
        mass = 0.0
        for i, p in enumerate(probs):
            mass += p
            if mass >= params.top_p:
                keep = min(keep, i + 1)
                break
    if params.min_p > 0.0:
        floor = params.min_p * probs[0]
        keep = min(keep, sum(1 for p in probs if p >= floor))
    total = sum(probs[:keep])
    return [ids[i] for i in order[:keep]], [p / total for p in probs[:keep]]


def kept_many(logits: np.ndarray, ids: np.ndarray, params: GenParams) -> tuple[np.ndarray, np.ndarray]:
    """The sampling transform on the candidates `ids`: temperature, then top-p and min-p on them, most likely
    first, renormalised."""
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


def sample_logits(logits: np.ndarray, params: GenParams, noise: Noise, place: int) -> int:
    """The target's token at `place`: `draw_dense(probabilities(logits, params), noise, place)`, the same token,
    without the dense vector (what plain decoding draws every token with); greedy: the argmax."""
    if params.greedy:
        return argmax(logits)
    ids, probs = _kept(logits, params)
    return draw(ids, probs, noise, place)


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
