"""Drafting one chain with a draft model, token by token: the loop `sps` and `auto` share.

Leviathan et al. 2023's drafting loop as llama.cpp's common/speculative.cpp
runs it: the draft (its own context and KV cache, holding the context with
the logits of its last token) proposes its next token from its logits
(greedy: the argmax; sampling: a draw from its tempered distribution q, kept
for rejection sampling), and is fed that token to propose the one after,
until a rule stops it or `k_max` tokens are drafted.

The rule (`DraftRule`) is where strategies differ: `sps` drafts while the
draft's confidence stays at or above p_min (llama.cpp's `--draft-p-min`,
`PMin`); `auto` drafts while the next token is expected to pay for its
draft decode and batch row (backends.strategies.auto.choose.DraftPays). The
confidence is the draft's top probability (of its tempered distribution when
sampling), as llama.cpp's --draft-p-min reads it: the sampled token's own
probability would call a draft unsure wherever its distribution is flat,
though a flat draft that matches a flat target is accepted just as often
(the chance is 1 - TV(p, q)).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generator, Protocol

import numpy as np

from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import argmax, probabilities, sample, top_probability
from backends.steps import Decode


class DraftRule(Protocol):
    def keep(self, i: int, confidence: float) -> bool:
        """Whether the i-th drafted token (0-based), of this confidence, is proposed (False ends the chain
        before it)."""
        ...

    def more(self, i: int, confidence: float) -> bool:
        """Whether to draft another token after proposing the i-th."""
        ...


@dataclass(frozen=True)
class PMin:
    """Propose while the draft's confidence is at least `p_min` (sps; llama.cpp's --draft-p-min). With
    `first_always`, the first token is proposed whatever its confidence (a try of the draft by `auto`); with
    `longest`, no token past that many (sps's K within a longer chain another rule may draft: `Either`)."""

    p_min: float
    first_always: bool = False
    longest: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.p_min < 1.0:
            raise ValueError("p_min must be in [0, 1)")
        if self.longest is not None and self.longest < 1:
            raise ValueError("longest must be at least 1")

    def keep(self, i: int, confidence: float) -> bool:
        if self.longest is not None and i >= self.longest:
            return False
        return (i == 0 and self.first_always) or confidence >= self.p_min

    def more(self, i: int, confidence: float) -> bool:
        return self.longest is None or i + 1 < self.longest


@dataclass(frozen=True)
class Either:
    """Propose, and go on, where either rule would: a chain at least as long as each would draft (both are asked
    every time, so that a rule that keeps state, as auto's stopping rule does, sees every token)."""

    first: DraftRule
    second: DraftRule

    def keep(self, i: int, confidence: float) -> bool:
        return self.first.keep(i, confidence) | self.second.keep(i, confidence)

    def more(self, i: int, confidence: float) -> bool:
        return self.first.more(i, confidence) | self.second.more(i, confidence)


@dataclass
class Chain:
    """A drafted chain: its tokens, the distribution each was drawn from (sampling only), the draft's
    confidence at each, and how many draft decodes drafting it took (beyond the one before the first token)."""

    tokens: list[int] = field(default_factory=list)
    dists: list[np.ndarray] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    decodes: int = 0


def draft_chain(run: Run, draft: KvSequence, k_max: int, rule: DraftRule,
                confidence: bool = True) -> Generator[Decode, list[int], Chain]:
    """Up to k_max tokens after the context, drafted on `draft` (which must hold the context, its last token's
    logits at hand: `draft.syncing(run.context)`). Greedy without `confidence`, the top probability is not
    computed (taken as 1.0): a rule that does not read it need not pay for a softmax over the vocabulary. A block
    drafter (`draft.chain_max`, backends.dflash) drafts no longer than its block, and its next tokens cost no
    decode."""
    chain = Chain()
    if draft.chain_max is not None:
        k_max = min(k_max, draft.chain_max)
    k_max = draft.max_depth(k_max)  # chained MTP heads: one per position (backends.mtp_chain)
    params = run.params
    for i in range(k_max):
        logits = run.logits(draft, path=chain.tokens, drafter=True)
        q = None
        if params.greedy:
            tok = argmax(logits)
            conf = top_probability(logits) if confidence else 1.0
        else:
            q = probabilities(logits, params)
            tok = sample(q, run.rng)
            conf = float(q.max())
        if not rule.keep(i, conf):
            break
        chain.tokens.append(tok)
        chain.confidences.append(conf)
        if q is not None:
            chain.dists.append(q)
        if i + 1 >= k_max or run.model.is_eog(tok) or not rule.more(i, conf):
            break  # nothing follows an end of generation: drafting on cost up to K decodes at every answer's end
        yield from draft.extending([tok])
        chain.decodes += draft.chain_max is None
    return chain
