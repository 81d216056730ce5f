"""`ar`: plain autoregressive decoding, one target forward per token.

The baseline every speedup is measured against; it samples with exactly the
transform the speculative strategies verify against (backends.sampling).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from backends.events import TARGET, Event
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams, argmax, probabilities, sample
from backends.strategies.base import drive, never


class Autoregressive:
    name = "ar"

    def __init__(self, target: KvSequence) -> None:
        self.target = target

    def generate(
        self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never
    ) -> Iterator[Event]:
        run = Run(self.name, self.target.model, params, prompt, self.target.n_ctx)

        def step() -> Iterator[Event]:
            self.target.extend([run.pending])
            logits = self.target.logits()
            tok = argmax(logits) if params.greedy else sample(probabilities(logits, params), run.rng)
            ev = run.commit(tok, TARGET)
            if ev is not None:
                yield ev
            yield run.end_step(0, 0, "plain")

        return drive(run, lambda: self.target.sync(prompt[:-1], logits=False), step, should_stop)
