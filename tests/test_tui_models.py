"""The chat app's models screen against a local Hub server: download a pair, pick a target, see its drafts."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from dataclasses import replace
from typing import Callable

from hub_server import catalog_hub, hub, hub_ggufs  # noqa: F401  (fixtures used by name)
from hub_server import OTHER_REPO, TARGET_FILE, TARGET_REPO, FakeHub
from textual.pilot import Pilot
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from app.cli import main
from app.tui.models_screen import ModelsScreen
from models.store import ModelStore, StoredModel
from tui_helpers import app_for, option_labels, send, tiny_settings, wait_for, wait_loaded



def _highlight(options: OptionList, wanted: Callable[[Option], bool]) -> None:
    options.focus()
    options.highlighted = next(i for i in range(options.option_count) if wanted(options.get_option_at_index(i)))


async def _start_pull(pilot: Pilot, pair: str) -> ModelsScreen:
    """Open the models screen (F6) once the chat's model is loaded, and press p on a catalog pair."""
    await wait_loaded(pilot)
    await pilot.press("f6")
    screen = pilot.app.screen
    assert isinstance(screen, ModelsScreen)
    _highlight(screen.query_one("#catalog", OptionList), lambda o: o.id == pair)
    await pilot.press("p")
    return screen


def test_pull_a_pair_pick_it_and_chat(catalog_hub: FakeHub, tiny, tmp_path, capsys) -> None:
    assert main(["models", "pull", f"hf:{OTHER_REPO}"]) == 0  # a local model with another vocabulary
    capsys.readouterr()

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, None, "ar", 8), tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _start_pull(pilot, "qwen2.5")
            await wait_for(pilot, lambda: not screen.pulling, "the download")
            assert screen.last_progress is not None
            assert screen.last_progress.done == screen.last_progress.total > 1_000_000  # reached 100%
            names = [m.name for m in screen.local]
            assert {"qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct", f"hf:{OTHER_REPO}"} <= set(names)

            local = screen.query_one("#local", OptionList)
            local.focus()
            local.highlighted = names.index("qwen2.5-7b-instruct")
            await pilot.press("enter")
            drafts = option_labels(screen.query_one("#drafts", OptionList))
            compatible = [label for label, ok in drafts.items() if label.startswith("qwen2.5-0.5b-instruct")]
            incompatible = [label for label, ok in drafts.items() if label.startswith(f"hf:{OTHER_REPO}")]
            assert compatible and drafts[compatible[0]]
            assert incompatible and not drafts[incompatible[0]] and "differs" in incompatible[0]

            _highlight(screen.query_one("#drafts", OptionList), lambda o: str(o.prompt).startswith("qwen2.5-0.5b"))
            await pilot.press("enter")
            chat = app.chat
            assert app.screen is chat
            assert (chat.settings.target, chat.settings.draft) == ("qwen2.5-7b-instruct", "qwen2.5-0.5b-instruct")
            await wait_for(pilot, lambda: chat.session is not None and not chat.loading, "the pulled pair")
            assert chat.engine.config.draft is not None
            chat.settings = replace(chat.settings, strategy="sps")
            await send(pilot, "hello")
            assert chat.last_done.reason in ("length", "eos") and chat.last_done.stats.strategy == "sps"

    asyncio.run(scenario())


def test_escape_cancels_a_download_and_the_next_pull_resumes(catalog_hub: FakeHub, tiny, tmp_path) -> None:
    release = threading.Event()
    catalog_hub.hold[TARGET_FILE] = (1_000_000, release)  # the first GET stalls after 1 MB until released

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, None, "ar", 8), tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            screen = await _start_pull(pilot, "qwen2.5")
            await wait_for(pilot, lambda: screen.last_progress is not None and screen.last_progress.done >= 900_000,
                           "the first megabyte")
            await pilot.press("escape")  # cancels the download; the screen stays
            release.set()
            await wait_for(pilot, lambda: not screen.pulling, "the cancellation")
            assert app.screen is screen
            assert "cancelled" in str(screen.query_one("#pull-status").render())
            assert "qwen2.5-7b-instruct" not in [m.name for m in screen.local]

            await pilot.press("p")  # again: resumes where it stopped
            await wait_for(pilot, lambda: not screen.pulling, "the resumed download")
            assert "download complete" in str(screen.query_one("#pull-status").render())
            local = {m.name: m.path for m in screen.local}
            assert hashlib.sha256(local["qwen2.5-7b-instruct"].read_bytes()).hexdigest() == \
                catalog_hub.sha256(TARGET_REPO, TARGET_FILE)
            resumed = catalog_hub.gets(TARGET_FILE)[-1]
            assert resumed.range is not None and int(resumed.range.split("=")[1].split("-")[0]) >= 900_000

    asyncio.run(scenario())


def test_the_bundled_target_shows_its_drafts_as_soon_as_it_is_highlighted(instruct_pair, tiny, tmp_path) -> None:
    """F6 on a machine with the SmolLM2 pair built: moving onto `smollm2` lists `smollm2-draft` as a draft at
    once (the pane used to stay empty until a target was picked with Enter)."""
    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, None, "ar", 8), tmp_path)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_loaded(pilot)
            await pilot.press("f6")
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            local = screen.query_one("#local", OptionList)
            names = [m.name for m in screen.local]
            local.focus()
            local.highlighted = names.index("smollm2")
            await pilot.pause()
            drafts = option_labels(screen.query_one("#drafts", OptionList))
            assert any(label.startswith("smollm2-draft") and ok for label, ok in drafts.items()), drafts
            assert screen.query_one("#local", OptionList).has_focus  # highlighting does not move the focus

    asyncio.run(scenario())


def test_the_catalog_lists_how_pairs_draft_and_pulls_an_mtp_pairs_target_alone(hub: FakeHub, tiny,  # noqa: F811
                                                                               thinking_models, tmp_path) -> None:
    """The catalog list says which pair drafts with the target's MTP head and which with an EAGLE-3 draft, and
    which target thinks and how it is turned off or bounded; `p` on the MTP pair fetches the target alone, which
    then lists as carrying its own head. A local model whose template thinks lists as thinking."""
    from qwen35_factory import write_qwen35_mtp_target

    repo, name = "unsloth/Qwen3.5-4B-MTP-GGUF", "Qwen3.5-4B-Q4_K_M.gguf"
    hub.add_file(repo, name, write_qwen35_mtp_target(tmp_path / "headed.gguf"))
    ModelStore().add(StoredModel("smollm2-qwq", thinking_models.qwq))  # in the fixture's data dir

    async def scenario() -> None:
        app = app_for(tiny_settings(tiny.target, None, "ar", 8), tmp_path)
        async with app.run_test(size=(160, 40)) as pilot:
            screen = await _start_pull(pilot, "qwen3.5-mtp")
            catalog = option_labels(screen.query_one("#catalog", OptionList))
            mtp = next(label for label in catalog if label.startswith("qwen3.5-mtp: "))
            assert mtp.startswith("qwen3.5-mtp: qwen3.5-4b-mtp Q4_K_M · MTP head inside the target · "
                                  "thinks: F7 turns it off · ~3.5 GB RAM")
            eagle = next(label for label in catalog if label.startswith("gpt-oss-eagle3: "))
            assert "gpt-oss-20b MXFP4 + gpt-oss-20b-eagle3 Q8_0 · EAGLE-3 draft · thinks (harmony), always: " \
                "F4's Thinking budget bounds it" in eagle
            plain = next(label for label in catalog if label.startswith("qwen2.5: "))  # a model that does not think
            assert "thinks" not in plain
            await wait_for(pilot, lambda: not screen.pulling, "the download")
            assert "download complete" in str(screen.query_one("#pull-status").render())
            assert [r.path.rsplit("/", 1)[1] for r in hub.requests if r.method == "GET" and "/resolve/" in r.path] \
                == [name]
            local = option_labels(screen.query_one("#local", OptionList))
            assert any(label.startswith("qwen3.5-4b-mtp ") and "its own MTP head" in label and ok
                       for label, ok in local.items()), local
            assert any(label.startswith("smollm2-qwq ") and label.endswith(" · thinks") for label in local), local
            assert not any(label.startswith("smollm2 ") and "thinks" in label for label in local), local

    asyncio.run(scenario())
