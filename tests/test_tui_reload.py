"""The chat app's conversation across what changes under it: models loaded again (a setting that needs them,
applied while an answer runs or after), a reopened chat's own system prompt, and saved conversation files
that are malformed or copied (a turn that fails before it starts: tests/test_tui.py). Driven with Textual's Pilot on the tests'
tiny GGUFs (real llama.cpp underneath)."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace

from app.conversations import Conversation, ConversationStore, now_iso
from app.chat_template import ChatMessage
from app.tui import make_app
from app.tui.history_screen import HistoryScreen
from backends.sampling import GenParams
from tui_helpers import app_for, send, tiny_settings, wait_for, wait_loaded


def _saved_messages(tmp_path, conversation_id: str) -> list[str]:
    data = json.loads((tmp_path / "conversations" / f"{conversation_id}.json").read_text())
    return [m["content"] for m in data["messages"]]


def test_models_loaded_again_keep_the_conversation_and_its_file(tiny, tmp_path) -> None:
    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "ar", 8), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            await send(pilot, "the cat")
            first = [m.content for m in chat.session.messages]
            engine = chat.engine
            chat._change_settings(replace(chat.settings, n_ctx=1024))  # a setting the models load again for
            await wait_for(pilot, lambda: chat.engine is not None and chat.engine is not engine and not chat.loading,
                           "the models loaded again")
            assert [m.content for m in chat.session.messages] == first  # the model still sees the chat
            await send(pilot, "and the dog")
            assert len(chat.session.messages) == 4
            assert chat.last_done.stats.prompt_tokens > len(chat.engine.tokenize("and the dog")) + 8
            saved = _saved_messages(tmp_path, chat.conversation_id)
            assert saved[:2] == first and len(saved) == 4  # the file kept the turns before the reload

    asyncio.run(scenario())


def test_a_model_change_made_while_answering_is_applied_when_the_answer_ends(tiny, tmp_path) -> None:
    settings = replace(tiny_settings(tiny.target, tiny.draft, "ar"), params=GenParams(max_tokens=4000,
                                                                                      ignore_eos=True))

    async def scenario() -> None:
        app = app_for(settings, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            engine = chat.engine
            chat.query_one("#prompt").value = "the cat"
            await pilot.press("enter")
            await wait_for(pilot, lambda: chat.generating, "the answer to start")
            chat._change_settings(replace(chat.settings, n_ctx=2048))
            assert chat.engine is engine and chat.settings.n_ctx == 2048  # saved now, loaded after the answer
            await pilot.press("escape")
            await wait_for(pilot, lambda: not chat.generating and chat.engine is not None
                           and chat.engine is not engine and not chat.loading, "the models loaded again")
            assert chat.engine.config.n_ctx == 2048
            assert [m.content for m in chat.session.messages][0] == "the cat"

    asyncio.run(scenario())


def test_a_reopened_chat_keeps_its_system_prompt_through_other_settings(tiny, tmp_path) -> None:
    store = ConversationStore(tmp_path / "conversations")
    store.save(Conversation("old-chat", now_iso(), None, "You answer in French.",
                            (ChatMessage("user", "the cat"), ChatMessage("assistant", "le chat"))))

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, tiny.draft, "ar", 8), tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            chat = app.chat
            await send(pilot, "the dog")
            assert chat.stats.live is not None
            chat._reopen("old-chat")
            assert chat.stats.live is None and "reopened: 1 turn" in chat.stats.render_text().plain  # not its figures
            await pilot.press("f2", "f3")  # a strategy and the view: nothing about the system prompt
            assert chat.session.system_prompt == "You answer in French."
            chat._change_settings(replace(chat.settings, system_prompt="Be brief."))  # this one is
            assert chat.session.system_prompt == "Be brief."
            await send(pilot, "the cat")
            await pilot.press("ctrl+n")
            assert chat.stats.live is None and "new chat" in chat.stats.render_text().plain

    asyncio.run(scenario())


def test_malformed_and_copied_conversation_files_are_skipped_or_refused_not_fatal(tiny, tmp_path) -> None:
    folder = tmp_path / "conversations"
    store = ConversationStore(folder)
    store.save(Conversation("good", now_iso(), None, "", (ChatMessage("user", "hello"), ChatMessage("assistant", "hi"))))
    shutil.copy(folder / "good.json", folder / "good-copy.json")  # the same "id" inside
    for name, data in {"no-time": {"updated": None}, "str-messages": {"messages": "oops"},
                       "not-an-object": []}.items():
        body = data if isinstance(data, list) else {**json.loads((folder / "good.json").read_text()), **data}
        (folder / f"{name}.json").write_text(json.dumps(body))
    listed = store.list()
    assert sorted(c.id for c in listed) == ["good", "good-copy"]  # a copy is a conversation of its own

    async def scenario() -> None:
        app = make_app(tiny_settings(tiny.target, tiny.draft, "ar", 8), settings_path=tmp_path / "settings.json",
                       conversations=folder, calibrate=False, resume="str-messages")
        async with app.run_test(size=(100, 30)) as pilot:
            await wait_loaded(pilot)
            await wait_for(pilot, lambda: any("could not open that conversation" in str(n.message)
                                              for n in app._notifications), "the refusal")
            await pilot.press("f5")
            await wait_for(pilot, lambda: isinstance(app.screen, HistoryScreen), "the conversations list")
            await pilot.press("down", "enter")
            chat = app.chat
            await wait_for(pilot, lambda: bool(chat.transcript.answers()), "a reopened chat")
            await send(pilot, "more")
            assert len(chat.session.messages) == 4
            assert chat.conversation_id in ("good", "good-copy")
            other = "good" if chat.conversation_id == "good-copy" else "good-copy"
            assert len(_saved_messages(tmp_path, chat.conversation_id)) == 4
            assert len(_saved_messages(tmp_path, other)) == 2  # the other file is left as it was

    asyncio.run(scenario())
