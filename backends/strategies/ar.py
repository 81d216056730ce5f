"""`ar`: plain autoregressive decoding, one target forward per token.

The baseline every speedup is measured against; it samples with exactly the
transform the speculative strategies verify against (backends.sampling).
"""

from __future__ import annotations

from typing import Callable, Sequence

from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import Steps
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.chain import plain_step


class Autoregressive(StepMachine):
    name = "ar"

    def __init__(self, target: KvSequence) -> None:
        self.target = target

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        run = Run(self.name, self.target.model, params, prompt, self.target.n_ctx)

        return drive(run, lambda: self.target.syncing(prompt[:-1], logits=False), lambda: plain_step(run, self.target),
                     should_stop)
