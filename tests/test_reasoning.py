"""Thinking models on real llama.cpp (backends.reasoning, app.prompt_format, `specchat run`): the output split
into reasoning and answer as it streams, the budget that ends the thinking, thinking turned off, a grammar on the
answer only, and every strategy's greedy output unchanged by any of it. The model is SmolLM2-Instruct re-packed
with QwQ's original template (the prompt opens the block) and Qwen3's (the model opens it; enable_thinking)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.chat_template import ChatMessage
from app.prompt_format import PromptFormat, ThinkingError
from backends.engine import Engine, EngineConfig
from backends.events import REJECTED, Done, Prefilled, Token
from backends.grammar import compile_grammar
from backends.registry import STRATEGIES
from backends.sampling import GenParams
from engine_helpers import DEMO_NOISE, assert_greedy_agrees

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is 17 times 3? Think it through."


@pytest.fixture(scope="module")
def qwq(thinking_models):
    engine = Engine(EngineConfig(target=thinking_models.qwq, draft=thinking_models.draft, n_ctx=2048,
                                 threads=os.cpu_count(), n_seq_max=16))
    yield engine
    engine.close()


def _prompt(engine: Engine, thinking: bool = True, question: str = QUESTION):
    fmt = PromptFormat(engine)
    kwargs = fmt.thinking_kwargs(thinking)
    messages = [ChatMessage("user", question)]
    return fmt.tokens(messages, kwargs=kwargs), fmt.reasoning_for(messages, kwargs=kwargs)


def _run(engine: Engine, strategy: str, params: GenParams, prompt: list[int]) -> tuple[list, Done]:
    events = list(engine.strategy(strategy).generate(prompt, params))
    done = events[-1]
    assert isinstance(done, Done) and done.reason != "error", done
    return events, done


def test_the_formats_are_found_from_the_templates(qwq, thinking_models) -> None:
    fmt = PromptFormat(qwq).reasoning
    assert (fmt.start, fmt.end, fmt.opened, fmt.can_disable) == ("<think>", "</think>", True, False)
    engine = Engine(EngineConfig(target=thinking_models.qwen3, n_ctx=512, threads=1))
    try:
        qwen3 = PromptFormat(engine)
        assert (qwen3.reasoning.opened, qwen3.reasoning.can_disable) == (False, True)
        off = qwen3.render([ChatMessage("user", "Hi")], kwargs=qwen3.thinking_kwargs(False))
        assert off.endswith("<think>\n\n</think>\n\n"), "Qwen3's template closes an empty block when off"
        assert qwen3.reasoning_for([ChatMessage("user", "Hi")], kwargs=qwen3.thinking_kwargs(False)).opened is False
    finally:
        engine.close()
    with pytest.raises(ThinkingError, match="cannot turn thinking off"):
        PromptFormat(qwq).thinking_kwargs(False)


@pytest.mark.parametrize("budget", [None, 24, 0])
def test_streamed_pieces_make_the_whole_and_every_strategy_gives_the_same_greedy_tokens(qwq, budget) -> None:
    """The prompt opens the block: what the model writes is reasoning until its end tag (or, unclosed, to the
    end). The tokens' reasoning and answer pieces add up to the Done's texts; the budget leaves at most that
    many tokens before the end tag, which is in the output as tokens; and the tokens are the same for ar and
    every speculating strategy (each phase is an ordinary generation, the answer's from the cached prefix)."""
    prompt, fmt = _prompt(qwq)
    assert fmt.opened
    params = GenParams(max_tokens=96, reasoning=fmt, reasoning_budget=budget)
    results = {}
    for strategy in ("ar", *(s for s in STRATEGIES if s != "ar")):  # sps and tree with the fixture's draft
        events, done = _run(qwq, strategy, params, prompt)
        assert isinstance(events[0], Prefilled) and sum(isinstance(e, Prefilled) for e in events) == 1
        shown = [e for e in events if isinstance(e, Token) and e.kind != REJECTED]
        assert [e.id for e in shown] == list(done.tokens), "the output is the tokens not rejected"
        assert "".join(e.reasoning for e in shown) == done.reasoning
        assert "".join(e.text for e in shown) + done.tail == done.text
        assert "</think>" not in done.reasoning + done.text
        results[strategy] = done.tokens
    for strategy, tokens in results.items():  # auto's batches follow live timings: parting at a near-tie only
        assert_greedy_agrees(qwq, prompt, results["ar"], tokens, strategy, DEMO_NOISE)
    tokens = list(results["ar"])
    end = qwq.target_model.tokenize("</think>", add_special=False, parse_special=True)
    at = next((i for i in range(len(tokens)) if tokens[i:i + len(end)] == end), None)
    if budget is not None:
        assert at is not None and at <= budget + 1, (at, budget)  # the budget, then the (forced) tag
        assert done.text, "the answer follows the thinking"
    if budget == 0:
        assert done.reasoning == ""


def test_without_a_budget_the_thinking_ends_where_the_model_ends_it_or_runs_to_the_end(qwq) -> None:
    """No budget: one generation's tokens, exactly those of decoding without the split (the split changes
    text, never tokens)."""
    prompt, fmt = _prompt(qwq)
    _, split = _run(qwq, "ar", GenParams(max_tokens=64, reasoning=fmt), prompt)
    _, whole = _run(qwq, "ar", GenParams(max_tokens=64), prompt)
    assert split.tokens == whole.tokens
    end = whole.text.find("</think>")
    expected = whole.text if end < 0 else whole.text[:end]
    assert split.reasoning == expected.strip()


def test_a_grammar_constrains_the_answer_and_never_the_thinking(qwq) -> None:
    """A JSON schema: the thinking is free text (the prompt opens the block), the answer after the end tag is
    JSON that parses and follows the schema."""
    prompt, fmt = _prompt(qwq, question="Give the answer to 17 times 3 as JSON.")
    model = qwq.target_model
    grammar = compile_grammar("json_schema", {"type": "object", "properties": {"answer": {"type": "integer"}},
                                              "required": ["answer"]}, model.guidance_tokenizer, model.n_vocab)
    for strategy in ("ar", "auto"):
        _, done = _run(qwq, strategy, GenParams(max_tokens=120, reasoning=fmt, reasoning_budget=16, grammar=grammar),
                       prompt)
        assert done.reasoning, "free thinking first"
        assert isinstance(json.loads(done.text)["answer"], int), done.text


def test_thinking_off_on_qwen3_gives_no_reasoning(thinking_models) -> None:
    engine = Engine(EngineConfig(target=thinking_models.qwen3, n_ctx=1024, threads=os.cpu_count()))
    try:
        prompt, fmt = _prompt(engine, thinking=False)
        _, done = _run(engine, "auto", GenParams(max_tokens=48, reasoning=fmt), prompt)
        assert done.reasoning == "" and done.text
    finally:
        engine.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SPECCHAT_MEMORY_DIR": ""})


def test_run_shows_the_reasoning_on_stderr_and_json_events_carry_the_channel(thinking_models) -> None:
    model = str(thinking_models.qwq)
    shown = _cli("-m", model, QUESTION, "-n", "64", "--temp", "0", "-t", "2", "--reasoning-budget", "12", "-s", "ar")
    assert shown.returncode == 0, shown.stderr
    lines = [json.loads(line) for line in _cli("-m", model, QUESTION, "-n", "64", "--temp", "0", "-t", "2",
                                                "--reasoning-budget", "12", "-s", "ar", "--json").stdout.splitlines()]
    done = lines[-1]
    assert done["type"] == "done" and done["reasoning"] and done["text"]
    tokens = [line for line in lines if line["type"] == "token"]
    assert {t["channel"] for t in tokens} == {"reasoning", "content"}
    assert "".join(t.get("reasoning", "") for t in tokens) == done["reasoning"]
    assert done["reasoning"] in shown.stderr and "</think>" not in shown.stdout
    assert shown.stdout.strip() == done["text"].strip(), "stdout holds the answer only"
    hidden = _cli("-m", model, QUESTION, "-n", "64", "--temp", "0", "-t", "2", "--reasoning-budget", "12", "-s", "ar",
                  "--reasoning", "hide")
    assert done["reasoning"] not in hidden.stderr and hidden.stdout == shown.stdout


def test_run_no_think_on_a_template_that_cannot_is_one_line(thinking_models) -> None:
    out = _cli("-m", str(thinking_models.qwq), "hi", "--no-think", "-n", "8", "-t", "1")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot turn thinking off" in lines[0] and "Traceback" not in out.stderr


def test_auto_learns_the_thinking_apart_from_the_answers(qwq) -> None:
    """The thinking phase keeps its own learnt state ("greedy.reasoning"), beside the answers' ("greedy")."""
    prompt, fmt = _prompt(qwq)
    qwq.auto_states = {}
    _run(qwq, "auto", GenParams(max_tokens=40, reasoning=fmt, reasoning_budget=16), prompt)
    assert {"greedy", "greedy.reasoning"} <= set(qwq.auto_states)
    thinking, answer = qwq.auto_states["greedy.reasoning"], qwq.auto_states["greedy"]
    assert thinking is not answer and thinking.to_json() != answer.to_json()


@pytest.mark.parametrize("stop", [("4.5",), ("= 4",)])
def test_text_held_back_for_a_stop_string_reaches_the_stream(qwq, stop) -> None:
    """A stop string's possible start is held back until it cannot be one; at a phase's end it has no token to
    carry it: it goes with the next token or the Done's tail, so the answer's pieces still make the whole."""
    prompt, fmt = _prompt(qwq, question="What is 2+2?")
    for budget in (3, None):
        events, done = _run(qwq, "ar", GenParams(max_tokens=40, reasoning=fmt, reasoning_budget=budget, stop=stop),
                            prompt)
        shown = [e for e in events if isinstance(e, Token) and e.kind != REJECTED]
        assert "".join(e.text for e in shown) + done.tail == done.text
        assert done.reasoning.startswith("".join(e.reasoning for e in shown))


# A message that writes the tags, the start tag last: read over the whole prompt, it would look like an open block.
TAGGED = "Does `</think>` close what the `<think>` tag opens?"


def test_a_tag_a_message_writes_opens_no_block(qwq, thinking_models) -> None:
    """Only the generation prompt (the rendering with the assistant's turn less the one without) says whether the
    block is open, as llama.cpp reads it (common/chat.cpp, common_chat_template_generation_prompt): on Qwen3's
    template a user's or system message that writes `<think>` opens nothing, and the answer is content; QwQ's
    generation prompt still opens it."""
    messages = [ChatMessage("user", TAGGED)]
    engine = Engine(EngineConfig(target=thinking_models.qwen3, n_ctx=1024, threads=os.cpu_count()))
    try:
        qwen3 = PromptFormat(engine)
        kwargs = qwen3.thinking_kwargs(True)
        for system in ("", "Explain tags such as <think>."):
            fmt = qwen3.reasoning_for(messages, system, kwargs=kwargs)
            assert fmt is not None and fmt.opened is False, system
        assert qwen3.generation_prompt(messages, kwargs=kwargs) == "<|im_start|>assistant\n"
        off = qwen3.generation_prompt(messages, kwargs=qwen3.thinking_kwargs(False))
        assert off == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        _, done = _run(engine, "ar", GenParams(max_tokens=32, reasoning=fmt), qwen3.tokens(messages, kwargs=kwargs))
        assert done.reasoning == "" and done.text, done
    finally:
        engine.close()
    fmt = PromptFormat(qwq)
    assert fmt.reasoning_for(messages, "Explain tags such as </think>.", kwargs={}).opened is True
    assert fmt.generation_prompt(messages, kwargs={}) == "<|im_start|>assistant\n<think>\n"


def test_run_reads_a_tag_in_the_question_as_text(thinking_models) -> None:
    """`specchat run` on Qwen3's template: the question's `<think>` opens no block; the answer is content."""
    out = _cli("-m", str(thinking_models.qwen3), TAGGED, "-n", "24", "--temp", "0", "-t", "2", "-s", "ar", "--json")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert lines[-1]["type"] == "done" and lines[-1]["text"] and not lines[-1]["reasoning"]
    assert {t["channel"] for t in lines if t["type"] == "token"} == {"content"}
