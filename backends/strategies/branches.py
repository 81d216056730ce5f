"""Verifying several candidates at one position, and keeping the winning branch.

Shared by the strategies that verify many branches in one batch, each under
its own sequence id (`lookahead`'s n-grams, `tree`'s paths). At each position
the target picks its token among the branches' candidates (greedy: argmax;
sampling: SpecInfer's one-hot multi-candidate rule, backends.verify); after the
walk the caller keeps the accepted branch's cells as sequence 0 and drops the
others (backends.kv.KvSequence.keep_branch).
"""

from __future__ import annotations

from typing import Generator, Sequence

import numpy as np

from backends.events import ACCEPTED, TARGET, Event, Source
from backends.run import Run
from backends.sampling import argmax, probabilities
from backends.verify import choose_among_candidates


def pick_among(run: Run, logits: np.ndarray, offered: Sequence[int],
               source: Source) -> Generator[Event, None, tuple[int, bool, bool]]:
    """Commit the target's token at a position offered `offered`; yields its events.

    Returns (token, matched: it was one of the candidates, counted: it was
    emitted as an accepted draft).
    """
    if run.params.greedy:
        token = argmax(logits)
    else:
        token = choose_among_candidates(probabilities(logits, run.params), offered, run.rng)
    matched = token in offered
    if offered and not matched:
        yield run.rejected(offered[0], source)
    ev = run.commit(token, ACCEPTED if matched else TARGET, correction=bool(offered) and not matched,
                    source=source)
    if ev is not None:
        yield ev
    return token, matched, ev is not None and matched
