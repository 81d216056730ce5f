"""The chat app driven with Textual's Pilot on real tiny GGUFs (real llama.cpp underneath)."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from app.cli import main
from app.render import TRUECOLOR
from app.settings import Settings, load_settings
from app.tui.transcript import AnswerView, UserMessage
from backends.engine import Engine, EngineConfig
from backends.events import REJECTED
from backends.sampling import GenParams
from engine_helpers import run_to_done
from tui_helpers import app_for, char_styles, errors, send, tiny_settings, wait_for, wait_loaded

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


def test_the_speedup_is_against_this_models_plain_decoding(tiny, tmp_path, monkeypatch) -> None:
    """The bar's baseline: the calibration run after a load, then the user's own `ar` turns; another model
    starts it over from its own calibration (the first model's `ar` turns had stayed the baseline, and every
    later speedup was shown against another model's plain decoding)."""
    calibrations = iter([111.0, 222.0])
    monkeypatch.setattr("app.tui.chat_screen.measure_plain_decoding", lambda engine: next(calibrations))

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "ar", 16), tmp_path, calibrate=True)
        async with app.run_test(size=(100, 30)) as pilot:
            chat = app.chat
            await wait_loaded(pilot)
            await wait_for(pilot, lambda: chat.stats.baseline == 111.0, "the calibration")
            await send(pilot, PROMPT)
            assert chat.stats.baseline == pytest.approx(chat.last_done.stats.tokens_per_second), "an ar turn"
            chat._change_settings(replace(chat.settings, target=str(tiny.draft), draft=None))
            await wait_for(pilot, lambda: chat.stats.baseline == 222.0, "the new model's calibration")
            assert chat.engine.config.target == Path(tiny.draft)

    asyncio.run(scenario())


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
            # Nothing was sent: the transcript shows no question the model never saw, and the message is back
            # in the input, to shorten and send again.
            assert not list(app.chat.query(UserMessage))
            assert app.chat.query_one("#prompt").value == ("word " * 200).strip()
            await send(pilot, "short")
            assert app.chat.last_done.reason == "length"
            assert [u.render().plain for u in app.chat.query(UserMessage)] == ["short"]

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
