"""The stats bar: strategy and its settings, acceptance, tokens per target
forward, tokens/s, the speedup against plain decoding measured on this
device in this session, and the share of tokens by source, each source named
in its colour; and the speculation view's legend (F3)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from backends.registry import strategy_label
from app.render import LEGEND_SOURCES, TRUECOLOR, legend_name, percent_text
from app.tui.streaming import LiveStats, PlainBaseline
from backends.config import StrategyOptions
from backends.sampling import GenParams


def share_text(shares: list[tuple[str, int]]) -> Text:
    """'draft 41% · target 59%', each source's name in the colour its accepted tokens have in the speculation view
    (F3): the legend that names which colour is which drafter (the model's own MTP head, EAGLE-3 or DFlash draft,
    a draft model, lookup, ...)."""
    text = Text()
    for i, (source, pct) in enumerate(shares):
        if i:
            text.append(" · ")
        text.append(source, style=TRUECOLOR.source_style(source) or None)
        text.append(f" {percent_text(pct)}")
    return text


def legend_markup() -> str:
    """The speculation view's legend as Textual markup, each item in its colour: who proposed an accepted token
    (a draft model, each of the model's own drafters, lookup, lookahead), then rejected drafts and corrections."""
    accepted = ", ".join(f"[{TRUECOLOR.source_style(source)}]{legend_name(source, words)}[/]"
                         for source, words, _ in LEGEND_SOURCES)
    return (f"accepted from {accepted}; [{TRUECOLOR.rejected}]rejected[/]; "
            f"[{TRUECOLOR.correction}]the target's correction[/]; the target's own tokens plain")


def turn_label(strategy: str, options: StrategyOptions, params: GenParams) -> str:
    """What runs the next turn: the strategy's label (as bench prints it) and the sampling."""
    sampling = "greedy" if params.greedy else f"temp {params.temperature:g} top-p {params.top_p:g}"
    return f"{strategy_label(strategy, options)} · {sampling}"


class StatsBar(Static):
    def __init__(self) -> None:
        super().__init__("", id="stats")
        self.label = ""
        self.state = "no model"
        self.live: LiveStats | None = None
        self.baseline: float | None = None  # plain decoding tok/s, measured in this session

    def show(self, *, label: str | None = None, state: str | None = None, live: LiveStats | None = None,
             baseline: float | None = None) -> None:
        if label is not None:
            self.label = label
        if state is not None:
            self.state = state
        if live is not None:
            self.live = live
        if baseline is not None:
            self.baseline = baseline
        # The bar's height is fixed (two lines, in the app's CSS), so an update need not lay the screen out again:
        # a layout pass reflows the whole transcript, and the bar updates four times a second while streaming.
        self.update(self.render_text(), layout=False)

    def clear_figures(self, state: str) -> None:
        """Another conversation: the last answer's figures are not its own."""
        self.live = None
        self.show(state=state)

    def render_text(self) -> Text:
        """Two lines: what runs and what it is doing; then the figures of the last or current turn."""
        text = Text()
        text.append(self.label, style="bold")
        text.append(f"  ·  {self.state}")
        live = self.live
        if live is not None and live.why:
            text.append(f"  ·  {live.strategy}: {live.why}", style="italic")
        text.append("\n")
        if live is not None:
            acc = "—" if live.acceptance_rate is None else f"{100 * live.acceptance_rate:.0f}%"
            text.append(f"accepted {acc}  │  {live.tokens_per_forward:.2f} tokens/forward  │  "
                        f"{live.tokens_per_second:.1f} tok/s")
            # An answer of a few tokens pays steps whatever decodes it (the first after the prompt, the one that
            # samples the end) over few tokens: a 7-token answer read 0.73x against long answers' plain steps, most
            # of it those two steps. Its ratio says little of speculation, so none is shown.
            if self.baseline and live.generated >= PlainBaseline.MIN_TOKENS:
                speedup = live.tokens_per_second / self.baseline
                text.append("  │  ")
                text.append(f"{speedup:.2f}×", style="bold green" if speedup >= 1 else "bold red")
                text.append(f" vs plain decoding ({self.baseline:.1f} tok/s here)")
            shares = live.shares()
            if shares:
                text.append("  │  ")
                text.append_text(share_text(shares))
        elif self.baseline:
            text.append(f"plain decoding here: {self.baseline:.1f} tok/s")
        return text
