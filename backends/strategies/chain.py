"""Verifying one chain of proposals in one target forward pass.

Shared by every strategy whose drafter proposes a single sequence (`sps`'s
draft model, `lookup`'s prompt n-grams): the target scores
`[last committed token, d1..dk]` with logits on every row (row i holds the
target's distribution for the token after d_i), the verification rule picks how
many to keep, and the cache is cut back past the first rejection.

Rules (backends.verify): greedy at temperature 0; with sampling, Leviathan et
al.'s rejection sampling when the drafter has a distribution q, and the
one-hot rule (accept with probability p(d)) when its proposals are deterministic.
"""

from __future__ import annotations

from typing import Generator, Sequence

import numpy as np

from backends.events import TARGET, Event, Source
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import argmax, probabilities, sample_logits
from backends.steps import Decode
from backends.verify import Verdict, verify_draft_sampling, verify_greedy, verify_one_hot_chain


def verify_chain(
    run: Run, target: KvSequence, drafts: Sequence[int], draft_dists: Sequence[np.ndarray] | None
) -> Generator[Decode, list[int], tuple[Verdict, list[int]]]:
    """Score the chain (at least one draft: an empty one is `plain_step`) on the target and decide;
    `draft_dists` is None for deterministic proposals. Returns the verdict and the chain's batch rows (row i:
    the target's logits after drafts[:i])."""
    n_cached = len(run.context)
    rows = yield from target.extending([run.pending, *drafts], logits="all")
    params = run.params
    if params.greedy:
        verdict = verify_greedy(drafts, lambda i: argmax(run.logits(target, rows[i], drafts[:i])))
    elif draft_dists is None:
        verdict = verify_one_hot_chain(drafts, lambda i: probabilities(run.logits(target, rows[i], drafts[:i]), params),
                                       run.noise, run.place())
    else:
        verdict = verify_draft_sampling(
            drafts, draft_dists, lambda i: probabilities(run.logits(target, rows[i], drafts[:i]), params), run.rng
        )
    # The cache keeps the pending token and the accepted drafts.
    target.truncate(n_cached + verdict.n_accepted)
    return verdict, rows


def chain_step(
    run: Run, target: KvSequence, drafts: Sequence[int], draft_dists: Sequence[np.ndarray] | None,
    source: Source = "draft", why: str = "",
) -> Generator[Event | Decode, list[int], Verdict]:
    """One forward pass over a chain proposed by `source`: its token events and its StepEnd. Returns the verdict."""
    if not drafts:
        return Verdict(0, (yield from plain_step(run, target, why)))
    verdict, rows = yield from verify_chain(run, target, drafts, draft_dists)
    # The rows verification looked at (every committed place) are masked in place already: read them as they are
    # (masking again would take the grammar's state, which each commit advances, twice past the drafts).
    yield from run.commit_step(drafts, verdict.n_accepted, verdict.next_token, source, lambda i: target.logits(rows[i]))
    yield run.end_step(len(drafts), verdict.n_accepted, source if drafts else "plain", why)
    return verdict


def plain_step(run: Run, target: KvSequence, why: str = "") -> Generator[Event | Decode, list[int], int]:
    """One plain step, the target's own token drawn without the dense vector: `ar`'s step, and every
    strategy's where it has nothing to verify. One path, as lean as `ar`'s: no verdict, no cut, no chain of
    events, since a speculative strategy's plain steps should cost what `ar`'s do (where a step takes 1.5 ms,
    as on an H200 with a 135M model, the chain's machinery around it cost a few percent). Returns the token."""
    yield from target.extending([run.pending])
    logits = run.logits(target)
    token = sample_logits(logits, run.params, run.noise, run.place())
    event = run.commit(token, TARGET, logits=logits)
    if event is not None:
        yield event
    yield run.end_step(0, 0, "plain", why)
    return token


def forced_step(run: Run, target: KvSequence) -> Generator[Event | Decode, list[int], int]:
    """Where the grammar forces the next bytes, verify their tokens as one chain (source "grammar"); how many
    it proposed (0: the grammar leaves a choice, and the strategy's own step runs instead). Every speculative
    strategy runs this first: these drafts cost no drafter and are nearly always accepted."""
    forced = run.forced()
    if forced:
        yield from chain_step(run, target, forced, None, "grammar", "the grammar forces what comes next")
    return len(forced)
