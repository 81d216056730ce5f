"""The chat screen: transcript, input, live stats bar, key bindings.

llama.cpp work (loading, the plain-decoding calibration, every turn) runs on
one thread for the app's whole life (`_engine_thread`), one job at a time
under `_engine_lock`, started from Textual thread workers, and reaches the UI
only as messages (app.tui.streaming), so the interface never waits on the
model. One thread, because llama.cpp's CPU backend runs its compute on
OpenMP: every thread that starts a decode gets a team of OpenMP threads that
lives as long as it does, and once more OpenMP threads are alive than there
are cores, libgomp's idle threads stop spinning and sleep, so every
operation waits for a thread to wake: with a new worker thread per turn the
chat app answered far slower than `specchat run` (docs/results.md, "Figures
behind design choices").
Escape sets the cancel flag the strategy polls between target forwards; the
partial answer is kept and the session stays usable.
A thinking model's reasoning streams in a block of its own above the answer
(app.tui.thinking); F7 turns thinking on or off (the `thinking` setting),
Ctrl+O expands or folds the last answer's reasoning.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, TypeVar

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.reactive import reactive
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Header, Input, ProgressBar

from app.conversations import Conversation, ConversationStore, new_conversation_id, now_iso
from app.errors import describe
from app.loading import open_engine
from app.prompt_format import ThinkingError
from app.session import ChatSession, TurnRequest, measure_plain_decoding
from app.settings import CHAT_N_SEQ_MAX, Settings
from app.tui.history_screen import HistoryScreen
from app.tui.models_screen import ModelsScreen
from app.tui.settings_screen import SettingsScreen
from app.tui.stats_bar import StatsBar, legend_markup, turn_label
from app.tui.messages import (BaselineMeasured, LoadFailed, LoadProgress, ModelLoaded, PromptDecoded, TokensArrived,
                              TurnFailed, TurnFinished)
from app.tui.streaming import Pacer, PlainBaseline, stream_events
from app.tui.thinking import answer_tail
from app.tui.transcript import AnswerView, Note, Transcript, UserMessage
from app.tui.welcome_screen import WelcomeScreen
from backends.engine import Engine
from backends.registry import NEEDS_DRAFT, STRATEGIES, n_seq_needed
from backends.events import Done
from models.demo import GEMMA, SMOLLM2

T = TypeVar("T")

# A turn's cells go to disk (backends.kv_store) once the chat has been idle this long after the answer: a next
# message sent sooner meets neither the copy of the cells nor their write (the turn after it keeps the longer
# conversation), one typed later meets a finished write (docs/results.md, "The next turn while the last one's
# cells go to disk"). Whatever is not kept yet is kept when the app closes or loads other models.
KEEP_WHEN_IDLE_S = 2.0
# Settings whose change needs the models loaded again.
RELOAD_FIELDS = ("target", "draft", "n_ctx", "n_batch", "threads", "n_gpu_layers", "n_gpu_layers_draft", "rpc")


class ChatScreen(Screen):
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("f2", "next_strategy", "Strategy"),
        Binding("f3", "toggle_view", "Spec view"),
        Binding("f4", "settings", "Settings"),
        Binding("f5", "history", "Chats"),
        Binding("f6", "models", "Models"),
        Binding("f7", "toggle_thinking", "Thinking"),
        Binding("ctrl+o", "toggle_thoughts", "Thoughts", show=False),  # a click on the block does it too
        Binding("ctrl+n", "new_chat", "New chat"),
    ]

    generating: reactive[bool] = reactive(False, init=False)  # an answer is streaming

    def __init__(self, settings: Settings, store: ConversationStore, save: Callable[[Settings], None],
                 calibrate: bool = True, resume: str | None = None) -> None:
        super().__init__()
        self.settings = settings
        self._resume = resume  # a saved conversation to reopen once the model is loaded (`chat --resume`)
        self.store = store
        self._save = save
        self.calibrate = calibrate
        self.engine: Engine | None = None
        self.session: ChatSession | None = None
        self.loading = False
        self.conversation_id = new_conversation_id()
        self._engine_lock = threading.Lock()
        self._engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specchat-engine")
        self._cancel = threading.Event()
        self._pacer = Pacer()  # the interval between token batches, from what showing them costs
        self._answer: AnswerView | None = None
        self._keep_timer: Timer | None = None  # keeps the last turn's cells once the chat is idle
        self._baseline = PlainBaseline()  # plain decoding's rate on this model: what the speedup is against
        self.last_done: Done | None = None  # the last turn's end, with its stats
        # The conversation (its system prompt and messages) while the models load again: the next session's.
        self._carried: tuple[str, list] | None = None
        self._reload_pending = False  # models changed while an answer or a load ran: loaded again when it ends
        self._asked: UserMessage | None = None  # the running turn's message, put back in the input if it fails

    # -- layout ---------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        yield Transcript(id="transcript")
        yield StatsBar()
        yield Input(placeholder="Message (Enter to send)", id="prompt")
        yield Footer(compact=True)

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    @property
    def stats(self) -> StatsBar:
        return self.query_one(StatsBar)

    def on_mount(self) -> None:
        self._show_label()
        self.query_one("#prompt", Input).focus()
        if self.settings.target:
            self.load_models()
        else:
            self.app.push_screen(WelcomeScreen(), self._welcome_choice)

    def _welcome_choice(self, choice: str | None) -> None:
        if choice in ("chat", "demo"):
            recipe = SMOLLM2 if choice == "chat" else GEMMA
            self._change_settings(replace(self.settings, target=recipe.target_alias, draft=recipe.draft_alias))
        elif choice == "models":
            self.action_models()
        else:
            self.action_settings()

    def _show_label(self) -> None:
        s = self.settings
        self.stats.show(label=turn_label(s.strategy, s.options, s.params))

    def _note(self, text: str, kind: str = "info") -> None:
        self.transcript.add(Note(text, kind))

    # -- loading --------------------------------------------------------------

    def load_models(self) -> None:
        if self.generating or self.loading:  # the settings are saved; the models follow them once it ends
            self._reload_pending = True
            self.notify("the models load again once the current answer or load ends (Escape stops an answer)")
            return
        self._reload_pending = False
        self.loading = True
        old, old_session = self.engine, self.session
        if old_session is not None:  # the conversation goes on with the new models
            self._carried = old_session.system_prompt, list(old_session.messages)
        self.engine = self.session = None
        self.stats.show(state="loading…")
        self.mount(ProgressBar(total=None, show_eta=False, id="load-progress"), before=self.stats)
        self._load_worker(self.settings, old, old_session)

    def _on_engine_thread(self, job: Callable[[], T]) -> T:
        """Run `job` on the engine thread, one job at a time; returns its result (or raises its exception)."""
        with self._engine_lock:
            return self._engine_thread.submit(job).result()

    @work(thread=True, group="engine", exit_on_error=False)
    def _load_worker(self, settings: Settings, old: Engine | None, old_session: ChatSession | None) -> None:
        post = self.post_message

        def load() -> Engine:
            if old_session is not None:
                old_session.close()
            if old is not None:
                old.close()  # before loading: two big models at once may not fit in memory
            return open_engine(settings, CHAT_N_SEQ_MAX, lambda msg: post(LoadProgress(msg)), announce=True)

        try:
            engine = self._on_engine_thread(load)
            post(ModelLoaded(engine))
            if self.calibrate:
                post(BaselineMeasured(self._on_engine_thread(lambda: measure_plain_decoding(engine))))
        except Exception as e:  # shown in the app; the app stays open
            post(LoadFailed(describe(e)))

    def on_load_progress(self, message: LoadProgress) -> None:
        self.stats.show(state=message.text)

    def _end_loading(self) -> None:
        self.loading = False
        for bar in self.query("#load-progress"):
            bar.remove()

    def _reload_if_pending(self) -> None:
        if self._reload_pending and not self.generating and not self.loading:
            self.load_models()

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self._end_loading()
        engine = message.engine
        system_prompt, previous = self._carried or (self.settings.system_prompt, [])
        self._carried = None
        self.engine = engine
        self.session = ChatSession(engine, system_prompt, kv_bytes=self.settings.kv_disk)
        self._baseline.reset()  # another model's plain rate says nothing of this one's
        self.stats.baseline = None
        self.session.reset(previous)
        names = engine.config.target.name + (f" + {engine.config.draft.name}" if engine.config.draft else "")
        self.app.sub_title = names
        mode = "plain completion (no chat template)" if self.session.plain else "chat template"
        self._note(f"loaded {names} · {mode}")
        self.stats.show(state="ready")
        if self.settings.strategy in NEEDS_DRAFT and engine.draft is None:  # nothing drafts for it: lookup does
            self._change_settings(replace(self.settings, strategy="lookup"))
            self.notify(f"{names} has no drafter: strategy lookup")
        if self._resume is not None:
            wanted, self._resume = self._resume, None
            if wanted == "last":
                saved = self.store.list()
                if not saved:
                    self.notify("no saved conversation to resume", severity="warning")
                wanted = saved[0].id if saved else None
            self._reopen(wanted)
        self._reload_if_pending()

    def on_load_failed(self, message: LoadFailed) -> None:
        self._end_loading()
        self._note(f"could not load the model: {message.error}", "error")
        self.stats.show(state="no model · F4 to choose one")
        self.notify(message.error, title="model not loaded", severity="error")
        self._reload_if_pending()

    def on_baseline_measured(self, message: BaselineMeasured) -> None:
        self._baseline.calibrated(message.tokens_per_second)  # the turns' own plain steps are the better baseline
        self.stats.show(baseline=self._baseline.value)

    # -- turns ----------------------------------------------------------------

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = event.value.strip()
        if not text:
            return
        if self.generating:
            self.notify("still answering; Escape stops it", severity="warning")
            return
        if self.session is None:
            self.notify("no model is loaded (F4: settings)", severity="warning")
            return
        event.input.value = ""
        s = self.settings
        request = TurnRequest(s.strategy, s.params, s.options, s.thinking, s.reasoning_effort)
        self._asked = UserMessage(text)
        self.transcript.add(self._asked)
        self._answer = AnswerView(s.speculation_view)
        self.transcript.add(self._answer)
        self.generating = True
        self._stop_keeping()  # the turn after this one keeps the longer conversation
        self._cancel.clear()
        self.stats.show(state="answering…")
        self._turn_worker(self.session, text, request)

    @work(thread=True, group="engine", exit_on_error=False)
    def _turn_worker(self, session: ChatSession, text: str, request: TurnRequest) -> None:
        try:
            self._on_engine_thread(lambda: stream_events(
                request.strategy, session.turn(text, request, self._cancel.is_set), self.post_message, self._pacer))
            self.app.call_from_thread(self._keep_when_idle)
        except ThinkingError as e:  # thinking off where the model cannot turn it off: what to do instead
            self.post_message(TurnFailed(f"{e} (F7 turns thinking back on; F4 sets a Thinking budget)"))
        except Exception as e:  # a prompt that does not fit, a template error, a bad setting
            self.post_message(TurnFailed(describe(e)))

    def _keep_when_idle(self) -> None:
        self._stop_keeping()
        self._keep_timer = self.set_timer(KEEP_WHEN_IDLE_S, self._keep_now)

    def _stop_keeping(self) -> None:
        if self._keep_timer is not None:
            self._keep_timer.stop()
            self._keep_timer = None

    def _keep_now(self) -> None:
        self._keep_timer = None
        if self.session is not None and not self.generating and not self.loading:
            self._keep_worker(self.session)

    @work(thread=True, group="engine", exit_on_error=False)
    def _keep_worker(self, session: ChatSession) -> None:
        self._on_engine_thread(session.keep_cells)

    def watch_generating(self, generating: bool) -> None:
        # Each blink of the cursor is a frame of its own, and while an answer streams every frame is CPU time
        # taken from generation; the cursor stays shown, still.
        self.query_one("#prompt", Input).cursor_blink = not generating

    def on_prompt_decoded(self, message: PromptDecoded) -> None:
        p = message.prefilled
        restored = self.session.restored if self.session is not None else None
        kept = f", restored {restored[0]} tokens in {1000 * restored[1]:.0f} ms" if restored else ""
        self.stats.show(state=f"answering · prompt {p.n_tokens} tokens, {p.n_cached} cached{kept}")
        self._pacer.started()

    def on_tokens_arrived(self, message: TokensArrived) -> None:
        self._pacer.arrived()
        if self._answer is not None:
            self._answer.add_tokens(message.tokens, message.thought)
        self.stats.show(live=message.live, baseline=self._baseline.for_answer(message.live))

    def on_turn_finished(self, message: TurnFinished) -> None:
        done = self.last_done = message.done
        self.generating = False
        self._asked = None
        if self._answer is not None:
            # A thinking that never ended (no answer, or cancelled) took the whole turn.
            self._answer.finish(answer_tail(self._answer.output_text, done), done.reasoning,
                                done.stats.decode_seconds)
        stats = done.stats
        if done.reason != "error":
            self._baseline.turn(message.live)
            self.stats.show(baseline=self._baseline.for_answer(message.live))
        # A turn stopped before its first token has no figures worth showing.
        last_why = self.stats.live.why if self.stats.live is not None else ""
        live = replace(message.live, why=message.live.why or last_why) if stats.generated_tokens else None
        self.stats.show(live=live, state=f"done: {done.reason}")
        if done.reason == "error":
            self._note(f"generation failed: {done.error}", "error")
        elif done.reason == "cancelled":
            self._note("stopped; the answer so far is kept", "info")
        if self.session is not None and self.session.dropped:
            self._note(f"the context is full: the oldest {self.session.dropped} messages were left out of "
                       "the model's view (Ctrl+N starts a new chat)", "info")
        self._save_conversation()
        self._reload_if_pending()

    def on_turn_failed(self, message: TurnFailed) -> None:
        """Nothing joined the conversation: the message leaves the transcript and goes back to the input."""
        self.generating = False
        if self._answer is not None:
            self._answer.remove()
            self._answer = None
        if self._asked is not None:
            self._asked.remove()
            prompt = self.query_one("#prompt", Input)
            if not prompt.value:
                prompt.value = self._asked.text
            self._asked = None
        self._note(message.error, "error")
        self.stats.show(state="ready")
        self._reload_if_pending()

    def _save_conversation(self) -> None:
        if self.session is None or not self.session.messages:
            return
        try:
            self.store.save(Conversation(self.conversation_id, now_iso(), self.settings.target,
                                         self.session.system_prompt, tuple(self.session.messages)))
        except OSError as e:
            self.notify(f"could not save the conversation: {e}", severity="error")

    # -- actions --------------------------------------------------------------

    def action_stop(self) -> None:
        if self.generating:
            self._cancel.set()
            self.stats.show(state="stopping…")

    def _available(self, strategy: str) -> bool:
        if strategy in NEEDS_DRAFT and self.engine is not None and self.engine.draft is None:
            return False
        return n_seq_needed(strategy, self.settings.options) <= CHAT_N_SEQ_MAX

    def action_next_strategy(self) -> None:
        i = STRATEGIES.index(self.settings.strategy)
        for step in range(1, len(STRATEGIES) + 1):
            candidate = STRATEGIES[(i + step) % len(STRATEGIES)]
            if self._available(candidate):
                self._change_settings(replace(self.settings, strategy=candidate))
                self.notify(f"strategy: {candidate} (from the next turn)")
                return

    def action_toggle_view(self) -> None:
        self._change_settings(replace(self.settings, speculation_view=not self.settings.speculation_view))
        if self.settings.speculation_view:  # what each colour means, drafters by name (the stats bar's share too)
            self.notify(legend_markup(), title="speculation view", timeout=10)

    def action_toggle_thinking(self) -> None:
        self._change_settings(replace(self.settings, thinking=not self.settings.thinking))
        self.notify(f"thinking: {'on' if self.settings.thinking else 'off'} (from the next turn; "
                    "for a model that thinks)")

    def action_toggle_thoughts(self) -> None:
        """Expand or fold the reasoning of the last answer that has one."""
        for answer in reversed(self.transcript.answers()):
            if answer.toggle_thinking():
                return

    def action_settings(self) -> None:
        self.app.push_screen(SettingsScreen(self.settings), self._settings_done)

    def _settings_done(self, settings: Settings | None) -> None:
        if settings is not None:
            self._change_settings(settings)

    def _change_settings(self, new: Settings) -> None:
        old, self.settings = self.settings, new
        self._save(new)
        self._show_label()
        if new.speculation_view != old.speculation_view:
            for answer in self.transcript.answers():
                answer.set_view(new.speculation_view)
        if new.system_prompt != old.system_prompt:  # (only then: a reopened chat keeps its own)
            if self.session is not None:
                self.session.system_prompt = new.system_prompt
            elif self._carried is not None:  # the models are loading: the conversation they go on with
                self._carried = new.system_prompt, self._carried[1]
        models_changed = any(getattr(new, f) != getattr(old, f) for f in RELOAD_FIELDS)
        if new.target and (models_changed or (self.engine is None and not self.loading)):
            self.load_models()
        if not self._available(new.strategy):
            self.notify(f"'{new.strategy}' needs a draft model or fewer sequences; set one in Settings (F4)",
                        severity="warning")

    def action_models(self) -> None:
        self.app.push_screen(ModelsScreen(), self._models_chosen)

    def _models_chosen(self, pair: tuple[str, str | None] | None) -> None:
        if pair is not None:  # a pair without a draft file may still draft (the target's MTP head): see on_model_loaded
            target, draft = pair
            self._change_settings(replace(self.settings, target=target, draft=draft))

    def action_new_chat(self) -> None:
        if self.generating:
            self.notify("stop the answer first (Escape)", severity="warning")
            return
        self.transcript.remove_children()
        self.conversation_id = new_conversation_id()
        self._carried = None
        self.stats.clear_figures("new chat")
        if self.session is not None:
            self.session.system_prompt = self.settings.system_prompt
            self.session.reset()

    def action_history(self) -> None:
        self.app.push_screen(HistoryScreen(self.store.list()), self._reopen)

    def _reopen(self, conversation_id: str | None) -> None:
        if conversation_id is None:
            return
        if self.generating or self.session is None:
            self.notify("load a model and stop any answer before reopening a chat", severity="warning")
            return
        try:
            conversation = self.store.load(conversation_id)
        except (OSError, ValueError) as e:  # a malformed file is a ValueError (ConversationStore.load)
            self.notify(f"could not open that conversation: {e}", severity="error")
            return
        self.transcript.remove_children()
        for m in conversation.messages:
            if m.role == "user":
                self.transcript.add(UserMessage(m.content))
            elif m.role == "assistant":
                answer = AnswerView(self.settings.speculation_view)
                self.transcript.add(answer)
                answer.finish(m.content, m.reasoning)
        self.conversation_id = conversation.id
        self.stats.clear_figures(f"reopened: {conversation.turns}")
        self.session.system_prompt = conversation.system_prompt
        self.session.reset([m for m in conversation.messages if m.role != "system"])

    def close_engine(self) -> None:
        """On exit: stop a running answer, then free llama.cpp's memory once no worker uses it."""
        self._cancel.set()
        if self._engine_lock.acquire(timeout=10):
            try:
                if self.engine is not None:
                    if self.session is not None:
                        self.session.close()
                    self.engine.close()
                    self.engine = self.session = None
            finally:
                self._engine_lock.release()
        self._engine_thread.shutdown(wait=False)
