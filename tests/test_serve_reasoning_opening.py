"""`specchat serve` on a model that opens its thinking block itself, through the official `openai` client.

SmolLM2-Instruct re-packed with Qwen3's template (tests/conftest.py's `thinking_models`): the generation prompt
leaves `<think>` to the model. What llama-server does there, and specchat now does too:
- a JSON schema (or a required tool call) lets the model open the block before its answer: llama.cpp's grammar is
  `space ("<think>" until("</think>") "</think>")? space answer` (common/chat-auto-parser-generator.cpp:120-155),
  the thinking free text, the answer the grammar's from the end tag, the budget still ending the thinking. Asked
  to explain `(<think>)`, SmolLM2 starts its answer with `<think>`, the grammar lets it, and it thinks: its
  `reasoning_content` is apart from the JSON `content`, whole and streamed. llama-server on the same file and
  request thinks the same 8 tokens ("is a rhetorical device that involves using a", with a budget of 8) and
  the same 24 without one; its JSON differs only as its layout is free (`{\n  "tag": ...`);
- the reasoning budget counts from the start tag (common/reasoning-budget.cpp:78-118), wherever the model
  writes it.
The stand-in model's cases, one by one (text before the tag, a tag spelt otherwise, a tool call, the tag inside
the answer): tests/test_reasoning_opening.py.
"""

from __future__ import annotations

import json

import pytest
from serve_helpers import Served, spec
from test_serve_reasoning import qwen3  # noqa: F401 - the one Qwen3 server fixture (with the draft, for sps)

TAG = {"type": "object", "properties": {"tag": {"type": "string", "maxLength": 12}}, "required": ["tag"],
       "additionalProperties": False}
EXPLAIN = [{"role": "user", "content": "Explain (<think>) in one sentence."}]
SCHEMA = {"type": "json_schema", "json_schema": {"name": "tag", "schema": TAG}}


def _reasoning(message: object) -> str:
    return (getattr(message, "model_extra", None) or {}).get("reasoning_content") or ""


def _n_tokens(served: Served, text: str) -> int:
    return len(served.post("/tokenize", {"content": text}).json()["tokens"])


def _answer(served: Served, stream: bool, **kw: object) -> tuple[str, str, list[tuple[str, str]], str, object]:
    """An answer's reasoning, content, tool calls (name, arguments), finish reason and usage: whole, or
    reassembled from the stream's deltas."""
    client = served.client()
    common = {"model": "smollm2-qwen3", "temperature": 0, "max_tokens": 64}
    if not stream:
        r = client.chat.completions.create(**{**common, **kw})
        choice = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
        return _reasoning(choice.message), choice.message.content or "", calls, choice.finish_reason, r.usage
    reasoning, content, finish, calls, usage = "", "", "", {}, None
    for chunk in client.chat.completions.create(**{**common, **kw}, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += _reasoning(choice.delta)
            content += choice.delta.content or ""
            for t in choice.delta.tool_calls or []:
                name, arguments = calls.get(t.index, ("", ""))
                calls[t.index] = (name + (t.function.name or ""), arguments + (t.function.arguments or ""))
            finish = choice.finish_reason or finish
    return reasoning, content, [calls[i] for i in sorted(calls)], finish, usage


@pytest.mark.parametrize("strategy", ["ar", "sps"])
def test_a_json_schema_lets_the_model_think_before_its_answer(qwen3: Served, strategy: str) -> None:
    """The old way forced the JSON from the first token (no thinking); now the model opens the block, thinks
    freely to the budget (8 tokens, the end tag then forced), and the JSON follows, valid: whole and streamed
    agree, and ar and sps give the same greedy answer."""
    extra = {"reasoning_budget_tokens": 8, **spec(strategy)}
    answers = []
    for stream in (False, True):
        reasoning, content, calls, finish, usage = _answer(qwen3, stream, messages=EXPLAIN, response_format=SCHEMA,
                                                           extra_body=extra)
        assert reasoning and "<think>" not in reasoning + content and "</think>" not in reasoning + content
        assert set(json.loads(content)) == {"tag"} and (calls, finish) == ([], "stop"), content
        assert _n_tokens(qwen3, reasoning) <= 8 and 0 < usage.completion_tokens_details.reasoning_tokens <= 8
        answers.append((reasoning, content))
    assert answers[0] == answers[1]
    ar = _answer(qwen3, False, messages=EXPLAIN, response_format=SCHEMA,
                 extra_body={"reasoning_budget_tokens": 8, **spec("ar")})
    assert (ar[0], ar[1]) == answers[0]


def test_without_a_budget_the_thinking_runs_until_the_model_closes_it_or_the_tokens_end(qwen3: Served) -> None:
    """No budget: SmolLM2 never closes the block, and a JSON schema needs an answer, so the turn cannot end in
    the thinking (llama.cpp's grammar spans it): it thinks to max_tokens, `finish_reason` length, no JSON, as
    llama-server answers it."""
    reasoning, content, _, finish, usage = _answer(qwen3, False, messages=EXPLAIN, response_format=SCHEMA,
                                                   max_tokens=24)
    assert reasoning and content == "" and finish == "length"
    assert usage.completion_tokens == 24


def test_reasoning_format_none_under_a_json_schema_is_the_answer_alone(qwen3: Served) -> None:
    """reasoning_format "none" shows the output as written; under a grammar llama.cpp leaves the optional block
    out of it (common/chat-auto-parser-generator.cpp:107, 141), and llama-server answers this request with the
    JSON alone. The same request with the default format thinks first (the test above), so this fails where
    "none" kept the optional block: `<think>...</think>` then JSON in `content`."""
    for stream in (False, True):
        reasoning, content, _, finish, _ = _answer(qwen3, stream, messages=EXPLAIN, response_format=SCHEMA,
                                                   extra_body={"reasoning_format": "none",
                                                               "reasoning_budget_tokens": 8})
        assert reasoning == "" and finish == "stop", (reasoning, content)
        assert set(json.loads(content)) == {"tag"}, content
