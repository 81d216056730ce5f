"""The arithmetic of `auto`'s choice: an option's worth, the expected tokens of a chain, and when to try again.

Pure functions of the estimates (backends.strategies.auto.state) and the
cost of a batch; backends.strategies.auto.choose applies them each step
(Dinkelbach's transform of tokens per second). Which subtree of a candidate
tree pays is backends.pricing's, shared with `tree`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

PLAIN, DRAFT, LOOKUP, LOOKAHEAD, MEMORY = "plain", "draft", "lookup", "lookahead", "memory"
# Fewest steps between two tries of one option: exploration's cost is bounded by the estimates, and this
# bounds it when an estimate is wrong (an option tried once per 128 steps costs at most ~1/128 of its step).
MIN_EXPLORE_INTERVAL = 128
# An option tried fewer than EARLY_TRIES times is still judged by its prior, so it is tried sooner: the
# first try after EARLY_INTERVAL steps with EARLY_BUDGET_FACTOR times the budget, each later try waiting
# twice as long on half the budget, until the steady schedule. Once per engine (the state is kept across
# turns), this costs a few steps in all: a draft that pays at greedy is found within the first ~10 tokens.
EARLY_TRIES = 4
EARLY_INTERVAL = 8
EARLY_BUDGET_FACTOR = 16
# An option taken fewer than SETTLE_STEPS times on an engine is still being learnt: its acceptance estimates are
# near their priors. The draft's stopping rule cut its first chains short on them (the Q8_0 draft, greedy, one
# client: 2 tokens in two plain steps' time for its first ~30 steps, then 6 to 13), and steps measured on those
# chains priced it at plain decoding's rate: dropped, or held back by the realised check, before the estimates
# learnt, it ran at 1.0x plain in runs where it delivers 1.4x. So while it is learnt the draft drafts at least
# what its tries would (sps's rule: .generation.draft_chain), and the realised check does not judge the ticks
# such an option's rows run in (backends.realised, `learning`). What that costs is bounded by this, once per
# engine and sampling mode (the state is kept between processes).
SETTLE_STEPS = 32
# Steps a switch to the draft must pay its catch-up back within: at most this many draft steps are counted
# on after a switch (fewer near the end of the answer).
SWITCH_HORIZON = 8
# Back-off: each try of an option that is then still not chosen on its estimate doubles the wait before its
# next try, up to 2**BACKOFF_MAX times the steady interval; choosing it on its estimate, or a new temperature
# (acceptance differs most between greedy and sampled decoding), starts the waits over.
BACKOFF_MAX = 3
# The longest chain a steady try of the draft drafts (the early tries draft up to sps's K): a try that tests
# the confidence estimates on a chain of a few tokens costs a third to a half of one drafting K, and lands
# whole on whichever answer it falls in.
TRY_DRAFT_MAX = 3


@dataclass(frozen=True)
class Choice:
    """One step's option: what to verify, how long at most, expected tokens and seconds, and why."""

    option: str
    length: int = 0  # lookup: tokens to verify; the draft: the longest chain (it finds its length as it drafts)
    tokens: float = 1.0  # expected output tokens
    seconds: float = 1.0  # expected time
    why: str = ""
    explore: bool = False
    # A one-off cost of taking this option now (the draft catching up on the tokens decoded while it stood
    # by), and over how many steps of it that is paid back: a switch must pay for itself within them.
    switch: float = 0.0
    horizon: float = 1.0
    nodes: tuple[int, ...] = ()  # the memory: which nodes of the step's candidate tree to verify

    def because(self, why: str) -> "Choice":
        """This choice, with its reason (what dataclasses.replace does, at a tenth of its cost: once a step)."""
        return Choice(self.option, self.length, self.tokens, self.seconds, why, self.explore, self.switch,
                      self.horizon, self.nodes)

    @property
    def step_seconds(self) -> float:
        """Expected seconds of this step, with its share of the switching cost."""
        return self.seconds + self.switch / self.horizon

    def value(self, rate: float) -> float:
        """Dinkelbach's worth at throughput `rate`: positive against a step that merely keeps the rate."""
        return self.tokens - rate * self.step_seconds


def being_learnt(option: str, taken: Mapping[str, int]) -> bool:
    """Whether `option` is still being learnt: taken fewer than SETTLE_STEPS times on the engine (plain
    decoding has nothing to learn)."""
    return option != PLAIN and taken.get(option, 0) < SETTLE_STEPS


def still_learnt(options: Sequence[Choice], taken: Mapping[str, int], t_plain: float) -> Choice | None:
    """Of the options taken fewer than SETTLE_STEPS times, the one worth most against plain decoding's rate,
    where one beats it on its estimate; else None.

    Such an option is judged against plain decoding, not against the rate `auto` reached (Dinkelbach's R):
    that rate is mostly its own first steps, and an estimate from a dozen steps moves with the text. A good
    draft whose first chains were long and the next few short was measured just above plain decoding but
    under the R its first steps had lifted; not taken, its estimate stayed there while the catch-up a switch
    back would cost grew with every plain step, and it was never taken again (docs/results.md, "An option
    judged against plain until it settles"). Judged against plain it goes on while it beats plain decoding,
    until its estimate settles; then R judges it.
    """
    plain_rate = 1.0 / t_plain
    learning = [o for o in options if being_learnt(o.option, taken) and o.value(plain_rate) > 0]
    return max(learning, key=lambda o: o.value(plain_rate)) if learning else None


def running_expected_tokens(accept: Sequence[float]) -> Iterator[float]:
    """Expected output of verifying the first 1, 2, ... proposals: 1 + the sum of the running products of
    `accept`, where `accept[i]` is the chance the (i+1)-th is accepted given the ones before."""
    expected, reach = 1.0, 1.0
    for a in accept:
        reach *= a
        expected += reach
        yield expected


def expected_chain_tokens(accept: Sequence[float], k: int) -> float:
    """Expected output of verifying the first k proposals (1.0 for none)."""
    return [1.0, *running_expected_tokens(accept[:k])][-1]


def best_chain_length(accept: Sequence[float], rate: float, t_plain: float, curve: Callable[[float], float],
                      per_token: float = 0.0, once: float = 0.0) -> tuple[int, float, float]:
    """The chain length k (0..len) maximising expected tokens - rate * seconds; with its tokens and seconds.

    `accept` as for `running_expected_tokens`; verifying k proposals costs
    t_plain * T(k+1)/T(1) + k * per_token + once (a block drafter's one decode for the whole chain).
    """
    best = (0, 1.0, t_plain)
    for i, expected in enumerate(running_expected_tokens(accept), start=1):
        seconds = t_plain * curve(i + 1) + i * per_token + once
        if expected - rate * seconds > best[1] - rate * best[2]:
            best = (i, expected, seconds)
    return best


def explore_interval(budget: float, extra_steps: float, n_options: int, taken: int, backoff: int = 0) -> int:
    """Steps to wait before trying an option the estimates call worse by `extra_steps` plain steps a try.

    Steady: the try costs at most `budget` / n_options of the time, and at least
    MIN_EXPLORE_INTERVAL steps pass; `backoff` tries in a row that left the
    option worse (still not chosen on its estimate) double the wait each, up
    to 2**BACKOFF_MAX times: the cost of confirming, again and again, that an
    option does not pay falls to an eighth of the budget, as retries back off
    in TCP. While the option has been taken fewer than EARLY_TRIES times its
    estimate is mostly prior, so the wait starts at EARLY_INTERVAL steps with
    EARLY_BUDGET_FACTOR x the budget, doubling per try.
    """
    if budget <= 0:
        return 1 << 30
    early = max(EARLY_TRIES - taken, 0)
    share = budget * min(EARLY_BUDGET_FACTOR, 2 ** early) / max(n_options, 1)
    if early:
        return max(min(MIN_EXPLORE_INTERVAL, EARLY_INTERVAL << taken), math.ceil(max(extra_steps, 0.0) / share))
    steady = max(MIN_EXPLORE_INTERVAL, math.ceil(max(extra_steps, 0.0) / share))
    return steady << min(max(backoff, 0), BACKOFF_MAX)
