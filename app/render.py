"""Headless rendering of the engine's event stream: the coloured speculation
view (as in the figure of Leviathan et al. 2023: accepted drafts green,
rejected drafts red and struck through, the target's correction blue, the
target's own tokens in the default colour), JSON event lines, and stats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import IO

from rich.console import Console
from rich.text import Text

from backends.engine import StrategyOptions
from backends.events import ACCEPTED, REJECTED, Done, Event, GenStats, Prefilled, StepEnd, Token
from backends.strategies.tree import TreeConfig

@dataclass(frozen=True)
class Palette:
    """Styles of the speculation view; the target's own tokens keep the default style."""

    accepted: str
    rejected: str
    correction: str


# The terminal's own colours for the CLI; fixed colours in the chat app, whose theme
# would otherwise turn ANSI red and blue into pink and purple.
ANSI = Palette(accepted="green", rejected="red strike", correction="blue")
TRUECOLOR = Palette(accepted="#3fb950", rejected="#f85149 strike", correction="#58a6ff")


def token_style(tok: Token, palette: Palette = ANSI) -> str:
    if tok.correction:
        return palette.correction
    return {ACCEPTED: palette.accepted, REJECTED: palette.rejected}.get(tok.kind, "")


class TextView:
    """Streams output text to a terminal; with colour on, also the rejected drafts."""

    def __init__(self, out: IO[str], color: bool) -> None:
        self.color = color
        self.out = out
        self.console = Console(file=out, force_terminal=color, no_color=not color, highlight=False, soft_wrap=True)

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
            if self.color:
                self.console.print(Text(event.text, style=token_style(event)), end="")
            else:
                self.out.write(event.text)
            self.out.flush()
        elif isinstance(event, Done):
            self.out.write(event.tail + "\n")
            self.out.flush()


def strategy_label(name: str, options: StrategyOptions) -> str:
    """A strategy and the settings it runs with, in the CLI's flag vocabulary (bench rows, the chat's stats bar)."""
    if name == "sps":
        s = options.sps
        return f"sps K={s.draft_max} p_min={s.p_min}" + ("" if s.adaptive else " fixed")
    if name == "lookahead":
        la = options.lookahead
        return f"lookahead W={la.window} N={la.ngram} G={la.guesses}" + (" seeded" if la.seed_pool_from_prompt else "")
    if name == "lookup":
        return f"lookup K={options.lookup.draft_max} n<={options.lookup.ngram_max}"
    if name == "tree":
        t = options.tree
        shape = " static" if t.shape == "static" else ""
        split = f" ps={t.p_split}" if t.shape == "static" and t.p_split != TreeConfig.p_split else ""
        return f"tree{shape} D={t.depth} k={t.top_k} M={t.nodes}{split}"
    return name


def event_json(event: Event) -> str:
    if isinstance(event, Prefilled):
        obj: dict[str, object] = {
            "type": "prefilled",
            "n_tokens": event.n_tokens,
            "n_cached": event.n_cached,
            "seconds": round(event.seconds, 6),
        }
    elif isinstance(event, Token):
        obj = {"type": "token", "id": event.id, "text": event.text, "kind": event.kind, "correction": event.correction}
    elif isinstance(event, StepEnd):
        obj = {"type": "step", "drafted": event.drafted, "accepted": event.accepted, "seconds": round(event.seconds, 6)}
    else:
        obj = {
            "type": "done",
            "reason": event.reason,
            "tokens": list(event.tokens),
            "text": event.text,
            "stats": event.stats.as_dict(),
        }
        if event.error:
            obj["error"] = event.error
    return json.dumps(obj, ensure_ascii=False)


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
    if stats.extra:
        lines.append(", ".join(f"{k.replace('_', ' ')}: {v}" for k, v in stats.extra.items()))
    return lines
