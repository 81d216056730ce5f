"""`auto`: before every target forward pass, verify whatever maximises expected tokens per second.

The options of one step:
  - nothing: a plain step, one token;
  - a prompt-lookup continuation (Saxena 2023), of a length chosen from the
    match: llama.cpp's examples/lookup proposal, verified as one chain;
  - a draft-model chain (Leviathan et al. 2023), drafted token by token and
    stopped where the draft's confidence no longer pays;
  - a lookahead step (Fu et al. 2024): lookahead.cpp's window and n-gram pool
    batch (backends.strategies.lookahead.LookaheadWindow), when it pays;
  - continuations from the speculation memory (backends.suffix, after
    SuffixDecoding): a tree of what followed the current suffix in earlier
    outputs, with prompt lookup's proposal merged in (.proposals), each node
    priced by its own estimate (the memory's by match length, the share of
    occurrences that went its way, and position; lookup's by match and
    position) and verified where its expected tokens pay for its row
    (decide.best_subtree: a chain when one path is worth it, else a tree,
    each path under its own sequence id); its first tokens' chances are
    calibrated within the answer, as lookup's are (below).
Under a grammar, the stretch the grammar forces comes first, verified as a
chain of its canonical tokens (certain: the mask allows nothing else), and
lookup's and the memory's proposals are cut where the grammar refuses them.

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

from typing import Callable, Sequence

from backends.config import StrategyOptions
from backends.sampling import GenParams
from backends.scheduler import Steps
from backends.slot import Slot
from backends.strategies.auto.generation import _Generation
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
        gen = _Generation(self, prompt, params)  # a prompt that does not fit fails here, as for every strategy
        name = f"{self.name}.{sampling_mode(params)}"
        # The learnt state is kept for later sessions before Done is handed on (a consumer may stop there).
        return drive(gen.run, gen.prefill, gen.step, should_stop,
                     on_done=lambda: self.slot.learnt.keep(name, gen.state.to_json()))
