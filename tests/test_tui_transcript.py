"""The chat app's transcript: streamed markdown, the pacer that batches tokens for the UI thread, and the
speculation view's frozen chunks (app.tui.streaming, app.tui.transcript), on Textual widgets."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from textual.app import App
from textual.geometry import Region
from textual.widgets import Markdown, Static

from app.tui.messages import PromptDecoded, TokensArrived, TurnFinished
from app.tui.streaming import LiveStats, Pacer, PlainBaseline, stream_events
from app.tui.transcript import AnswerView, ColouredText, Transcript
from backends.events import ACCEPTED, REJECTED, TARGET, Done, GenStats, Prefilled, StepEnd, Token
from tui_helpers import char_styles, wait_for

# Markdown whose blocks change type as text streams in: a heading, a list that grows, a fence
# split mid-line, a table, emphasis opened in one batch and closed in the next.
STREAMED_MARKDOWN = (
    "# Colours\n\nThe *primary* colours are:\n\n- red\n- green\n- blue\n\n"
    "```python\nprint('hi')\nx = 1\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
    "A **bold** end.\n1. one\n2. two\n"
)


def markdown_blocks(markdown: Markdown) -> list[tuple[str, str]]:
    """The widget tree a Markdown widget built: block types and their text, in order.

    Table cells are compared by their text only: Textual builds the cells of rows that arrive
    by appending as plain `Static`s, of rows parsed at once as a `Static` subclass.
    """
    def described(widget) -> tuple[str, str]:
        if isinstance(widget, Static) and widget.has_class("cell"):
            return "cell", str(widget.content)
        return type(widget).__name__, widget._content.plain if hasattr(widget, "_content") else ""

    return [described(b) for b in markdown.walk_children()]


@pytest.mark.parametrize("batch", [1, 3, 7])
def test_streamed_markdown_equals_the_whole_document(batch) -> None:
    """Fed in batches (rejected drafts among them, as speculation streams them), the view is the
    same widget tree as the whole answer rendered at once; toggling views keeps it."""
    pieces = [STREAMED_MARKDOWN[i:i + 5] for i in range(0, len(STREAMED_MARKDOWN), 5)]
    tokens = []
    for i, piece in enumerate(pieces):
        if i % 4 == 1:
            tokens.append(Token(0, "## no", REJECTED, source="draft"))
        tokens.append(Token(i, piece, ACCEPTED if i % 2 else TARGET, source="draft" if i % 2 else "target"))

    class Harness(App):
        def compose(self):
            yield AnswerView(speculation_view=False)
            yield Markdown(STREAMED_MARKDOWN.removesuffix("\n"), id="whole")

    async def scenario() -> None:
        app = Harness()
        async with app.run_test(size=(100, 60)) as pilot:
            answer = app.query_one(AnswerView)
            for i in range(0, len(tokens), batch):
                answer.add_tokens(tokens[i:i + batch])
                if i % (3 * batch) == 0:
                    answer.set_view(True)  # the user looks at the colours for a while
                    await pilot.pause()
                    answer.set_view(False)
                await pilot.pause()
            answer.finish("\n")
            await wait_for(pilot, lambda: answer.markdown.source == STREAMED_MARKDOWN + "\n", "the last append")
            await pilot.pause()
            assert answer.output_text == STREAMED_MARKDOWN + "\n"
            expected = markdown_blocks(app.query_one("#whole", Markdown))
            assert len(expected) > 10
            assert markdown_blocks(answer.markdown) == expected

    asyncio.run(scenario())


def test_the_stream_posts_at_the_interval_it_is_given_and_the_end_at_once() -> None:
    """Tokens reach the UI in batches at least `interval()` seconds apart, always at a step boundary; the
    interval is asked for at every step (the pacer lengthens it mid-answer as batches get dearer to show);
    the tokens left at the end come with the `Done`."""
    now = [0.0]
    interval = [0.25]
    events: list = [Prefilled(n_tokens=3, n_cached=0, seconds=0.0)]
    for step in range(40):  # a step every 0.1 s, two tokens each
        events += [Token(2 * step, "a", ACCEPTED, source="draft"), Token(2 * step + 1, "b", TARGET),
                   StepEnd(drafted=1, accepted=1, seconds=0.1)]
    done = Done(reason="length", tokens=(), text="ab" * 40, stats=GenStats("sps", prompt_tokens=3, prompt_cached=0, prompt_seconds=0.0,
                                                generated_tokens=80, decode_seconds=4.0, target_forwards=40,
                                                drafted=40, accepted=40))
    posted: list[tuple[float, object]] = []

    def timed():
        for ev in events:
            if isinstance(ev, StepEnd):
                now[0] += 0.1
                if now[0] > 1.95:
                    interval[0] = 1.0  # showing a batch got dearer
            yield ev
        yield done

    assert stream_events("sps", timed(), lambda m: posted.append((now[0], m)), lambda: interval[0],
                         clock=lambda: now[0]) is done
    batches = [(t, m) for t, m in posted if isinstance(m, TokensArrived)]
    times = [t for t, _ in batches]
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:])]
    assert isinstance(posted[0][1], PromptDecoded) and isinstance(posted[-1][1], TurnFinished)
    early = [g for t, g in zip(times[1:], gaps) if t <= 1.95]
    late = [g for t, g in zip(times[1:], gaps) if t > 2.05]
    assert early and all(0.25 <= g <= 0.3 + 1e-9 for g in early), gaps
    assert late and all(1.0 <= g <= 1.1 + 1e-9 for g in late[:-1]), gaps
    streamed = [tok for _, m in batches for tok in m.tokens]
    assert streamed == [ev for ev in events if isinstance(ev, Token)]  # every token once, in order
    assert batches[-1][1].live.generated == 80


def test_the_pacer_spaces_batches_by_what_the_ui_thread_spent_on_the_last_one() -> None:
    """At 2% of a core: a batch that cost 5 ms keeps the shortest interval, 40 ms asks for 2 s, a second
    for the longest; each answer starts at the shortest. It times the UI thread's own CPU, not the
    generation's: a busy other thread does not lengthen the interval, the same work in this thread does."""
    cpu = [10.0]
    pacer = Pacer(budget=0.02, lo=0.25, hi=3.0, cpu_clock=lambda: cpu[0])
    pacer.started()
    seen = []
    for cost in (0.005, 0.04, 1.0, 0.01):
        cpu[0] += cost
        pacer.arrived()
        seen.append(pacer())
    assert seen == pytest.approx([0.25, 2.0, 3.0, 0.5])
    pacer.started()
    assert pacer() == 0.25
    with pytest.raises(ValueError):
        Pacer(budget=0)

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    real = Pacer(budget=0.02, lo=0.25, hi=3.0)
    real.started()
    other = threading.Thread(target=burn, args=(0.2,))
    other.start()
    other.join()
    real.arrived()
    assert real() == 0.25
    burn(0.05)
    real.arrived()
    assert real() >= 2.5


def shown_lines(*widgets) -> list[str]:
    """The lines the widgets render, in order."""
    return [strip.text.rstrip() for w in widgets for strip in w.render_lines(Region(0, 0, *w.size))]


def test_a_long_speculation_view_answer_is_shown_in_frozen_chunks_that_wrap_as_one_text() -> None:
    """A long answer streamed into the speculation view, paragraphs and then one paragraph of 4,000
    characters: its lines but the last move into Statics that never change again, so an update re-wraps
    only the live part. What is shown is every token in its colour, in the same lines as the whole text in
    one Static, also after the terminal is resized."""
    words = [f"w{i}" + "x" * (i % 7) for i in range(1400)]
    pieces = [w + ("\n\n" if i % 37 == 36 and i < 500 else "\n" if i % 11 == 10 and i < 500 else " ")
              for i, w in enumerate(words)]

    class Harness(App):
        def compose(self):
            yield AnswerView(speculation_view=True)
            yield Static(id="whole", markup=False)

    async def scenario() -> None:
        app = Harness()
        async with app.run_test(size=(90, 40)) as pilot:
            answer = app.query_one(AnswerView)
            whole = app.query_one("#whole", Static)
            for i in range(0, len(pieces), 6):
                answer.add_tokens([Token(i + k, p, ACCEPTED if k % 2 else TARGET, source="draft" if k % 2
                                         else "target") for k, p in enumerate(pieces[i:i + 6])])
                if i % 30 == 0:
                    await pilot.pause()
            answer.add_tokens([Token(0, "no", REJECTED, source="draft")])
            answer.finish("")
            for width in (90, 61):
                await pilot.resize_terminal(width, 40)
                await pilot.pause()
                whole.update(answer.coloured)
                await pilot.pause()
                chunks = list(answer.spec.query(Static))
                assert len(chunks) >= (4 if width == 90 else 2), "the text was cut into chunks"
                if width == 90:  # cut as it streamed (what came before the first layout went in one piece)
                    assert max(len(c.content) for c in chunks[1:]) <= 2 * ColouredText.CHUNK
                # the same text in the same colours, rejected drafts too
                assert char_styles(*answer.spec.pieces) == char_styles(answer.coloured)
                lines = shown_lines(*chunks)
                assert len(lines) > 60 and lines == shown_lines(whole), width

    asyncio.run(scenario())


def test_saved_answer_reopens_in_either_view() -> None:
    """A reopened conversation: `finish` alone, before the view is even mounted, shows the saved text."""
    class Harness(App):
        def compose(self):
            yield from ()

    async def scenario() -> None:
        app = Harness()
        async with app.run_test(size=(100, 40)) as pilot:
            answer = AnswerView(speculation_view=False)
            app.mount(answer)
            answer.finish(STREAMED_MARKDOWN)
            await wait_for(pilot, lambda: answer.markdown.source == STREAMED_MARKDOWN, "the saved answer")
            await pilot.pause()
            assert any(type(b).__name__ == "MarkdownFence" for b in answer.markdown.walk_children())
            answer.set_view(True)
            assert answer.spec.display and answer.spec.text.plain == STREAMED_MARKDOWN
            answer.set_view(False)
            await pilot.pause()
            assert answer.markdown.source == STREAMED_MARKDOWN  # not appended twice

    asyncio.run(scenario())


def test_transcript_follows_a_growing_markdown_answer_unless_scrolled_up() -> None:
    """Markdown grows after the batch that caused it (when the stream's append runs): the
    transcript still keeps its end in view, and leaves the reader alone once they scroll up."""
    lines = [Token(i, f"Paragraph {i}.\n\n", TARGET) for i in range(40)]

    class Harness(App):
        def compose(self):
            yield Transcript()

    async def scenario() -> None:
        app = Harness()
        async with app.run_test(size=(60, 12)) as pilot:
            transcript = app.query_one(Transcript)
            answer = transcript.add(AnswerView(speculation_view=False))
            for i in range(0, 20, 4):
                answer.add_tokens(lines[i:i + 4])
                await pilot.pause()
            await wait_for(pilot, lambda: transcript.max_scroll_y > 10 and transcript.scroll_y == transcript.max_scroll_y,
                           "the transcript to follow the answer", 10)
            transcript.scroll_home(animate=False)
            await pilot.pause()
            answer.add_tokens(lines[20:])
            answer.finish("")
            await wait_for(pilot, lambda: answer.markdown.source == answer.output_text, "the last append")
            await pilot.pause(0.2)
            assert transcript.scroll_y == 0 < transcript.max_scroll_y

    asyncio.run(scenario())


def test_the_stream_times_each_answers_plain_steps() -> None:
    """The plain steps' tokens and seconds, each from the step before (the first from the prompt's end): plain
    decoding's rate under the answer's own conditions, for the bar's speedup."""
    now = [0.0]
    steps = [("plain", 0, 1, 0.05), ("plain", 0, 1, 0.02), ("lookup", 3, 4, 0.03), ("plain", 0, 1, 0.025),
             ("plain", 0, 0, 0.02)]  # (choice, drafted, tokens, seconds): the last one's token ended the answer

    def timed():
        yield Prefilled(n_tokens=3, n_cached=0, seconds=0.0)
        for choice, drafted, tokens, seconds in steps:
            for i in range(tokens):
                yield Token(i, "a", TARGET)
            now[0] += seconds
            yield StepEnd(drafted=drafted, accepted=max(0, tokens - 1) if drafted else 0, seconds=seconds,
                          choice=choice)
        yield Done(reason="eos", tokens=(), text="", stats=GenStats(
            "auto", prompt_tokens=3, prompt_cached=0, prompt_seconds=0.0, generated_tokens=7, decode_seconds=now[0],
            target_forwards=5, drafted=3, accepted=3))

    posted: list[object] = []
    stream_events("auto", timed(), posted.append, lambda: 10.0, clock=lambda: now[0])
    finished = posted[-1]
    assert isinstance(finished, TurnFinished)
    assert finished.live.plain_tokens == 3 and finished.live.plain_seconds == pytest.approx(0.115)
    assert finished.live.generated == 7 and finished.live.strategy == "auto"


def test_a_plainly_decoded_answer_is_its_own_baseline_when_its_last_events_come_late() -> None:
    """The engine hands a step's events on only after what it does before its next request: after an answer's
    last step, on a new machine, `auto` measures the device (seconds). The plain steps are timed by the engine
    (StepEnd.seconds), so that wait is not plain decoding's: timed by this thread's clock, a first answer decoded
    plainly throughout read 1.47x against its own plain steps in the chat app."""
    now = [0.0]

    def late():
        yield Prefilled(n_tokens=3, n_cached=0, seconds=0.0)
        for i in range(40):
            yield Token(i, "a", TARGET)
            now[0] += 0.03 + (3.0 if i == 39 else 0.0)  # the device measured before the last step's events
            yield StepEnd(drafted=0, accepted=0, seconds=0.03, choice="plain")
        yield Done(reason="length", tokens=(), text="", stats=GenStats(
            "auto", prompt_tokens=3, prompt_cached=0, prompt_seconds=0.0, generated_tokens=40, decode_seconds=1.2,
            target_forwards=40, drafted=0, accepted=0))

    posted: list[object] = []
    stream_events("auto", late(), posted.append, lambda: 10.0, clock=lambda: now[0])
    finished = posted[-1]
    assert isinstance(finished, TurnFinished)
    baseline = PlainBaseline()
    baseline.turn(finished.live)
    assert baseline.value == pytest.approx(40 / 1.2)
    assert finished.live.tokens_per_second / baseline.value == pytest.approx(1.0)


def _live(strategy: str, generated: int, seconds: float, plain_tokens: int = 0, plain_seconds: float = 0.0):
    return LiveStats(strategy, generated, 0, 0, generated, seconds, plain_tokens=plain_tokens,
                     plain_seconds=plain_seconds)


def test_the_plain_baseline_prefers_ar_turns_then_the_answers_plain_steps_then_the_calibration() -> None:
    b = PlainBaseline()
    assert b.value is None
    b.calibrated(50.0)
    assert b.value == 50.0, "the run after the load, until the turns say more"
    b.turn(_live("auto", 20, 0.5, plain_tokens=20, plain_seconds=0.45))
    assert b.value == 50.0, f"fewer than {PlainBaseline.MIN_TOKENS} plain tokens: not yet"
    b.turn(_live("auto", 40, 0.9, plain_tokens=20, plain_seconds=0.45))
    assert b.value == pytest.approx(40 / 0.9), "the answers' plain steps, under the answers' conditions"
    b.turn(_live("ar", 30, 1.0))
    b.turn(_live("ar", 30, 0.6))
    b.turn(_live("ar", 4, 0.01))  # too short to say anything
    assert b.value == pytest.approx(40.0), "the median of the user's own ar turns"
    b.reset()
    assert b.value is None, "a new model starts over"


def test_an_answer_with_plain_steps_enough_of_its_own_is_judged_against_them() -> None:
    """A step grows with the context: a late turn held back to plain steps ran 36-40 ms a step where the first ran
    29-31, and against the turns before it read 0.94x, as if slower than itself. Its own plain steps ran at its
    context length; under MIN_TOKENS of them, the session's baseline stands."""
    b = PlainBaseline()
    b.turn(_live("ar", 60, 2.0))  # 30 tok/s, early in the conversation
    late = _live("auto", 100, 4.0, plain_tokens=100, plain_seconds=3.9)
    assert b.for_answer(late) == pytest.approx(100 / 3.9)
    assert late.tokens_per_second / b.for_answer(late) == pytest.approx(0.975)
    few = _live("auto", 100, 2.5, plain_tokens=PlainBaseline.MIN_TOKENS - 1, plain_seconds=1.2)
    assert b.for_answer(few) == b.value == pytest.approx(30.0)


def test_the_answers_last_tokens_are_posted_at_its_last_step_not_at_done() -> None:
    """Between an answer's last step and its Done, `auto` may measure a new machine (seconds): the tokens held back
    for the next batch are posted at the step that ended the answer (StepEnd.last), not when Done comes."""
    now = [0.0]
    posted: list[tuple[float, object]] = []

    def stream():
        yield Prefilled(n_tokens=3, n_cached=0, seconds=0.0)
        for i in range(3):
            yield Token(i, "a", TARGET)
            now[0] += 0.03
            yield StepEnd(drafted=0, accepted=0, seconds=0.03, choice="plain", last=i == 2)
        now[0] += 2.0  # the measurement
        yield Done(reason="length", tokens=(), text="", stats=GenStats(
            "auto", prompt_tokens=3, prompt_cached=0, prompt_seconds=0.0, generated_tokens=3, decode_seconds=0.09,
            target_forwards=3, drafted=0, accepted=0))

    stream_events("auto", stream(), lambda m: posted.append((now[0], m)), lambda: 10.0, clock=lambda: now[0])
    arrived = [(t, m) for t, m in posted if isinstance(m, TokensArrived)]
    assert len(arrived) == 1 and arrived[0][0] == pytest.approx(0.09) and len(arrived[0][1].tokens) == 3
    assert isinstance(posted[-1][1], TurnFinished) and posted[-1][0] == pytest.approx(2.09)
