"""Chat sessions without the UI: chat templates in the sandbox, plain completion, settings, saved chats."""

from __future__ import annotations

import json
import os
import random

import pytest

from app.chat_template import ChatMessage, ChatTemplateError, render_chat
from app.cli import build_parser
from app.commands.chat import settings_from_flags
from app.conversations import Conversation, ConversationStore
from app.session import ChatSession, TurnRequest, estimated_cut, first_fitting_cut
from app.settings import Settings, load_settings, save_settings
from backends.config import StrategyOptions, TreeConfig
from backends.engine import Engine, EngineConfig
from backends.events import Done, until_done
from backends.sampling import GenParams
from backends.strategies.lookup import LookupConfig
from gguf_factory import WORDS, write_llama_gguf
from models.files import write_atomic

# A Gemma-style template: BOS written by the template, turns marked with plain-text tags.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>\n"
    "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_template_renders_like_transformers() -> None:
    text = render_chat(TEMPLATE, [ChatMessage("system", "be brief"), ChatMessage("user", " hi ")], "<s>", "</s>")
    assert text == "<s><system>be brief</system>\n<user>hi</user>\n<assistant>"


@pytest.mark.parametrize("template, problem", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "failed"),  # sandbox escape attempt
    ("{{ messages.append(1) }}", "failed"),  # the immutable sandbox refuses mutation
    ("{% if %}", "does not parse"),
    ("{{ raise_exception('only user and assistant roles') }}", "refused"),
])
def test_template_errors_are_clear(template: str, problem: str) -> None:
    with pytest.raises(ChatTemplateError, match=problem):
        render_chat(template, [ChatMessage("user", "hi")], "<s>", "</s>")


def test_ministral_3_reads_earlier_reasoning_as_thinking_blocks() -> None:
    """Ministral 3 Reasoning's template reads an answer's reasoning only as a `thinking` content block (llama.cpp's
    common_chat_params_init_ministral_3 writes it so): as `reasoning_content` it was dropped from the prompt, and
    an answer with reasoning and no text (a turn cut short while thinking) made the template refuse the chat."""
    from pathlib import Path

    template = (Path(__file__).parent / "data" / "templates" /
                "mistralai-Ministral-3-14B-Reasoning-2512.jinja").read_text(encoding="utf-8")
    for answer in ("4", ""):
        messages = [ChatMessage("user", "2+2?"), ChatMessage("assistant", answer, reasoning="2+2 is 4"),
                    ChatMessage("user", "and 3+3?")]
        text = render_chat(template, messages, "<s>", "</s>")
        assert text.endswith(f"[INST]2+2?[/INST][THINK]2+2 is 4[/THINK]{answer}</s>[INST]and 3+3?[/INST]"), text[-120:]
    text = render_chat(template, [ChatMessage("system", "Be brief."), ChatMessage("user", "hi")], "<s>", "</s>")
    assert text == "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]hi[/INST]"


def _run(session: ChatSession, text: str, strategy: str = "ar", n: int = 12) -> Done:
    return until_done(session.turn(text, TurnRequest(strategy, GenParams(max_tokens=n), StrategyOptions())))


def test_chat_template_session_reuses_the_cache(tmp_path) -> None:
    model = write_llama_gguf(tmp_path / "chat.gguf", chat_template=TEMPLATE)
    engine = Engine(EngineConfig(target=model, n_ctx=1024, threads=1))
    try:
        session = ChatSession(engine, system_prompt="be brief")
        assert not session.plain
        tokens = session.prompt_tokens("hello")
        bos = engine.target_model.token_text(1)
        expected = engine.target_model.tokenize(
            f"{bos}<system>be brief</system>\n<user>hello</user>\n<assistant>", add_special=False, parse_special=True)
        assert tokens == expected and tokens.count(1) == 1  # one BOS: the template's
        first = _run(session, "hello")
        second = _run(session, "more")
        assert [m.role for m in session.messages] == ["user", "assistant"] * 2
        assert session.messages[1].content == first.text
        assert second.stats.prompt_cached > first.stats.prompt_tokens // 2
    finally:
        engine.close()


def test_plain_session_first_turn_is_the_raw_prompt(tiny_engine) -> None:
    session = ChatSession(tiny_engine)
    assert session.plain
    assert session.prompt_tokens("the cat") == tiny_engine.tokenize("the cat")
    done = _run(session, "the cat")
    # Later messages start on a new line of the same document.
    assert session.prompt_tokens("a dog") == tiny_engine.tokenize("the cat" + done.text + "\na dog")


def test_chat_flags_override_only_what_was_given() -> None:
    saved = Settings(target="saved.gguf", draft="saved-draft.gguf", strategy="lookup",
                     params=GenParams(max_tokens=300, temperature=0.7))
    args = build_parser().parse_args(["chat", "-s", "lookahead", "-W", "5", "--temp", "0"])
    got = settings_from_flags(saved, args)
    assert (got.strategy, got.options.lookahead.window, got.params.temperature) == ("lookahead", 5, 0.0)
    assert (got.target, got.draft, got.params.max_tokens) == ("saved.gguf", "saved-draft.gguf", 300)
    args = build_parser().parse_args(["chat", "-m", "new.gguf", "--draft-max", "3", "--no-adaptive"])
    got = settings_from_flags(saved, args)
    assert (got.target, got.draft) == ("new.gguf", None)  # a new target drops the old target's draft
    assert (got.options.sps.draft_max, got.options.lookup.draft_max, got.options.sps.adaptive) == (3, 3, False)


def test_seed_minus_one_overrides_a_saved_seed() -> None:
    saved = Settings(params=GenParams(seed=5))
    chat = lambda *flags: settings_from_flags(saved, build_parser().parse_args(["chat", *flags])).params.seed
    assert (chat(), chat("--seed", "9"), chat("--seed", "-1")) == (5, 9, None)


def test_flags_across_fields_apply_together() -> None:
    """Saved n-grams 3..4, flags 1..2: applied one at a time, max=2 would first meet min=3 and fail."""
    saved = Settings(options=StrategyOptions(lookup=LookupConfig(ngram_max=4, ngram_min=3)))
    args = build_parser().parse_args(["chat", "--lookup-ngram-max", "2", "--lookup-ngram-min", "1"])
    got = settings_from_flags(saved, args).options.lookup
    assert (got.ngram_min, got.ngram_max) == (1, 2)


def test_settings_round_trip_and_bad_file(tmp_path) -> None:
    path = tmp_path / "settings.json"
    settings = Settings(target="t.gguf", strategy="tree", params=GenParams(seed=7, stop=("END",)),
                        options=StrategyOptions(tree=TreeConfig(nodes="auto", shape="static")))
    save_settings(settings, path)
    assert load_settings(path) == (settings, None)
    path.write_text(json.dumps({"strategy": "warp"}))
    loaded, warning = load_settings(path)
    assert loaded == Settings() and "warp" in warning
    path.write_text(json.dumps({"params": {"temperature": "hot"}}))
    assert "temperature" in load_settings(path)[1]


def test_atomic_write_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch) -> None:
    path = tmp_path / "c.json"
    write_atomic(path, "old")

    def fail(*_args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        write_atomic(path, "new" * 1000)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temporary file left behind


def test_conversation_store_lists_newest_first_and_skips_broken_files(tmp_path) -> None:
    store = ConversationStore(tmp_path)
    for i, when in enumerate(["2026-01-01T00:00:00+00:00", "2026-02-01T00:00:00+00:00"]):
        store.save(Conversation(f"c{i}", when, "m.gguf", "", (ChatMessage("user", f"question {i}"),
                                                              ChatMessage("assistant", "answer"))))
    (tmp_path / "broken.json").write_text("{ not json")
    listed = store.list()
    assert [c.id for c in listed] == ["c1", "c0"]
    assert listed[0].title == "question 1"
    assert store.load("c0").messages[1].content == "answer"
    assert listed[0].turns == "1 turn"
    two = Conversation("c2", "2026-03-01T00:00:00+00:00", "m.gguf", "", listed[0].messages * 2)
    assert two.turns == "2 turns"


@pytest.mark.demo
def test_second_turn_decodes_only_the_new_message_on_gemma(demo_engine) -> None:
    session = ChatSession(demo_engine)
    first = _run(session, "The three primary colours are", "sps", 24)
    second = _run(session, "Another fact:", "lookahead", 16)
    new_tokens = len(demo_engine.target_model.tokenize("\nAnother fact:", add_special=False))
    turn1_tokens = first.stats.prompt_tokens + first.stats.generated_tokens
    assert second.stats.prompt_tokens == turn1_tokens + new_tokens
    assert second.stats.prompt_cached == turn1_tokens - 1  # all of turn 1 was reused


def test_old_turns_leave_the_prompt_when_the_context_is_full(tiny) -> None:
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=160, threads=1))
    try:
        session = ChatSession(engine)
        for i in range(6):
            done = _run(session, f"turn {i}", n=40)
            assert done.reason == "length"
            assert done.stats.prompt_tokens + 40 <= engine.target.n_ctx  # llama.cpp may round n_ctx up
        assert session.dropped >= 2 and session.dropped % 2 == 0
        assert len(session.messages) == 12  # the transcript keeps everything
        with pytest.raises(Exception, match="context"):
            _run(session, "word " * 400)  # a single message too long for the context
    finally:
        engine.close()


def test_a_full_chats_answers_keep_their_whole_room(tiny) -> None:
    # Once old turns leave the prompt, each answer still gets its max_tokens (up to half the context): a fixed
    # 256 tokens of room had cut every later answer of a full chat short.
    engine = Engine(EngineConfig(target=tiny.target, n_ctx=1024, threads=1))
    try:
        session = ChatSession(engine)
        request = TurnRequest("ar", GenParams(max_tokens=320, ignore_eos=True), StrategyOptions())
        for i in range(5):
            done = until_done(session.turn(f"turn {i}", request))
            assert done.stats.generated_tokens == 320, (i, done.reason, done.stats.prompt_tokens)
        assert session.dropped >= 2
        assert session.answer_reserve(4000) == engine.target.n_ctx // 2  # the conversation keeps the other half
    finally:
        engine.close()


def test_bad_chat_flag_is_one_line_and_exit_1(capsys, tmp_path, monkeypatch) -> None:
    from app.cli import main

    monkeypatch.setenv("SPECCHAT_CONFIG_DIR", str(tmp_path))
    assert main(["chat", "-m", "model.gguf", "--temp", "-1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["specchat: error: temperature must be >= 0"]


# -- where the prompt is cut when the conversation outgrows the context ------------------------------


def reference_prompt(session: ChatSession, user_text: str, reserve: int) -> tuple[list[int], int]:
    """The simple rule, one full render and tokenization per pair tried: drop pairs from the front until it fits."""
    n_ctx = session.engine.target.n_ctx
    history = session.messages
    while True:
        tokens = session.format.tokens([*history, ChatMessage("user", user_text)], session.system_prompt)
        if len(tokens) + reserve <= n_ctx or not history:
            return tokens, len(session.messages) - len(history)
        history = history[2:]


def random_text(rng: random.Random, most_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, most_words)))


def random_conversation(rng: random.Random, n_messages: int) -> list[ChatMessage]:
    return [ChatMessage("user" if i % 2 == 0 else "assistant", random_text(rng, 25)) for i in range(n_messages)]


@pytest.mark.parametrize("last", range(0, 12))
def test_first_fitting_cut_finds_the_boundary_from_any_hint(last) -> None:
    for answer in range(last + 1):
        for hint in range(-2, last + 3):
            calls: list[int] = []

            def fits(k: int) -> bool:
                calls.append(k)
                return k >= answer

            assert first_fitting_cut(fits, hint, last) == answer, (answer, hint)
            assert all(0 <= k <= last for k in calls) and len(calls) == len(set(calls))
            if hint == answer:
                assert len(calls) <= 2


def test_estimated_cut_keeps_the_largest_suffix_within_budget() -> None:
    costs = [5, 1, 4, 4, 2, 2]  # pairs cost 6, 8, 4
    assert estimated_cut(costs.__getitem__, 6, 3, 100) == 0
    assert estimated_cut(costs.__getitem__, 6, 3, 7) == 2  # the last pair and the new message: 7
    assert estimated_cut(costs.__getitem__, 6, 3, 6) == 3  # not even the last pair
    assert estimated_cut(costs.__getitem__, 6, 3, 15) == 1
    assert estimated_cut([5, 1, 4].__getitem__, 3, 1, 5) == 1  # an odd history: a lone last message


@pytest.fixture(scope="module")
def small_context_engines(tiny, tmp_path_factory):
    """A chat-template model and a plain base model, each with a 256-token context."""
    chat_model = write_llama_gguf(tmp_path_factory.mktemp("cut") / "chat.gguf", chat_template=TEMPLATE)
    engines = {name: Engine(EngineConfig(target=path, n_ctx=256, threads=1))
               for name, path in (("template", chat_model), ("plain", tiny.target))}
    yield engines
    for engine in engines.values():
        engine.close()


@pytest.mark.parametrize("kind", ["template", "plain"])
def test_cut_equals_the_simple_rule_on_random_conversations(small_context_engines, kind) -> None:
    engine = small_context_engines[kind]
    rng = random.Random(7)
    cuts = set()
    for case in range(40):
        session = ChatSession(engine, system_prompt=random_text(rng, 6) if case % 3 else "")
        session.reset(random_conversation(rng, rng.randint(0, 40)))
        for _ in range(3):  # later turns start from what the session learned
            user_text, reserve = random_text(rng, 30), rng.choice([0, 16, 64, 200])
            expected, dropped = reference_prompt(session, user_text, reserve)
            assert session.prompt_tokens(user_text, reserve) == expected
            assert session.dropped == dropped
            cuts.add(dropped if dropped < len(session.messages) else "all")
            session.messages += [ChatMessage("user", user_text), ChatMessage("assistant", random_text(rng, 25))]
    assert 0 in cuts and "all" in cuts and len(cuts) > 8, cuts  # the cases cut at many places


def test_a_long_conversation_costs_a_few_renderings_per_turn(small_context_engines, monkeypatch) -> None:
    session = ChatSession(small_context_engines["template"])
    rng = random.Random(3)
    session.reset(random_conversation(rng, 600))
    calls: list[int] = []
    real_render = session.format.render
    monkeypatch.setattr(session.format, "render", lambda messages, system="", **kw: calls.append(len(messages))
                        or real_render(messages, system, **kw))
    per_turn = []
    for _ in range(20):
        calls.clear()
        user_text = random_text(rng, 10)
        session.prompt_tokens(user_text, 32)
        assert session.dropped >= 560
        assert max(calls) < 40  # never the whole conversation
        per_turn.append(len(calls))
        session.messages += [ChatMessage("user", user_text), ChatMessage("assistant", random_text(rng, 25))]
    assert max(per_turn[1:]) <= 4 and sum(per_turn[1:]) / len(per_turn[1:]) <= 2.5, per_turn


def test_a_thinking_turn_renders_its_conversation_once(thinking_models, monkeypatch) -> None:
    """The prompt's rendering is the one the reasoning format is read from (QwQ's template opens the block in
    the generation prompt): a turn renders the conversation once with the assistant's turn opened, plus once
    without it (PromptFormat.generation_prompt), not once more for the reasoning."""
    engine = Engine(EngineConfig(target=thinking_models.qwq, n_ctx=1024, threads=os.cpu_count()))
    try:
        session = ChatSession(engine)
        assert session.format.reasoning is not None  # found once per model, from a probe of its own
        renders: list[str] = []
        real_render_inner = session.format._render
        monkeypatch.setattr(session.format, "_render", lambda template, *a: renders.append(template)
                            or real_render_inner(template, *a))
        request = TurnRequest("ar", GenParams(max_tokens=8), StrategyOptions())
        for question in ("What is 2 and 2?", "And 3 and 3?"):
            renders.clear()
            prompt, params = session.request_params(question, request)
            assert params.reasoning is not None and params.reasoning.opened  # read from the one rendering
            assert len(renders) == 2 and renders[0] == session.format.template, renders
            assert session.format.encode(session.rendered) == prompt
            session.messages += [ChatMessage("user", question), ChatMessage("assistant", "4", reasoning="2+2")]
    finally:
        engine.close()
