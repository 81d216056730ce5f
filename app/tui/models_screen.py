"""The models screen: local models, the catalog, downloads with progress, and pairing.

Pick a target among the local models and the drafts list shows every other
local model: those that can speculate for it (llama.cpp's rules,
models.compat) selectable, the others greyed out with the reason. Catalog
entries download into the Hugging Face cache (models.hub.pull) in a thread
worker; the progress bar follows the bytes, Escape cancels and keeps the
partial file for the next pull to resume.
"""

from __future__ import annotations

import threading

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, OptionList, ProgressBar, Static
from textual.widgets.option_list import Option

from app.errors import describe
from app.units import format_size
from backends.reasoning import template_thinks
from models.catalog import load_catalog
from models.compat import check_pair
from models.drafters import mtp_heads
from models.errors import ModelError
from models.hub import Cancelled, Progress, pull
from models.local import LocalModel, local_models
from models.resolve import hub_models

NO_DRAFT = "\0no-draft"  # the drafts list's first row: chat with the target alone
# Drafters made for one target's layers (they read its hidden states or its cells), by architecture: listed as
# drafts only, and first among a target's drafts.
_OWN_DRAFTERS = {"eagle3": "EAGLE-3", "dflash": "DFlash", "gemma4-assistant": "Gemma 4 assistant"}


class PullProgress(Message):
    def __init__(self, progress: Progress) -> None:
        super().__init__()
        self.progress = progress


class PullEnded(Message):
    def __init__(self, error: str | None) -> None:
        super().__init__()
        self.error = error


class ModelsScreen(Screen[tuple[str, str | None] | None]):
    """Dismissed with (target, draft or None) to chat with, or None."""

    BINDINGS = [
        Binding("escape", "back", "Back / cancel download"),
        Binding("p", "pull", "Pull selected catalog entry"),
    ]

    def __init__(self) -> None:
        super().__init__()
        self.local: list[LocalModel] = []
        self.target: LocalModel | None = None
        self.pulling = False
        self.last_progress: Progress | None = None
        self._cancel = threading.Event()

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="models-lists"):
            with Vertical():
                yield Static("Local models · Enter: use as target", classes="title")
                yield OptionList(id="local")
            with Vertical():
                yield Static("Drafts for the target · Enter: chat with this pair", classes="title", id="drafts-title")
                yield OptionList(id="drafts")
        yield Static("Catalog · Enter or p: download into the Hugging Face cache", classes="title")
        yield OptionList(id="catalog")
        yield Static("", id="pull-status")
        yield ProgressBar(total=None, show_eta=True, id="pull-progress")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#pull-progress").display = False
        catalog = self.query_one("#catalog", OptionList)
        try:
            entries = load_catalog()
        except ModelError as e:
            self._status(str(e))
            return
        for pair in entries.pairs:  # `p` pulls what the pair needs: an MTP pair's target alone (hub_models)
            ram = pair.ram_gb()
            files = " + ".join(f"{m.alias} {m.default_quant}" for m in pair.models)
            thinking = pair.target.thinking
            catalog.add_option(Option(
                f"{pair.name}: {files}" + (f" · {pair.drafter_label}" if pair.drafter_label else "")
                + (f" · {thinking.label}" if thinking else "")
                + (f" · ~{ram:.1f} GB RAM" if ram else "") + f" · {pair.notes}",
                id=pair.name,
            ))
        self.refresh_local()

    def refresh_local(self) -> None:
        self.local, warning = local_models()
        options = self.query_one("#local", OptionList)
        options.clear_options()
        for i, m in enumerate(self.local):
            if m.info is None:
                options.add_option(Option(f"{m.name} · unusable: {m.problem}", id=str(i), disabled=True))
            elif m.info.architecture in _OWN_DRAFTERS:  # a draft only: it runs beside the target it reads
                kind = _OWN_DRAFTERS[m.info.architecture]
                options.add_option(Option(f"{m.name} · {format_size(m.info.size_bytes)} · {kind} draft: pick its "
                                          "target, then it", id=str(i), disabled=True))
            else:
                heads = mtp_heads(m.info)
                options.add_option(Option(
                    f"{m.name} · {format_size(m.info.size_bytes)} · {m.info.architecture} {m.info.quantization or ''}"
                    + (f" · its own MTP head{'s' if heads > 1 else ''}" if heads else "")
                    + (" · thinks" if template_thinks(m.info.chat_template) else ""), id=str(i)))
        if self.local:
            options.highlighted = 0
            options.focus()
        else:
            self._status("no local models yet: download one from the catalog below")
        if warning:
            self.notify(warning, severity="warning")

    def _status(self, text: str) -> None:
        self.query_one("#pull-status", Static).update(text)

    # -- pairing --------------------------------------------------------------

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        list_id, option_id = event.option_list.id, event.option.id
        if list_id == "local" and option_id is not None:
            self.show_drafts(self.local[int(option_id)])
        elif list_id == "drafts" and self.target is not None and option_id is not None:
            draft = None if option_id == NO_DRAFT else self.local[int(option_id)].name
            self.dismiss((self.target.name, draft))
        elif list_id == "catalog" and option_id is not None:
            self.start_pull(option_id)

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        """Moving through the local models shows each one's drafts at once (Enter then picks the pair): the pane
        was empty until a target was chosen, so a bundled pair looked as if it had no draft."""
        if event.option_list.id == "local" and event.option.id is not None:
            model = self.local[int(event.option.id)]
            if model.info is not None:
                self.show_drafts(model, focus=False)

    def show_drafts(self, target: LocalModel, focus: bool = True) -> None:
        """Every other usable local model: compatible ones selectable, the rest greyed out with the reason."""
        assert target.info is not None
        self.target = target
        self.query_one("#drafts-title", Static).update(f"Drafts for {target.name} · Enter: chat with this pair")
        drafts = self.query_one("#drafts", OptionList)
        drafts.clear_options()
        heads = mtp_heads(target.info)
        drafts.add_option(Option("(no draft file: its own MTP head drafts)" if heads else
                                 "(no draft: ar, lookahead and lookup only)", id=NO_DRAFT))
        own: list[int] = []  # the rows of compatible drafts made for a target's layers (EAGLE-3, DFlash)
        others: list[int] = []  # of the other compatible models
        for i, m in enumerate(self.local):
            if m is target or m.info is None:
                continue
            verdict = check_pair(target.info, m.info)
            label = f"{m.name} · {format_size(m.info.size_bytes)} {m.info.quantization or ''}" \
                + (f" · {_OWN_DRAFTERS[m.info.architecture]}" if m.info.architecture in _OWN_DRAFTERS else "")
            if verdict.ok:
                (own if m.info.architecture in _OWN_DRAFTERS else others).append(drafts.option_count)
                drafts.add_option(Option(label, id=str(i)))
            else:
                drafts.add_option(Option(f"{label} — {verdict.problems[0]}", id=str(i), disabled=True))
        # The likely choice first: the target's own drafter (a draft made for it, else its MTP head), else the
        # first compatible draft model, else chatting without one.
        drafts.highlighted = (own or ([0] if heads else others) or [0])[0]
        if focus:
            drafts.focus()

    # -- downloads ------------------------------------------------------------

    def action_pull(self) -> None:
        catalog = self.query_one("#catalog", OptionList)
        if catalog.highlighted is not None:
            option_id = catalog.get_option_at_index(catalog.highlighted).id
            if option_id is not None:
                self.start_pull(option_id)

    def start_pull(self, ref: str) -> None:
        if self.pulling:
            self.notify("a download is running; Escape cancels it", severity="warning")
            return
        self.pulling = True
        self._cancel.clear()
        bar = self.query_one("#pull-progress", ProgressBar)
        bar.update(total=None, progress=0)
        bar.display = True
        self._status(f"pulling {ref}…")
        self._pull_worker(ref)

    @work(thread=True, group="pull", exit_on_error=False)
    def _pull_worker(self, ref: str) -> None:
        try:
            models = hub_models(ref)
            if not models:
                raise ModelError(f"{ref}: not in the catalog")
            for model in models:
                pull(model, progress=lambda p: self.post_message(PullProgress(p)), cancel=self._cancel)
            self.post_message(PullEnded(None))
        except Cancelled:
            self.post_message(PullEnded("cancelled; the partial download is kept and the next pull resumes it"))
        except Exception as e:  # one line in the screen; the app stays open
            self.post_message(PullEnded(describe(e)))

    def on_pull_progress(self, message: PullProgress) -> None:
        p = self.last_progress = message.progress
        bar = self.query_one("#pull-progress", ProgressBar)
        bar.update(total=p.total, progress=p.done)
        total = f" of {format_size(p.total)}" if p.total else ""
        self._status(f"{p.filename}: {format_size(p.done)}{total}")

    def on_pull_ended(self, message: PullEnded) -> None:
        self.pulling = False
        self.query_one("#pull-progress").display = False
        self.refresh_local()
        self._status(message.error or "download complete")
        if message.error:
            self.notify(message.error, severity="error" if "cancelled" not in message.error else "warning")

    def action_back(self) -> None:
        if self.pulling:
            self._cancel.set()
            self._status("cancelling…")
        else:
            self.dismiss(None)
