"""Pictures of the chat app (pytest-textual-snapshot): fixed terminal size, real tiny models.

Timings are the only thing that changes between runs, so the stats bar's
figures are pinned (100 tok/s against a plain-decoding baseline of 80) after
the real answer has been generated; everything else on screen is what the app
rendered. Update with `pytest tests/test_tui_snapshots.py --snapshot-update`
after checking the new pictures by eye.
"""

from __future__ import annotations

from dataclasses import replace

from tui_helpers import app_for, send, tiny_settings, wait_loaded

SIZE = (100, 30)
PINNED_TOKENS_PER_SECOND = 100.0
PINNED_BASELINE = 80.0


def _small(tiny, tmp_path, monkeypatch):
    # Relative model paths: the settings panel shows them, and tmp folders differ between runs.
    monkeypatch.chdir(tiny.small_target.parent)
    return app_for(tiny_settings(tiny.small_target.name, tiny.small_draft.name, "sps", 40), tmp_path)


def _pin_stats(chat) -> None:
    """The stats bar's figures pinned (the real answer's tokens, a fixed speed and baseline), and the prompt's
    cursor held shown: once the answer ends it blinks again, and on a slow machine the picture caught it off (a
    clean-clone CI run did)."""
    live = chat.stats.live
    chat.stats.show(live=replace(live, seconds=live.generated / PINNED_TOKENS_PER_SECOND), baseline=PINNED_BASELINE)
    chat.query_one("#prompt").cursor_blink = False  # a cursor that does not blink is shown


async def _answered(pilot) -> None:
    await wait_loaded(pilot)
    await send(pilot, "a b")
    _pin_stats(pilot.app.chat)
    await pilot.pause()


def test_empty_chat(snap_compare, tiny, tmp_path, monkeypatch) -> None:
    assert snap_compare(_small(tiny, tmp_path, monkeypatch), terminal_size=SIZE, run_before=wait_loaded)


def test_answer_with_speculation_view(snap_compare, tiny, tmp_path, monkeypatch) -> None:
    assert snap_compare(_small(tiny, tmp_path, monkeypatch), terminal_size=SIZE, run_before=_answered)


def test_answer_as_markdown(snap_compare, tiny, tmp_path, monkeypatch) -> None:
    async def run_before(pilot) -> None:
        await _answered(pilot)
        await pilot.press("f3")

    assert snap_compare(_small(tiny, tmp_path, monkeypatch), terminal_size=SIZE, run_before=run_before)


def test_settings_panel(snap_compare, tiny, tmp_path, monkeypatch) -> None:
    async def run_before(pilot) -> None:
        await wait_loaded(pilot)
        await pilot.press("f4")

    assert snap_compare(_small(tiny, tmp_path, monkeypatch), terminal_size=SIZE, run_before=run_before)


def test_error_message(snap_compare, tmp_path) -> None:
    app = app_for(tiny_settings("missing-model.gguf", None, "ar"), tmp_path)
    assert snap_compare(app, terminal_size=SIZE, run_before=wait_loaded)


def test_a_thinking_answer_folded(snap_compare, thinking_models, tmp_path, monkeypatch) -> None:
    """A thinking model's answer (SmolLM2 with QwQ's template, its thinking ended by a budget of 16): the block
    folded above the answer, "Thought for N tokens, S s" (the seconds pinned as the stats are)."""
    from test_tui_reasoning import settings_for

    monkeypatch.chdir(thinking_models.qwq.parent)
    # Plain decoding: which tokens a real draft gets accepted (the answer's colours, the stats bar's acceptance
    # and tokens per forward) turns on p_min where the CPU's arithmetic decides, so a picture with `sps` differed
    # between machines (2.54 tokens/forward on the Intel AMX VM, 2.75 on the AMD EPYC one) while the answer did not.
    app = app_for(replace(settings_for(thinking_models.qwq.name, None), strategy="ar"), tmp_path)

    async def run_before(pilot) -> None:
        await wait_loaded(pilot)
        await send(pilot, "What is the capital of France? Explain.")
        chat = pilot.app.chat
        _pin_stats(chat)
        block = chat.transcript.answers()[-1].thinking
        assert block.visible and not block.expanded, "folded once the answer started"
        block.seconds = 1.0
        block.refresh_view()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
