"""Bookkeeping shared by every strategy: output, stop conditions, events, stats.

A strategy decides which tokens to propose and how to verify them; `Run`
turns its decisions into the event stream (backends.events) and tracks why
generation ends (end-of-generation token, max tokens, full context, stop
string, cancellation).

Cache convention used by all strategies (as llama.cpp's speculative examples
do): the target's KV cache holds `context[:-1]`; each target forward pass
starts with `context[-1]`, the last committed token, followed by the proposals.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from backends.errors import PromptError
from backends.events import ACCEPTED, REJECTED, TARGET, Done, DoneReason, GenStats, Prefilled, Source, StepEnd, Token
from backends.grammar import Constraint
from backends.kv import KvSequence
from backends.llama import LlamaModel
from backends.sampling import GenParams, Noise, log_probabilities, make_rng
from backends.text import TextStream, rendering


class Run:
    def __init__(self, strategy: str, model: LlamaModel, params: GenParams, prompt: Sequence[int], n_ctx: int) -> None:
        if not prompt:
            raise PromptError("the prompt is empty")
        if len(prompt) >= n_ctx:
            raise PromptError(
                f"the prompt has {len(prompt)} tokens but the context holds {n_ctx}; "
                f"shorten it or raise the context size (-c)"
            )
        self.strategy = strategy
        self.model = model
        self.params = params
        self.n_ctx = n_ctx
        self.rng = make_rng(params.seed)  # a draft model's sampling and rejection sampling's decisions
        self.noise = Noise.of(params.seed)  # the target's draws (backends.sampling)
        self.context: list[int] = list(prompt)  # prompt + committed output
        self.n_prompt = len(prompt)
        self.output: list[int] = []
        self.reason: DoneReason | None = None
        # A thinking model's tags are text even where its vocabulary has them as control tokens (backends.text).
        self._piece = rendering(model, params.reasoning.tags) if params.reasoning is not None else model.piece
        self._stream = TextStream(self._piece, params.stop)
        self._n_cached = 0
        self._prompt_seconds = 0.0
        self._t0 = time.perf_counter()
        self._t_decode = self._t0
        self._step_t0 = self._t0
        self.forwards = 0
        self.drafted = 0
        self.accepted = 0
        self.accepted_at: list[int] = []
        self.drafted_at: list[int] = []
        self.by_source: dict[str, int] = {}
        self.by_choice: dict[str, int] = {}
        self.extra: dict[str, object] = {}
        self._reports: list[Callable[[], dict[str, object]]] = []
        self._banned = np.asarray(model.eog_ids, dtype=np.int64) if params.ignore_eos and model.eog_ids else None
        if params.grammar is not None and params.grammar.n_vocab != model.n_vocab:
            raise PromptError(f"the grammar was compiled for a vocabulary of {params.grammar.n_vocab} tokens; "
                              f"this model has {model.n_vocab}")
        # Where the output stands in its grammar (None: free text).
        self.constraint: Constraint | None = params.grammar.start() if params.grammar is not None else None

    # -- phases -------------------------------------------------------------

    def prefilled(self, n_cached: int) -> Prefilled:
        """The prompt is in the cache (`n_cached` of its tokens were there already): decoding starts."""
        self._n_cached = n_cached
        now = time.perf_counter()
        self._prompt_seconds = now - self._t0
        self._t_decode = self._step_t0 = now
        return Prefilled(self.n_prompt, self._prompt_seconds, self._n_cached)

    @property
    def pending(self) -> int:
        """The last committed token: not in the target's cache yet."""
        return self.context[-1]

    def place(self) -> int:
        """The place in the answer of the next token the target draws (the noise it draws with is indexed by it)."""
        return self.params.first_place + len(self.output)

    def room(self) -> int:
        """How many more tokens the next target forward may produce (proposals + 1)."""
        return min(self.params.max_tokens - len(self.output), self.n_ctx - len(self.context) + 1)

    def should_continue(self, should_stop: Callable[[], bool]) -> bool:
        if self.reason is None and should_stop():
            self.reason = "cancelled"
        if self.reason is None and self.room() <= 0:
            self.reason = "length"
        return self.reason is None

    # -- what the generation may draw from ---------------------------------

    def logits(self, seq: KvSequence, row: int | None = None, path: Sequence[int] | None = (),
               drafter: bool = False) -> np.ndarray:
        """The logits of batch row `row` of `seq` (the target's or the draft's; default: its last token's) as this
        generation may draw from them: the tokens it never emits at -inf (end-of-generation tokens with
        `ignore_eos`).

        `path` is what the row follows past the committed output (a chain's drafts before it, a tree node's
        ancestors); None for a row on no output path (lookahead's window of guesses). `drafter`: the row is
        a drafter's (unmasked when `GenParams.mask_drafts` is off). Every strategy reads
        logits here, for the target and for its drafter alike, so verification compares like with like
        and the output follows the restricted distribution exactly. The row is changed in place (its
        logits are a view of llama.cpp's, valid until the next decode; masking twice changes nothing).
        """
        logits = seq.logits(row)
        if self._banned is not None:
            logits[self._banned] = -np.inf
        if self.constraint is not None and path is not None and (self.params.mask_drafts or not drafter):
            self.constraint.apply(logits, path)
        return logits

    def valid_prefix(self, proposal: Sequence[int]) -> list[int]:
        """The part of a proposal (lookup's, lookahead's) the grammar admits after the output: the rest would
        cost batch rows that are never accepted."""
        if self.constraint is None or not proposal or not self.params.mask_drafts:
            return list(proposal)
        return list(proposal[: self.constraint.valid_prefix(proposal)])

    def forced(self) -> list[int]:
        """The tokens the grammar forces next (a draft of near certainty), within what may still be generated."""
        if self.constraint is None or self.reason is not None:
            return []
        return self.constraint.forced(self.room() - 1)

    # -- tokens of one step -------------------------------------------------

    def commit(self, token: int, kind: str, correction: bool = False, source: Source = "target",
               logits: np.ndarray | None = None) -> Token | None:
        """Add a verified token to the output. Returns its event, or None for an end-of-generation token.

        `logits`: the (masked) target logits the token was drawn or verified at, for its log-probability.
        """
        if self.model.is_eog(token):
            self.reason = "eos"
            return None
        if kind == TARGET:
            source = "target"
        if self.constraint is not None:
            self.constraint.commit(token)
        logprob, top = None, ()
        if self.params.logprobs is not None and logits is not None:
            logprob, top = log_probabilities(logits, token, self.params.logprobs)
        self.output.append(token)
        self.context.append(token)
        self.by_source[source] = self.by_source.get(source, 0) + 1
        text = self._stream.push(token)
        if self._stream.stopped:
            self.reason = "stop"
        elif self.constraint is not None and self.constraint.done:
            self.reason = "stop"  # the grammar is complete: only the end could follow
        elif len(self.output) >= self.params.max_tokens or len(self.context) > self.n_ctx:
            self.reason = "length"
        return Token(token, text, kind, correction, source, logprob, top)  # type: ignore[arg-type]

    def commit_step(self, proposals: Sequence[int], n_accepted: int, next_token: int,
                    source: Source = "draft", logits_at: Callable[[int], np.ndarray] | None = None) -> list[Token]:
        """Events of a verified chain: accepted proposals, the first refused one, then the target's token.

        `logits_at(i)`: the target's logits at the chain's i-th place (for log-probabilities)."""
        events: list[Token] = []
        want = self.params.logprobs is not None and logits_at is not None
        for i, tok in enumerate(proposals[:n_accepted]):
            ev = self.commit(tok, ACCEPTED, source=source, logits=logits_at(i) if want else None)  # type: ignore[misc]
            if ev is not None:
                events.append(ev)
            if self.reason is not None:
                return events
        rejected = n_accepted < len(proposals)
        if rejected:
            events.append(self.rejected(proposals[n_accepted], source))
        ev = self.commit(next_token, TARGET, correction=rejected,
                         logits=logits_at(n_accepted) if want else None)  # type: ignore[misc]
        if ev is not None:
            events.append(ev)
        return events

    def rejected(self, token: int, source: Source) -> Token:
        return Token(token, self._piece(token).decode("utf-8", errors="replace"), REJECTED, source=source)

    def end_step(self, drafted: int, accepted: int, choice: str, why: str = "") -> StepEnd:
        self.forwards += 1
        self.by_choice[choice] = self.by_choice.get(choice, 0) + 1
        self.drafted += drafted
        self.accepted += accepted
        for counts, n in ((self.drafted_at, drafted), (self.accepted_at, accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1
        now = time.perf_counter()
        seconds, self._step_t0 = now - self._step_t0, now
        return StepEnd(drafted, accepted, seconds, choice, why, last=self.reason is not None or self.room() <= 0)

    # -- the end ------------------------------------------------------------

    def report(self, figures: Callable[[], dict[str, object]]) -> None:
        """A strategy's own figures (its batch rows, draft decodes, tree sizes): read into GenStats.extra when the
        stats are taken, at the end, rather than kept current every step."""
        self._reports.append(figures)

    def stats(self) -> GenStats:
        for figures in self._reports:
            self.extra.update(figures())
        if self.constraint is not None:  # what the grammar cost: masks, look-aheads, forced tokens
            self.extra.update(grammar_seconds=round(self.constraint.seconds, 6), grammar_masks=self.constraint.masks)
        return GenStats(
            strategy=self.strategy,
            prompt_tokens=self.n_prompt,
            prompt_cached=self._n_cached,
            prompt_seconds=self._prompt_seconds,
            generated_tokens=len(self.output),
            decode_seconds=time.perf_counter() - self._t_decode,
            target_forwards=self.forwards,
            drafted=self.drafted,
            accepted=self.accepted,
            accepted_per_position=tuple(self.accepted_at + [0] * (len(self.drafted_at) - len(self.accepted_at))),
            drafted_per_position=tuple(self.drafted_at),
            tokens_by_source=dict(self.by_source),
            steps_by_choice=dict(self.by_choice),
            extra=dict(self.extra),
        )

    def done(self, error: Exception | None = None) -> Done:
        reason: DoneReason = "error" if error is not None else (self.reason or "length")
        tail = self._stream.flush()  # text held back for a stop string that never came
        return Done(reason, self.stats(), tuple(self.output), self._stream.text, tail, str(error) if error else None)
