"""`specchat serve` on thinking models (issue 43), through the official `openai` client and httpx.

Two real servers on tests/conftest.py's `thinking_models` (SmolLM2-Instruct re-packed with QwQ's original
template, whose prompt opens `<think>` and cannot turn it off, and with Qwen3's, where the model opens the
block itself and `enable_thinking` turns it off). SmolLM2 never closes the block by itself, so the answer
after the thinking comes from a reasoning budget (the end tag forced): whole and streamed answers carry
`reasoning_content` apart from `content` and agree at temperature 0; thinking off is a 400 where the
template cannot do it; `reasoning_format: "none"` shows the output as written; a reasoning sent back
reaches the template; /v1/models and /props say how the model thinks; the field checks are a 400 naming the
field (tested in-process, without a server).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from typing import Iterator

import httpx
import openai
import pytest
from serve_helpers import API_KEY, Served, assert_error, spec, start_server, stop_server

from app.serve.fields import ApiError
from app.serve.thinking import ThinkingRequest, thinking_request
from app.settings import Settings
from backends.sampling import GenParams

QUESTION = "What is 17 times 3? Think it through."
USER = [{"role": "user", "content": QUESTION}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def qwq(thinking_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    served = start_server(["-m", str(thinking_models.qwq), "-md", str(thinking_models.draft), "--api-key", API_KEY,
                           "-np", "1", "--temp", "0", "-n", "48"], tmp_path_factory.mktemp("qwq") / "server.log")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def qwen3(thinking_models, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """SmolLM2 with Qwen3's template, and its draft (for `sps`); tests/test_serve_reasoning_opening.py uses it too."""
    served = start_server(["-m", str(thinking_models.qwen3), "-md", str(thinking_models.draft), "--api-key", API_KEY,
                           "-np", "1", "--temp", "0", "-n", "32"], tmp_path_factory.mktemp("qwen3") / "server.log")
    yield served
    stop_server(served)


def _reasoning(message: object) -> str | None:
    return (getattr(message, "model_extra", None) or {}).get("reasoning_content")


def _chat(served: Served, model: str, **extra: object):
    return served.client().chat.completions.create(model=model, messages=USER, temperature=0, extra_body=extra)


def _streamed(served: Served, model: str, **extra: object) -> tuple[str, str, list, object]:
    """A streamed answer's reasoning and content, reassembled; its chunks; its usage."""
    reasoning, content, chunks, usage = "", "", [], None
    for chunk in served.client().chat.completions.create(model=model, messages=USER, temperature=0, stream=True,
                                                         stream_options={"include_usage": True}, extra_body=extra):
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning += _reasoning(choice.delta) or ""
            content += choice.delta.content or ""
    return reasoning, content, chunks, usage


def _n_tokens(served: Served, text: str) -> int:
    return len(served.post("/tokenize", {"content": text}).json()["tokens"])


# -- QwQ: the prompt opens the block --------------------------------------------------------------------------


def test_whole_and_streamed_answers_keep_the_reasoning_apart_and_agree(qwq: Served) -> None:
    _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24)  # the prompt in the slot: every answer below reuses it
    whole = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24)
    message = whole.choices[0].message
    reasoning = _reasoning(message)
    assert reasoning and message.content, message
    for text in (reasoning, message.content):
        assert "<think>" not in text and "</think>" not in text
    assert whole.usage.completion_tokens_details.reasoning_tokens <= 24 < whole.usage.completion_tokens
    streamed_reasoning, streamed_content, chunks, usage = _streamed(qwq, "smollm2-qwq", reasoning_budget_tokens=24)
    assert (streamed_reasoning, streamed_content) == (reasoning, message.content)
    assert usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens_details.reasoning_tokens
    thinking = [i for i, c in enumerate(chunks) if c.choices and _reasoning(c.choices[0].delta)]
    answering = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].delta.content]
    assert thinking and answering and max(thinking) <= min(answering), "the thinking streams first, then the answer"


@pytest.mark.parametrize("field", ["reasoning_budget_tokens", "thinking_budget_tokens"])
def test_a_budget_ends_the_thinking_and_the_answer_follows(qwq: Served, field: str) -> None:
    unbounded = _chat(qwq, "smollm2-qwq")
    assert _reasoning(unbounded.choices[0].message) and not unbounded.choices[0].message.content, \
        "SmolLM2 never closes the block: without a budget, all it writes is reasoning"
    answer = _chat(qwq, "smollm2-qwq", **{field: 24})
    reasoning = _reasoning(answer.choices[0].message)
    assert reasoning and answer.choices[0].message.content
    assert _n_tokens(qwq, reasoning) <= 24 and answer.usage.completion_tokens_details.reasoning_tokens <= 24
    assert unbounded.choices[0].message.model_extra["reasoning_content"].startswith(reasoning[:20])
    message = _chat(qwq, "smollm2-qwq", **{field: 8}, reasoning_budget_message="Time to answer.")
    assert _reasoning(message.choices[0].message).endswith("Time to answer.") and message.choices[0].message.content


def test_the_forced_end_of_a_thinking_has_a_numeric_logprob(qwq: Served) -> None:
    # The budget's end tag is written by the server, never drawn from the model: its logprob is 0.0 (it had no
    # other choice), not null, where OpenAI's field is a number that clients add up.
    r = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=8, logprobs=True, top_logprobs=2)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert all(isinstance(e.logprob, float) and e.logprob <= 0 for e in entries), [e.logprob for e in entries]
    tokens = [e.token for e in entries]
    end = "".join(tokens).index("</think>")  # (several tokens in SmolLM2's vocabulary)
    forced = next(i for i in range(len(tokens)) if len("".join(tokens[:i + 1])) > end)
    assert [e.logprob for e in entries[forced:forced + 3]] == [0.0] * 3, tokens[forced:forced + 3]


def test_the_forced_end_of_a_thinking_counts_in_max_tokens(qwq: Served) -> None:
    # The end tag forced when the budget is spent counts as llama.cpp's forced (sampled) tokens do: cut at the
    # limit, never written past it (9 tokens of thinking and a 4-token "</think>\n\n" made 13 of 10).
    r = _chat(qwq, "smollm2-qwq", max_tokens=10, reasoning_budget_tokens=9)
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length", r.usage
    assert _reasoning(r.choices[0].message) and not r.choices[0].message.content


def test_thinking_off_is_a_400_where_the_template_cannot_turn_it_off(qwq: Served) -> None:
    for extra, param in (({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs.enable_thinking"),
                         ({"reasoning_effort": "none"}, "reasoning_effort")):
        message = assert_error(qwq.post("/v1/chat/completions", {"messages": USER, **extra}), 400, param=param)
        assert "cannot turn thinking off" in message and "reasoning_budget_tokens" in message
        with pytest.raises(openai.BadRequestError):
            qwq.client().chat.completions.create(model="smollm2-qwq", messages=USER, extra_body=extra)
    assert _chat(qwq, "smollm2-qwq", chat_template_kwargs={"enable_thinking": True}, max_tokens=4).choices


def test_reasoning_format_none_keeps_the_output_as_written(qwq: Served) -> None:
    split = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24).choices[0].message
    raw = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24, reasoning_format="none").choices[0].message
    assert _reasoning(raw) is None and "</think>" in raw.content
    thought, _, answer = raw.content.partition("</think>")
    assert (thought.removeprefix("<think>\n").strip(), answer.strip()) == (_reasoning(split), split.content)
    reasoning, content, _, _ = _streamed(qwq, "smollm2-qwq", reasoning_budget_tokens=24, reasoning_format="none")
    assert (reasoning, content) == ("", raw.content)
    deepseek = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24, reasoning_format="deepseek").choices[0].message
    assert (_reasoning(deepseek), deepseek.content) == (_reasoning(split), split.content)


def test_reasoning_format_none_starts_with_what_the_prompt_opened(qwq: Served) -> None:
    """As llama-server gives it (test-chat.cpp:2159): QwQ's prompt opens the block (`<think>\n`), and the content
    is that opening, then the output as written, whole and streamed (the first content delta carries it)."""
    raw = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24, reasoning_format="none").choices[0].message
    assert raw.content.startswith("<think>\n") and raw.content.count("<think>") == 1
    _, content, chunks, _ = _streamed(qwq, "smollm2-qwq", reasoning_budget_tokens=24, reasoning_format="none")
    first = next(c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content)
    assert content == raw.content and first.startswith("<think>\n") and len(first) > len("<think>\n")


def test_greedy_answers_are_the_same_under_ar_and_the_default_strategy(qwq: Served) -> None:
    """Token for token, up to 32 tokens: greedy_margins found this answer's 34th token won by 0.0087 only, a
    near-tie that another batch shape (auto's, sps's verification) may rightly decide otherwise."""
    answers = {}
    for strategy in ("ar", "auto", "sps"):
        a = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=24, max_tokens=32, **spec(strategy)).choices[0].message
        answers[strategy] = (_reasoning(a), a.content)
    assert answers["ar"][0] and answers["ar"][1]
    assert answers["auto"] == answers["ar"] == answers["sps"]


def test_tool_calls_and_json_are_read_from_the_answer(qwq: Served) -> None:
    called = qwq.client().chat.completions.create(
        model="smollm2-qwq", messages=[{"role": "user", "content": "The weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", temperature=0, max_tokens=64, extra_body={"reasoning_budget_tokens": 3})
    choice = called.choices[0]  # (SmolLM2 ends its turn inside the block after 6 tokens: a budget under that)
    assert choice.finish_reason == "tool_calls" and _reasoning(choice.message) and not choice.message.content
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert set(json.loads(choice.message.tool_calls[0].function.arguments)) == {"city"}
    raw = qwq.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "The weather in Paris?"}],
                                            "tools": [WEATHER], "tool_choice": "required", "max_tokens": 64,
                                            "reasoning_budget_tokens": 3, "reasoning_format": "none"}).json()
    assert raw["choices"][0]["message"]["tool_calls"][0]["function"] == \
        {"name": "get_weather", "arguments": choice.message.tool_calls[0].function.arguments}
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}},
              "required": ["name"], "additionalProperties": False}
    answer = qwq.client().chat.completions.create(
        model="smollm2-qwq", messages=[{"role": "user", "content": "Name a person."}], temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": person}},
        extra_body={"reasoning_budget_tokens": 8})
    assert _reasoning(answer.choices[0].message) and set(json.loads(answer.choices[0].message.content)) == {"name"}


def _answer(served: Served, stream: bool, **kw: object) -> tuple[str, str, list[tuple[str, str]], str]:
    """An answer's reasoning, content, tool calls (name, arguments) and finish reason: whole, or reassembled
    from the stream's deltas."""
    client = served.client()
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        return _reasoning(choice.message) or "", choice.message.content or "", calls, choice.finish_reason
    reasoning, content, finish, calls = "", "", "", {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            reasoning += _reasoning(choice.delta) or ""
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                name, arguments = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), arguments + (t.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("strategy", ["ar", "sps"])
def test_a_grammar_holds_only_the_answer_after_the_opened_block(qwq: Served, strategy: str) -> None:
    """QwQ's prompt opens the block: the thinking is free text, and a JSON schema or a required tool call holds
    what follows `</think>` only, whole and streamed alike. On these questions SmolLM2 ends its turn inside the
    block (after 7 and 6 tokens), as it does with tool_choice "auto" (no grammar: llama.cpp's is lazy there); a
    grammar that needs an answer does not let it (llama.cpp's is eager and spans the thinking), so it thinks on
    to the budget (12), its free thinking continued, and the answer follows, valid."""
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
            "additionalProperties": False}
    common = {"model": "smollm2-qwq", "temperature": 0, "max_tokens": 64,
              "extra_body": {"reasoning_budget_tokens": 12, **spec(strategy)}}
    capital = {**common, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    weather = {**common, "messages": [{"role": "user", "content": "The weather in Paris?"}], "tools": [WEATHER]}
    for free, constrained in (({}, {"response_format": {"type": "json_schema", "json_schema": {"name": "city",
                                                                                               "schema": city}}}),
                              ({"tool_choice": "auto"}, {"tool_choice": "required"})):
        question = weather if "tool_choice" in free else capital
        thought, content, calls, finish = _answer(qwq, False, **question, **free)
        assert thought and (content, calls, finish) == ("", [], "stop"), "the turn ends inside the block"
        for stream in (False, True):
            reasoning, content, calls, finish = _answer(qwq, stream, **question, **constrained)
            assert reasoning.startswith(thought) and len(reasoning) > len(thought), (stream, reasoning)
            assert _n_tokens(qwq, reasoning) <= 12 and "</think>" not in reasoning + content
            if calls:
                assert finish == "tool_calls" and not content and [name for name, _ in calls] == ["get_weather"]
                assert set(json.loads(calls[0][1])) == {"city"}
            else:
                assert "tool_choice" not in constrained and finish == "stop", (stream, content, finish)
                assert set(json.loads(content)) == {"city"}


def test_a_budget_of_0_closes_the_opened_block_at_once(qwq: Served) -> None:
    """llama-server takes `reasoning_budget_tokens: 0` on a template whose prompt opens the block: "0 for
    immediate end" (common/arg.cpp), its budget sampler forcing the end tag from the prompt's start tag on
    (common/reasoning-budget.cpp:85). It is an empty thinking, not thinking off (which QwQ's template cannot do,
    a 400): the end tag first, then the answer; no reasoning_content, whole and streamed."""
    whole = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=0)
    message = whole.choices[0].message
    assert _reasoning(message) is None and message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    raw = _chat(qwq, "smollm2-qwq", reasoning_budget_tokens=0, reasoning_format="none").choices[0].message.content
    assert raw.startswith("<think>\n</think>") and raw.removeprefix("<think>\n</think>").strip() == message.content
    reasoning, content, _, _ = _streamed(qwq, "smollm2-qwq", reasoning_budget_tokens=0)
    assert (reasoning, content) == ("", message.content)


def test_reasoning_sent_back_is_accepted_and_completions_stay_raw(qwq: Served) -> None:
    history = [*USER, {"role": "assistant", "content": "51.", "reasoning_content": "17 times 3 is 51."},
               {"role": "user", "content": "And 17 times 4?"}]
    r = qwq.post("/v1/chat/completions", {"messages": history, "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert_error(qwq.post("/v1/chat/completions", {"messages": [{**history[1], "reasoning_content": 3}]}), 400,
                 param="messages[0].reasoning_content")
    text = qwq.client().completions.create(model="smollm2-qwq", prompt="<think>\nHi", max_tokens=8, temperature=0)
    assert "reasoning_content" not in (text.choices[0].model_extra or {})
    for field, value in (("reasoning_budget_tokens", 4), ("chat_template_kwargs", {"enable_thinking": True})):
        assert_error(qwq.post("/v1/completions", {"prompt": "Hi", field: value}), 400, param=field)


def test_models_and_props_say_how_the_model_thinks(qwq: Served) -> None:
    expected = {"start": "<think>", "end": "</think>", "opened": True, "can_disable": False}
    models = qwq.client().models.list()
    assert models.data[0].model_extra["meta"]["reasoning"] == expected
    props = httpx.get(f"{qwq.url}/props", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert props["reasoning"] == expected and props["chat_template_caps"] == {"supports_thinking": True}
    assert props["thinking"] is True and "<think>" in props["chat_template"] and props["total_slots"] == 1
    assert_error(httpx.get(f"{qwq.url}/props"), 401, "invalid_api_key")


def test_a_client_that_leaves_mid_thinking_cancels_it(qwq: Served) -> None:
    before = qwq.health()["cancelled"]
    with httpx.stream("POST", f"{qwq.url}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"messages": USER, "stream": True, "max_tokens": 2000, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if "reasoning_content" in line:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (qwq.health()["cancelled"] > before and qwq.health()["running"] == 0):
        time.sleep(0.1)
    assert qwq.health()["cancelled"] > before and qwq.health()["running"] == 0


# A question that writes the tags, the start tag last: read over the whole prompt, it would look like an open block.
TAGGED = [{"role": "user", "content": "Does `</think>` close what the `<think>` tag opens?"}]


def test_a_tag_in_a_message_leaves_the_opened_block_as_the_prompt_opened_it(qwq: Served) -> None:
    """QwQ's generation prompt opens the block whatever the messages write: the output is reasoning, and under
    reasoning_format none the content starts with the generation prompt's `<think>\n`, nothing of the question."""
    client = qwq.client()
    whole = client.chat.completions.create(model="smollm2-qwq", messages=TAGGED, temperature=0,
                                           extra_body={"reasoning_budget_tokens": 12}).choices[0].message
    assert _reasoning(whole) and whole.content, whole
    raw = client.chat.completions.create(model="smollm2-qwq", messages=TAGGED, temperature=0,
                                         extra_body={"reasoning_budget_tokens": 12, "reasoning_format": "none"})
    thought = raw.choices[0].message.content.removeprefix("<think>\n")
    assert thought != raw.choices[0].message.content and thought.strip().startswith(_reasoning(whole)[:20]), thought


# -- Qwen3: the template turns thinking off ----------------------------------------------------------------------


def test_enable_thinking_false_gives_no_reasoning(qwen3: Served) -> None:
    on = _chat(qwen3, "smollm2-qwen3")
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"reasoning_effort": "none"}):
        off = _chat(qwen3, "smollm2-qwen3", **extra)
        assert _reasoning(off.choices[0].message) is None and off.choices[0].message.content
        assert off.usage.completion_tokens_details.reasoning_tokens == 0
        # The template closed an empty block in the prompt: "<think>\n\n</think>\n\n" after the assistant's turn.
        assert off.usage.prompt_tokens > on.usage.prompt_tokens
    props = httpx.get(f"{qwen3.url}/props", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert props["reasoning"] == {"start": "<think>", "end": "</think>", "opened": False, "can_disable": True}


def test_a_budget_of_0_is_llama_servers_not_thinking_off(qwen3: Served) -> None:
    """On a template that can turn thinking off, llama-server's budget 0 does not: only `enable_thinking` and
    `reasoning_effort` do (tools/server/server-common.cpp:1362-1380); the prompt is thinking on's and a block
    the model opens is ended at once (common/reasoning-budget.cpp:85). SmolLM2 opens none on this question, so
    the answer is the one without a budget, token for token (as llama-server gives it on the same file), and
    not thinking off's, whose prompt closes an empty block."""
    # Plain decoding, so that "token for token" holds exactly: `auto`'s choices (the draft, the memory of the
    # first answer) follow its live costs, and a verification batch's float noise can flip a near-tie.
    plain = {"speculative": {"strategy": "ar"}}
    on = _chat(qwen3, "smollm2-qwen3", **plain)
    zero = _chat(qwen3, "smollm2-qwen3", reasoning_budget_tokens=0, **plain)
    off = _chat(qwen3, "smollm2-qwen3", chat_template_kwargs={"enable_thinking": False}, **plain)
    assert (zero.usage.prompt_tokens, zero.choices[0].message.content) == \
        (on.usage.prompt_tokens, on.choices[0].message.content)
    assert _reasoning(zero.choices[0].message) is None and zero.usage.completion_tokens_details.reasoning_tokens == 0
    assert off.usage.prompt_tokens > zero.usage.prompt_tokens and off.choices[0].message.content != on.choices[0].message.content


def test_a_reasoning_sent_back_reaches_the_template(qwen3: Served) -> None:
    """Qwen3's template writes the thinking of the turns after the last question (an agent's tool calls)."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    history = [{"role": "user", "content": "The weather in Rome?"}, {"role": "assistant", "content": "",
               "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = {"messages": history, "tools": [WEATHER], "max_tokens": 2}
    plain = qwen3.post("/v1/chat/completions", body).json()
    history[1]["reasoning_content"] = "The user wants the weather in Rome: call the tool."
    thought = qwen3.post("/v1/chat/completions", body).json()
    grown = thought["usage"]["prompt_tokens"] - plain["usage"]["prompt_tokens"]
    assert grown >= _n_tokens(qwen3, history[1]["reasoning_content"])


def test_a_tag_in_a_message_opens_no_block(qwen3: Served) -> None:
    """A question that writes `<think>` and `</think>` (the start tag last): Qwen3's generation prompt opens no
    block, so the answer is content, whole and streamed, as llama-server reads it (only what the generation
    prompt adds decides, common/chat.cpp); reasoning_format none adds nothing of the prompt to it."""
    client = qwen3.client()
    whole = client.chat.completions.create(model="smollm2-qwen3", messages=TAGGED, temperature=0)
    message = whole.choices[0].message
    assert _reasoning(message) is None and message.content, message
    assert whole.usage.completion_tokens_details.reasoning_tokens == 0
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="smollm2-qwen3", messages=TAGGED, temperature=0, stream=True):
        for choice in chunk.choices:
            reasoning += _reasoning(choice.delta) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("", message.content)
    raw = client.chat.completions.create(model="smollm2-qwen3", messages=TAGGED, temperature=0,
                                         extra_body={"reasoning_format": "none"}).choices[0].message
    assert _reasoning(raw) is None and raw.content.strip() == message.content.strip(), raw.content


def test_no_think_is_refused_at_start_on_a_template_that_cannot(thinking_models) -> None:
    r = subprocess.run([sys.executable, "-m", "app", "serve", "-m", str(thinking_models.qwq), "--no-think",
                        "-np", "1", "--port", "0", "-t", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "--no-think" in r.stderr and "cannot turn thinking off" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


# -- the fields, checked (no server) -------------------------------------------------------------------------------


def _parse(body: dict, chat: bool = True, settings: Settings | None = None) -> ThinkingRequest:
    return thinking_request(body, chat, settings or Settings())


@pytest.mark.parametrize("body, param", [
    ({"reasoning_format": "deepseek-legacy"}, "reasoning_format"),
    ({"reasoning_format": "think"}, "reasoning_format"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"enable_thinking": "false"}}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, "reasoning_effort"),
    ({"reasoning_budget_tokens": -2}, "reasoning_budget_tokens"),
    ({"reasoning_budget_tokens": 1.5}, "reasoning_budget_tokens"),
    ({"thinking_budget_tokens": True}, "thinking_budget_tokens"),
    ({"reasoning_budget_tokens": 3, "thinking_budget_tokens": 4}, "thinking_budget_tokens"),
    ({"reasoning_budget_message": 7}, "reasoning_budget_message"),
])
def test_bad_fields_are_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ApiError) as e:
        _parse(body)
    assert (e.value.status, e.value.param) == (400, param) and e.value.message


def test_fields_over_the_servers_defaults() -> None:
    assert _parse({}) == ThinkingRequest()
    t = _parse({"chat_template_kwargs": {"enable_thinking": False, "x": 1}, "reasoning_effort": "high",
                "thinking_budget_tokens": 5, "reasoning_budget_message": "Done.", "reasoning_format": "none"})
    assert (t.split, t.thinking, t.asked_off, t.budget, t.message) == (False, False,
                                                                       "chat_template_kwargs.enable_thinking", 5, "Done.")
    assert t.kwargs == {"x": 1, "reasoning_effort": "high"}
    off = _parse({"reasoning_effort": "none", "chat_template_kwargs": {"reasoning_effort": "low"}})
    assert (off.thinking, off.asked_off, off.kwargs) == (False, "reasoning_effort", {})
    served = Settings(thinking=False, params=GenParams(reasoning_budget=12))
    assert (_parse({}, settings=served).thinking, _parse({}, settings=served).budget) == (False, 12)
    assert _parse({"reasoning_budget_tokens": -1}, settings=served).budget == 12  # llama-server's "the default"
    assert _parse({"reasoning_budget_tokens": 0}, settings=served).budget == 0
    assert _parse({"reasoning_format": "none"}, chat=False) == ThinkingRequest(split=False)
    with pytest.raises(ApiError, match="belongs to /v1/chat/completions"):
        _parse({"reasoning_effort": "low"}, chat=False)
