"""`lookup`: prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding";
llama.cpp's examples/lookup without its persistent n-gram caches).

No draft model: the proposal is what followed the most recent earlier
occurrence of the context's last n tokens (n from ngram_max down to ngram_min)
in the prompt and the output so far. It pays on input-grounded tasks
(rewriting code, summarising or quoting a given passage), where the output
copies long runs of the input. Proposals are verified as one chain
(backends.strategies.chain): greedy, or the lossless one-hot rule when sampling.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from backends.config import LookupConfig
from backends.kv import KvSequence
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import Steps
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.chain import chain_step, forced_step


class NgramIndex:
    """Start positions of every n-gram (n in [n_min, n_max]) of a growing token list."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.sizes = range(n_min, n_max + 1)
        self._starts: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # n-grams ending before this position are indexed

    def update(self, tokens: Sequence[int]) -> None:
        for end in range(self._indexed + 1, len(tokens) + 1):
            for n in self.sizes:
                if end >= n:
                    self._starts.setdefault(tuple(tokens[end - n : end]), []).append(end - n)
        self._indexed = len(tokens)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        return self.propose_with_match(tokens, k)[0]

    def propose_with_match(self, tokens: Sequence[int], k: int, extend: int = 0) -> tuple[list[int], int]:
        """`propose`, and the length of the suffix that matched (0: no match): longer matches are likelier right.

        The length is the n of the n-gram found, then followed back past it, up to `extend` more tokens, for
        as long as the text before that occurrence equals the text before the suffix: copying a passage
        gives long matches, a phrase that merely recurs gives short ones.
        """
        n, starts = self.earlier(tokens, 1)
        if k <= 0 or not n:
            return [], 0
        start, length = starts[-1], len(tokens)
        match = n
        while match < n + extend and start + n - match > 0 \
                and tokens[start + n - match - 1] == tokens[length - match - 1]:
            match += 1
        return list(tokens[start + n : start + n + k]), match

    def earlier(self, tokens: Sequence[int], limit: int) -> tuple[int, list[int]]:
        """The longest suffix of `tokens` (up to n_max) that occurred before, as (n, where its latest `limit`
        earlier occurrences start, oldest first); (0, []) when none did."""
        self.update(tokens)
        length = len(tokens)
        for n in reversed(self.sizes):
            if length <= n:
                continue
            starts = self._starts.get(tuple(tokens[length - n :]), [])
            # Starts ascend; the last entry is the suffix itself, the ones before it occurred earlier.
            end = len(starts) - 1 if starts and starts[-1] + n >= length else len(starts)
            if end:
                return n, starts[max(0, end - limit) : end]
        return 0, []


class PromptLookup(StepMachine):
    name = "lookup"

    def __init__(self, target: KvSequence, config: LookupConfig = LookupConfig()) -> None:
        self.target = target
        self.config = config

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        run = Run(self.name, self.target.model, params, prompt, self.target.n_ctx)
        index = NgramIndex(self.config.ngram_min, self.config.ngram_max)

        def step() -> Iterator[object]:
            if (yield from forced_step(run, self.target)):
                return
            drafts = run.valid_prefix(index.propose(run.context, min(self.config.draft_max, run.room() - 1)))
            yield from chain_step(run, self.target, drafts, None, "lookup")

        return drive(run, lambda: self.target.syncing(prompt[:-1], logits=False), step, should_stop)
