"""`auto`: before every target forward pass, verify whatever maximises expected tokens per second.

The options of one step:
  - nothing: a plain step, one token;
  - a prompt-lookup continuation (Saxena 2023), of a length chosen from the
    match: llama.cpp's examples/lookup proposal, verified as one chain;
  - a draft-model chain (Leviathan et al. 2023), drafted token by token and
    stopped where the draft's confidence no longer pays;
  - a lookahead step (Fu et al. 2024): lookahead.cpp's window and n-gram pool
    batch (backends.strategies.lookahead.LookaheadWindow), when it pays;
  - continuations from the speculation memory (backends.memory, after
    SuffixDecoding): a tree of what followed the current suffix in earlier
    outputs, with prompt lookup's proposal merged in (.proposals), each node
    priced by its own estimate and verified where its expected tokens pay
    for its row (a chain when one path is worth it, else a tree).
Under a grammar, the stretch the grammar forces comes first, verified as a
chain of its canonical tokens (certain: the mask allows nothing else), and
lookup's and the memory's proposals are cut where the grammar refuses them.

The rooms:
  - .state: what is learnt and kept across turns and sessions: acceptance
    per proposer (the draft by confidence and position, lookup by match
    length and position, the memory by match, share and position), timings;
  - .costs: what a step costs here (the device's curve, live step times,
    the batch load);
  - .choose: the decision (Dinkelbach's transform of tokens per second) and
    the exploration schedule; .decide its pure arithmetic;
  - .generation: the step machine that runs the choice and learns from it.
docs/auto.md explains the rule and its tuning for users.

Lossless: each step is one of the lossless steps of the fixed strategies
(greedy or Leviathan's rejection sampling for draft chains, SpecInfer's
one-hot rule for lookup and lookahead, plain sampling), and the choice of step
depends only on what is already known, never on the target's coming sample.
Greedy output is the target's greedy output; sampled output has its law.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

from backends.config import StrategyOptions
from backends.sampling import GenParams
from backends.slot import Slot
from backends.steps import Steps
from backends.strategies.auto.generation import Generation
from backends.strategies.auto.state import AutoState, sampling_mode
from backends.strategies.base import StepMachine, drive, never


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
        gen = Generation(self, prompt, params)  # a prompt that does not fit fails here, as for every strategy
        name = f"{self.name}.{sampling_mode(params)}"
        # The learnt state is kept for later sessions, and a device cost not yet known is measured, before Done
        # is handed on (a consumer may stop there).
        def done() -> Iterator[object]:
            self.slot.learnt.keep(name, gen.state.to_json)
            yield from gen.measure_after()

        return drive(gen.run, gen.prefill, gen.step, should_stop, on_done=done)
