"""Headless rendering of the engine's event stream: the coloured speculation
view (as in the figure of Leviathan et al. 2023: accepted drafts green,
rejected drafts red and struck through, the target's correction blue, the
target's own tokens in the default colour; accepted tokens from prompt lookup
cyan, from lookahead's n-gram pool yellow, and from the model's own drafters
each in a colour of its own: its MTP head, an EAGLE-3 draft, a DFlash draft;
so `auto`'s mix shows, and which drafter drafted), JSON event lines, and stats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO

from rich.console import Console
from rich.text import Text

from backends.events import ACCEPTED, REJECTED, Done, Event, GenStats, Prefilled, StepEnd, Token

@dataclass(frozen=True)
class Palette:
    """Styles of the speculation view; the target's own tokens keep the default style."""

    accepted: str  # proposed by the draft model (and the grammar's forced tokens, the speculation memory's)
    rejected: str
    correction: str
    lookup: str  # accepted, proposed by prompt lookup
    lookahead: str  # accepted, proposed by lookahead's n-gram pool
    mtp: str  # accepted, proposed by the target's own MTP head
    eagle3: str  # accepted, proposed by an EAGLE-3 draft
    dflash: str  # accepted, proposed by a DFlash (or DSpark) block draft

    def accepted_from(self, source: str) -> str:
        return {"lookup": self.lookup, "lookahead": self.lookahead, "mtp": self.mtp, "eagle3": self.eagle3,
                "dflash": self.dflash}.get(source, self.accepted)

    def source_style(self, source: str) -> str:
        """The style a source's accepted tokens have: what a legend names it in ("" for the target's own)."""
        return "" if source == "target" else self.accepted_from(source)


# The terminal's own colours for the CLI where it has one per source (its theme picks the shade); the two drafters
# it has none left for get fixed 256-colour ones, which a 16-colour terminal maps to its nearest.
ANSI = Palette(accepted="green", rejected="red strike", correction="blue", lookup="cyan", lookahead="yellow",
               mtp="magenta", eagle3="color(205)", dflash="color(208)")
# Fixed colours in the chat app, whose theme would otherwise turn ANSI red and blue into pink and purple. The three
# drafters' (violet, pink, orange) are of middle lightness, so that they read on dark and light themes alike: a
# contrast ratio of 3.4 or more on every dark built-in Textual theme's background, 2.5 or more on every light one's
# (where the draft model's green has under 2.5); and they are at least 17 CIEDE2000 units (28 CIE76) from each
# other and from every other colour here, orange nearest to rejected red, which is also struck through.
TRUECOLOR = Palette(accepted="#3fb950", rejected="#f85149 strike", correction="#58a6ff", lookup="#39c5cf",
                    lookahead="#d29922", mtp="#a371f7", eagle3="#e0529c", dflash="#db6d1c")

# Who proposed an accepted token, in the legend's order: its source label (as --json's `source` and the stats line
# name it), the words for it, and its colour's name in ANSI.
LEGEND_SOURCES = (
    ("draft", "the draft model", "green"),
    ("mtp", "the model's MTP head", "magenta"),
    ("eagle3", "an EAGLE-3 draft", "pink"),
    ("dflash", "a DFlash draft", "orange"),
    ("lookup", "prompt lookup", "cyan"),
    ("lookahead", "lookahead", "yellow"),
)


def legend_name(source: str, words: str) -> str:
    """A legend's name for a source: its words, and its label where that differs (e.g. "an EAGLE-3 draft (eagle3)")."""
    return words if words == source else f"{words} ({source})"


LEGEND = ("speculation view: accepted from "
          + ", ".join(f"{legend_name(source, words)} = {colour}" for source, words, colour in LEGEND_SOURCES)
          + "; rejected = red struck through; target's correction = blue; target's own token = default")


def token_style(tok: Token, palette: Palette = ANSI) -> str:
    if tok.correction:
        return palette.correction
    if tok.kind == ACCEPTED:
        return palette.accepted_from(tok.source)
    return palette.rejected if tok.kind == REJECTED else ""


class TextView:
    """Streams output text to a terminal; with colour on, also the rejected drafts. A thinking model's reasoning
    goes to `reasoning` (stderr), dimmed, and the answer to `out`; None hides the reasoning."""

    def __init__(self, out: IO[str], color: bool, reasoning: IO[str] | None = None) -> None:
        self.color = color
        self.out = out
        self.console = Console(file=out, force_terminal=color, no_color=not color, highlight=False, soft_wrap=True)
        self.reasoning = reasoning
        self._thought = ""  # reasoning shown so far
        self._answered = False
        if reasoning is not None:
            self.thinking = Console(file=reasoning, force_terminal=color, no_color=not color, highlight=False,
                                    soft_wrap=True)

    def _think(self, text: str) -> None:
        if self.reasoning is None or not text:
            return
        self._thought += text
        self.thinking.print(Text(text, style="dim italic"), end="")
        self.reasoning.flush()

    def _end_thinking(self) -> None:
        """The answer starts: the reasoning's line ends first, so that the answer starts on its own."""
        if not self._answered and self._thought and self.reasoning is not None:
            self.reasoning.write("\n\n")
            self.reasoning.flush()
        self._answered = True

    def show_prompt(self, prompt: str) -> None:
        """The prompt, dimmed, before the completion (the demo shows what it continues)."""
        if self.color:
            self.console.print(Text(prompt, style="dim"), end="")
        else:
            self.out.write(prompt)
        self.out.flush()

    def show(self, event: Event) -> None:
        if isinstance(event, Token):
            if event.kind == REJECTED and not self.color:
                return  # without colour a rejected draft would read as output
            if event.kind == REJECTED and event.channel == "reasoning":
                if self.reasoning is not None:
                    self.thinking.print(Text(event.text, style=token_style(event)), end="")
                return
            self._think(event.reasoning)
            if not event.text:
                return
            self._end_thinking()
            if self.color:
                self.console.print(Text(event.text, style=token_style(event)), end="")
            else:
                self.out.write(event.text)
            self.out.flush()
        elif isinstance(event, Done):
            self._think(event.reasoning[len(self._thought):])
            if event.tail:
                self._end_thinking()
            elif self._thought and not self._answered and self.reasoning is not None:
                self.reasoning.write("\n")
            self.out.write(event.tail + "\n")
            self.out.flush()


def event_json(event: Event, parse: bool = False) -> str:
    """One line of `--json`. With `parse` (a run under --json-schema) the done line carries the output parsed
    (`"parsed"`), or `"parsed": null` and `"parse_error"` when it is not whole JSON (cut by -n)."""
    if isinstance(event, Prefilled):
        obj: dict[str, object] = {
            "type": "prefilled",
            "n_tokens": event.n_tokens,
            "n_cached": event.n_cached,
            "seconds": round(event.seconds, 6),
        }
    elif isinstance(event, Token):
        obj = {"type": "token", "id": event.id, "text": event.text, "kind": event.kind, "correction": event.correction,
               "source": event.source, "channel": event.channel}
        if event.reasoning:
            obj["reasoning"] = event.reasoning
        if event.logprob is not None:
            obj["logprob"] = event.logprob
    elif isinstance(event, StepEnd):
        obj = {"type": "step", "drafted": event.drafted, "accepted": event.accepted, "seconds": round(event.seconds, 6),
               "choice": event.choice}
        if event.why:
            obj["why"] = event.why
    else:
        obj = {
            "type": "done",
            "reason": event.reason,
            "tokens": list(event.tokens),
            "text": event.text,
            "reasoning": event.reasoning,
            "stats": event.stats.as_dict(),
        }
        if event.error:
            obj["error"] = event.error
        if parse:
            try:
                obj["parsed"] = json.loads(event.text)
            except json.JSONDecodeError as e:
                obj["parsed"], obj["parse_error"] = None, str(e)
    return json.dumps(obj, ensure_ascii=False)


def percent_text(pct: float) -> str:
    """A source's share of the tokens, "41%"; under one percent "<1%": a source listed gave a token at least,
    never "0%" (`run --stats`, the chat app's bar)."""
    return f"{pct:.0f}%" if pct >= 1 else "<1%"


def stats_lines(stats: GenStats, reason: str) -> list[str]:
    lines = [
        f"strategy {stats.strategy}: {stats.generated_tokens} tokens in {stats.decode_seconds:.2f} s "
        f"= {stats.tokens_per_second:.1f} tok/s (stopped: {reason})",
        f"prompt: {stats.prompt_tokens} tokens ({stats.prompt_cached} cached) in {stats.prompt_seconds:.2f} s",
        f"target forwards: {stats.target_forwards}, tokens per forward: {stats.mean_accepted_per_forward:.2f}",
    ]
    if stats.drafted:
        per_pos = " ".join(
            f"{a}/{d}" for a, d in zip(stats.accepted_per_position, stats.drafted_per_position)
        )
        lines.append(
            f"drafted {stats.drafted}, accepted {stats.accepted} ({100 * stats.acceptance_rate:.1f}%); "
            f"accepted/drafted by position: {per_pos}"
        )
    total = sum(stats.tokens_by_source.values())
    if total and set(stats.tokens_by_source) != {"target"}:
        lines.append("tokens by source: " + ", ".join(f"{k} {percent_text(100 * v / total)}"
                                                     for k, v in sorted(stats.tokens_by_source.items())))
    if len(stats.steps_by_choice) > 1 or stats.strategy == "auto":
        lines.append("steps by choice: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.steps_by_choice.items())))
    if stats.extra:
        lines.append(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in stats.extra.items()))
    return lines
