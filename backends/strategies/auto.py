"""`auto`: before every target forward pass, verify whatever maximises expected tokens per second.

The options of one step:
  - nothing: a plain step, one token;
  - a prompt-lookup continuation (Saxena 2023), of a length chosen from the
    match: llama.cpp's examples/lookup proposal, verified as one chain;
  - a draft-model chain (Leviathan et al. 2023), drafted token by token and
    stopped where the draft's confidence no longer pays;
  - a lookahead step (Fu et al. 2024): lookahead.cpp's window and n-gram pool
    batch (backends.strategies.lookahead.LookaheadWindow), when it pays.

How it decides. Maximising a ratio (tokens / seconds) step by step is done
with Dinkelbach's transform: with R the throughput this engine reaches (the
better of plain decoding's rate and the rate `auto` has measured), each option
is worth E[tokens] - R * E[seconds], and the best option is the one worth most;
an option pays exactly when it beats R. This is the rule vLLM's adaptive
verification and SmartSpec's "goodput" apply (expected accepted tokens per
unit of time, from a cost model measured on the device); TensorRT-LLM's
switch-off at low acceptance is its special case. The inputs:
  - expected tokens: the chance a proposed token is accepted, learnt live per
    proposer and kept across the turns of a conversation (the engine's Learnt holds
    the state): for the draft by its confidence (its top probability, as
    llama.cpp's --draft-p-min reads it; EAGLE-2 shows it tracks acceptance)
    and by position, for lookup by match length and position, for lookahead
    its tokens per step.
    Lookup's match is followed back past the n-gram that found it (up to
    MATCH_EXTEND tokens), which tells copying a passage (long matches) from
    quoting a phrase (short ones). Beta-Bernoulli counts with a prior,
    decayed so they follow the text.
    Lookup's counts pool text that copies (a rewrite, code) with text that
    does not (an answer that quotes a passage now and then), so the tokens
    its steps really give beyond the first are also compared with what the
    counts predicted, over the last few lookup steps of the answer, and the
    prediction is scaled by that ratio (`Calibration`): a lookup that promised
    7 tokens and gave 1.2 is not taken again at that length in the same
    answer, while the next answer starts from the counts alone;
  - seconds: the device's batch cost curve T(k)/T(1) and the draft's cost
    (measured once per model files, threads and build, cached on disk:
    Engine.device_cost), scaled by the live time of a plain step and of a
    draft decode. The curve's extra cost beyond one token is scaled by what
    verification batches really take against what it predicts (the ratio of
    decayed sums, `Calibration`), which also covers the Python work per
    verified row: a curve measured once in a fast or slow spell of a shared
    machine (a batch of 2 measured at 1.6x one token where verification
    batches take 1.3x) would otherwise steer every decision for as long as
    it is kept.
The draft decodes only when used, so switching to it after a stretch of other
steps first catches it up on that stretch: a one-off cost, which its expected
gain must pay back within SWITCH_HORIZON steps (fewer near the end of the
answer); otherwise the switch is made only by a try.
For the draft chain the same rule runs per token: after drafting token i with
confidence c, it is verified if its expected gain P(all before accepted) *
a(c) exceeds R times the extra batch row, and drafting goes on while the
tokens after it are expected to pay for their draft decodes as well (looking
several tokens ahead, not only at the next one).

Exploration: an option the estimates call worse is still tried now and then
(a try of the draft drafts as sps does, by p_min, so that estimates too low
to let a chain grow are tested on a chain that does: up to sps's K in its
early tries, then up to TRY_DRAFT_MAX tokens), each at most once per
`interval` steps, the interval chosen so that trying all of them costs at
most `explore_budget` (1%) of the time. Each try after which the option is
still not chosen doubles its next wait, up to 8x (BACKOFF_MAX): confirming
again and again that an option does not pay costs an eighth of that in the
end, while choosing it on its estimate, or a new temperature, starts the
waits over. An option barely
tried yet is judged by its prior alone, so its first tries come sooner (after
8, 16, 32, 64 steps, on a budget halving from 16x), once per engine: a draft
that pays is found within the first tokens, one that does not costs a few
steps (explore_interval). A try of the draft also counts the time the draft
takes to catch up on the tokens decoded while it stood by, so once it is known
not to pay it is retried near the start of a generation, when that is small.

Lossless: each step is one of the lossless steps of the fixed strategies
(greedy or Leviathan's rejection sampling for draft chains, SpecInfer's
one-hot rule for lookup and lookahead, plain sampling), and the choice of step
depends only on what is already known, never on the target's coming sample.
Greedy output is the target's greedy output; sampled output has its law.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Generator, Iterator, Sequence

import numpy as np

from backends.config import StrategyOptions
from backends.cost import BatchCost
from backends.kv import Decode
from backends.run import Run
from backends.sampling import GenParams, argmax, probabilities, sample, top_probability
from backends.scheduler import Steps
from backends.slot import Slot
from backends.strategies.base import StepMachine, drive, never
from backends.strategies.chain import chain_step, forced_step
from backends.strategies.lookahead import LookaheadWindow
from backends.strategies.lookup import NgramIndex

PLAIN, DRAFT, LOOKUP, LOOKAHEAD, MEMORY = "plain", "draft", "lookup", "lookahead", "memory"
# The speculation memory's proposals are learnt by the share of earlier occurrences that went their way, in
# this many bins (backends.suffix: a continuation every earlier occurrence took is likelier than a split one).
SHARE_BINS = 5
CONFIDENCE_BINS = 10
MAX_POSITION = 12
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
# Lookup positions past this share one estimate: the first proposals decide whether a lookup starts.
LOOKUP_POSITIONS = 3
# Lookup's match length is counted up to this many tokens past the n-gram, and learnt in these bins: a
# rewrite that copies its source matches 10 or 16 tokens back, an answer quoting a phrase of the question
# 3 or 4, and their acceptance differs as much (pooled, the copying steps made the quoting ones look good).
MATCH_EXTEND = 16
MATCH_BINS = (1, 2, 3, 4, 6, 10, 16)
# Tokens the draft lags behind the context at the start of a draft step that follows one: the last
# drafted token (never decoded on the draft) and the target's bonus or correction token.
CHAIN_LAG = 2
# Before it is measured, a caught-up token costs this share of one draft decode (a batched decode of
# many tokens costs far less per token than decoding them one by one).
CATCH_UP_PRIOR = 0.15
WHY_EVERY = 16  # steps between two refreshes of the reason shown (formatting it is not free)
TRYING = "trying it (its estimate is stale)"  # the reason given for a try: "<option> — TRYING"
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
# Under load, an extra row is priced by the curve's slope over at least this many rows from the batch's size
# (_curve_relative): a single step of the measured curve may be flat.
LOAD_SLOPE_SPAN = 4
# The least the batch cost curve's extra cost is scaled by (Calibration can approach 0 when verification batches
# keep taking no longer than a plain step, as they may on a GPU): a row is never taken as free.
MIN_CURVE_SCALE = 0.1


class Acceptance:
    """Chance that a proposed token is accepted, per key: Beta-Bernoulli counts with a prior, decayed.

    `prior(key)` gives the prior mean; `weight` is how many observations it is
    worth; `decay` < 1 forgets old observations (about 1/(1-decay) of them count).
    """

    def __init__(self, prior: Callable[[object], float], weight: float = 2.0, decay: float = 0.995) -> None:
        self.prior = prior
        self.weight = weight
        self.decay = decay
        self._counts: dict[object, list[float]] = {}

    def p(self, key: object) -> float:
        c = self._counts.get(key)
        prior = self.prior(key)
        if c is None:
            return prior
        return (c[0] + self.weight * prior) / (c[0] + c[1] + self.weight)

    def update(self, key: object, accepted: bool) -> None:
        c = self._counts.setdefault(key, [0.0, 0.0])
        c[0] *= self.decay
        c[1] *= self.decay
        c[0 if accepted else 1] += 1.0

    def counts(self) -> list[list[object]]:
        """The counts as JSON: [key (a list for a tuple key), accepted, refused] each."""
        return [[list(k) if isinstance(k, tuple) else k, a, r] for k, (a, r) in self._counts.items()]

    def load(self, counts: list[list[object]]) -> None:
        """Counts as `counts` gives them."""
        loaded: dict[object, list[float]] = {}
        for key, a, r in counts:
            k = tuple(int(x) for x in key) if isinstance(key, list) else int(key)  # type: ignore[arg-type]
            loaded[k] = [_finite(a), _finite(r)]
            if min(loaded[k]) < 0:
                raise ValueError("a negative count")
        self._counts = loaded


@dataclass
class Ewma:
    """Exponentially weighted mean; `value` is None until the first observation unless seeded.

    The n-th observation weighs max(alpha, 1/n): the plain mean while there are
    few, so that one lucky or unlucky first step does not steer for the next
    1/alpha steps, then the exponential forgetting that follows the text.
    """

    alpha: float
    value: float | None = None
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        weight = max(self.alpha, 1.0 / self.n)
        self.value = x if self.value is None else self.value + weight * (x - self.value)

    def seed(self, x: float) -> None:
        """Start from a prediction worth one observation."""
        self.value, self.n = x, 1

    def get(self, default: float) -> float:
        return default if self.value is None else self.value


def confidence_bin(c: float) -> int:
    return min(int(c * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)


def lookup_key(match: int, position: int) -> tuple[int, int]:
    """The estimate a lookup proposal at `position` (0-based) after a `match`-token match is learnt under."""
    return max(b for b in MATCH_BINS if b <= max(match, 1)), min(position, LOOKUP_POSITIONS)


def lookup_acceptance(first: float = 0.15, longest: float = 0.6) -> Acceptance:
    """Lookup's acceptance by (match length, position).

    The first position's prior is `first` after a 1-token match, as most text
    does not repeat itself, and doubles with each further matched token (up to
    `longest`): a longer match is likelier to go on, and a prior that is too
    low is never corrected, because an option estimated worse is only tried
    once per MIN_EXPLORE_INTERVAL steps, while one tried on an optimistic prior
    is learnt from at once. A later position borrows the estimate of the one
    before it as its prior: a copy accepted so far tends to go on (repetition
    runs in streaks), and with a fixed low prior the positions past the first
    tries would never be verified, so never learnt, and chains would stay as
    short as first tried.
    """
    def prior(key: object) -> float:
        match, position = key  # type: ignore[misc]
        if position == 0:
            return min(first * 2 ** max(match - 1, 0), longest)
        return acc.p((match, position - 1))

    acc = Acceptance(prior)
    return acc


def memory_key(match: int, share: float, position: int) -> tuple[int, int, int]:
    """The estimate a proposal of the speculation memory is learnt under: match length bin, share bin, position."""
    return (max(b for b in MATCH_BINS if b <= max(match, 1)), min(int(share * SHARE_BINS), SHARE_BINS - 1),
            min(position, LOOKUP_POSITIONS))


def memory_acceptance() -> Acceptance:
    """The memory's acceptance by (match, share, position): the first position's prior is the share itself (as
    often as earlier text went this way), halved after a one-token match; later positions borrow the one
    before them, as lookup's do."""
    def prior(key: object) -> float:
        match, share, position = key  # type: ignore[misc]
        if position == 0:
            return min((share + 0.5) / SHARE_BINS * (0.5 if match <= 1 else 1.0), 0.95)
        return acc.p((match, share, position - 1))

    acc = Acceptance(prior)
    return acc


def sampling_mode(params: GenParams) -> str:
    """Which of an engine's learnt states a generation uses: "greedy" or "sampled". Acceptance differs most
    between them (on the Gemma pair the draft pays 1.9x greedy and loses at 0.8), so each learns its own:
    one-off runs at 0.8 that started from a state learnt greedily ran at 1.02x and 1.08x `ar` in two
    measurements, from one learnt at 0.8 at 1.07x and 1.28x (tests/perf/auto_kept.py modes)."""
    return "greedy" if params.greedy else "sampled"


@dataclass
class AutoState:
    """What `auto` has learnt on one engine in one sampling mode: kept across turns and requests (Learnt.session)
    and between sessions (Learnt.keep)."""

    # Draft: by confidence bin (prior: the confidence itself, a calibrated draft) and by position.
    draft_by_conf: Acceptance = field(default_factory=lambda: Acceptance(
        lambda b: (b + 0.5) / CONFIDENCE_BINS))  # type: ignore[operator]
    draft_by_pos: Acceptance = field(default_factory=lambda: Acceptance(lambda _k: 0.5))
    # Lookup: by (match length, position).
    lookup: Acceptance = field(default_factory=lambda: lookup_acceptance())
    # The speculation memory: by (match length, share of earlier occurrences, position).
    memory: Acceptance = field(default_factory=lambda: memory_acceptance())
    # What a lookahead step and a draft step (drafting with its stopping rule, then verifying) really
    # yield, and cost in plain steps: measured against the plain step's time of the moment, so that a
    # busy machine, which slows every kind of step alike, does not tilt the comparison.
    lookahead_tokens: Ewma = field(default_factory=lambda: Ewma(0.1))
    lookahead_cost: Ewma = field(default_factory=lambda: Ewma(0.1))
    draft_step_tokens: Ewma = field(default_factory=lambda: Ewma(0.1))
    draft_step_cost: Ewma = field(default_factory=lambda: Ewma(0.1))
    # Seconds: a plain step; one draft decode.
    t_plain: Ewma = field(default_factory=lambda: Ewma(0.1))
    t_draft: Ewma = field(default_factory=lambda: Ewma(0.1))
    # The measured curve's error: the extra time (in plain steps, beyond one) that verification batches really
    # took, against what the curve predicted for them, as a ratio of decayed sums (see Calibration).
    batch_scale: "Calibration" = field(default_factory=lambda: Calibration(prior=2.0, decay=0.98))
    # Seconds per token for the draft to catch up on tokens decoded while it stood by (a batched decode).
    catch_up: Ewma = field(default_factory=lambda: Ewma(0.1))
    # Throughput reached: EWMA of tokens and of seconds per step.
    tokens: Ewma = field(default_factory=lambda: Ewma(0.02))
    seconds: Ewma = field(default_factory=lambda: Ewma(0.02))
    since: dict[str, int] = field(default_factory=dict)  # steps since each option was last taken
    taken: dict[str, int] = field(default_factory=dict)  # steps each option was taken, ever
    # Steady tries of each option since it was last chosen on its estimate (explore_interval's back-off), and
    # the temperature they were made at: a new one starts the back-off over.
    backoff: dict[str, int] = field(default_factory=dict)
    temperature: float | None = None
    # False: keep the times the device cost gave and learn only acceptance (tests pin a synthetic device so).
    learn_timing: bool = True

    # Kept between sessions (Learnt.keep), so that a new one, or a one-off `specchat run`, does not pay
    # the first tries again: without it, 128-token runs at temperature 0.8 on the instruct pair spent 16% of
    # their steps trying options and ran at 0.96x plain decoding (geometric mean over the chat prompts; 0.87x
    # on the worst), where the state kept from earlier runs gave 1.08x. `since` is of this session (a new one
    # waits a full interval before its first try); `learn_timing` is a setting, not learnt.
    NOT_KEPT = ("since", "learn_timing")
    # What the keys of the estimates mean: state kept under other bins starts afresh.
    FORMAT = [1, CONFIDENCE_BINS, MAX_POSITION, list(MATCH_BINS), LOOKUP_POSITIONS]

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"format": self.FORMAT, "saved_at": time.time()}
        for f in fields(self):
            if f.name in self.NOT_KEPT:
                continue
            v = getattr(self, f.name)
            if isinstance(v, Acceptance):
                out[f.name] = v.counts()
            elif isinstance(v, Ewma):
                out[f.name] = [v.value, v.n]
            elif isinstance(v, Calibration):
                out[f.name] = [v.real, v.predicted]
            else:
                out[f.name] = v
        return out

    @classmethod
    def from_json(cls, data: dict | None) -> "AutoState":
        """The state `to_json` kept; a new one for None, another format or anything malformed."""
        state = cls()
        if not isinstance(data, dict) or data.get("format") != cls.FORMAT:
            return state
        try:
            for f in fields(state):
                if f.name in cls.NOT_KEPT or f.name not in data:
                    continue
                v, current = data[f.name], getattr(state, f.name)
                if isinstance(current, Acceptance):
                    current.load(v)
                elif isinstance(current, Ewma):
                    value, n = v
                    current.value, current.n = (None if value is None else _finite(value)), int(n)
                elif isinstance(current, Calibration):
                    current.real, current.predicted = _finite(v[0]), _finite(v[1])
                elif isinstance(current, dict):
                    setattr(state, f.name, {str(k): int(n) for k, n in v.items()})
                else:  # the temperature
                    setattr(state, f.name, None if v is None else float(v))
        except (TypeError, ValueError, AttributeError):
            return cls()
        return state


def _finite(x: object) -> float:
    v = float(x)  # type: ignore[arg-type]
    if not math.isfinite(v):
        raise ValueError("not a finite number")
    return v


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

    @property
    def step_seconds(self) -> float:
        """Expected seconds of this step, with its share of the switching cost."""
        return self.seconds + self.switch / self.horizon

    def value(self, rate: float) -> float:
        """Dinkelbach's worth at throughput `rate`: positive against a step that merely keeps the rate."""
        return self.tokens - rate * self.step_seconds


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


@dataclass
class Calibration:
    """How far a prediction can be trusted: what really came, against what was predicted, over the last
    observations. For lookup's counts in this answer: the extra tokens (beyond the one every step gives) its
    lookup steps gave, against what the counts predicted; for the batch cost curve: the extra time (beyond a
    plain step) verification batches took, against what the curve predicted.

    The ratio of decayed sums, each with `prior` added, so that it starts at 1 and moves by evidence in the
    predicted unit: one lookup that promised 6 extra tokens and gave none takes it to 2/8, while one that
    promised 0.5 and gave none only to 2/2.5. `decay` per observation follows the text (or the machine).
    """

    prior: float = 2.0
    decay: float = 0.9
    real: float = 0.0
    predicted: float = 0.0

    def add(self, real: float, predicted: float) -> None:
        self.real = self.real * self.decay + real
        self.predicted = self.predicted * self.decay + predicted

    def factor(self) -> float:
        return (self.real + self.prior) / (self.predicted + self.prior)


def best_chain_length(accept: Sequence[float], rate: float, t_plain: float, curve: Callable[[float], float],
                      per_token: float = 0.0) -> tuple[int, float, float]:
    """The chain length k (0..len) maximising expected tokens - rate * seconds; with its tokens and seconds.

    `accept` as for `running_expected_tokens`; verifying k proposals costs
    t_plain * T(k+1)/T(1) + k * per_token.
    """
    best = (0, 1.0, t_plain)
    for i, expected in enumerate(running_expected_tokens(accept), start=1):
        seconds = t_plain * curve(i + 1) + i * per_token
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


class AutoDecoding(StepMachine):
    name = "auto"

    def __init__(self, slot: Slot, options: StrategyOptions = StrategyOptions()) -> None:
        self.slot = slot
        self.options = options

    def state_for(self, params: GenParams) -> AutoState:
        """What was learnt on these models in `params`' sampling mode (Learnt.session): on its first use in this
        session, what an earlier session kept (Learnt.kept), else nothing. Every slot of an engine shares it."""
        mode = sampling_mode(params)
        learnt = self.slot.learnt
        state = learnt.session.get(mode)
        if not isinstance(state, AutoState):
            state = learnt.session[mode] = AutoState.from_json(learnt.kept(f"{self.name}.{mode}"))
        return state

    def steps(self, prompt: Sequence[int], params: GenParams, should_stop: Callable[[], bool] = never) -> Steps:
        gen = _Generation(self, prompt, params)  # a prompt that does not fit fails here, as for every strategy
        name = f"{self.name}.{sampling_mode(params)}"
        # The learnt state is kept for later sessions before Done is handed on (a consumer may stop there).
        return drive(gen.run, gen.prefill, gen.step, should_stop,
                     on_done=lambda: self.slot.learnt.keep(name, gen.state.to_json()))


class _Generation:
    """One generation of `auto`: its run, proposers and per-step bookkeeping."""

    def __init__(self, owner: AutoDecoding, prompt: Sequence[int], params: GenParams) -> None:
        slot, options = owner.slot, owner.options
        self.slot = slot
        self.cfg = options.auto
        self.sps = options.sps  # how a try of the draft drafts
        self.state = owner.state_for(params)
        self.target = slot.target
        self.draft = slot.draft if options.auto.draft else None
        n_ctx = min(s.n_ctx for s in (self.target, self.draft) if s is not None)
        self.run = Run(owner.name, self.target.model, params, prompt, n_ctx)
        self.params = params
        self.prompt = prompt
        self.index = NgramIndex(options.lookup.ngram_min, options.lookup.ngram_max) if options.auto.lookup else None
        self.memory = slot.memory() if options.suffix_cache and options.auto.memory else None
        self.memory_keys: list[tuple[int, int, int]] = []
        la = options.lookahead
        self.window: LookaheadWindow | None = None
        if options.auto.lookahead and self.target.n_seq_max >= la.n_seq_max \
                and la.batch_size <= self.target.batch_capacity:
            self.window = LookaheadWindow(self.target, la, prompt)
        self.curve: BatchCost | None = None
        self.t1 = 0.0  # the measured T(1), seconds
        self.decide_seconds = 0.0
        self.draft_decodes = 0
        self.batch_tokens = 0
        self.explored = 0
        self.own_rows = 1  # rows this sequence put in its last target batch (the others' are the rest of it)
        self.catch_up = 0.0  # seconds the last draft step spent catching the draft up (draft_chain)
        # For the last decision: the estimate each lookup position is learnt under, and its acceptance as counted.
        self.lookup_keys: list[tuple[int, int]] = []
        self.lookup_accept: list[float] = []
        self.lookup_calibration = Calibration()
        self._why_text, self._why_option, self._why_step = "", "", 0
        if self.state.temperature != params.temperature:  # what the tries confirmed held at another temperature
            self.state.backoff.clear()
            self.state.temperature = params.temperature

    # -- prefill -------------------------------------------------------------

    def prefill(self) -> Generator[Decode, list[int], int]:
        # Alone, the draft takes the prompt now, so that its first tries find it caught up. Beside others it
        # waits until it is used (its catch-up is priced then, for the whole batch): a prompt costs this draft
        # about what it costs the target, every sequence waits for it, and under load the draft seldom pays
        # (eight requests at once got their first token after 2.0 s instead of 1.0 s).
        if self.draft is not None and self.slot.load.running == 1:
            yield from self.draft.syncing(self.prompt[:-1], logits=False)
        cached = yield from self.target.syncing(self.prompt[:-1], logits=False)
        cost = self.slot.device_cost()  # from the disk cache, or measured now after this real context
        if cost is not None:
            self.curve = cost.batch
            self.t1 = cost.batch.seconds[0]
            st = self.state
            if st.t_plain.value is None:
                st.t_plain.seed(self.t1)
            if st.t_draft.value is None and self.draft is not None:
                st.t_draft.seed(cost.draft * self.t1)
        return cached

    # -- the cost model ------------------------------------------------------

    def _timing(self) -> bool:
        """Whether what this step takes is learnt: alone only. Beside others, a step's wall time holds their
        rows and prompt chunks too, so the times learnt alone (and the curve) are kept, and only acceptance is
        learnt (learnt from ticks, a plain step's time swelled with others' prompt chunks and took the curve's
        correction to its floor: lookups accepted 15% of the time looked worth verifying)."""
        return self.state.learn_timing and self._batch() == (1, 0)

    def _time(self, ewma: Ewma, x: float) -> None:
        if self._timing():
            ewma.add(x)

    def _batch(self) -> tuple[int, int]:
        """(B, L): how many sequences the batch this one decodes in holds, and how many rows the others put
        in it (backends.scheduler.BatchLoad): (1, 0) alone."""
        load = self.slot.load
        return max(load.sequences, 1), max(load.rows - self.own_rows, 0)

    def relative(self, k: float) -> float:
        """What verifying k rows costs, in plain steps of this sequence.

        Alone: T(k)/T(1), the measured curve with its extra cost beyond one
        token scaled by what verification batches really took
        (AutoState.batch_scale). Beside others (B sequences, L rows of theirs),
        the extra rows delay the whole batch: the time they add,
        T(L+k)/T(L+1) - 1, counts once for each of the B sequences that wait
        for it (Dinkelbach's rule over the batch's tokens per second, split
        per sequence, as SmartSpec's goodput prices a batch). A lone sequence
        gets exactly the decisions it gets alone; under load a row costs
        more where the curve is steeper and the batch fuller, so fewer
        sequences speculate, and those whose proposals are likeliest.
        """
        b, others = self._batch()
        return self._shared(self.time_relative(k, others), b, others)

    @staticmethod
    def _shared(time_relative: float, b: int, others: int) -> float:
        """A step's time relative to a plain one, as a cost to the batch: its extra counted B times."""
        if b == 1 and others == 0:
            return time_relative
        return 1.0 + b * (time_relative - 1.0)

    def time_relative(self, k: float, others: int = 0) -> float:
        """How much longer the batch takes with k rows of this sequence than with one (alone: T(k)/T(1)), from
        the measured curve corrected by what verification batches took."""
        base = self._curve_relative(k, others)
        if self.curve is None:
            return base
        return 1.0 + max(self.state.batch_scale.factor(), MIN_CURVE_SCALE) * (base - 1.0)

    def _curve_relative(self, k: float, others: int = 0) -> float:
        """T(others + k)/T(others + 1) as measured; without a measured curve, as steep as it gets (speculation
        never pays).

        Beside others, by the curve's slope over at least LOAD_SLOPE_SPAN rows from the batch's size: a curve
        measured on a busy machine is made non-decreasing by suffix minima (backends.cost.monotone), which
        leaves flat steps (T(4) = T(5) in a measurement here), and on a flat step one more row would look free
        to every sequence of a full batch (lookups accepted 18% of the time were then verified on a third of
        the steps, and the batch ran at 0.85x plain batched decoding)."""
        if not others:
            return self._curve_at(k)
        lo = others + 1
        hi = max(others + k, lo + LOAD_SLOPE_SPAN)
        slope = (self._curve_at(hi) - self._curve_at(lo)) / (hi - lo)
        return 1.0 + max(slope, 0.0) * (k - 1) / self._curve_at(lo)

    def _curve_at(self, k: float) -> float:
        """T(k)/T(1) as measured, extrapolated linearly beyond the measurement; k without a curve."""
        if self.curve is None:
            return float(k)
        if k > len(self.curve.seconds):  # beyond the measurement: grow linearly from its last slope
            n = len(self.curve.seconds)
            last = self.curve.relative(n)
            slope = last - self.curve.relative(n - 1)
            return last + max(slope, 0.0) * (k - n)
        return self.curve.relative(k)

    def rate(self) -> float:
        """R: tokens per second this engine reaches (never below plain decoding's)."""
        st = self.state
        plain = 1.0 / max(st.t_plain.get(self.t1 or 1.0), 1e-6)
        if st.tokens.value and st.seconds.value:
            return max(plain, st.tokens.value / st.seconds.value)
        return plain

    def _interval(self, extra_seconds: float, t_plain: float, n_options: int, option: str) -> int:
        """Steps between explorations of an option costing `extra_seconds` over a plain step."""
        st = self.state
        return explore_interval(self.cfg.explore_budget, extra_seconds / t_plain, n_options,
                                st.taken.get(option, 0), st.backoff.get(option, 0))

    def decide(self, lookup: list[int], match: int, memory: tuple[list[int], list[float], int] = ([], [], 0)
               ) -> Choice:
        st, run = self.state, self.run
        room = run.room() - 1
        t_plain = st.t_plain.get(self.t1 or 1.0)
        rate = self.rate()
        plain = Choice(PLAIN, 0, 1.0, t_plain)
        options: list[Choice] = []
        chain, shares, mem_match = memory
        if chain and room > 0:
            self.memory_keys = [memory_key(mem_match, s, i) for i, s in enumerate(shares[:room])]
            accept = [st.memory.p(key) for key in self.memory_keys]
            k, tokens, seconds = best_chain_length(accept, rate, t_plain, self.relative)
            options.append(Choice(MEMORY, max(k, 1), tokens, seconds) if k else
                           self._chain_of_one(MEMORY, accept[0], t_plain, 0.0))
        if lookup and room > 0:
            self.lookup_keys = [lookup_key(match, i) for i in range(len(lookup[:room]))]
            self.lookup_accept = [st.lookup.p(key) for key in self.lookup_keys]
            # Scaling the first position's chance scales every length's expected extra tokens alike.
            accept = list(self.lookup_accept)
            accept[0] = min(accept[0] * self.lookup_calibration.factor(), 0.99)
            k, tokens, seconds = best_chain_length(accept, rate, t_plain, self.relative)
            options.append(Choice(LOOKUP, max(k, 1), tokens, seconds) if k else
                           self._chain_of_one(LOOKUP, accept[0], t_plain, 0.0))
        if self.draft is not None and room > 0:
            k_max = min(self.cfg.draft_max, room)
            if st.draft_step_tokens.value is not None and st.draft_step_cost.value is not None:
                # Measured: what draft steps (drafting until the confidence no longer pays) gave lately.
                draft = Choice(DRAFT, k_max, st.draft_step_tokens.value,
                               self._shared(st.draft_step_cost.value, *self._batch()) * t_plain)
            else:  # before any draft step: from the acceptance by position
                t_draft = self.t_draft(t_plain)
                accept = [st.draft_by_pos.p(i) for i in range(k_max)]
                k, tokens, seconds = best_chain_length(accept, rate, t_plain, self.relative, t_draft)
                draft = Choice(DRAFT, k_max, tokens, seconds) if k else \
                    self._chain_of_one(DRAFT, accept[0], t_plain, t_draft)
            options.append(replace(draft, length=k_max, switch=self.catch_up_seconds(t_plain),
                                   horizon=max(1.0, min(room / max(draft.tokens, 1.0), SWITCH_HORIZON))))
        if self.window is not None and self.window.fits(run) and room >= self.window.config.ngram:
            b, others = self._batch()
            size = self.window.config.batch_size
            cost = self._shared(st.lookahead_cost.get(self.time_relative(size, others)), b, others)
            options.append(Choice(LOOKAHEAD, 0, st.lookahead_tokens.get(1.0), cost * t_plain))
        best = max([plain, *options], key=lambda o: o.value(rate))
        # Exploration: an option not taken for its interval is tried once, to keep its estimate fresh.
        for o in options:
            if o.option == best.option:
                continue
            extra = o.seconds - o.tokens / rate  # seconds it is expected to lose against keeping the rate
            taken = st.taken.get(o.option, 0)
            early = taken < EARLY_TRIES
            if not early:  # a try pays its switch in full; the early tries come once per engine, so what
                extra += o.switch  # the draft catches up on then is bounded
            if st.since.get(o.option, 0) >= self._interval(extra, t_plain, len(options), o.option):
                return Choice(o.option, self._try_length(o, early), o.tokens, o.seconds,
                              f"{o.option} — {TRYING}", True)
        if best.option != self._why_option or run.forwards - self._why_step >= WHY_EVERY:
            self._why_text = self._why(best, options, t_plain)
            self._why_option, self._why_step = best.option, run.forwards
        return Choice(best.option, best.length, best.tokens, best.seconds, self._why_text)

    def _try_length(self, o: Choice, early: bool) -> int:
        """How long a try of `o` is at most. Lookup: 2 tokens. The draft: sps's K while it is still judged by
        its prior (its EARLY_TRIES first steps, once per engine: a paying draft is found on full chains), then
        TRY_DRAFT_MAX, a cheaper test."""
        if o.option == DRAFT:
            return min(o.length, self.sps.draft_max if early else min(self.sps.draft_max, TRY_DRAFT_MAX))
        return max(1, min(o.length, 2))

    def t_draft(self, t_plain: float) -> float:
        """Seconds a draft decode costs: measured alone, seeded from the device cost, else half a plain step.
        Beside others, once for each of the B sequences in the batch: they all wait for the draft phase of the
        step (backends.scheduler)."""
        return self._t_draft_alone(t_plain) * self._batch()[0]

    def _t_draft_alone(self, t_plain: float) -> float:
        return self.state.t_draft.get(t_plain * 0.5)

    def catch_up_seconds(self, t_plain: float) -> float:
        """Expected time for the draft to catch up on the tokens it missed, were it used now.

        The draft option's switching cost (Choice.switch): the draft decodes
        only when used, so taking it after a stretch of other steps first
        decodes that stretch. Chosen on its estimate, the draft pays it back
        over SWITCH_HORIZON of its steps; a try pays it in full. Over
        a long stretch that comes to a fixed share of the time (a few percent
        with a draft a quarter of the target's cost), more than the exploration
        budget, so the draft is then tried only when it is nearly caught up: in
        the first steps of a generation, after the prefill synced it. The early
        tries leave it out: they come once per engine, within its first ~120
        steps, so what they catch up on is bounded.
        """
        draft = self.draft
        assert draft is not None
        lag = len(self.run.context) - len(draft.tokens)
        if lag <= CHAIN_LAG:
            return 0.0
        per_token = self.state.catch_up.get(CATCH_UP_PRIOR * self._t_draft_alone(t_plain))
        return (lag - 1) * per_token * self._batch()[0]  # the batch waits for it, as for a draft decode

    def _chain_of_one(self, option: str, accept: float, t_plain: float, extra: float) -> Choice:
        """The shortest chain, for the record (what it would give) when no length pays."""
        return Choice(option, 1, 1.0 + accept, t_plain * self.relative(2) + extra)

    @staticmethod
    def _why(best: Choice, options: list[Choice], t_plain: float) -> str:
        """In words, with each option's predicted speed against a plain step's."""
        def speedup(o: Choice) -> float:
            return o.tokens / o.step_seconds * t_plain

        if best.option == PLAIN:
            if not options:
                return "plain — nothing to propose"
            alt = max(options, key=speedup)
            return f"plain — {alt.option} would give {speedup(alt):.2f}× here"
        return f"{best.option} — predicted {speedup(best):.2f}× plain"

    # -- proposers -----------------------------------------------------------

    def draft_chain(self, k_max: int, explore: bool) -> Generator[Decode, list[int],
                                                                  tuple[list[int], list[np.ndarray], list[float]]]:
        """Draft up to k_max tokens, stopping where the next one no longer pays.

        A try of the draft (`explore`) drafts as `sps` does instead: while the
        draft's confidence stays at or above sps's p_min, at least one token,
        up to k_max (the try's length, from _try_length). Its chain must
        not be cut by the estimates it is there to correct: when they are too
        low (a draft not yet seen at this temperature), the stopping rule
        would draft one token, which cannot pay with a draft decode and a
        batch row to pay for, so the try would confirm the estimate it was
        meant to test and the positions past the first would never be
        verified, so never learnt.
        """
        st, params = self.state, self.params
        draft = self.draft
        assert draft is not None
        rate = self.rate()
        t_plain = st.t_plain.get(self.t1 or 1.0)
        t_draft = self.t_draft(t_plain)
        tokens: list[int] = []
        dists: list[np.ndarray] = []
        confs: list[float] = []
        t0 = time.perf_counter()
        lag = len(self.run.context) - (yield from draft.syncing(self.run.context))
        if lag > CHAIN_LAG:
            # The draft catches up on tokens decoded while it stood by (plain or lookup steps). That is a
            # switching cost spread over those steps, not the cost of drafting: left out of what a draft
            # step is measured to cost (one draft decode stands for it), or a draft tried after a long
            # plain stretch would look dear and never be taken again.
            self.catch_up = max(time.perf_counter() - t0 - t_draft, 0.0)
            self._time(st.catch_up, self.catch_up / (lag - 1))
        else:
            self.catch_up = 0.0
        decodes = 1
        reach = 1.0
        for i in range(k_max):
            logits = self.run.logits(draft, path=tokens, drafter=True)
            # The confidence is the draft's top probability (of its tempered distribution when sampling),
            # as for sps and llama.cpp's --draft-p-min: the sampled token's own probability would call a
            # draft unsure wherever its distribution is flat, though a flat draft that matches a flat
            # target is accepted just as often (the chance is 1 - TV(p, q)).
            if params.greedy:
                tok = argmax(logits)
                conf = top_probability(logits)
            else:
                q = probabilities(logits, params)
                tok = sample(q, self.run.rng)
                conf = float(q.max())
                dists.append(q)
            a = st.draft_by_conf.p(confidence_bin(conf))
            if explore:
                stop = i > 0 and conf < self.sps.p_min
            else:
                stop = reach * a - rate * t_plain * (self.relative(i + 2) - self.relative(i + 1)) <= 0
            if stop:
                if not params.greedy:
                    dists.pop()
                break
            reach *= a
            tokens.append(tok)
            confs.append(conf)
            # Draft on only if the tokens after this one are expected to pay for their draft decodes too.
            if explore:
                last = i + 1 >= k_max
            else:
                last = i + 1 >= k_max or \
                    self._continue_gain(reach, a, i + 1, k_max, rate, t_plain, t_draft) <= 0
            if last:
                break
            yield from draft.extending([tok])
            decodes += 1
        self.draft_decodes += decodes
        self._time(st.t_draft, (time.perf_counter() - t0 - self.catch_up) / decodes)
        return tokens, dists, confs

    def _continue_gain(self, reach: float, a: float, n: int, k_max: int, rate: float, t_plain: float,
                       t_draft: float) -> float:
        """What drafting more after n tokens is worth at best: over m = 1.. more tokens, each accepted with
        chance `a` (the last one's: a draft's confidence runs in streaks), the expected tokens minus rate
        times their draft decode and batch row; the best m's sum. Looking past the next token matters: with
        a draft accepted 90% of the time, the next token alone may not pay for its decode while the next
        three do."""
        best = total = 0.0
        for m in range(n, k_max):
            reach *= a
            total += reach - rate * (t_draft + t_plain * (self.relative(m + 2) - self.relative(m + 1)))
            best = max(best, total)
            if reach < 0.05:
                break
        return best

    # -- one step ------------------------------------------------------------

    def step(self) -> Iterator[object]:
        run, st = self.run, self.state
        forced = yield from forced_step(run, self.target)  # acceptance ~1, no drafter: always worth a row each
        if forced:
            self.batch_tokens += forced + 1
            self.own_rows = forced + 1
            return
        t0 = time.perf_counter()
        lookup, match = ([], 0)
        if self.index is not None:
            lookup, match = self.index.propose_with_match(run.context, min(self.cfg.draft_max, run.room() - 1),
                                                          MATCH_EXTEND)
            lookup = run.valid_prefix(lookup)
        memory: tuple[list[int], list[float], int] = ([], [], 0)
        if self.memory is not None:
            tree = self.memory.continuations(run.context, min(self.cfg.draft_max, run.room() - 1), 64)
            chain, shares = tree.best_chain(self.cfg.draft_max)
            chain = run.valid_prefix(chain)
            memory = (chain, shares[:len(chain)], tree.match)
        choice = self.decide(lookup, match, memory)
        self.decide_seconds += time.perf_counter() - t0
        self.explored += choice.explore
        for option in (DRAFT, LOOKUP, LOOKAHEAD, MEMORY):
            st.since[option] = 0 if option == choice.option else st.since.get(option, 0) + 1
        if choice.explore:
            if st.taken.get(choice.option, 0) >= EARLY_TRIES:
                st.backoff[choice.option] = st.backoff.get(choice.option, 0) + 1
        elif choice.option != PLAIN:
            st.backoff.pop(choice.option, None)  # chosen on its estimate: its tries start over
        st.taken[choice.option] = st.taken.get(choice.option, 0) + 1
        before = len(run.output)
        if choice.option == LOOKAHEAD and self.window is not None:
            yield from self._lookahead_step(choice)
        elif choice.option == DRAFT:
            yield from self._draft_step(choice)
        elif choice.option == MEMORY:
            proposed = memory[0][:choice.length]
            yield from self._chain(proposed, None, MEMORY, choice, self.memory_keys[:choice.length])
            assert self.memory is not None
            self.memory.record(len(proposed), min(len(run.output) - before - 1, len(proposed)))
        elif choice.option == LOOKUP:
            yield from self._chain(lookup[:choice.length], None, LOOKUP, choice,
                                   self.lookup_keys[:choice.length])
            self.lookup_calibration.add(len(run.output) - before - 1,
                                        expected_chain_tokens(self.lookup_accept, choice.length) - 1)
        else:
            yield from self._chain([], None, PLAIN, choice, [])
        seconds = time.perf_counter() - t0
        self._time(st.tokens, len(run.output) - before)
        self._time(st.seconds, seconds)
        run.extra.update(self.stats())

    def _chain(self, drafts: list[int], dists: list[np.ndarray] | None, source: str, choice: Choice,
               keys: list[object], confs: Sequence[float] = ()) -> Iterator[object]:
        st, run = self.state, self.run
        t0 = time.perf_counter()
        verdict = yield from chain_step(run, self.target, drafts, dists, "draft" if source == DRAFT else
                                        "lookup" if source == LOOKUP else "memory" if source == MEMORY else
                                        "target", choice.why)
        seconds = time.perf_counter() - t0
        self.batch_tokens += len(drafts) + 1
        self.own_rows = len(drafts) + 1
        if not drafts:
            self._time(st.t_plain, seconds)
            return
        if self._timing():
            t_plain = st.t_plain.get(self.t1 or seconds)
            predicted = self._curve_relative(len(drafts) + 1, self._batch()[1]) - 1.0
            # A step interrupted (another process, a pause of the collector) says nothing about the curve:
            # what one step adds is bounded, so one stall moves the scale by at most a few steps' worth.
            st.batch_scale.add(min(seconds / t_plain - 1.0, 3.0 * predicted + 1.0), predicted)
        # The proposals the target looked at: the accepted ones and the first refused one.
        for i in range(min(verdict.n_accepted + 1, len(drafts))):
            accepted = i < verdict.n_accepted
            if source == LOOKUP:
                st.lookup.update(keys[i], accepted)
            elif source == MEMORY:
                st.memory.update(keys[i], accepted)
            else:
                st.draft_by_conf.update(confidence_bin(confs[i]), accepted)
                st.draft_by_pos.update(min(i, MAX_POSITION), accepted)

    def _draft_step(self, choice: Choice) -> Iterator[object]:
        st, run = self.state, self.run
        before = len(run.output)
        t0 = time.perf_counter()
        tokens, dists, confs = yield from self.draft_chain(choice.length, choice.explore)
        yield from self._chain(tokens, None if self.params.greedy else dists, DRAFT if tokens else PLAIN, choice, [],
                               confs)
        st.draft_step_tokens.add(len(run.output) - before)
        self._time(st.draft_step_cost, (time.perf_counter() - t0 - self.catch_up) / st.t_plain.get(self.t1 or 1.0))

    def _lookahead_step(self, choice: Choice) -> Iterator[object]:
        st, run = self.state, self.run
        window = self.window
        assert window is not None
        self.target.share_with(window.n_seqs)  # other steps grew sequence 0 alone
        before = len(run.output)
        t0 = time.perf_counter()
        yield from window.step(run, choice.why)
        seconds = time.perf_counter() - t0
        self.batch_tokens += window.config.batch_size
        self.own_rows = window.config.batch_size
        st.lookahead_tokens.add(len(run.output) - before)
        self._time(st.lookahead_cost, seconds / st.t_plain.get(self.t1 or seconds))

    def stats(self) -> dict[str, object]:
        steps = max(self.run.forwards, 1)
        return {
            "batch_tokens": self.batch_tokens,
            "draft_forwards": self.draft_decodes,
            "explored_steps": self.explored,
            "decide_ms_per_step": round(1000 * self.decide_seconds / steps, 4),
        }
