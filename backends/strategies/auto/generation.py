"""One generation of `auto`: its run, its proposers, the cost model under load, and each step's decision.

The rule and its reasons are in backends.strategies.auto's docstring; the
estimates in .state, the choice's arithmetic in .decide. Over 500 lines on
purpose: one generation's cost model, decision and proposers share its
state step by step, and read best in one place (cut further, each part
would reach into the others' attributes).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Generator, Iterator, Sequence

import numpy as np

from backends.cost import BatchCost
from backends.kv import Decode
from backends.run import Run
from backends.sampling import GenParams, argmax, probabilities, sample, top_probability
from backends.strategies.auto.decide import (DRAFT, EARLY_TRIES,
                                            LOAD_SLOPE_SPAN, LOOKAHEAD, LOOKUP, MEMORY, MIN_CURVE_SCALE, PLAIN,
                                            SWITCH_HORIZON, TRY_DRAFT_MAX, Choice, best_chain_length, best_subtree,
                                            expected_chain_tokens, explore_interval, is_chain, path_reach)
from backends.strategies.auto.proposals import LOOKUP_SOURCE, CandidateTree, candidate_tree, looked_at
from backends.strategies.auto.state import (MATCH_EXTEND, MAX_POSITION, Calibration, Ewma,
                                           confidence_bin, lookup_key, memory_key)
from backends.strategies.branches import verify_tree
from backends.strategies.chain import chain_step, forced_step
from backends.strategies.lookahead import LookaheadWindow
from backends.strategies.lookup import NgramIndex
from backends.strategies.suffix import prune_by_grammar
from backends.verify import Verdict

if TYPE_CHECKING:
    from backends.strategies.auto import AutoDecoding

# Tokens the draft lags behind the context at the start of a draft step that follows one: the last
# drafted token (never decoded on the draft) and the target's bonus or correction token.
CHAIN_LAG = 2
# Before it is measured, a caught-up token costs this share of one draft decode (a batched decode of
# many tokens costs far less per token than decoding them one by one).
CATCH_UP_PRIOR = 0.15
# The speculation memory is consulted only for earlier text that matches at least this many tokens back:
# one-token matches are everywhere where nothing repeats, seldom go on the same way, and each costs the step a
# lookup (consulting every match, the chat and builtin prompts ran at 0.97x and 0.94x auto without the memory;
# docs/results.md, "Speculation memory"). The memory's estimates are also calibrated within the answer
# (memory_calibration): without it the tree ran at 0.95x auto without the memory on both sets, with it at
# 1.00 / 1.01x (the same page).
MEMORY_MIN_MATCH = 2
# The memory's candidate tree holds at most MEMORY_NODES_PER_TOKEN x draft_max nodes (and auto's memory_paths
# root-to-leaf paths), of which best_subtree verifies those worth their rows.
MEMORY_NODES_PER_TOKEN = 2
WHY_EVERY = 16  # steps between two refreshes of the reason shown (formatting it is not free)
TRYING = "trying it (its estimate is stale)"  # the reason given for a try: "<option> — TRYING"


class _Generation:
    """One generation of `auto`: its run, proposers and per-step bookkeeping."""

    def __init__(self, owner: "AutoDecoding", prompt: Sequence[int], params: GenParams) -> None:
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
        self.tree = CandidateTree()  # this step's candidates from the memory and lookup (`memory` option)
        self.tree_leaves = max(1, min(options.auto.memory_paths, self.target.n_seq_max - 1))
        self.tree_nodes = max(1, min(MEMORY_NODES_PER_TOKEN * options.auto.draft_max, self.target.batch_capacity - 1))
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
        self.tree_steps = 0  # memory steps verified as a tree (several paths)
        self.own_rows = 1  # rows this sequence put in its last target batch (the others' are the rest of it)
        self.catch_up = 0.0  # seconds the last draft step spent catching the draft up (draft_chain)
        # For the last decision: the estimate each lookup position is learnt under, and its acceptance as counted.
        self.lookup_keys: list[tuple[int, int]] = []
        self.lookup_accept: list[float] = []
        self.lookup_calibration = Calibration()
        # The memory's estimates pool work that repeats with work that does not, as lookup's do: within the
        # answer, the extra tokens its steps gave against what the estimates predicted scale the root's children.
        self.memory_calibration = Calibration()
        self.tree_estimates: list[float] = []  # this step's chance per candidate node, as the counts say
        self.tree_accept: list[float] = []  # and calibrated
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

    def _p(self, source: str, key: object) -> float:
        """The chance a proposal learnt under `key` is accepted (lookup's or the memory's estimates)."""
        return (self.state.lookup if source == LOOKUP_SOURCE else self.state.memory).p(key)

    def _learn(self, source: str, key: object, accepted: bool) -> None:
        (self.state.lookup if source == LOOKUP_SOURCE else self.state.memory).update(key, accepted)

    def decide(self, lookup: list[int], match: int, tree: CandidateTree = CandidateTree()) -> Choice:
        st, run = self.state, self.run
        room = run.room() - 1
        t_plain = st.t_plain.get(self.t1 or 1.0)
        rate = self.rate()
        plain = Choice(PLAIN, 0, 1.0, t_plain)
        options: list[Choice] = []
        if tree.tokens and room > 0:
            self.tree_estimates = tree.accept(self._p)
            factor = self.memory_calibration.factor()
            accept = [min(a * factor, 0.99) if p < 0 else a for a, p in zip(self.tree_estimates, tree.parents)]
            self.tree_accept = accept
            # Depth is bounded by the room (the tree was built so); the node count by the context's free cells.
            cells = run.n_ctx - len(run.context)
            nodes, tokens, seconds = best_subtree(tree.parents, accept, rate, t_plain, self.relative,
                                                  self.tree_leaves, min(self.tree_nodes, cells))
            if nodes:
                options.append(Choice(MEMORY, len(nodes), tokens, seconds, nodes=tuple(nodes)))
            else:  # for the record, and for a try: the likeliest first token
                first = tree.likeliest_path(accept, 1)
                options.append(replace(self._chain_of_one(MEMORY, accept[first[0]], t_plain, 0.0),
                                       nodes=tuple(first)))
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
                length = self._try_length(o, early)
                nodes = tuple(tree.likeliest_path(self.tree_accept, length)) if o.option == MEMORY else ()
                return Choice(o.option, length, o.tokens, o.seconds, f"{o.option} — {TRYING}", True, nodes=nodes)
        if best.option != self._why_option or run.forwards - self._why_step >= WHY_EVERY:
            self._why_text = self._why(best, options, t_plain)
            self._why_option, self._why_step = best.option, run.forwards
        return replace(best, why=self._why_text)

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
        self.tree = self._candidates(lookup, match)
        choice = self.decide(lookup, match, self.tree)
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
            yield from self._memory_step(choice)
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

    def _candidates(self, lookup: list[int], match: int) -> CandidateTree:
        """What the memory proposes after the context, as a tree (cut where the grammar refuses it), with
        lookup's proposal merged in; empty where the memory has nothing (lookup is then an option of its own)."""
        run = self.run
        if self.memory is None or run.room() <= 1:
            return CandidateTree()
        found = prune_by_grammar(run, self.memory.continuations(
            run.context, min(self.cfg.draft_max, run.room() - 1), self.tree_nodes, min_match=MEMORY_MIN_MATCH))
        if not found.tokens:
            return CandidateTree()
        depth: list[int] = []
        for p in found.parents:
            depth.append(depth[p] + 1 if p >= 0 else 0)
        keys = [memory_key(found.match, share, d) for share, d in zip(found.probs, depth)]
        return candidate_tree(found, keys, lookup, [lookup_key(match, i) for i in range(len(lookup))])

    def _memory_step(self, choice: Choice) -> Iterator[object]:
        """Verify the chosen nodes of the candidate tree: as a chain when they are one (no branch ids), else as
        a tree (backends.strategies.branches.verify_tree); each node the target looked at teaches its
        estimates."""
        tree, nodes, run = self.tree, list(choice.nodes), self.run
        tokens, parents = tree.subtree(nodes)
        keys = [tree.keys[n] for n in nodes]
        reach = path_reach(tree.parents, self.tree_estimates)
        predicted = sum(reach[n] for n in nodes)  # extra tokens the counts expect, for the calibration
        before = len(run.output)
        assert self.memory is not None
        if is_chain(tree.parents, nodes):
            verdict = yield from self._chain(tokens, None, MEMORY, choice, keys)
            self.memory.record(len(tokens), verdict.n_accepted)
            self.memory_calibration.add(len(run.output) - before - 1, predicted)
            return
        t0 = time.perf_counter()
        v = yield from verify_tree(self.run, self.target, tokens, parents, "memory", "memory", choice.why)
        self.tree_steps += 1
        self._learn_scale(time.perf_counter() - t0, len(tokens))
        self.batch_tokens += len(tokens) + 1
        self.own_rows = len(tokens) + 1
        for i, accepted in looked_at(parents, v.path, finished=len(v.path) > v.matched):
            for source, key in keys[i]:
                self._learn(source, key, accepted)
        self.memory.record(len(tokens), v.accepted)
        self.memory_calibration.add(len(run.output) - before - 1, predicted)

    def _learn_scale(self, seconds: float, drafts: int) -> None:
        """What a verification of `drafts` rows past the pending token took, against the curve's prediction."""
        if self._timing():
            st = self.state
            t_plain = st.t_plain.get(self.t1 or seconds)
            predicted = self._curve_relative(drafts + 1, self._batch()[1]) - 1.0
            # A step interrupted (another process, a pause of the collector) says nothing about the curve:
            # what one step adds is bounded, so one stall moves the scale by at most a few steps' worth.
            st.batch_scale.add(min(seconds / t_plain - 1.0, 3.0 * predicted + 1.0), predicted)

    def _chain(self, drafts: list[int], dists: list[np.ndarray] | None, source: str, choice: Choice,
               keys: list[object], confs: Sequence[float] = ()) -> Generator[object, object, Verdict]:
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
            return verdict
        self._learn_scale(seconds, len(drafts))
        # The proposals the target looked at: the accepted ones and the first refused one.
        for i in range(min(verdict.n_accepted + 1, len(drafts))):
            accepted = i < verdict.n_accepted
            if source == LOOKUP:
                st.lookup.update(keys[i], accepted)
            elif source == MEMORY:  # a path of the candidate tree: each node's (source, key) estimates
                for node_source, key in keys[i]:  # type: ignore[union-attr]
                    self._learn(node_source, key, accepted)
            else:
                st.draft_by_conf.update(confidence_bin(confs[i]), accepted)
                st.draft_by_pos.update(min(i, MAX_POSITION), accepted)
        return verdict

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
            "memory_tree_steps": self.tree_steps,
            "decide_ms_per_step": round(1000 * self.decide_seconds / steps, 4),
        }
