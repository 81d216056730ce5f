"""Each step's decision of `auto`: the options, their worth at the rate reached, and when to try one again.

Maximising a ratio (tokens / seconds) step by step is done with Dinkelbach's
transform: with R the throughput this engine reaches (the better of plain
decoding's rate and the rate `auto` has measured), each option is worth
E[tokens] - R * E[seconds], and the best option is the one worth most; an
option pays exactly when it beats R (an option taken fewer than decide.SETTLE_STEPS times is judged
against plain decoding instead: decide.still_learnt). This is the rule vLLM's adaptive
verification and SmartSpec's "goodput" apply (expected accepted tokens per
unit of time, from a cost model measured on the device); TensorRT-LLM's
switch-off at low acceptance is its special case. Expected tokens come from
the estimates (.state), seconds from the cost model (.costs), the arithmetic
of chains and trees from .decide.

The draft decodes only when used, so switching to it after a stretch of
other steps first catches it up on that stretch: a one-off cost, which its
expected gain must pay back within SWITCH_HORIZON steps (fewer near the end
of the answer); otherwise the switch is made only by a try. For the draft
chain the same rule runs per token (`DraftPays`).

Above the rule, the outcome is checked, before any proposal is looked up
(Generation.step): where the scheduler saw speculating ticks deliver fewer
tokens per second than plain ones at this batch size lately
(backends.realised), every sequence decodes plainly (HELD_BACK).

Exploration: an option the estimates call worse is still tried now and then,
each at most once per `interval` steps, the interval chosen so that trying
all of them costs at most `explore_budget` (1%) of the time
(decide.explore_interval says how the waits grow and back off).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

from backends.config import AutoConfig, SpsConfig
from backends.kv import KvSequence, common_prefix
from backends.pricing import best_subtree, path_reach
from backends.run import Run
from backends.strategies.auto.costs import CostModel
from backends.strategies.auto.decide import (DRAFT, EARLY_INTERVAL, EARLY_TRIES, LOOKAHEAD, LOOKUP, MEMORY, PLAIN,
                                            SWITCH_HORIZON, TRY_DRAFT_MAX, Choice, best_chain_length,
                                            explore_interval, still_learnt)
from backends.strategies.auto.proposals import CandidateTree
from backends.strategies.auto.state import AutoState, Calibration, confidence_bin, lookup_key

if TYPE_CHECKING:
    from backends.strategies.lookahead import LookaheadWindow

# Tokens the draft lags behind the context at the start of a draft step that follows one: the last
# drafted token (never decoded on the draft) and the target's bonus or correction token.
CHAIN_LAG = 2
# An early try of the draft waits until the draft is at most this many tokens behind (the early tries' longest
# wait, counted from a generation's first step, where it took the prompt, or from the last try): it then pays
# the catch-up of those steps, not the conversation's (measured alone at 0.8 on the SmolLM2 pair, early tries
# that caught the draft up on whole conversations cost 0.29 s each, ten plain steps).
EARLY_LAG = (EARLY_INTERVAL << (EARLY_TRIES - 1)) + CHAIN_LAG
# Alone, the draft catches up on what it missed (a prompt after the first tokens, or the context before an early
# try) only where this answer can afford it: that catch-up, priced as a switch (catch_up_seconds), at most
# EAGER_SHARE of the plain time of the answer still to come, counted over at most ANSWER_HORIZON tokens. A long
# prompt the draft does not hold (a pasted document, an agent's prefix, a conversation restored with the target's
# cells alone), or a draft whose prompt decode is dear on this machine (Gemma's Q4_K_M draft without repacked
# weights, on the AMX VM: 6.8 s for 2,816 tokens, more than its F32 target; the SmolLM2 Q2_K draft at -t 1 there:
# 0.33 s for a 50-token chat prompt, seven plain steps), would otherwise stall short answers for tries they
# cannot repay.
EAGER_SHARE = 0.05
ANSWER_HORIZON = 256
# The draft counts as in use (it takes each new prompt alone, .generation) while it was taken within this many
# steps, or is still to be tried early.
IN_USE = 64
# Before it is measured, a caught-up token costs this share of one draft decode (a batched decode of
# many tokens costs far less per token than decoding them one by one).
CATCH_UP_PRIOR = 0.15
WHY_EVERY = 16  # steps between two refreshes of the reason shown (formatting it is not free)
TRYING = "trying it (its estimate is stale)"  # the reason given for a try: "<option> — TRYING"
HELD_BACK = "plain — speculating ticks delivered less than plain ones here lately"


@dataclass
class Proposals:
    """One step's proposals, and the estimates each is judged and learnt under."""

    lookup: list[int] = field(default_factory=list)
    match: int = 0  # lookup's match length
    tree: CandidateTree = field(default_factory=CandidateTree)  # the memory's candidates, lookup's merged in
    lookup_keys: list[tuple[int, int]] = field(default_factory=list)
    lookup_accept: list[float] = field(default_factory=list)  # as counted, before the answer's calibration
    tree_estimates: list[float] = field(default_factory=list)  # each candidate node's chance, as counted
    tree_accept: list[float] = field(default_factory=list)  # and calibrated


class Chooser:
    """Picks each step's option for one generation (its proposals priced by its cost model)."""

    def __init__(self, state: AutoState, costs: CostModel, run: Run, cfg: AutoConfig, sps: SpsConfig,
                 draft: KvSequence | None, window: "LookaheadWindow | None", tree_leaves: int,
                 tree_nodes: int) -> None:
        self.state, self.costs, self.run = state, costs, run
        self.cfg, self.sps = cfg, sps
        self.draft, self.window = draft, window
        self.tree_leaves, self.tree_nodes = tree_leaves, tree_nodes
        # Within the answer, what lookup's and the memory's steps gave beyond their first token against what
        # their counts predicted (the counts pool text that copies with text that does not).
        self.lookup_calibration = Calibration()
        self.memory_calibration = Calibration()
        self._why_text, self._why_option, self._why_step = "", "", 0

    def p(self, source: str, key: object) -> float:
        """The chance a proposal learnt under `key` is accepted (lookup's or the memory's estimates)."""
        return self.state.estimates(source).p(key)

    def choose(self, props: Proposals) -> Choice:
        """The step's option; fills in `props`' estimates."""
        st, run, costs = self.state, self.run, self.costs
        room = run.room() - 1
        t_plain = costs.t_plain()
        rate = costs.rate()
        relative = costs.prices()
        plain = Choice(PLAIN, 0, 1.0, t_plain)
        options: list[Choice] = []
        tree = props.tree
        if len(tree) and room > 0:
            props.tree_estimates = tree.accept(self.p)
            factor = self.memory_calibration.factor()
            props.tree_accept = [min(a * factor, 0.99) if p < 0 else a
                                 for a, p in zip(props.tree_estimates, tree.tree.parents)]
            # Depth is bounded by the room (the tree was built so); the node count by the context's free cells.
            cells = run.n_ctx - len(run.context)
            priced = best_subtree(tree.tree, path_reach(tree.tree, props.tree_accept),
                                  lambda n: t_plain * relative(n + 1) if n else t_plain, rate,
                                  self.tree_leaves, min(self.tree_nodes, cells))
            if priced.nodes:
                options.append(Choice(MEMORY, len(priced.nodes), priced.tokens, priced.cost, nodes=priced.nodes))
            else:  # for the record, and for a try: the likeliest first token
                first = tree.likeliest_path(props.tree_accept, 1)
                options.append(replace(self._chain_of_one(MEMORY, props.tree_accept[first[0]], t_plain, 0.0,
                                                          relative), nodes=tuple(first)))
        if props.lookup and room > 0:
            props.lookup_keys = [lookup_key(props.match, i) for i in range(len(props.lookup[:room]))]
            # Positions past LOOKUP_POSITIONS share a key (and each key's prior asks the position before it).
            chance = {key: st.lookup.p(key) for key in dict.fromkeys(props.lookup_keys)}
            props.lookup_accept = [chance[key] for key in props.lookup_keys]
            # Scaling the first position's chance scales every length's expected extra tokens alike.
            accept = list(props.lookup_accept)
            accept[0] = min(accept[0] * self.lookup_calibration.factor(), 0.99)
            k, tokens, seconds = best_chain_length(accept, rate, t_plain, relative)
            options.append(Choice(LOOKUP, max(k, 1), tokens, seconds) if k else
                           self._chain_of_one(LOOKUP, accept[0], t_plain, 0.0, relative))
        if self.draft is not None and room > 0:
            k_max = self.draft.max_depth(min(self.cfg.draft_max, room))  # chained MTP heads
            options.append(self._draft_option(k_max, room, rate, t_plain, relative))
        if self.window is not None and self.window.fits(run) and room >= self.window.config.ngram:
            b, others = costs.batch()
            size = self.window.config.batch_size
            measured = st.lookahead_cost.value  # else as dear as a batch of its rows (not priced when measured)
            cost = costs.shared(measured if measured is not None else costs.time_relative(size, others, b), b,
                                others)
            options.append(Choice(LOOKAHEAD, 0, st.lookahead_tokens.get(1.0), cost * t_plain))
        best = max([plain, *options], key=lambda o: o.value(rate))
        if best.option == PLAIN:  # an option still being learnt is judged against plain decoding, not R
            best = still_learnt(options, st.taken, t_plain) or best
        tried = self._try(options, best, rate, t_plain, props)
        if tried is not None:
            return tried
        if best.option != self._why_option or run.forwards - self._why_step >= WHY_EVERY:
            self._why_text = self._why(best, options, t_plain)
            self._why_option, self._why_step = best.option, run.forwards
        return best.because(self._why_text)

    def _draft_option(self, k_max: int, room: int, rate: float, t_plain: float,
                      relative: Callable[[float], float]) -> Choice:
        st, costs = self.state, self.costs
        if st.draft_step_tokens.value is not None and st.draft_step_cost.value is not None:
            # Measured: what draft steps (drafting until the confidence no longer pays) gave lately.
            draft = Choice(DRAFT, k_max, st.draft_step_tokens.value,
                           costs.shared(st.draft_step_cost.value, *costs.batch()) * t_plain)
        else:  # before any draft step: from the acceptance by position
            t_draft = costs.t_draft(t_plain)
            accept = [st.draft_by_pos.p(i) for i in range(k_max)]
            # A block drafter (backends.dflash) drafts the whole chain in one decode; others one per token.
            block = self.draft is not None and self.draft.chain_max is not None
            k, tokens, seconds = best_chain_length(accept, rate, t_plain, relative, 0.0 if block else t_draft,
                                                   t_draft if block else 0.0)
            draft = Choice(DRAFT, k_max, tokens, seconds) if k else \
                self._chain_of_one(DRAFT, accept[0], t_plain, t_draft, relative)
        return Choice(DRAFT, k_max, draft.tokens, draft.seconds, switch=self.catch_up_seconds(t_plain),
                      horizon=max(1.0, min(room / max(draft.tokens, 1.0), SWITCH_HORIZON)))

    def _try(self, options: list[Choice], best: Choice, rate: float, t_plain: float,
             props: Proposals) -> Choice | None:
        """Exploration: an option not taken for its interval is tried once, to keep its estimate fresh. Not
        before the device's cost is known: a try priced on no curve would be paid by the user's answer."""
        st = self.state
        if not self.costs.priced:
            return None
        # Beside other sequences every try is a steady one: the batch waits for what it drafts and for the
        # draft catching up on the conversation (which under load it has not decoded: a try there cost five
        # ticks of everyone's time, measured), so no early tries on a larger budget.
        alone = self.costs.batch()[0] <= 1
        for o in options:
            if o.option == best.option:
                continue
            extra = o.seconds - o.tokens / rate  # seconds it is expected to lose against keeping the rate
            taken = st.taken.get(o.option, 0)
            early = taken < EARLY_TRIES and alone
            if early and o.option == DRAFT and (self.lag() > EARLY_LAG or not self.catch_up_affordable(t_plain)):
                continue  # until a generation's first steps, where the draft holds the prompt or can afford it
            if not early:  # a try pays its switch in full; the early tries come once per engine, alone, so
                extra += o.switch  # what the draft catches up on then is bounded
            interval = explore_interval(self.cfg.explore_budget, extra / t_plain, len(options),
                                        taken if alone else max(taken, EARLY_TRIES), st.backoff.get(o.option, 0))
            if st.since.get(o.option, 0) >= interval:
                length = self._try_length(o, early)
                nodes = tuple(props.tree.likeliest_path(props.tree_accept, length)) if o.option == MEMORY else ()
                return Choice(o.option, length, o.tokens, o.seconds, f"{o.option} — {TRYING}", True, nodes=nodes)
        return None

    def _try_length(self, o: Choice, early: bool) -> int:
        """How long a try of `o` is at most. Lookup: 2 tokens. The draft: sps's K while it is still judged by
        its prior (its EARLY_TRIES first steps, once per engine: a paying draft is found on full chains), then
        TRY_DRAFT_MAX, a cheaper test."""
        if o.option == DRAFT:
            return min(o.length, self.sps.draft_max if early else min(self.sps.draft_max, TRY_DRAFT_MAX))
        return max(1, min(o.length, 2))

    def lag(self) -> int:
        """Tokens of the context the draft has not decoded: past what it holds of it, which is less than all it
        holds where its slot served another conversation before (counted by its length, that conversation's
        prompt looked already decoded: its catch-up was priced at nothing and paid by the first draft step)."""
        assert self.draft is not None
        return len(self.run.context) - common_prefix(self.draft.tokens, self.run.context)

    def draft_in_use(self) -> bool:
        """Whether the draft was taken lately (in this session), or is still to be tried early."""
        st = self.state
        return st.taken.get(DRAFT, 0) < EARLY_TRIES or st.since.get(DRAFT, IN_USE) < IN_USE

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
        lag = self.lag()
        if lag <= CHAIN_LAG:
            return 0.0
        per_token = self.state.catch_up.get(CATCH_UP_PRIOR * self.costs.t_draft_alone(t_plain))
        return (lag - 1) * per_token * self.costs.batch()[0]  # the batch waits for it, as for a draft decode

    def catch_up_affordable(self, t_plain: float) -> bool:
        """Whether the draft's catch-up, were it used now, costs at most EAGER_SHARE of this answer's plain time
        to come (its room, at most ANSWER_HORIZON tokens)."""
        return self.catch_up_seconds(t_plain) <= EAGER_SHARE * min(self.run.room(), ANSWER_HORIZON) * t_plain

    @staticmethod
    def _chain_of_one(option: str, accept: float, t_plain: float, extra: float,
                      relative: Callable[[float], float]) -> Choice:
        """The shortest chain, for the record (what it would give) when no length pays."""
        return Choice(option, 1, 1.0 + accept, t_plain * relative(2) + extra)

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


class DraftPays:
    """How `auto` drafts a chain when the draft is chosen on its estimate (backends.strategies.drafting's
    DraftRule): after drafting token i with confidence c, it is verified if its expected gain P(all before
    accepted) * a(c) exceeds R times the extra batch row, and drafting goes on while the tokens after it are
    expected to pay for their draft decodes as well (looking several tokens ahead, not only at the next one).
    A block drafter's (`block`: backends.dflash) later tokens cost no decode, only their rows.
    """

    def __init__(self, state: AutoState, costs: CostModel, k_max: int, block: bool = False) -> None:
        self.state, self.costs, self.k_max = state, costs, k_max
        self.relative = costs.prices()  # nothing it reads moves while a chain is drafted
        self.rate = costs.rate()
        self.t_plain = costs.t_plain()
        self.t_draft = 0.0 if block else costs.t_draft(self.t_plain)
        self.reach = 1.0  # the chance every token so far is accepted
        self.a = 0.0  # the last token's chance

    def _row(self, i: int) -> float:
        """Seconds the (i+1)-th drafted token's batch row adds."""
        return self.t_plain * (self.relative(i + 2) - self.relative(i + 1))

    def keep(self, i: int, confidence: float) -> bool:
        a = self.state.draft_by_conf.p(confidence_bin(confidence))
        # The row's price multiplied in the order it always was (rate * t_plain first), not through _row: a
        # different rounding can flip this comparison at a near tie.
        if self.reach * a - self.rate * self.t_plain * (self.relative(i + 2) - self.relative(i + 1)) <= 0:
            return False
        self.reach *= a
        self.a = a
        return True

    def more(self, i: int, confidence: float) -> bool:
        return continue_gain(self.reach, self.a, i + 1, self.k_max, self.rate, self.t_draft, self._row) > 0


def continue_gain(reach: float, a: float, n: int, k_max: int, rate: float, t_draft: float,
                  row: Callable[[int], float]) -> float:
    """What drafting more after n tokens is worth at best: over m = 1.. more tokens, each accepted with chance
    `a` (the last one's: a draft's confidence runs in streaks), the expected tokens minus rate times their
    draft decode and batch row (`row(m)`: seconds); the best m's sum. Looking past the next token matters:
    with a draft accepted 90% of the time, the next token alone may not pay for its decode while the next
    three do."""
    best = total = 0.0
    for m in range(n, k_max):
        reach *= a
        total += reach - rate * (t_draft + row(m))
        best = max(best, total)
        if reach < 0.05:
            break
    return best

