"""A thinking model in the chat app, driven with Textual's Pilot on real llama.cpp (issue 43).

The models are SmolLM2-135M-Instruct re-packed with thinking templates (conftest's `thinking_models`):
QwQ's original template opens the <think> block in its generation prompt and cannot turn it off;
Qwen3's lets the model open it and turns it off with enable_thinking. SmolLM2 never closes a block
itself, so the QwQ turns end their thinking with a budget (GenParams.reasoning_budget): the end tag
is forced there and the answer follows, which is when the block folds.
"""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import Input

from app.chat_template import ChatMessage
from app.conversations import Conversation, ConversationStore
from app.render import TRUECOLOR
from app.settings import Settings, load_settings
from app.tui.messages import TokensArrived
from app.tui.streaming import Pacer, stream_events
from app.tui.thinking import ThinkingBlock, answer_tail, answers, thinks
from backends.events import REJECTED, TARGET, Done, GenStats, Prefilled, StepEnd, Token
from tui_helpers import app_for, errors, send, tiny_settings, wait_for, wait_loaded

QUESTION = "What is the capital of France? Explain."
BUDGET = 16
# Qwen3's template, but writing every earlier answer's reasoning back (Qwen3's own does so only for the answers
# after the last user message, in a chain of tool calls), to show in the prompt what the session passes.
KEEPS_REASONING = ("{%- if loop.index0 > ns.last_query_index %}", "{%- if true %}")


def settings_for(model: Path, draft: Path, budget: int | None = BUDGET, max_tokens: int = 40, **kw) -> Settings:
    s = tiny_settings(model, draft, "sps", max_tokens, **kw)
    return replace(s, params=replace(s.params, reasoning_budget=budget))


def spy_turns(chat) -> list[tuple[list[int], object]]:
    """Each turn's prompt tokens and parameters, as the session hands them to the strategy."""
    seen: list[tuple[list[int], object]] = []
    real = chat.session.request_params

    def spy(text, request):
        out = real(text, request)
        seen.append(out)
        return out

    chat.session.request_params = spy
    return seen


def holds(chat, tokens: list[int], text: str, at_end: bool = False) -> bool:
    """Whether `tokens` hold the tokens of `text` (special ones parsed): anywhere, or as their end."""
    part = chat.session.engine.target_model.tokenize(text, add_special=False, parse_special=True)
    if at_end:
        return tokens[len(tokens) - len(part):] == part
    return any(tokens[i:i + len(part)] == part for i in range(len(tokens) - len(part) + 1))


def block_of(chat, i: int = -1) -> ThinkingBlock:
    return chat.transcript.answers()[i].thinking


@pytest.mark.demo
def test_the_thinking_streams_in_a_block_that_folds_when_the_answer_starts(thinking_models, tmp_path) -> None:
    """While the model thinks, its reasoning streams dim and expanded above the answer, its drafts in the
    speculation view's colours; once the answer starts the block folds to 'Thought for N tokens, S s';
    Ctrl+O and a click expand and fold it. The stream is held at the answer's first token (every step
    shown as it ends) to look at the block mid-turn."""
    release, held = threading.Event(), threading.Event()
    streamed: list[Token] = []

    async def scenario() -> None:
        app = app_for(settings_for(thinking_models.qwq, thinking_models.draft), tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            chat._pacer = Pacer(lo=1e-3, hi=1e-3)  # every step's tokens posted as it ends
            real = chat.session.turn

            def held_at_the_answer(text, request, should_stop):
                for event in real(text, request, should_stop):
                    if isinstance(event, Token):
                        if answers(event) and any(thinks(t) for t in streamed) and not held.is_set():
                            held.set()
                            release.wait(60)
                        streamed.append(event)
                    yield event

            chat.session.turn = held_at_the_answer
            chat.query_one("#prompt", Input).value = QUESTION
            await pilot.press("enter")
            await wait_for(pilot, held.is_set, "the end of the thinking")
            thought = [t for t in streamed if thinks(t)]
            block = block_of(chat)
            await wait_for(pilot, lambda: block.tokens == len(thought), "the thinking shown")
            await pilot.pause()
            answer = chat.transcript.answers()[0]
            assert block.is_mounted and block.expanded and block.body.display
            assert block.header.content.plain == f"▼ Thinking… {len(thought)} tokens"
            assert block.text == "".join(t.reasoning for t in thought) and block.text.strip()
            assert answer.output_text == ""  # no answer yet
            assert list(answer.children).index(block) < list(answer.children).index(answer.spec)
            release.set()
            await wait_for(pilot, lambda: not chat.generating and chat.last_done is not None, "the answer")
            await pilot.pause()
            done = chat.last_done
            assert done.reasoning and done.text.strip() and answer.output_text == done.text
            assert block.text == done.reasoning
            assert not block.expanded and not block.body.display
            header = block.header.content.plain
            assert header.startswith(f"▶ Thought for {len(thought)} tokens, ") and header.endswith(" s"), header
            assert block.size.height == 1
            # The speculation view's colours inside it: the drafts of the reasoning, rejected ones too, and
            # none of those in the answer.
            styles = [(span.style, block.body.text.plain[span.start:span.end]) for span in block.body.text.spans]
            # (A rejected draft whose text is empty, part of a character, has nothing to colour.)
            rejected = [t.text for t in streamed if t.kind == REJECTED and t.channel == "reasoning" and t.text]
            assert [text for style, text in styles if TRUECOLOR.rejected in str(style)] == rejected
            assert any(TRUECOLOR.accepted in str(style) for style, _ in styles), "the draft guessed some thinking"
            assert all("dim" in str(style) for style, _ in styles)
            in_answer = [t.text for t in answer.tokens if t.kind == REJECTED and t.channel == "content" and t.text]
            coloured = answer.coloured
            assert [coloured.plain[s.start:s.end] for s in coloured.spans if "strike" in str(s.style)] == in_answer
            # Expand and fold: the key acts on the last answer's block, a click on any.
            await pilot.press("ctrl+o")
            assert block.expanded and block.body.display and block.header.content.plain.startswith("▼ Thought")
            await pilot.pause()
            await pilot.click(block.header)
            assert not block.expanded and not block.body.display
            # Out of the speculation view: the plain reasoning, dim, without the rejected drafts.
            await pilot.press("f3", "ctrl+o")
            await pilot.pause()
            assert block.body.text.plain == done.reasoning
            assert {str(s.style) for s in block.body.text.spans} == {"dim italic"}

    asyncio.run(scenario())


@pytest.mark.demo
def test_thinking_off_on_qwen3_renders_it_closed_and_shows_no_block(thinking_models, tmp_path) -> None:
    """F7 turns thinking off (saved with the settings): Qwen3's template closes the block in the prompt
    (enable_thinking false), the output is all answer, and no block is shown. Qwen3 with thinking on
    renders the prompt open for the model to think; SmolLM2 does not, so no block either."""
    async def scenario() -> None:
        app = app_for(settings_for(thinking_models.qwen3, thinking_models.draft, max_tokens=16), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            turns = spy_turns(chat)
            await send(pilot, QUESTION)
            await pilot.press("f7")
            assert chat.settings.thinking is False
            assert load_settings(tmp_path / "config" / "settings.json")[0].thinking is False
            await send(pilot, "And of Italy?")
            assert errors(chat) == []
            (on, on_params), (off, off_params) = turns
            assert on_params.reasoning is not None and off_params.reasoning is not None
            assert on_params.reasoning_budget == BUDGET
            opened, closed = "<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
            assert holds(chat, on, opened, at_end=True) and not holds(chat, on, closed)
            assert holds(chat, off, closed, at_end=True)
            done = chat.last_done
            assert done.reasoning == "" and done.text
            for answer in chat.transcript.answers():
                assert answer.thinking.parent is None and not answer.thinking.visible
                assert not list(answer.query(ThinkingBlock))
            assert chat.session.messages[-1] == ChatMessage("assistant", done.text)

    asyncio.run(scenario())


@pytest.mark.demo
def test_thinking_off_on_qwq_is_one_error_line_and_the_app_goes_on(thinking_models, tmp_path) -> None:
    """QwQ's original template always opens the block: thinking off is refused before the turn runs, as one
    line in the transcript; the conversation is untouched, and with thinking on again the chat goes on."""
    async def scenario() -> None:
        app = app_for(settings_for(thinking_models.qwq, thinking_models.draft, max_tokens=24), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            await pilot.press("f7")
            await send(pilot, QUESTION)
            shown = errors(chat)
            assert len(shown) == 1 and "\n" not in shown[0], shown
            assert "cannot turn thinking off" in shown[0] and "smollm2-qwq" in shown[0] and "F7" in shown[0]
            assert chat.session.messages == [] and chat.transcript.answers() == [] and not chat.generating
            await pilot.press("f7")
            await send(pilot, QUESTION)
            assert chat.last_done.reasoning and len(chat.session.messages) == 2
            assert errors(chat) == shown

    asyncio.run(scenario())


@pytest.mark.demo
def test_a_saved_conversation_keeps_the_reasoning_and_passes_it_back(thinking_models, tmp_path) -> None:
    """The answer's reasoning is saved with it; reopened (F5), it shows folded above the answer; the next
    turn's prompt passes it back as ChatMessage.reasoning, which a template that writes earlier reasoning
    (KEEPS_REASONING) shows the model."""
    async def first() -> tuple[str, str, str]:
        app = app_for(settings_for(thinking_models.qwq, thinking_models.draft), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await send(pilot, QUESTION)
            done = app.chat.last_done
            assert done.reasoning and done.text
            return app.chat.conversation_id, done.reasoning, done.text

    conversation_id, reasoning, text = asyncio.run(first())
    saved = json.loads((tmp_path / "conversations" / f"{conversation_id}.json").read_text())
    assert saved["messages"] == [{"role": "user", "content": QUESTION},
                                 {"role": "assistant", "content": text, "reasoning": reasoning}]

    async def second() -> None:
        app = app_for(settings_for(thinking_models.qwq, thinking_models.draft, max_tokens=12), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            await pilot.press("f5")
            await pilot.press("enter")
            await wait_for(pilot, lambda: bool(chat.transcript.answers()), "the reopened chat")
            await pilot.pause()
            answer = chat.transcript.answers()[0]
            assert answer.output_text == text
            assert answer.thinking.is_mounted and answer.thinking.text == reasoning
            assert not answer.thinking.expanded and answer.thinking.header.content.plain == "▶ Thoughts"
            assert chat.session.messages[1] == ChatMessage("assistant", text, reasoning=reasoning)
            fmt = chat.session.format
            assert KEEPS_REASONING[0] in _qwen3_template()
            fmt.template = _qwen3_template().replace(*KEEPS_REASONING)
            turns = spy_turns(chat)
            await send(pilot, "And of Italy?")
            (prompt, params), = turns
            assert holds(chat, prompt, f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n{text}<|im_end|>")
            assert params.reasoning is not None and not params.reasoning.opened  # Qwen3's: the model opens it

    asyncio.run(second())


@pytest.mark.demo
def test_a_thinking_that_never_ends_stays_open(thinking_models, tmp_path) -> None:
    """No budget: SmolLM2 never closes QwQ's block, so the whole turn is thinking (llama.cpp's parse: an
    unclosed block is reasoning) and there is no answer to fold it above: the block stays open."""
    async def scenario() -> None:
        app = app_for(settings_for(thinking_models.qwq, thinking_models.draft, budget=None, max_tokens=12), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            await send(pilot, QUESTION)
            done = chat.last_done
            assert done.reason == "length" and done.text == "" and done.reasoning
            block = block_of(chat)
            assert block.is_mounted and block.expanded and block.body.display and block.text == done.reasoning
            assert block.header.content.plain.startswith("▼ Thought for 12 tokens, ")
            assert chat.session.messages[-1] == ChatMessage("assistant", "", reasoning=done.reasoning)

    asyncio.run(scenario())


def test_the_stream_times_the_thinking_to_the_answers_first_token() -> None:
    """The batch in which the answer starts, and every later one, carry the seconds from the prompt's end to
    the answer's first token, timed at that token (not at its batch's post); before, none."""
    now = [0.0]
    events: list = [Prefilled(n_tokens=3, seconds=0.0)]
    for step in range(6):  # reasoning for three steps, then the answer; a step every 0.1 s
        thinking = step < 3
        events += [Token(step, "" if thinking else "x", TARGET, reasoning="r" if thinking else "",
                         channel="reasoning" if thinking else "content"),
                   Token(99, "y", REJECTED, source="draft", channel="reasoning" if thinking else "content"),
                   StepEnd(drafted=1, accepted=0, seconds=0.1)]
    stats = GenStats("sps", prompt_tokens=3, prompt_cached=0, prompt_seconds=0.0, generated_tokens=6,
                     decode_seconds=0.6, target_forwards=6, drafted=6, accepted=0)
    done = Done(reason="length", stats=stats, tokens=tuple(range(6)), text="xxx", reasoning="rrr")

    def timed():
        for event in events:
            if isinstance(event, StepEnd):
                now[0] += 0.1
            yield event
        yield done

    posted: list = []
    stream_events("sps", timed(), posted.append, lambda: 0.2, clock=lambda: now[0])
    batches = [m for m in posted if isinstance(m, TokensArrived)]
    firsts = [next((t for t in b.tokens if answers(t)), None) for b in batches]
    start = next(i for i, t in enumerate(firsts) if t is not None)
    assert all(b.thought is None for b in batches[:start])
    assert all(b.thought == pytest.approx(0.3) for b in batches[start:])


def test_the_answers_tail_is_what_done_has_past_the_tokens() -> None:
    """Done.tail, unless Done.text holds more past what the tokens showed (a thinking model's Done may carry
    answer text that no token and no tail did); never less than the tail."""
    stats = GenStats("ar", 0, 0, 0.0, 0, 0.0, 0, 0, 0)
    assert answer_tail("2+2 = ", Done("eos", stats, (), "2+2 = 4", reasoning="r")) == "4"
    assert answer_tail("ab", Done("eos", stats, (), "abc", tail="c")) == "c"
    assert answer_tail("ab", Done("stop", stats, (), "ab")) == ""
    assert answer_tail("", Done("error", stats, (), "", tail="")) == ""


def _qwen3_template() -> str:
    return (Path(__file__).parent / "data" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()


def test_conversations_saved_before_reasoning_read_as_answers_without_it(tmp_path) -> None:
    """A file written before answers kept their reasoning (no "reasoning" key) reads as before; an answer's
    reasoning is written only when there is some; a reasoning that is not text marks the file malformed."""
    store = ConversationStore(tmp_path)
    old = {"id": "old", "updated": "2026-01-01T00:00:00+00:00", "model": "m", "system_prompt": "",
           "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    assert store.load("old").messages == (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello"))
    new = Conversation("new", "2026-01-02T00:00:00+00:00", "m", "",
                       (ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello", reasoning="They greet me.")))
    store.save(new)
    assert store.load("new") == new
    assert "reasoning" not in json.loads((tmp_path / "new.json").read_text())["messages"][0]
    bad = {**old, "id": "bad", "messages": [{"role": "assistant", "content": "x", "reasoning": 3}]}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError):
        store.load("bad")
    assert [c.id for c in store.list()] == ["new", "old"]


def test_the_settings_panel_sets_thinking_and_its_budget(tiny, tmp_path) -> None:
    """F4's Thinking switch and Thinking budget (empty: no bound) set `thinking` and `params.reasoning_budget`."""
    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "sps", 8), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            await pilot.press("f4")
            budget = app.screen.query_one("#f-params-reasoning-budget", Input)
            assert budget.value == "" and app.screen.query_one("#f-thinking").value is True
            budget.value = "7"
            app.screen.query_one("#f-thinking").value = False
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert chat.settings.thinking is False and chat.settings.params.reasoning_budget == 7
            await pilot.press("f4")
            app.screen.query_one("#f-params-reasoning-budget", Input).value = " "
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert chat.settings.params.reasoning_budget is None
            await pilot.press("f4")
            app.screen.query_one("#f-params-reasoning-budget", Input).value = "-1"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert "budget" in str(app.screen.query_one("#settings-error").render()).lower()

    asyncio.run(scenario())
