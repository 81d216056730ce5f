"""One generation of `auto`: its step machine, its proposers, and what each step teaches.

Every step: the stretch a grammar forces first (a chain of certain tokens);
else the proposals of the moment (prompt lookup's continuation, the
speculation memory's candidate tree with lookup's merged in) go to the
decision (.choose, priced by .costs), and the chosen option runs as one of
the fixed strategies' lossless steps: a chain verified as sps and lookup
verify theirs (backends.strategies.chain), the draft's chain drafted by the
loop sps drafts with (backends.strategies.drafting), a tree as the memory's
(backends.strategies.branches.verify_tree), lookahead's window
(backends.strategies.lookahead.LookaheadWindow). Afterwards every proposal
the target looked at teaches its estimate (.state), and the step's time
teaches the cost model, alone only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Generator, Iterator, Sequence

import numpy as np

from backends.pricing import best_chain_speedup, path_reach
from backends.run import Run
from backends.sampling import GenParams
from backends.steps import PAUSE, Decode
from backends.strategies.auto.choose import CHAIN_LAG, HELD_BACK, Chooser, DraftPays, Proposals
from backends.strategies.auto.costs import CostModel
from backends.strategies.auto.decide import (DRAFT, EARLY_TRIES, LOOKAHEAD, LOOKUP, MEMORY, PLAIN, Choice,
                                            being_learnt, expected_chain_tokens)
from backends.strategies.auto.proposals import CandidateTree, candidate_tree, looked_at
from backends.strategies.auto.state import MATCH_EXTEND, MAX_POSITION, confidence_bin, lookup_key, memory_key
from backends.strategies.branches import verify_tree
from backends.strategies.chain import chain_step, forced_step, plain_step
from backends.strategies.drafting import Chain, DraftRule, Either, PMin, draft_chain
from backends.strategies.lookahead import LookaheadWindow
from backends.strategies.lookup import NgramIndex
from backends.strategies.suffix import prune_by_grammar
from backends.verify import Verdict

if TYPE_CHECKING:
    from backends.strategies.auto import AutoDecoding

# The speculation memory is consulted only for earlier text that matches at least this many tokens back:
# one-token matches are everywhere where nothing repeats, seldom go on the same way, and each costs the step a
# lookup (docs/results.md, "Speculation memory", measures what consulting every match cost).
MEMORY_MIN_MATCH = 2
# The memory's candidate tree holds at most MEMORY_NODES_PER_TOKEN x draft_max nodes (and auto's memory_paths
# root-to-leaf paths), of which the decision verifies those worth their rows.
MEMORY_NODES_PER_TOKEN = 2
# The first step verifies nothing with the prompt's last token: a chain's rows would delay the first token (its
# time to first token was 1.25x ar's in process when the first step verified a lookup chain; docs/results.md).
FIRST_TOKEN = "plain — the first token as soon as plain decoding gives it"
SOURCES = {DRAFT: "draft", LOOKUP: "lookup", MEMORY: "memory", PLAIN: "target"}  # Token.source per option
# A draft whose best case, every token it drafts accepted, beats plain decoding by less than this share is dropped
# before it is tried: acceptance is never whole, and each token it drafts costs the host a step's work that its
# measured decode leaves out. On an H200 a draft file identical to the target's measured 0.97 of it (a best case
# of 1.03x on the GPU's flat curve) and was kept, and one-client runs read 0.44x plain at 2.7-2.9 tokens a forward
# (docs/results.md, "A GPU").
DRAFT_MIN_BEST = 1.05
HELD = Choice(PLAIN, why=HELD_BACK)  # every held-back step's choice (it is never changed)
# Before the device's cost is known (a new machine's first answer: measured after it, `measure_after`) nothing can
# pay as priced, so nothing is looked up either: `ar`'s step, and a plain tick for the realised check.
UNPRICED = Choice(PLAIN, why="plain — this machine's costs are measured once this answer ends")


class Generation:
    """One generation of `auto`: the step machine's parts (`prefill`, `step`) and its per-step bookkeeping."""

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
        self.memory = slot.memory() if options.memory and options.auto.memory else None
        la = options.lookahead
        self.window: LookaheadWindow | None = None
        if options.auto.lookahead and self.target.n_seq_max >= la.n_seq_max \
                and la.batch_size <= self.target.batch_capacity:
            self.window = LookaheadWindow(self.target, la, prompt)
        self.costs = CostModel(self.state, slot)
        self.tree_nodes = max(1, min(MEMORY_NODES_PER_TOKEN * options.auto.draft_max, self.target.batch_capacity - 1))
        self.chooser = Chooser(self.state, self.costs, self.run, self.cfg, self.sps, self.draft, self.window,
                               tree_leaves=max(1, min(options.auto.memory_paths, self.target.n_seq_max - 1)),
                               tree_nodes=self.tree_nodes)
        self.proposals = self._none = Proposals()  # this step's; `_none` for the steps that look for none
        self.decide_seconds = 0.0
        self.draft_decodes = 0
        self.batch_tokens = 0
        self.explored = 0
        self.tree_steps = 0  # memory steps verified as a tree (several paths)
        self.catch_up = 0.0  # seconds the last draft step spent catching the draft up (draft_step)
        self.held_tokens = 0  # tokens decoded while held back (backends.realised) since the draft last caught up
        self.run.report(self.stats)
        if self.state.temperature != params.temperature:  # what the tries confirmed held at another temperature
            self.state.backoff.clear()
            self.state.temperature = params.temperature

    def prefill(self) -> Generator[Decode, list[int], int]:
        """The target's prompt, and nothing else before the first token: no draft prompt and no measurement
        (a device cost not yet known is measured after the answer, `measure_after`)."""
        cached = yield from self.target.syncing(self.prompt[:-1], logits=False)
        cost = self.slot.known_cost()
        self.costs.seed(cost, self.draft is not None)
        if self.draft is not None and self.costs.priced \
                and best_chain_speedup(1.0, self.costs.draft_ratio(), self.costs.curve)[0] < DRAFT_MIN_BEST:
            # A draft this dear (its lanes' live costs, else as measured) cannot pay even were it always right (a draft as costly as the target: K + 1
            # tokens for K draft decodes and a batch of K + 1): it is neither tried nor kept in step.
            self.draft = self.chooser.draft = None
        return cached

    def measure_after(self) -> Iterator[object]:
        """Once the answer is done: measure the device's cost if this answer ran without it (a new machine or
        new model files), so that the next answer prices its options. Until then `auto` decodes plainly and
        tries nothing: the first answer on a new machine pays neither a calibration nor exploration. It pauses
        first, so that the answer's last tokens are handed on before it (a scheduler hands a tick's events on when
        the tick ends: the chat app's first answer stalled before its last tokens for the measurement, 2 s)."""
        if not self.costs.priced:
            yield PAUSE
            t0 = time.perf_counter()
            self.slot.device_cost()
            self.slot.load.realised.switching(time.perf_counter() - t0)  # not the last tick's cost

    def decide(self, lookup: list[int], match: int, tree: CandidateTree | None = None) -> Choice:
        """This step's option for these proposals (kept in `proposals` for the step to learn from)."""
        self.proposals = Proposals(lookup, match, tree if tree is not None else CandidateTree())
        return self.chooser.choose(self.proposals)

    # -- one step ------------------------------------------------------------

    def step(self) -> Iterator[object]:
        run, st = self.run, self.state
        forced = yield from forced_step(run, self.target)  # acceptance ~1, no drafter: always worth a row each
        if forced:
            self.batch_tokens += forced + 1
            self.costs.own_rows = forced + 1
            return
        t0 = time.perf_counter()
        lookup, match = ([], 0)
        learning = False  # the option chosen is still being learnt (decide.SETTLE_STEPS)
        first = not run.output
        realised = self.slot.load.realised
        if first:  # the prompt's last token alone: a chain verified with it would delay the first token
            choice = Choice(PLAIN, why=FIRST_TOKEN)
        elif not self.costs.priced:  # nothing is priced to pay: no lookups, and `ar`'s step
            yield from self._held_back(t0, UNPRICED)
            return
        elif not realised.allows(self.costs.batch()[0]):  # held back: no lookups, and `ar`'s step
            yield from self._held_back(t0, HELD)
            return
        else:
            realised.deciding()  # what this costs counts with speculation's ticks (backends.realised)
            if self.index is not None:
                lookup, match = self.index.propose_with_match(run.context, min(self.cfg.draft_max, run.room() - 1),
                                                              MATCH_EXTEND)
                lookup = run.valid_prefix(lookup)
            choice = self.decide(lookup, match, self._candidates(lookup, match))
            learning = being_learnt(choice.option, st.taken)
            if learning or choice.explore:
                # Exploration's price, bounded by SETTLE_STEPS and by the exploration budget: its losses are not the
                # check's to judge (its gains are: backends.realised). A try is of an option the estimates call
                # worse, so it loses by design: counted, every try would weigh against the options that pay.
                realised.learning()
        self.decide_seconds += time.perf_counter() - t0
        self._count(choice)
        before = len(run.output)
        if choice.option == LOOKAHEAD and self.window is not None:
            yield from self._lookahead_step(choice)
        elif choice.option == DRAFT:
            yield from self._draft_step(choice, learning)
        elif choice.option == MEMORY:
            yield from self._memory_step(choice)
        elif choice.option == LOOKUP:
            props = self.proposals
            yield from self._chain(lookup[:choice.length], None, LOOKUP, choice, props.lookup_keys[:choice.length])
            self.chooser.lookup_calibration.add(len(run.output) - before - 1,
                                                expected_chain_tokens(props.lookup_accept, choice.length) - 1)
        else:
            yield from self._chain([], None, PLAIN, choice, [])
        self.costs.learn(st.tokens, len(run.output) - before)
        self.costs.learn(st.seconds, time.perf_counter() - t0)
        if first and self.draft is not None and self.slot.load.running == 1 and self.costs.priced \
                and self.chooser.lag() > CHAIN_LAG and self.chooser.draft_in_use() \
                and self.chooser.catch_up_affordable(self.costs.t_plain()):
            # Alone, the draft takes the prompt now, once the first tokens were handed on (not before them, where
            # it would delay the first token by its own prompt decode), so that its first tries find it caught up:
            # while it is in use or still to be tried early. A draft found not to pay does not (its prompt cost
            # 3% of a run where it was never used, measured); were it chosen or tried later, its catch-up is
            # priced then. Beside others it waits until it is used (its catch-up is priced then, for the whole
            # batch): every sequence would wait for its prompt, and under load it seldom pays. Without a known
            # device cost this answer speculates not at all (measure_after), so the draft waits for the next one.
            # (Its lag counts what it holds of this context: a slot that served another conversation holds that
            # one, and the first draft step paid its prompt, priced at nothing and counted as drafting's cost.)
            t0 = time.perf_counter()
            kept = yield from self.draft.syncing(self.prompt[:-1], logits=False)
            seconds = time.perf_counter() - t0
            self.slot.load.realised.switching(seconds)  # a switch, not a draft step's cost
            if (decoded := len(self.draft.tokens) - kept) > 1:  # what a caught-up token costs, for later catch-ups
                self.costs.learn(st.catch_up, seconds / decoded)

    def _held_back(self, t0: float, choice: Choice) -> Iterator[object]:
        """A plain step where the realised check holds speculation back (backends.realised), or where nothing is
        priced yet (`UNPRICED`): `ar`'s own step, and of the bookkeeping only what the exploration schedule and
        the timings need. Where speculation does not pay, this is nearly every step `auto` takes, and on a fast
        device each microsecond of it is a share of the step: the general path (a new Choice, a chain of none, a
        timing check per figure learnt) cost it a fifth more host time over `ar`'s step than this does
        (docs/results.md, "A fast step")."""
        run, st = self.run, self.state
        self.proposals = self._none
        self._count(choice)
        before = len(run.output)
        t1 = time.perf_counter()
        self.decide_seconds += t1 - t0
        yield from plain_step(run, self.target, choice.why)
        t2 = time.perf_counter()
        self._rows(1)
        tokens = len(run.output) - before
        self.held_tokens += tokens
        if self.costs.timing():  # alone: as `_chain` and `step` learn a plain step's time and yield
            st.t_plain.add(t2 - t1)
            st.tokens.add(tokens)
            st.seconds.add(t2 - t0)

    def _count(self, choice: Choice) -> None:
        """The exploration schedule's bookkeeping: steps since each option was taken, tries, back-off."""
        st = self.state
        self.explored += choice.explore
        for option in (DRAFT, LOOKUP, LOOKAHEAD, MEMORY):
            st.since[option] = 0 if option == choice.option else st.since.get(option, 0) + 1
        if choice.explore:
            if st.taken.get(choice.option, 0) >= EARLY_TRIES:
                st.backoff[choice.option] = st.backoff.get(choice.option, 0) + 1
        elif choice.option != PLAIN:
            st.backoff.pop(choice.option, None)  # chosen on its estimate: its tries start over
        st.taken[choice.option] = st.taken.get(choice.option, 0) + 1

    def _candidates(self, lookup: list[int], match: int) -> CandidateTree:
        """What the memory proposes after the context, as a tree (cut where the grammar refuses it), with
        lookup's proposal merged in; empty where the memory has nothing (lookup is then an option of its own)."""
        run = self.run
        if self.memory is None or run.room() <= 1:
            return CandidateTree()
        found = prune_by_grammar(run, self.memory.continuations(
            run.context, min(self.cfg.draft_max, run.room() - 1), self.tree_nodes, min_match=MEMORY_MIN_MATCH))
        if not len(found):
            return CandidateTree()
        keys = [memory_key(found.match, share, d - 1) for share, d in zip(found.tree.weights, found.tree.depth)]
        return candidate_tree(found, keys, lookup, [lookup_key(match, i) for i in range(len(lookup))])

    def _memory_step(self, choice: Choice) -> Iterator[object]:
        """Verify the chosen nodes of the candidate tree: as a chain when they are one (no branch ids), else as
        a tree (backends.strategies.branches.verify_tree); each node the target looked at teaches its
        estimates."""
        props, nodes, run = self.proposals, list(choice.nodes), self.run
        candidates = props.tree
        chosen = candidates.tree.subset(nodes)
        keys = [candidates.keys[n] for n in nodes]
        reach = path_reach(candidates.tree, props.tree_estimates)
        predicted = sum(reach[n] for n in nodes)  # extra tokens the counts expect, for the calibration
        before = len(run.output)
        assert self.memory is not None
        if candidates.tree.is_chain(nodes):
            verdict = yield from self._chain(list(chosen.tokens), None, MEMORY, choice, keys)
            self.memory.record(len(chosen), verdict.n_accepted)
        else:
            t0 = time.perf_counter()
            v = yield from verify_tree(self.run, self.target, chosen, "memory", "memory", choice.why)
            self.tree_steps += 1
            self.costs.learn_scale(time.perf_counter() - t0, len(chosen))
            self._rows(len(chosen) + 1)
            for i, accepted in looked_at(chosen.parents, v.path, finished=len(v.path) > v.matched):
                for source, key in keys[i]:
                    self.state.estimates(source).update(key, accepted)
            self.memory.record(len(chosen), v.accepted)
        self.chooser.memory_calibration.add(len(run.output) - before - 1, predicted)

    def _rows(self, n: int) -> None:
        """This step put n rows in the target batch."""
        self.batch_tokens += n
        self.costs.own_rows = n

    def _chain(self, drafts: list[int], dists: list[np.ndarray] | None, source: str, choice: Choice,
               keys: list[object], confs: Sequence[float] = ()) -> Generator[object, object, Verdict]:
        """Verify one chain (none: a plain step) and learn from it: its time, and each proposal the target
        looked at (the accepted ones and the first refused one)."""
        st, run = self.state, self.run
        t0 = time.perf_counter()
        label = self.draft.label if source == DRAFT and self.draft is not None else SOURCES[source]
        verdict = yield from chain_step(run, self.target, drafts, dists, label, choice.why)
        seconds = time.perf_counter() - t0
        self._rows(len(drafts) + 1)
        if not drafts:
            self.costs.learn(st.t_plain, seconds)
            return verdict
        self.costs.learn_scale(seconds, len(drafts))
        for i in range(min(verdict.n_accepted + 1, len(drafts))):
            accepted = i < verdict.n_accepted
            if source == LOOKUP:
                st.lookup.update(keys[i], accepted)
            elif source == MEMORY:  # a path of the candidate tree: each node's (source, key) estimates
                for node_source, key in keys[i]:  # type: ignore[union-attr]
                    st.estimates(node_source).update(key, accepted)
            else:
                st.draft_by_conf.update(confidence_bin(confs[i]), accepted)
                st.draft_by_pos.update(min(i, MAX_POSITION), accepted)
        return verdict

    def draft_chain(self, k_max: int, explore: bool, learning: bool = False) -> Generator[Decode, list[int], Chain]:
        """Draft up to k_max tokens, stopping where the next one no longer pays (choose.DraftPays).

        A try of the draft (`explore`) drafts as `sps` does instead: while the
        draft's confidence stays at or above sps's p_min, at least one token,
        up to k_max. Its chain must not be cut by the estimates it is there to
        correct: when they are too low (a draft not yet seen at this
        temperature), the stopping rule would draft one token, which cannot
        pay with a draft decode and a batch row to pay for, so the try would
        confirm the estimate it was meant to test and the positions past the
        first would never be verified, so never learnt. While the draft is
        still being learnt (`learning`: decide.SETTLE_STEPS) a step drafts as
        long as either rule would, for the same reason: on chains the
        stopping rule cut short, draft steps measured at plain decoding's
        rate and the draft was dropped before its estimates learnt. When
        sampling, sps's rule drafts up to its K only: a token is accepted less
        often than greedy (1 - TV of the two distributions), and learning
        chains up to `auto`'s K were refused early and priced the draft at
        plain decoding's rate, while greedy the shorter chains did
        (docs/results.md, "An option judged once its estimates settle").
        """
        st, draft = self.state, self.draft
        assert draft is not None
        rule: DraftRule
        if explore:
            rule = PMin(self.sps.p_min, first_always=True)
        else:
            rule = DraftPays(st, self.costs, k_max, draft.chain_max is not None)
            if learning:  # sps's rule (when sampling up to its K, as the early tries draft); the stopping rule past it
                longest = None if self.params.greedy else self.sps.draft_max
                rule = Either(PMin(self.sps.p_min, first_always=True, longest=longest), rule)
        t_draft = self.costs.t_draft(self.costs.t_plain())
        t0 = time.perf_counter()
        draft.plan(k_max)  # a block drafter's block (backends.dflash)
        lag = len(self.run.context) - (yield from draft.syncing(self.run.context))
        if lag > CHAIN_LAG:
            # The draft catches up on tokens decoded while it stood by (plain or lookup steps). That is a
            # switching cost spread over those steps, not the cost of drafting: left out of what a draft
            # step is measured to cost (one draft decode stands for it), or a draft tried after a long
            # plain stretch would look dear and never be taken again.
            self.catch_up = max(time.perf_counter() - t0 - t_draft, 0.0)
            self.costs.learn(st.catch_up, self.catch_up / (lag - 1))
            # The share of it that the realised check's hold-back caused is that check's switch, not this tick's
            # cost (backends.realised): else the first draft step after a hold-back, a probe, always looks dear.
            # The rest, tokens of `auto`'s own plain and lookup steps, recurs where it alternates: counted.
            self.slot.load.realised.switching(self.catch_up * min(self.held_tokens, lag - 1) / (lag - 1))
        else:
            self.catch_up = 0.0
        self.held_tokens = 0
        chain = yield from draft_chain(self.run, draft, k_max, rule)
        decodes = chain.decodes + 1
        self.draft_decodes += decodes
        self.costs.learn(st.t_draft, (time.perf_counter() - t0 - self.catch_up) / decodes)
        return chain

    def _draft_step(self, choice: Choice, learning: bool = False) -> Iterator[object]:
        """One draft step: its chain (`draft_chain`), verified; what it gave and cost, for the draft's price."""
        st, run = self.state, self.run
        before = len(run.output)
        t0 = time.perf_counter()
        chain = yield from self.draft_chain(choice.length, choice.explore, learning)
        yield from self._chain(chain.tokens, None if self.params.greedy else chain.dists,
                               DRAFT if chain.tokens else PLAIN, choice, [], chain.confidences)
        st.draft_step_tokens.add(len(run.output) - before)
        self.costs.learn(st.draft_step_cost, (time.perf_counter() - t0 - self.catch_up) / self.costs.t_plain())

    def _lookahead_step(self, choice: Choice) -> Iterator[object]:
        st, run = self.state, self.run
        window = self.window
        assert window is not None
        self.target.share_with(window.n_seqs)  # other steps grew sequence 0 alone
        before = len(run.output)
        t0 = time.perf_counter()
        yield from window.step(run, choice.why)
        seconds = time.perf_counter() - t0
        self._rows(window.config.batch_size)
        st.lookahead_tokens.add(len(run.output) - before)
        self.costs.learn(st.lookahead_cost, seconds / st.t_plain.get(self.costs.t1 or seconds))

    def stats(self) -> dict[str, object]:
        steps = max(self.run.forwards, 1)
        return {
            "batch_tokens": self.batch_tokens,
            "draft_forwards": self.draft_decodes,
            "explored_steps": self.explored,
            "memory_tree_steps": self.tree_steps,
            "decide_ms_per_step": round(1000 * self.decide_seconds / steps, 4),
        }
