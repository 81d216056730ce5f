"""The engine's event stream.

Every strategy yields, in order: one `Prefilled`, then per target forward pass
any number of `Token`s followed by one `StepEnd`, then one `Done`. The CLI and
the TUI consume exactly this stream; no decoding logic lives in `app/`.

Invariant: the output is the sequence of tokens whose kind is not `rejected`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Literal, Union

TokenKind = Literal["accepted", "target", "rejected"]
# Who proposed a token: the draft model, the target's MTP head, an EAGLE-3 draft, a DFlash draft, prompt lookup, lookahead's
# n-gram pool, or nobody (the target's own).
Source = Literal["draft", "mtp", "eagle3", "dflash", "lookup", "lookahead", "grammar", "memory", "target"]
DoneReason = Literal["eos", "length", "stop", "cancelled", "error"]
# Where a thinking model's text goes (backends.reasoning): its reasoning block or the answer.
Channel = Literal["reasoning", "content"]

ACCEPTED: TokenKind = "accepted"
TARGET: TokenKind = "target"
REJECTED: TokenKind = "rejected"


@dataclass(frozen=True)
class Prefilled:
    """The prompt is in the target's KV cache (only the tokens not cached yet were decoded)."""

    n_tokens: int
    seconds: float
    n_cached: int = 0


@dataclass(frozen=True)
class Token:
    """One token of a step.

    `text` is the output text this token releases: UTF-8 safe (a character split
    across tokens is released whole with the token that completes it) and with
    anything that might begin a stop string held back. Rejected tokens carry
    their own piece for display only.
    `correction` marks a target token sampled right after a rejection.
    `source` says who proposed it: a drafter for accepted and rejected
    tokens ("grammar" for a stretch the grammar forces), "target" for the
    target's own.
    With `GenParams.logprobs`, an output token carries its log-probability
    under the target's distribution at its place (after a grammar's mask, at
    temperature 1, before any truncation) and the `logprobs` likeliest
    tokens there with theirs, best first.
    For a thinking model (GenParams.reasoning), `text` is the answer's part
    of what the token releases and `reasoning` its reasoning's part (the
    tags removed); `channel` is where the token stands (a rejected token's
    piece is shown there).
    """

    id: int
    text: str
    kind: TokenKind
    correction: bool = False
    source: Source = "target"
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    reasoning: str = ""
    channel: Channel = "content"


@dataclass(frozen=True)
class StepEnd:
    """One target forward pass is finished.

    `choice` names what the step verified ("plain", "draft", "lookup",
    "lookahead", "tree"); `why` is `auto`'s reason for it, in words; `last`
    that it ended the answer (its length, an end token or a stop string): what
    comes next is Done, maybe after work that takes a while (`auto` measuring a
    new machine), so whoever holds tokens back to batch them hands them on now.
    """

    drafted: int
    accepted: int
    seconds: float
    choice: str = ""
    why: str = ""
    last: bool = False


@dataclass(frozen=True)
class GenStats:
    """Totals of one generation (docs/cli.md: `--json`'s stats)."""

    strategy: str
    prompt_tokens: int
    prompt_cached: int
    prompt_seconds: float
    generated_tokens: int
    decode_seconds: float
    target_forwards: int
    drafted: int
    accepted: int
    accepted_per_position: tuple[int, ...] = ()
    drafted_per_position: tuple[int, ...] = ()
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # output tokens by who proposed them
    steps_by_choice: dict[str, int] = field(default_factory=dict)  # target forwards by what they verified
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_per_forward(self) -> float:
        """Output tokens per target forward (1.0 for plain decoding)."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "strategy": self.strategy,
            "prompt_tokens": self.prompt_tokens,
            "prompt_cached": self.prompt_cached,
            "prompt_seconds": round(self.prompt_seconds, 6),
            "generated_tokens": self.generated_tokens,
            "decode_seconds": round(self.decode_seconds, 6),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "target_forwards": self.target_forwards,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_per_forward": round(self.mean_accepted_per_forward, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "tokens_by_source": dict(self.tokens_by_source),
            "steps_by_choice": dict(self.steps_by_choice),
            **self.extra,
        }


@dataclass(frozen=True)
class Done:
    """The end of a generation. `tokens`/`text` are the whole output.

    `tail` is output text not carried by any Token event: what was held back
    because it might have begun a stop string. A streaming consumer prints it
    last. `error` is set when reason is 'error'. For a thinking model, `text`
    is the answer and `reasoning` the whole reasoning (tags removed); reasoning
    no Token carried (held back as a stop string's possible start) is its
    end, `reasoning[len(shown):]`, which a streaming consumer shows last.
    """

    reason: DoneReason
    stats: GenStats
    tokens: tuple[int, ...]
    text: str
    tail: str = ""
    error: str | None = None
    reasoning: str = ""


Event = Union[Prefilled, Token, StepEnd, Done]


def until_done(events: Iterable[Event]) -> Done:
    """Consume a stream whose events nobody shows, and return its Done."""
    done = None
    for event in events:
        done = event
    if not isinstance(done, Done):
        raise RuntimeError("the event stream ended without Done")
    return done
