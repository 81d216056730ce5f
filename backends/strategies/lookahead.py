"""`lookahead`: lookahead decoding (Fu, Bailis, Stoica & Zhang 2024, "Break the
Sequential Dependency of LLM Inference Using Lookahead Decoding"), step for
step as llama.cpp's examples/lookahead/lookahead.cpp drives it.

Each target forward pass is one batch holding, with their own sequence ids:
  seq 0          the input token (it belongs to every sequence),
  seqs 1..W      the lookahead branch: a 2-D window of N-1 levels x W columns of
                 past Jacobi iterations (column i lives in sequence i+1),
  seqs W+1..W+G  the verification branch: up to G n-grams from the pool that
                 start with the input token.
The target's token after the input is compared with the n-grams' next tokens;
each match lets one more token through in the same pass (greedy: equality;
sampling: the target's draw at that place, backends.verify, lossless). The window
shifts by one level per step and its new last level is the target's argmax
at the last level's rows; every column then yields an n-gram for the pool.
After the step, cells past the accepted prefix are dropped, and the winning
n-gram's sequence becomes sequence 0 and is shared with all others again.

Unlike lookahead.cpp, N = 2 (plain Jacobi decoding: the window's single level
carries logits) and G = 0 (no pool, lookahead branch only) are supported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Iterator, Sequence

import numpy as np

from backends.config import LookaheadConfig
from backends.events import TARGET
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams, argmax, sample_logits
from backends.steps import Decode, Steps
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.branches import pick_among
from backends.strategies.chain import chain_step, forced_step
from backends.strategies.ngram_pool import NgramPool

# lookahead.cpp fills the initial window with 100, 101, ... (any tokens work).
_WINDOW_INIT_TOKEN = 100


@dataclass
class _Batch:
    """Where each part of one lookahead batch landed (row indices for logits)."""

    candidates: list[tuple[int, ...]]  # n-grams from the pool: tokens after the input
    candidate_rows: list[list[int]]  # [g][v]: row of the v-th token of candidate g's chain (v=0: input)
    last_level_rows: list[int]  # row per window column whose logits make the new last level
    input_row: int  # row of the input token


class LookaheadWindow:
    """One generation's lookahead state: the Jacobi window, the n-gram pool and the step counters.

    `step(run)` runs one lookahead forward pass after the committed context
    (the cache holds context[:-1]); `auto` drives the same object between its
    other kinds of step, so the window and pool persist across them.
    """

    def __init__(self, target: KvSequence, config: LookaheadConfig, prompt: Sequence[int]) -> None:
        self.target = target
        self.config = config
        W, N = config.window, config.ngram
        self.pool = NgramPool(config.guesses)
        if config.seed_pool_from_prompt:
            self.pool.seed(prompt, N - 1)
        n_vocab = target.n_vocab
        self.window = [[(_WINDOW_INIT_TOKEN + i) % n_vocab for i in range(W)] for _ in range(N - 1)]
        self.accepted_hist = [0] * N
        self.batch_tokens = 0  # tokens decoded by all forwards, for the cost model (backends.pricing)

    @property
    def n_seqs(self) -> int:
        return self.config.n_seq_max

    def fits(self, run: Run) -> bool:
        """Room in the context for a whole window after the committed text."""
        return len(run.context) + self.config.window + self.config.ngram <= run.n_ctx

    def _decode_batch(self, run: Run, n_past: int) -> Generator[Decode, list[int], _Batch]:
        """Lay out and decode one lookahead batch; returns where each part landed. Under a grammar, the pool's
        n-grams it refuses are left out (they would cost N-1 rows each and could never be accepted)."""
        W, N, G = self.config.window, self.config.ngram, self.config.guesses
        window = self.window
        token = run.pending
        entries: list[tuple[int, int, Sequence[int], bool]] = [(token, n_past, range(W + G + 1), True)]
        candidates = list(self.pool.get(token))
        if run.constraint is not None:
            candidates = [g for g in candidates if len(run.valid_prefix(g)) == len(g)]
        rows = [[0] * N for _ in candidates]
        # Verification n-grams first (less KV fragmentation, as lookahead.cpp).
        for j in range(N - 1):
            for g, gram in enumerate(candidates):
                rows[g][j + 1] = len(entries)
                entries.append((gram[j], n_past + j + 1, (W + 1 + g,), True))
        last_rows = [0] * W  # column 0 of level 0 is the input token itself (row 0)
        for i in range(1, W):
            if N == 2:
                last_rows[i] = len(entries)
            entries.append((window[0][i], n_past + i, range(i + 1, W + 1), N == 2))
        for j in range(1, N - 1):
            for i in range(W):
                if j == N - 2:
                    last_rows[i] = len(entries)
                entries.append((window[j][i], n_past + j + i, (i + 1,), j == N - 2))
        got = yield from self.target.decoding(entries)
        self.batch_tokens += len(entries)
        # Rows of this batch as the lane placed it (the same indices when the sequence decodes alone).
        return _Batch(candidates, [[got[r] for r in gram] for gram in rows], [got[r] for r in last_rows], got[0])

    def _advance_window(self, b: _Batch, first_of_step: bool) -> None:
        W, N = self.config.window, self.config.ngram
        window = self.window
        previous = list(window[0])
        for j in range(N - 2):
            window[j] = window[j + 1]
        if first_of_step:
            window[N - 2] = [argmax(self.target.logits(r)) for r in b.last_level_rows]
            for i in range(W):  # every column is an n-gram continuing its old level-0 token
                self.pool.add(previous[i], [window[j][i] for j in range(N - 1)])
        else:
            window[N - 2] = list(window[0])

    def step(self, run: Run, why: str = "") -> Iterator[object]:
        """One lookahead forward pass: its token events and StepEnd. Sequences 1.. must share sequence 0's cells."""
        W, N, G = self.config.window, self.config.ngram, self.config.guesses
        target = self.target
        n_past = len(run.context) - 1
        b = yield from self._decode_batch(run, n_past)
        active = list(range(len(b.candidates)))
        best_seq, row = 0, b.input_row
        n_matched = 0  # matched tokens whose cells (in best_seq) stay in the cache
        n_accepted = 0  # tokens emitted as accepted drafts
        for v in range(N):
            if v > 0:
                if not active:
                    break
                best_seq, row = W + 1 + active[0], b.candidate_rows[active[0]][v]
            offered = [b.candidates[g][v] for g in active] if v < N - 1 else []
            token, matched, counted = yield from pick_among(run, run.logits(target, row), offered, "lookahead")
            n_accepted += counted
            if run.reason is not None:
                break
            n_matched += matched
            active = [g for g in active if v < N - 1 and b.candidates[g][v] == token]
            self._advance_window(b, v == 0)
        # KV: keep the input token and the matched n-gram prefix, in sequence 0, shared again.
        target.keep_branch(run.context, min(n_past + 1 + n_matched, len(run.context)), best_seq, W + G + 1)
        self.accepted_hist[n_accepted] += 1
        yield run.end_step(len(b.candidates[0]) if b.candidates else 0, n_accepted, "lookahead", why)

    def stats(self) -> dict[str, object]:
        return {"ngram_pool_size": len(self.pool), "accepted_per_step_histogram": list(self.accepted_hist),
                "batch_tokens": self.batch_tokens}


class LookaheadDecoding(StepMachine):
    name = "lookahead"

    def __init__(self, target: KvSequence, config: LookaheadConfig = LookaheadConfig()) -> None:
        if target.n_seq_max < config.n_seq_max:
            raise ValueError(
                f"lookahead W={config.window}, G={config.guesses} needs a context with "
                f"{config.n_seq_max} sequences (it has {target.n_seq_max})"
            )
        if config.batch_size > target.batch_capacity:
            raise ValueError(f"lookahead W={config.window} N={config.ngram} G={config.guesses} needs a batch of "
                             f"{config.batch_size} tokens, more than the batch size {target.batch_capacity} (-b)")
        self.target = target
        self.config = config

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        target = self.target
        run = Run(self.name, target.model, params, prompt, target.n_ctx)
        la = LookaheadWindow(target, self.config, prompt)
        first_token: list[int] = []
        first_logits: list[np.ndarray | None] = []
        forced = [False]  # the last step verified a stretch the grammar forces: sequence 0 grew alone

        def prefill() -> Generator[Decode, list[int], int]:
            # As lookahead.cpp, batch for batch: the prompt but its last token, then the last token alone, and the
            # first token from its logits. (One batch for the whole prompt rounds that cell's keys and values
            # otherwise; the window's guesses are argmaxes over near-ties, and they follow.)
            cached = yield from target.syncing(prompt[:-1], logits=False)
            yield from target.extending(prompt[-1:])
            logits = run.logits(target)
            first_token.append(sample_logits(logits, params, run.noise, run.place()))
            first_logits.append(np.array(logits) if params.logprobs is not None else None)
            return cached

        def step() -> Iterator[object]:
            if first_token:
                ev = run.commit(first_token.pop(), TARGET, logits=first_logits.pop())
                if ev is not None:
                    yield ev
                target.share_with(la.n_seqs)
                la.batch_tokens += 1
                yield run.end_step(0, 0, "plain")
            elif (yield from forced_step(run, target)):
                forced[0] = True
            elif not la.fits(run):
                # Too close to the end of the context for a window: plain decoding.
                la.batch_tokens += 1
                yield from chain_step(run, target, [], None)
            else:
                if forced[0]:
                    target.share_with(la.n_seqs)  # the grammar's steps grew sequence 0 alone
                    forced[0] = False
                yield from la.step(run)

        run.report(la.stats)

        return drive(run, prefill, step, should_stop)
