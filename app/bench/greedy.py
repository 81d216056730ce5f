"""Whether a greedy output that parts from `ar`'s is a loss, or a near-tie that llama.cpp's batches may flip.

At temperature 0 every strategy must write the target's greedy tokens. But
llama.cpp's arithmetic is not batch-invariant: a row decoded in a
verification batch, or beside other sequences, gets logits a few last bits
away from the same row decoded alone (up to about 0.05 on the demo models:
tests/perf/greedy_margins.py `--noise`). Where `ar`'s top two logits are
closer than that, another batch shape may rightly choose the other token, and
from there on the answer is another text. `auto` decides its batches from
live timings, so its greedy answer can part from `ar`'s at such a place and
still be the target's own greedy decoding, which a bench that reads every
parting as "NO" would call a loss. So `specchat bench` measures, at the
parting token, by how much `ar`'s choice wins and how far this model's logits
move between a row decoded alone and in a batch along the same answer, and
says which it is.

A change of batch shape moves each logit by about the noise measured, so
the gap between two logits by up to twice that: a parting where `ar`'s
choice wins by less than twice the noise is a near-tie, anything more a
changed token. The tests read the same gaps (tests/engine_helpers.py's
assert_greedy_agrees) against a fixed bound measured once on the demo models.

The order of a sequence's KV cells moves the logits too. llama.cpp's
attention sums over the cache's cells in their order in the buffer, and a
freed cell is the next one taken: a strategy that verifies several branches
at once (a tree, lookahead's n-grams, `auto`'s memory trees: a registry
entry with more than one sequence) frees its rejected branches' cells among
the kept ones, so the next tokens' cells come before cells of earlier
positions. On an F32 model that moves a logit by about what a batch does
(0.005-0.024 on the demo targets), but a quantized model's activations are
rounded to 8 bits before each product, and a last-bit difference that
crosses a rounding step grows from layer to layer: 0.4-1.7 on the Q8_0,
Q2_K and Q3_K_M/Q4_K_M files of the demo models (docs/results.md, "The KV
cells' order"), where `ar`'s cells, decoded in turn, stay in order. So a
parting is also measured against that (`order_noise`: the same answer
decoded with its cells out of order), and for such a strategy a parting
under twice it is a near-tie as well; a chain strategy's cells stay in order
and its partings are judged by the batch noise alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

from backends.engine import Engine
from backends.grammar import Grammar


def _batched_rows(engine: Engine, prompt: list[int], tokens: Sequence[int]) -> Iterator[np.ndarray]:
    """The target's logits before each of `tokens` (an answer to `prompt`), from one pass that decodes the
    answer in batches with every row's logits, row by row (float64 copies). The first slot's caches are emptied
    once the rows are read."""
    seq = engine.target
    seq.reset()
    try:
        seq.sync(prompt[:-1], logits=False)
        fed = [prompt[-1], *tokens[:-1]]
        for start in range(0, len(fed), seq.batch_capacity):
            seq.extend(fed[start:start + seq.batch_capacity], logits="all")
            for row in seq.rows:
                yield np.array(seq.logits(row), dtype=np.float64)
    finally:
        seq.reset()


def greedy_gaps(engine: Engine, prompt: list[int], tokens: Sequence[int],
                grammar: Grammar | None = None) -> list[float]:
    """Before each of `tokens` (a greedy answer to `prompt`), by how much the target prefers that token to the
    best other one (that `grammar` allows, when the answer was generated under one): its logit less the highest
    other logit, inf where nothing else was allowed. Read from one pass that decodes the answer with every
    row's logits (a batch's arithmetic: a row decoded alone differs by llama.cpp's batch noise only), so a gap
    is negative where that pass would choose otherwise. The first slot's caches are emptied."""
    constraint = grammar.start() if grammar is not None else None
    gaps = []
    for logits, token in zip(_batched_rows(engine, prompt, tokens), tokens):
        if constraint is not None:
            constraint.apply(logits)
            constraint.commit(token)
        chosen, logits[token] = logits[token], -np.inf
        gaps.append(float(chosen - logits.max()))
    return gaps


def top2_gap(engine: Engine, context: list[int]) -> float:
    """The target's top-2 logit gap after `context`, computed alone (the first slot's caches are emptied)."""
    seq = engine.target
    seq.reset()
    seq.sync(context)
    top2 = np.sort(seq.logits())[-2:]
    seq.reset()
    return float(top2[1] - top2[0])


def _alone_rows(engine: Engine, prompt: list[int], tokens: Sequence[int]) -> list[np.ndarray]:
    """The target's logits before each of `tokens`, decoded one row at a time as `ar` decodes (float64 copies).
    The first slot's caches are emptied."""
    seq = engine.target
    seq.reset()
    try:
        seq.sync(prompt)
        rows = [np.array(seq.logits(), dtype=np.float64)]
        for token in tokens[:-1]:
            seq.extend([token])
            rows.append(np.array(seq.logits(), dtype=np.float64))
        return rows
    finally:
        seq.reset()


def _out_of_order_rows(engine: Engine, prompt: list[int], tokens: Sequence[int]) -> list[np.ndarray]:
    """The target's logits before each of `tokens`, decoded with their KV cells out of order: every other one
    after a throwaway cell of a scratch sequence (a batch of two rows, as a verification's), which is then freed,
    so the next one's cell takes that hole, ahead of the cell of the position before it, as the next token after
    a tree's rejected branch does. Batches of one and two rows in order give `ar`'s logits here: only the order
    differs. The first slot's caches are emptied."""
    seq = engine.target
    seq.reset()
    try:
        seq.sync(prompt[:-1], logits=False)
        start = len(prompt) - 1
        rows: list[np.ndarray] = []
        for i, token in enumerate([prompt[-1], *tokens[:-1]]):
            if i % 2 == 0:
                seq.fork(0, 1)  # the scratch sequence's positions follow on from the prefix, as llama.cpp requires
                row = seq.decode_rows([(token, start + i, (1,), False), (token, start + i, (0,), True)])[1]
                seq.drop_seq(1)  # the hole, before this token's cell
            else:
                row = seq.decode_rows([(token, start + i, (0,), True)])[0]  # into the hole
            rows.append(np.array(seq.logits(row), dtype=np.float64))
        return rows
    finally:
        seq.reset()


def _largest_difference(alone: list[np.ndarray], other: Iterable[np.ndarray]) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(alone, other))


def plain_pass_noise(engine: Engine, prompt: list[int], tokens: Sequence[int],
                     alone: list[np.ndarray] | None = None) -> tuple[float, int]:
    """The answer decoded one row at a time (as `ar` does; `alone`, where already decoded) against the same rows
    in one batch: the largest difference of any logit, and at how many positions the two passes' argmax differ.
    The first slot's caches are emptied."""
    alone = _alone_rows(engine, prompt, tokens) if alone is None else alone
    batched = list(_batched_rows(engine, prompt, tokens))
    flips = sum(int(a.argmax() != b.argmax()) for a, b in zip(alone, batched))
    return _largest_difference(alone, batched), flips


def order_noise(engine: Engine, prompt: list[int], tokens: Sequence[int],
                alone: list[np.ndarray] | None = None) -> float | None:
    """The answer decoded one row at a time (`alone`, where already decoded) against the same rows with their KV
    cells out of order (see the module): the largest difference of any logit; None where the first slot has one
    sequence id only (its cells cannot be out of order). The first slot's caches are emptied."""
    if engine.target.n_ids < 2:
        return None
    alone = _alone_rows(engine, prompt, tokens) if alone is None else alone
    return _largest_difference(alone, _out_of_order_rows(engine, prompt, tokens))


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (one ending first counts there); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass(frozen=True)
class Parting:
    """Where a greedy output parts from `ar`'s (`token`: the first index that differs, or where one ended), by how
    much `ar`'s choice wins there (`gap`: its logit less the best other's, or its end token's top-2 gap where
    `ar` ended), the batch noise along `ar`'s answer up to there, and the noise of its KV cells' order (`order`).
    `gap` and the noises are None where they were not measured (a thinking model's answer under a grammar, whose
    phases' grammars differ; the order on a slot of one sequence id)."""

    token: int
    gap: float | None = None
    noise: float | None = None
    order: float | None = None

    def __post_init__(self) -> None:
        if self.token < 0:
            raise ValueError(f"a parting is at an output token, not {self.token}")
        for name, value in (("batch", self.noise), ("cell order", self.order)):
            if value is not None and value < 0:
                raise ValueError(f"a {name} noise is a size, not {value}")

    @property
    def near_tie(self) -> bool:
        """Whether another batch shape may rightly choose otherwise here (see the module)."""
        return self.gap is not None and self.noise is not None and self.gap < 2 * self.noise

    def near_tie_for(self, reorders: bool) -> bool:
        """`near_tie`, or, for a strategy whose verification leaves the KV cells out of order (`reorders`), a gap
        under twice the order's noise (see the module)."""
        return self.near_tie or (reorders and self.gap is not None and self.order is not None
                                 and self.gap < 2 * self.order)


def choice_gap(engine: Engine, prompt: list[int], want: Sequence[int], at: int,
               grammar: Grammar | None = None) -> float:
    """By how much `ar`'s choice at output token `at` of its greedy answer `want` (under `grammar` if it had one)
    wins: its logit less the best other's (greedy_gaps), or, where `want` ended at `at`, its end token's top-2
    gap."""
    if at < len(want):
        return greedy_gaps(engine, prompt, want[:at + 1], grammar)[at]
    return top2_gap(engine, list(prompt) + list(want))


def parting(engine: Engine, prompt: list[int], want: Sequence[int], at: int,
            grammar: Grammar | None = None) -> Parting:
    """Another output's parting from `want` (`ar`'s greedy answer to `prompt`, under `grammar` if it had one) at
    output token `at` (first_difference), measured."""
    answered = list(want[:at + 1])
    alone = _alone_rows(engine, prompt, answered)  # the one-row pass both noises are read against
    return Parting(at, choice_gap(engine, prompt, want, at, grammar),
                   plain_pass_noise(engine, prompt, answered, alone)[0], order_noise(engine, prompt, answered, alone))
