"""The speculation view's colours by source (app.render's palettes) and their legend, without a model.

Each of the model's own drafters (MTP head `mtp`, EAGLE-3 `eagle3`, DFlash
`dflash`) has a colour of its own, apart from a draft model's and from the
rejected, correction, lookup and lookahead colours, that reads on Textual's
dark and light themes; the CLI's legend names each, and in the chat app the
stats bar names every source of the turn in its colour, and F3 shows the
legend when it turns the view on (Pilot).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from typing import get_args

import pytest
from rich.text import Text
from textual.app import App
from textual.content import Content
from textual.theme import BUILTIN_THEMES

from app.render import ANSI, LEGEND, TRUECOLOR, token_style
from app.tui.stats_bar import StatsBar, legend_markup, share_text
from app.tui.streaming import LiveStats, PlainBaseline
from app.tui.transcript import AnswerView
from backends.events import ACCEPTED, REJECTED, TARGET, Source, Token
from tui_helpers import app_for, char_styles, tiny_settings, wait_loaded

DRAFTERS = ("mtp", "eagle3", "dflash")  # the model's own drafters, as Token.source names them
OTHERS = ("accepted", "rejected", "correction", "lookup", "lookahead")  # the palette's other colours


def _colour(style: str) -> str:
    return style.split()[0]  # "#f85149 strike" -> "#f85149"


def _linear(hex_colour: str) -> list[float]:
    channels = [int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    return [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]


def _luminance(hex_colour: str) -> float:
    r, g, b = _linear(hex_colour)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _contrast(a: str, b: str) -> float:
    """WCAG 2 contrast ratio."""
    hi, lo = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (hi + 0.05) / (lo + 0.05)


def _lab(hex_colour: str) -> tuple[float, float, float]:
    """CIE L*a*b* (D65) of an sRGB colour."""
    r, g, b = _linear(hex_colour)
    x, y, z = ((0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b,
               (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883)
    fx, fy, fz = (t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z))
    return 116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)


def _themes() -> list[tuple[str, bool, str]]:
    """(name, dark, background) of Textual's built-in themes with fixed colours (not the terminal's own)."""
    return [(name, theme.dark, str(theme.to_color_system().generate()["background"]))
            for name, theme in BUILTIN_THEMES.items() if not name.startswith("ansi")]


def test_every_drafter_has_its_own_colour_apart_from_the_others() -> None:
    for palette in (TRUECOLOR, ANSI):
        styles = {s: palette.accepted_from(s) for s in DRAFTERS}
        assert len(set(styles.values())) == 3, styles
        others = {getattr(palette, f) for f in OTHERS}
        assert not set(styles.values()) & others, (styles, others)
        assert palette.source_style("target") == "" and palette.source_style("draft") == palette.accepted
    # Every source a token may carry has a colour but the target's own; the grammar's forced tokens and the
    # speculation memory's draw as a draft model's.
    assert [s for s in get_args(Source) if not TRUECOLOR.source_style(s)] == ["target"]
    assert TRUECOLOR.source_style("grammar") == TRUECOLOR.source_style("memory") == TRUECOLOR.accepted


def test_the_chat_apps_drafter_colours_are_far_from_every_other_colour() -> None:
    """At least 25 CIE76 units apart from each other and from the accepted, rejected, correction, lookup and
    lookahead colours (the palette's other colours are 51 or more apart among themselves)."""
    colours = {s: _colour(TRUECOLOR.accepted_from(s)) for s in DRAFTERS}
    colours |= {f: _colour(getattr(TRUECOLOR, f)) for f in OTHERS}
    for a, b in itertools.combinations(colours, 2):
        if a in DRAFTERS or b in DRAFTERS:
            assert math.dist(_lab(colours[a]), _lab(colours[b])) >= 25, (a, b)


@pytest.mark.parametrize(("name", "dark", "background"), _themes())
def test_the_drafter_colours_read_on_dark_and_light_themes(name: str, dark: bool, background: str) -> None:
    """Contrast 3 or more on a dark theme's background, 2.5 or more on a light one's, where a draft model's green
    (tuned for dark backgrounds) reads less well than they do."""
    for source in DRAFTERS:
        ratio = _contrast(_colour(TRUECOLOR.accepted_from(source)), background)
        assert ratio >= (3.0 if dark else 2.5), (name, source, round(ratio, 2))
        if not dark:
            assert ratio > _contrast(TRUECOLOR.accepted, background), (name, source)


def test_the_cli_legend_names_each_drafter_and_its_colour() -> None:
    assert "the draft model (draft) = green" in LEGEND
    for words in ("the model's MTP head (mtp) = magenta", "an EAGLE-3 draft (eagle3) = pink",
                  "a DFlash draft (dflash) = orange", "prompt lookup (lookup) = cyan", "lookahead = yellow"):
        assert words in LEGEND, words
    legend = Content.from_markup(legend_markup())  # the chat app's, each name in its own colour
    named = {legend.plain[span.start:span.end]: str(span.style) for span in legend.spans}
    assert named["the model's MTP head (mtp)"] == TRUECOLOR.mtp
    assert named["an EAGLE-3 draft (eagle3)"] == TRUECOLOR.eagle3
    assert named["a DFlash draft (dflash)"] == TRUECOLOR.dflash
    assert named["the draft model (draft)"] == TRUECOLOR.accepted and named["rejected"] == TRUECOLOR.rejected


def _spans(text: Text) -> dict[str, str]:
    return {text.plain[s.start:s.end]: str(s.style) for s in text.spans}


class _BarApp(App):
    """The stats bar alone, for Pilot."""

    def compose(self):
        yield StatsBar()


def test_the_stats_bar_names_each_source_in_its_colour() -> None:
    """Pilot: a turn whose tokens came from every drafter; the bar's share is the legend of the turn."""
    by_source = (("dflash", 1), ("draft", 2), ("eagle3", 3), ("lookup", 1), ("mtp", 4), ("target", 9))

    async def scenario() -> None:
        app = _BarApp()
        async with app.run_test(size=(200, 5)) as pilot:
            bar = app.query_one(StatsBar)
            bar.show(label="sps", state="done", live=LiveStats("sps", 20, 12, 10, 8, 1.0, by_source))
            await pilot.pause()
            line = bar.render_text().split("\n")[-1]
            assert line.plain.endswith("dflash 5% · draft 10% · eagle3 15% · lookup 5% · mtp 20% · target 45%")
            shown = _spans(line)
            for source in ("dflash", "draft", "eagle3", "lookup", "mtp"):
                assert shown[source] == TRUECOLOR.accepted_from(source), source
            assert "target" not in shown  # the target's own tokens keep the default colour
            assert str(bar.content) == str(bar.render_text())

    asyncio.run(scenario())
    assert share_text([]).plain == ""
    assert share_text(LiveStats("auto", 300, 2, 1, 290, 9.0, (("draft", 1), ("lookup", 18), ("target", 281)))
                      .shares()).plain == "draft <1% · lookup 6% · target 94%", "one token of 300 is not none"


def test_the_stats_bar_shows_a_speedup_only_for_answers_long_enough_to_say_one() -> None:
    """Pilot: against a baseline, an answer of a few tokens shows its tokens/s and no ratio (the step after the prompt
    and the one that samples the end weigh on few tokens: a 7-token answer read 0.73x); from PlainBaseline.MIN_TOKENS
    tokens the ratio is shown."""
    async def scenario() -> None:
        app = _BarApp()
        async with app.run_test(size=(200, 5)) as pilot:
            bar = app.query_one(StatsBar)
            short = PlainBaseline.MIN_TOKENS - 1
            bar.show(label="auto", state="done", live=LiveStats("auto", short, 0, 0, short, short / 20.0),
                     baseline=25.0)
            await pilot.pause()
            line = bar.render_text().plain.split("\n")[-1]
            assert "20.0 tok/s" in line and "×" not in line, line
            n = PlainBaseline.MIN_TOKENS
            bar.show(live=LiveStats("auto", n, 0, 0, n, n / 20.0))
            await pilot.pause()
            assert "0.80× vs plain decoding (25.0 tok/s here)" in bar.render_text().plain

    asyncio.run(scenario())


def test_the_speculation_view_colours_each_drafters_tokens() -> None:
    """Pilot: an answer whose tokens came from each drafter, shown in the speculation view (F3's)."""
    tokens = [Token(1, "M", ACCEPTED, source="mtp"), Token(2, "E", ACCEPTED, source="eagle3"),
              Token(3, "D", ACCEPTED, source="dflash"), Token(4, "G", ACCEPTED, source="draft"),
              Token(5, "x", REJECTED, source="dflash"), Token(6, "C", TARGET, correction=True),
              Token(7, "T", TARGET)]

    class Harness(App):
        def compose(self):
            yield AnswerView(speculation_view=True)

    async def scenario() -> None:
        app = Harness()
        async with app.run_test(size=(80, 10)) as pilot:
            answer = app.query_one(AnswerView)
            answer.add_tokens(tokens)
            await pilot.pause()
            assert answer.spec.display
            assert char_styles(*answer.spec.pieces) == [
                ("M", TRUECOLOR.mtp), ("E", TRUECOLOR.eagle3), ("D", TRUECOLOR.dflash), ("G", TRUECOLOR.accepted),
                ("x", TRUECOLOR.rejected), ("C", TRUECOLOR.correction), ("T", "")]
            assert [token_style(t, TRUECOLOR) for t in tokens[:3]] == [TRUECOLOR.mtp, TRUECOLOR.eagle3,
                                                                        TRUECOLOR.dflash]

    asyncio.run(scenario())


def test_f3_shows_the_legend_when_it_turns_the_view_on(tmp_path) -> None:
    """Pilot on the chat app (no model: the legend needs none)."""
    async def scenario() -> None:
        app = app_for(tiny_settings("missing-model.gguf", None, "ar"), tmp_path)
        async with app.run_test(size=(120, 30)) as pilot:
            await wait_loaded(pilot)
            assert app.chat.settings.speculation_view
            await pilot.press("f3")  # off: the Markdown view, no legend
            assert not app.chat.settings.speculation_view
            assert not [n for n in app._notifications if n.title == "speculation view"]
            await pilot.press("f3")
            await pilot.pause()
            (shown,) = [n for n in app._notifications if n.title == "speculation view"]
            assert shown.message == legend_markup()
            for name in ("(mtp)", "(eagle3)", "(dflash)"):
                assert name in Content.from_markup(shown.message).plain

    asyncio.run(scenario())
