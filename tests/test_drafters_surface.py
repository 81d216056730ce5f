"""The drafters a model carries as the user meets them (issue 44, items 3 and 4), on real llama.cpp.

`specchat run --json` (a subprocess) labels every drafted token, accepted or rejected, with its drafter: "mtp",
"eagle3" or "dflash", for chains and trees, and beside the grammar's own drafts under --json-schema. In the chat
app, F6 lists a target that carries an MTP head as such, a draft made for a target's layers as a draft only, and
offers a target's own drafter first among its drafts; picking it loads an engine that drafts with it, even where
the strategy was `sps` and no draft file is picked (an MTP head); a turn then shows the drafter's tokens under the
same label: in the speculation view (F3: the tokens' source, and their colour, the drafter's own, which is neither
a draft model's nor another drafter's) and in the stats bar's share of tokens by source, named in that colour.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hub_server import hub  # noqa: F401  (a fixture used by name: a data dir and a Hugging Face cache of its own)
from hub_server import FakeHub
from textual.widgets import OptionList

from app.render import TRUECOLOR
from app.tui.models_screen import NO_DRAFT, ModelsScreen
from backends.events import ACCEPTED, REJECTED
from backends.sampling import GenParams
from drafter_files import DRAFTERS, DrafterFiles, write_drafter_files
from models.store import ModelStore, StoredModel
from tui_helpers import app_for, option_labels, send, tiny_settings, wait_for, wait_loaded

PROMPT = "the cat sat on the mat and"
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 80}}, "required": ["story"],
          "additionalProperties": False}
KIND = {"eagle3": "EAGLE-3", "dflash": "DFlash"}  # how the models screen names a draft made for a target's layers


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DrafterFiles]:
    return write_drafter_files(tmp_path_factory.mktemp("drafters"))


def _run_json(f: DrafterFiles, *args: str) -> list[dict]:
    r = subprocess.run([sys.executable, "-m", "app", "run", PROMPT, *f.cli_args(), "-t", "1", "--temp", "0",
                        "--json", "--no-memory", *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return [json.loads(line) for line in r.stdout.splitlines()]


def _drafted(events: list[dict]) -> list[dict]:
    return [e for e in events if e["type"] == "token" and e["kind"] in (ACCEPTED, REJECTED)]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_json_labels_every_drafted_token_with_its_drafter(files: dict[str, DrafterFiles], drafter: str) -> None:
    f = files[drafter]
    want = _run_json(f, "-s", "ar", "-n", "32")[-1]["tokens"]
    kinds = set()
    for strategy in ("sps", "tree"):
        events = _run_json(f, "-s", strategy, "-n", "32")
        done = events[-1]
        assert done["tokens"] == want, strategy
        drafted = _drafted(events)
        assert {e["source"] for e in drafted} == {drafter}, strategy
        accepted = sum(e["kind"] == ACCEPTED for e in drafted)
        assert accepted > 0 and done["stats"]["tokens_by_source"].get(drafter) == accepted, strategy
        kinds |= {e["kind"] for e in drafted}
    assert kinds == {ACCEPTED, REJECTED}
    # Under a schema (run's --json-schema) the grammar's forced stretches are its own drafts; the free text is the
    # drafter's.
    events = _run_json(f, "-s", "sps", "-n", "60", "--json-schema", json.dumps(SCHEMA))
    assert {e["source"] for e in _drafted(events)} == {drafter, "grammar"}



@pytest.mark.parametrize("drafter", DRAFTERS)
def test_f6_offers_the_targets_own_drafter_and_a_turn_drafts_with_it(hub: FakeHub, files: dict[str, DrafterFiles],  # noqa: F811
                                                                    tiny, tmp_path, drafter: str) -> None:
    store = ModelStore()  # in the fixture's data dir: the local models F6 lists
    for label, f in files.items():
        store.add(StoredModel(f"{label}-target", f.target))
        if f.draft is not None:
            store.add(StoredModel(f"{label}-draft", f.draft))
    # A plain model listed first, that could speculate as a draft model for the MTP and EAGLE-3 targets (their
    # vocabulary): the target's own drafter is offered before it.
    store.add(StoredModel("a-plain-draft", Path(shutil.copy(files["eagle3"].target, tmp_path / "plain.gguf"))))
    # A user chatting with `sps` on a draft-model pair, who then picks a model that drafts for itself.
    settings = replace(tiny_settings(tiny.target, tiny.draft, "sps"), params=GenParams(max_tokens=32, temperature=0))

    async def scenario() -> None:
        app = app_for(settings, tmp_path)
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_loaded(pilot)
            await pilot.press("f6")
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            local = option_labels(screen.query_one("#local", OptionList))
            target_row = next(label for label in local if label.startswith(f"{drafter}-target "))
            assert local[target_row] and (("its own MTP head" in target_row) == (drafter == "mtp")), target_row
            for kind_label, kind in KIND.items():  # a draft made for a target's layers is no target of its own
                draft_row = next(label for label in local if label.startswith(f"{kind_label}-draft "))
                assert not local[draft_row] and f"{kind} draft: pick its target" in draft_row, draft_row

            names = [m.name for m in screen.local]
            targets = screen.query_one("#local", OptionList)
            targets.focus()
            targets.highlighted = names.index(f"{drafter}-target")
            await pilot.press("enter")
            drafts = screen.query_one("#drafts", OptionList)
            assert drafts.has_focus
            offered = drafts.get_option_at_index(drafts.highlighted)  # the likely choice, Enter picks it
            if drafter == "mtp":
                assert offered.id == NO_DRAFT and str(offered.prompt) == "(no draft file: its own MTP head drafts)"
            else:
                assert names[int(offered.id)] == f"{drafter}-draft", offered.prompt
                assert str(offered.prompt).endswith(f" · {KIND[drafter]}"), offered.prompt
            await pilot.press("enter")

            chat = app.chat
            assert app.screen is chat
            await wait_for(pilot, lambda: chat.engine is not None and not chat.loading and chat.session is not None,
                           "the picked model")
            assert chat.engine.drafter == drafter and chat.engine.draft.label == drafter
            assert chat.settings.strategy == "sps", "the strategy fell back although the model drafts for itself"
            await send(pilot, PROMPT)
            assert chat.last_done.reason in ("length", "eos") and chat.last_done.stats.strategy == "sps"

            # F3's view: every drafted token under the drafter's label, its accepted ones in the drafter's own colour
            # (not a draft model's green, nor another drafter's), and the stats bar's share under the same label,
            # named in that colour.
            answer = chat.transcript.answers()[-1]
            assert chat.settings.speculation_view and answer.spec.display
            drafted = [t for t in answer.tokens if t.kind in (ACCEPTED, REJECTED)]
            assert {t.source for t in drafted} == {drafter}
            assert sum(t.kind == ACCEPTED for t in drafted) == chat.last_done.stats.tokens_by_source[drafter] > 0
            styles = {str(span.style) for span in answer.coloured.spans}
            own = TRUECOLOR.accepted_from(drafter)
            others = {TRUECOLOR.accepted} | {TRUECOLOR.accepted_from(d) for d in DRAFTERS if d != drafter}
            assert own in styles and not styles & others, styles
            line = chat.stats.render_text().split("\n")[-1]
            assert re.search(rf"\b{drafter} \d+%", line.plain), line.plain
            assert any(line.plain[s.start:s.end] == drafter and str(s.style) == own for s in line.spans), line.spans

    asyncio.run(scenario())
