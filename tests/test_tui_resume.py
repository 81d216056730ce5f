"""`specchat chat --resume`: the chat app reopens a saved conversation once the model is loaded, and its KV cells
come back from disk (backends.kv_store) instead of being decoded; driven with Textual's Pilot on the SmolLM2 pair."""

from __future__ import annotations

import asyncio
import json

import pytest

from app.tui import chat_screen, make_app
from tui_helpers import send, tiny_settings, wait_for, wait_loaded

LONG = "Here is a list. " + " ".join(f"Item {i} is a {['red', 'blue', 'green'][i % 3]} box." for i in range(30))


def test_resume_reopens_the_last_conversation_and_restores_its_cells(instruct_pair, tmp_path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECCHAT_KV_DIR", str(tmp_path / "kv"))
    settings = tiny_settings(instruct_pair.target, instruct_pair.draft, "auto", 16)

    def app(resume: str | None = None):
        return make_app(settings, settings_path=tmp_path / "config" / "settings.json",
                        conversations=tmp_path / "conversations", calibrate=False, resume=resume)

    async def first() -> list[str]:
        chat_app = app()
        async with chat_app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await send(pilot, LONG)
            return [a.output_text for a in chat_app.chat.transcript.answers()]

    answers = asyncio.run(first())  # the app closes within the idle delay: the cells are kept as it closes
    assert list((tmp_path / "kv").glob("*.kv")), "the turn's cells were kept on disk"

    async def resumed() -> None:
        chat_app = app(resume="last")
        async with chat_app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = chat_app.chat
            await wait_for(pilot, lambda: bool(chat.transcript.answers()), "the resumed chat")
            assert [a.output_text for a in chat.transcript.answers()] == answers
            await send(pilot, "Which box is item 4?")
            restored = chat.session.restored
            assert restored is not None and restored[0] > 200, restored
            assert chat.last_done.stats.prompt_cached >= restored[0] - 1

    asyncio.run(resumed())


def test_cells_wait_for_the_chat_to_be_idle(instruct_pair, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn's cells are not copied while the next message may follow at once: they go to disk once the chat
    has been idle for KEEP_WHEN_IDLE_S, and a turn sent sooner puts the keeping off until after itself."""
    monkeypatch.setenv("SPECCHAT_KV_DIR", str(tmp_path / "kv"))
    monkeypatch.setattr(chat_screen, "KEEP_WHEN_IDLE_S", 1.5)
    kept = lambda: sorted((tmp_path / "kv").glob("*.kv"))  # noqa: E731

    async def scenario() -> None:
        chat_app = make_app(tiny_settings(instruct_pair.target, instruct_pair.draft, "ar", 8),
                            settings_path=tmp_path / "settings.json", conversations=tmp_path / "conversations",
                            calibrate=False)
        async with chat_app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            store = chat_app.chat.session.kv_store
            await send(pilot, LONG)
            await send(pilot, "Which box is item 4?")  # at once: the first turn's cells were never copied
            store.wait()
            assert kept() == [], "nothing kept while the chat was answering"
            await wait_for(pilot, lambda: bool(kept()), "the cells kept once idle", timeout=30)
            store.wait()
            files = kept()
            assert len(files) == 1  # the second turn's conversation, which the first one's is a prefix of
            with files[0].open("rb") as f:
                tokens = json.loads(f.readline())["target_tokens"]
            assert len(tokens) == len(chat_app.chat.session.engine.slots[0].target.tokens) > 200

    asyncio.run(scenario())


def test_resume_with_nothing_saved_says_so_and_the_app_works(tiny, tmp_path) -> None:
    async def scenario() -> None:
        chat_app = make_app(tiny_settings(tiny.target, tiny.draft, "ar", 8),
                            settings_path=tmp_path / "settings.json", conversations=tmp_path / "none",
                            calibrate=False, resume="last")
        async with chat_app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await wait_for(pilot, lambda: any("no saved conversation" in str(n.message)
                                              for n in chat_app._notifications), "the notice")
            await send(pilot, "the cat")
            assert chat_app.chat.last_done is not None

    asyncio.run(scenario())
