"""The chat app driven with Textual's Pilot on real tiny GGUFs (real llama.cpp underneath)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from textual.app import App
from textual.geometry import Region
from textual.widgets import Markdown, Static

from app.cli import main
from app.render import TRUECOLOR
from app.settings import Settings, load_settings
from app.tui.messages import PromptDecoded, TokensArrived, TurnFinished
from app.tui.streaming import Pacer, stream_events
from app.tui.transcript import AnswerView, ColouredText, Transcript, UserMessage
from backends.engine import Engine, EngineConfig
from backends.events import ACCEPTED, REJECTED, TARGET, Done, GenStats, Prefilled, StepEnd, Token
from backends.sampling import GenParams
from engine_helpers import run_to_done
from tui_helpers import app_for, errors, send, tiny_settings, wait_for, wait_loaded

PROMPT = "Once upon a time"


def cli_text(capsys: pytest.CaptureFixture[str], prompt: str, target: Path, draft: Path, *flags: str) -> str:
    assert main(["run", prompt, "-m", str(target), "-md", str(draft), "-t", "1", "--no-color", "--temp", "0",
                 *flags]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def greedy_continuation(target: Path, tokens: list[int], n: int) -> str:
    engine = Engine(EngineConfig(target=target, n_ctx=4096, threads=1))
    try:
        return run_to_done(engine, "ar", tokens, GenParams(max_tokens=n)).text
    finally:
        engine.close()


def test_answer_equals_specchat_run(tiny, tmp_path, capsys) -> None:
    expected = cli_text(capsys, PROMPT, tiny.target, tiny.draft, "-s", "sps", "-n", "40")

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "sps", 40), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await pilot.click("#prompt")
            await pilot.press(*[("space" if c == " " else c) for c in PROMPT])
            typed = app.chat.query_one("#prompt")
            await wait_for(pilot, lambda: typed.value == PROMPT, f"the typed prompt (got {typed.value!r})", 10)
            await pilot.press("enter")
            await wait_for(pilot, lambda: app.chat.last_done is not None and not app.chat.generating, "the answer")
            await pilot.pause()
            last = list(app.chat.transcript.children)[-1]
            assert isinstance(last, AnswerView)
            assert last.output_text == expected
            assert app.chat.last_done.stats.accepted > 0, "the tiny pair must exercise acceptance"
            assert [u.render().plain for u in app.chat.query(UserMessage)] == [PROMPT]

    asyncio.run(scenario())


def test_strategy_switch_keeps_conversation_and_cache(tiny, tmp_path, capsys) -> None:
    first = cli_text(capsys, PROMPT, tiny.target, tiny.draft, "-s", "sps", "-n", "24")
    second_message = "and then"

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "sps", 24), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await send(pilot, PROMPT)
            chat = app.chat
            turn1 = chat.last_done
            await pilot.press("f2")  # sps -> lookahead
            assert chat.settings.strategy == "lookahead"
            document = chat.session.prompt_tokens(second_message)
            await send(pilot, second_message)
            turn2 = chat.last_done
            assert turn2.stats.strategy == "lookahead"
            answers = [a.output_text for a in chat.transcript.answers()]
            assert answers[0] == first
            assert answers[1] == greedy_continuation(tiny.target, document, 24)
            assert [m.role for m in chat.session.messages] == ["user", "assistant"] * 2
            # The cache kept everything turn 1 left that the new prompt starts with (all of
            # turn 1 but its last token, never decoded by the convention of backends/run.py,
            # where retokenizing the transcript gives the same tokens; the tiny model's random
            # bytes do not always survive retokenization, real text does: see test_chat_session).
            turn1_tokens = chat.session.engine.tokenize(PROMPT) + list(turn1.tokens)
            common = next((i for i, (a, b) in enumerate(zip(turn1_tokens, document)) if a != b), len(turn1_tokens))
            assert turn2.stats.prompt_tokens == len(document)
            assert turn2.stats.prompt_cached == min(common, len(turn1_tokens) - 1) > 0

    asyncio.run(scenario())


def test_all_llama_cpp_work_of_the_app_runs_on_one_thread(tiny, tmp_path, monkeypatch) -> None:
    """Loading, the calibration and every turn, on one thread for the app's life: llama.cpp's OpenMP gives each
    thread that decodes a team of threads that lives as long as it does, and with more of them alive than
    cores its threads sleep between operations (SmolLM2 in the app ran at 0.65x `specchat run` with a new
    worker thread per turn)."""
    from backends.llama import LlamaContext, LlamaModel

    threads: dict[str, set[int]] = {"load": set(), "decode": set()}
    load, decode = LlamaModel.__init__, LlamaContext.decode

    def spy_load(self, *args, **kwargs) -> None:
        threads["load"].add(threading.get_ident())
        load(self, *args, **kwargs)

    def spy_decode(self, batch) -> None:
        threads["decode"].add(threading.get_ident())
        decode(self, batch)

    monkeypatch.setattr(LlamaModel, "__init__", spy_load)
    monkeypatch.setattr(LlamaContext, "decode", spy_decode)

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "sps", 12), tmp_path, calibrate=True)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            for text in (PROMPT, "and then", "and later"):
                await send(pilot, text)
            await pilot.press("f2")  # another strategy: still the same thread
            await send(pilot, "at last")
            assert len(app.chat.session.messages) == 8

    asyncio.run(scenario())
    assert len(threads["load"] | threads["decode"]) == 1, threads
    assert threading.get_ident() not in threads["decode"], "never the UI's thread"


def test_escape_cancels_and_the_next_turn_works(tiny, tmp_path) -> None:
    async def scenario() -> None:
        # ignore_eos: the tiny target's greedy answer ends (eos) after about 3,900 tokens, which a slow machine
        # can generate before the Escape is handled; the cancellation must be what ends this turn.
        settings = tiny_settings(tiny.target, tiny.draft, "ar", 30000, n_ctx=32768)
        app = app_for(replace(settings, params=GenParams(max_tokens=30000, ignore_eos=True)), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            chat.query_one("#prompt").value = PROMPT
            await pilot.press("enter")
            await wait_for(pilot, lambda: bool(chat.transcript.answers()[0].tokens), "the first tokens")
            await pilot.press("escape")
            await wait_for(pilot, lambda: not chat.generating, "the cancellation")
            assert chat.last_done.reason == "cancelled"
            partial = chat.transcript.answers()[0].output_text
            assert 0 < chat.last_done.stats.generated_tokens < 30000
            assert chat.session.messages[-1].content == partial  # the partial answer is kept
            # The next prompt holds the partial answer, whose length depends on timing: no eos here either.
            chat.settings = replace(chat.settings, params=GenParams(max_tokens=10, ignore_eos=True))
            await send(pilot, "again")
            assert chat.last_done.reason == "length"
            assert chat.last_done.stats.generated_tokens == 10
            assert len(chat.session.messages) == 4

    asyncio.run(scenario())


@pytest.mark.parametrize("problem", ["missing", "malformed", "incompatible"])
def test_bad_model_shows_an_error_and_the_app_keeps_running(tiny, tmp_path, problem) -> None:
    bad = {"missing": tmp_path / "nope.gguf", "malformed": tmp_path / "junk.gguf", "incompatible": tiny.target}[problem]
    draft = tiny.other_vocab if problem == "incompatible" else None
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    expected = {"missing": "no such file", "malformed": "junk.gguf", "incompatible": "cannot speculate"}[problem]

    async def scenario() -> None:
        app = app_for(tiny_settings(bad, draft, "ar", 8), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            assert chat.session is None
            assert any(expected in e for e in errors(chat)), errors(chat)
            # Still usable: fix the model in the settings panel, then chat.
            await pilot.press("f4")
            target_input = app.screen.query_one("#f-target")
            target_input.value = str(tiny.target)
            app.screen.query_one("#f-draft").value = str(tiny.draft)
            await pilot.press("ctrl+s")
            await wait_for(pilot, lambda: chat.session is not None, "the fixed model")
            await send(pilot, PROMPT)
            assert chat.last_done.reason == "length"

    asyncio.run(scenario())


def test_prompt_too_long_is_an_error_in_the_app(tiny, tmp_path) -> None:
    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "sps", 8, n_ctx=64), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await send(pilot, "word " * 200)
            assert any("context" in e for e in errors(app.chat))
            assert app.chat.session.messages == []
            await send(pilot, "short")
            assert app.chat.last_done.reason == "length"

    asyncio.run(scenario())


def test_speculation_view_toggles_colours_and_markdown(tiny, tmp_path) -> None:
    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.small_target, tiny.small_draft, "sps", 48), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await send(pilot, "a b")
            answer = app.chat.transcript.answers()[0]
            assert answer.spec.display and not answer.markdown.display
            assert char_styles(*answer.spec.pieces) == char_styles(answer.coloured)  # every token, rejected drafts too
            styles = {str(span.style) for span in answer.coloured.spans}
            palette = TRUECOLOR
            assert {palette.accepted, palette.rejected, palette.correction} <= styles, styles
            rejected = [t for t in answer.tokens if t.kind == REJECTED]
            assert rejected and all(t.text not in ("", None) for t in rejected)
            assert answer.markdown.source == ""  # the hidden view is not fed while streaming
            await pilot.press("f3")
            assert app.chat.settings.speculation_view is False
            assert answer.markdown.display and not answer.spec.display
            await wait_for(pilot, lambda: answer.markdown.source == answer.output_text, "the Markdown view")
            assert load_settings(tmp_path / "config" / "settings.json")[0].speculation_view is False
            await send(pilot, "c d")  # streamed straight into the Markdown view
            second = app.chat.transcript.answers()[1]
            await wait_for(pilot, lambda: second.markdown.source == second.output_text, "the streamed Markdown")
            assert second.markdown.display and second.output_text
            await pilot.press("f3")
            assert second.spec.display and char_styles(*second.spec.pieces) == char_styles(second.coloured)

    asyncio.run(scenario())


def test_settings_and_conversations_persist_and_reopen(tiny, tmp_path) -> None:
    async def first_session() -> list[str]:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "sps", 12), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await send(pilot, PROMPT)
            await pilot.press("f2", "f2")  # sps -> lookahead -> lookup
            return [a.output_text for a in app.chat.transcript.answers()]

    answers = asyncio.run(first_session())
    settings, warning = load_settings(tmp_path / "config" / "settings.json")
    assert warning is None and settings.strategy == "lookup"
    saved = list((tmp_path / "conversations").glob("*.json"))
    assert len(saved) == 1
    assert json.loads(saved[0].read_text())["messages"][1]["content"] == answers[0]

    async def second_session() -> None:
        app = app_for(settings, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await pilot.press("f5")
            await pilot.press("enter")
            chat = app.chat
            await wait_for(pilot, lambda: bool(chat.transcript.answers()), "the reopened chat")
            assert [a.output_text for a in chat.transcript.answers()] == answers
            assert [m.content for m in chat.session.messages] == [PROMPT, answers[0]]
            await send(pilot, "more")  # continues the reopened conversation
            assert chat.last_done.stats.strategy == "lookup"
            assert len(chat.session.messages) == 4

    asyncio.run(second_session())


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


def char_styles(*texts) -> list[tuple[str, str]]:
    """Each visible character of rich Texts with the styles on it (a space's or a newline's shows nowhere)."""
    out = []
    for text in texts:
        styles: list[list[str]] = [[] for _ in text.plain]
        for span in text.spans:
            for i in range(span.start, span.end):
                styles[i].append(str(span.style))
        out += [(ch, "+".join(st)) for ch, st in zip(text.plain, styles) if not ch.isspace()]
    return out


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


@pytest.mark.demo
def test_first_start_offers_the_chat_pair_and_it_answers(instruct_pair, tmp_path) -> None:
    """No model configured: the welcome screen's first button loads the SmolLM2 pair, whose template is applied."""
    from app.tui.welcome_screen import WelcomeScreen

    async def scenario() -> None:
        app = app_for(Settings(), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_for(pilot, lambda: isinstance(app.screen, WelcomeScreen), "the welcome screen")
            buttons = [b.id for b in app.screen.query("Button")]
            assert buttons[0] == "chat", buttons
            await pilot.click("#chat")
            await wait_for(pilot, lambda: app.chat.settings.target == "smollm2", "the chat pair chosen")
            assert app.chat.settings.draft == "smollm2-draft"
            await wait_loaded(pilot)
            assert app.chat.session is not None and not app.chat.session.plain, "the chat template is used"
            app.chat.settings = replace(app.chat.settings, params=GenParams(max_tokens=32))
            await send(pilot, "What is the capital of France?")
            done = app.chat.last_done
            assert done.reason in ("eos", "length") and "Paris" in done.text

    asyncio.run(scenario())
