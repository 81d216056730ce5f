"""`sps`: draft-model speculative sampling.

Leviathan, Kalman & Matias 2023 (Algorithm 1) and Chen et al. 2023; the loop
follows llama.cpp's `examples/speculative-simple` with `common/speculative.cpp`:
the draft model (own context, own KV cache) proposes up to K tokens
(backends.strategies.drafting, the loop `auto` drafts with too), the target
scores `[last token, d1..dK]` in one batch with logits on every row, and both
caches are rolled back past the first rejection.

K adapts twice: drafting stops early when the draft's top probability falls
under `p_min` (llama.cpp's `--draft-p-min`), and K itself follows Hugging
Face's "heuristic" schedule (candidate_generator.py): +2 after a step whose
drafts were all accepted, -1 after a rejection, within [1, K_max].
"""

from __future__ import annotations

from typing import Callable, Generator, Iterator, Sequence

from backends.config import SpsConfig
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import Decode, Steps
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.chain import chain_step, forced_step
from backends.strategies.drafting import Chain, PMin, draft_chain


class SpeculativeSampling(StepMachine):
    name = "sps"

    def __init__(self, target: KvSequence, draft: KvSequence, config: SpsConfig = SpsConfig()) -> None:
        self.target = target
        self.draft = draft
        self.config = config

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        run = Run(self.name, self.target.model, params, prompt, min(self.target.n_ctx, self.draft.n_ctx))
        cfg = self.config
        k_cur = cfg.draft_max
        rule = PMin(cfg.p_min)

        def prefill() -> Generator[Decode, list[int], int]:
            yield from self.draft.syncing(prompt[:-1], logits=False)
            return (yield from self.target.syncing(prompt[:-1], logits=False))

        def propose(k: int) -> Generator[Decode, list[int], Chain]:
            """Up to k draft tokens while the draft's confidence holds (and, when sampling, their distributions)."""
            if k == 0:
                return Chain()
            self.draft.plan(k)  # a block drafter's block (backends.dflash)
            yield from self.draft.syncing(run.context)
            return (yield from draft_chain(run, self.draft, k, rule, confidence=cfg.p_min > 0))

        def step() -> Iterator[object]:
            nonlocal k_cur
            if (yield from forced_step(run, self.target)):
                return
            chain = yield from propose(min(k_cur, run.room() - 1))
            drafts = chain.tokens
            verdict = yield from chain_step(run, self.target, drafts, None if params.greedy else chain.dists,
                                            self.draft.label)
            if cfg.adaptive and drafts:
                if verdict.n_accepted == len(drafts):
                    k_cur = min(cfg.draft_max, k_cur + 2)
                else:
                    k_cur = max(1, k_cur - 1)

        return drive(run, prefill, step, should_stop)
