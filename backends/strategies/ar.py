"""`ar`: plain autoregressive decoding, one target forward per token.

The baseline every speedup is measured against; it samples with exactly the
transform the speculative strategies verify against (backends.sampling).
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from backends.events import TARGET
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams, sample_logits
from backends.steps import Steps
from backends.strategies.base import StepMachine, drive, never


class Autoregressive(StepMachine):
    name = "ar"

    def __init__(self, target: KvSequence) -> None:
        self.target = target

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        run = Run(self.name, self.target.model, params, prompt, self.target.n_ctx)

        def step() -> Iterator[object]:
            yield from self.target.extending([run.pending])
            logits = run.logits(self.target)
            tok = sample_logits(logits, params, run.noise, run.place())
            ev = run.commit(tok, TARGET, logits=logits)
            if ev is not None:
                yield ev
            yield run.end_step(0, 0, "plain")

        return drive(run, lambda: self.target.syncing(prompt[:-1], logits=False), step, should_stop)
