"""The server's structured output, tool calls and log-probabilities, through the official `openai` client.

Servers on tiny real GGUFs: one whose model has no chat template (tools go
the generic way: described in the system message, the answer held by a JSON
grammar), one with a Hermes-style template (`<tool_call>` blocks, the tools
handed to the template). Every JSON answer is checked with `jsonschema`.
"""

from __future__ import annotations

import json
import shutil
from typing import Iterator

import httpx
import jsonschema
import openai
import pytest

from gguf_factory import spm_vocab, write_llama_gguf
from serve_helpers import API_KEY, Served, assert_error, spec, start_server, stop_server

# A ChatML template that knows tools as Qwen 2.5's and Hermes' do: the tools listed in the system turn, calls
# written as <tool_call> JSON blocks, tool results sent back in <tool_response> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
    "{% endif %}You may call functions:\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "</tools>\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' and tools %}{% continue %}{% endif %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# A Llama 3.1-style template: the tools listed in the user's turn, a call answered as one JSON object after
# <|python_tag|> (what marks the template as Llama 3's), results in ipython turns.
LLAMA3_TEMPLATE = (
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if loop.last and tools %}Functions: {{ tools | tojson }}\nAnswer a call as {\"name\": ..., \"parameters\": "
    "...} (<|python_tag|> for built-ins).\n{% endif %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "{{ {'name': c.function.name, 'parameters': c.function.arguments} | tojson }}{% endfor %}{% else %}"
    "{{ m.content }}{% endif %}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
USER = [{"role": "user", "content": "the cat sat on the mat"}]


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    d = tmp_path_factory.mktemp("structured")
    target, draft = d / "target.gguf", d / "draft.gguf"  # the model's id is its file's name
    shutil.copy(tiny.json_target, target)
    shutil.copy(tiny.json_draft, draft)
    served = start_server(["-m", str(target), "-md", str(draft), "--api-key", API_KEY, "--temp", "0.8"],
                          d / "server.log")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    d = tmp_path_factory.mktemp("hermes")
    model = write_llama_gguf(d / "target.gguf", vocab=spm_vocab(space=True), chat_template=HERMES_TEMPLATE)
    draft = write_llama_gguf(d / "hermes-draft.gguf", vocab=spm_vocab(space=True), chat_template=HERMES_TEMPLATE,
                             noise=0.3)
    served = start_server(["-m", str(model), "-md", str(draft), "--api-key", API_KEY], d / "server.log")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def instruct(instruct_pair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """SmolLM2-135M-Instruct with its draft: a real model closes the JSON objects it opens."""
    d = tmp_path_factory.mktemp("instruct")
    target = d / "target.gguf"
    target.symlink_to(instruct_pair.target)
    served = start_server(["-m", str(target), "-md", str(instruct_pair.draft), "-c", "2048", "-np", "2"],
                          d / "server.log", threads="2")
    yield served
    stop_server(served)


@pytest.fixture(scope="module")
def llama3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    d = tmp_path_factory.mktemp("llama3")
    model = write_llama_gguf(d / "target.gguf", vocab=spm_vocab(space=True), chat_template=LLAMA3_TEMPLATE)
    served = start_server(["-m", str(model), "--api-key", API_KEY], d / "server.log")
    yield served
    stop_server(served)


def _chat(served: Served, stream: bool, **kwargs: object):
    """A chat answer (a stream assembled as the openai client's users do): (content, tool calls, finish reason,
    the response or last chunk)."""
    client = served.client()
    if not stream:
        r = client.chat.completions.create(model="target", messages=kwargs.pop("messages", USER), **kwargs)
        m = r.choices[0].message
        calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []]
        return m.content, calls, r.choices[0].finish_reason, r
    content, calls, finish, last = "", {}, None, None
    for chunk in client.chat.completions.create(model="target", messages=kwargs.pop("messages", USER), stream=True,
                                                **kwargs):
        last = chunk
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            slot = calls.setdefault(c.index, ["", "", ""])
            slot[0] += c.id or ""
            slot[1] += (c.function.name or "") if c.function else ""
            slot[2] += (c.function.arguments or "") if c.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(v) for _k, v in sorted(calls.items())], finish, last


def _check_call(call: tuple[str, str, str], tools: list[dict]) -> None:
    call_id, name, arguments = call
    assert call_id.startswith("call_")
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("strategy", ["sps", "auto"])
def test_response_format_json_object_and_schema(plain: Served, instruct: Served, stream: bool, strategy: str) -> None:
    messages = [{"role": "user", "content": "Give the name and age of Maria Lopez, 31, as a JSON object."}]
    # Greedy: a 135M model sampling at 0.8 may write a string that never closes within max_tokens (valid so far).
    content, _, finish, _ = _chat(instruct, stream, messages=messages, response_format={"type": "json_object"},
                                  max_tokens=120, temperature=0, extra_body=spec(strategy))
    assert finish == "stop" and json.loads(content) == {"name": "Maria Lopez", "age": 31}, content
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        content, _, finish, _ = _chat(plain, stream, response_format=rf, max_tokens=300, seed=seed,
                                      extra_body=spec(strategy))
        assert finish == "stop"
        jsonschema.validate(json.loads(content), PERSON)


def test_llama_server_grammar_and_json_schema_fields(plain: Served) -> None:
    client = plain.client()
    for seed in range(4):
        r = client.completions.create(model="target", prompt="the cat", max_tokens=20, seed=seed,
                                      extra_body={"grammar": 'root ::= "yes" | "no" | "maybe so"'})
        assert r.choices[0].text in ("yes", "no", "maybe so")
    r = client.completions.create(model="target", prompt="the cat", max_tokens=300, extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_a_schema_or_grammar_that_does_not_compile_is_a_400(plain: Served) -> None:
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/nowhere"}}}}}
    cases = [
        ({"messages": USER, "response_format": bad_schema}, "response_format.json_schema.schema"),
        ({"prompt": "hi", "grammar": "root ::= (\"a\""}, "grammar"),
        ({"prompt": "hi", "grammar": "root ::= undefined_rule"}, "grammar"),
        ({"prompt": "hi", "json_schema": "not an object"}, "json_schema"),
        ({"prompt": "hi", "grammar": 'root ::= "a"', "json_schema": PERSON}, "json_schema"),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format"),
        ({"messages": USER, "response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format"),
        ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"messages": USER, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0].function.name"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
        ({"prompt": "hi", "logprobs": 9}, "logprobs"),
    ]
    for body, param in cases:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        message = assert_error(plain.post(path, body), 400, param=param)
        assert "\n" not in message


@pytest.mark.parametrize("stream", [False, True])
def test_required_and_named_tools_always_call_with_valid_arguments(plain: Served, hermes: Served, llama3: Served,
                                                                   stream: bool) -> None:
    """Generic format (no template), Hermes' (<tool_call> in the template) and Llama 3's (one JSON object):
    'required' and a named function are enforced by a grammar, so every answer is a call whose arguments match
    the function's schema."""
    for served in (plain, hermes, llama3):
        for seed in range(3):
            for choice, names in (("required", {"get_weather", "get_time"}),
                                  ({"type": "function", "function": {"name": "get_time"}}, {"get_time"})):
                content, calls, finish, _ = _chat(served, stream, tools=TOOLS, tool_choice=choice, max_tokens=300,
                                                  seed=seed, temperature=0.9,
                                                  extra_body=spec("sps" if served is not llama3 else "lookup"))
                assert finish == "tool_calls" and calls, (served.log_path, content)
                for call in calls:
                    assert call[1] in names
                    _check_call(call, TOOLS)
                assert not content


def test_auto_tools_answer_or_call_and_the_conversation_goes_on(plain: Served, hermes: Served,
                                                               llama3: Served) -> None:
    """tool_choice auto: a call (valid) or an answer; then the call and the tool's result go back through the
    template and the model answers."""
    for served in (plain, hermes, llama3):
        outcomes = set()
        for seed in range(6):
            content, calls, finish, _ = _chat(served, False, tools=TOOLS, max_tokens=200, seed=seed, temperature=1.0)
            if calls:
                assert finish == "tool_calls"
                for call in calls:
                    _check_call(call, TOOLS)
                outcomes.add("call")
            else:
                assert finish in ("stop", "length") and content is not None
                outcomes.add("answer")
        assert outcomes
        messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
                    {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees and rain"}]
        content, calls, finish, r = _chat(served, False, messages=messages, tools=TOOLS, max_tokens=40)
        assert finish in ("stop", "length", "tool_calls") and r.usage.prompt_tokens > 20


def test_the_generic_tool_prompt_and_results_reach_the_model(plain: Served) -> None:
    """Without a template that knows tools, the tools are described in the prompt and a tool's result goes back
    as a turn: the prompt grows by both (usage counts the prompt's tokens)."""
    bare = _chat(plain, False, max_tokens=1)[3].usage.prompt_tokens
    with_tools = _chat(plain, False, tools=TOOLS, max_tokens=1)[3].usage.prompt_tokens
    assert with_tools > bare + 40
    none = _chat(plain, False, tools=TOOLS, tool_choice="none", max_tokens=1)[3].usage.prompt_tokens
    assert none == bare


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_match_the_returned_tokens(plain: Served, stream: bool) -> None:
    client = plain.client()
    for strategy in ("ar", "sps", "tree"):
        kwargs = dict(model="target", messages=USER, max_tokens=30, logprobs=True, top_logprobs=3,
                      extra_body=spec(strategy), stream_options={"include_usage": True} if stream else None)
        if stream:
            entries, tokens = [], 0
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                if chunk.choices and chunk.choices[0].logprobs:
                    entries += chunk.choices[0].logprobs.content
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
        else:
            kwargs.pop("stream_options")
            r = client.chat.completions.create(**kwargs)
            entries, tokens = r.choices[0].logprobs.content, r.usage.completion_tokens
        assert len(entries) == tokens > 0
        for e in entries:
            assert e.logprob <= 0 and len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-9
            assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    r = client.completions.create(model="target", prompt="the cat", max_tokens=12, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    # Streamed under a stop string whose start ends many tokens (their text is held back until the next one),
    # each token's offset is where it starts in the completion, as in the whole answer.
    kw = dict(model="target", prompt="the cat", max_tokens=24, logprobs=1, temperature=0, stop=["defqq"])
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, offsets = [], []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert (tokens, offsets) == (whole.tokens, whole.text_offset)
    assert any(t.endswith("def") for t in tokens[:-1]), "no token was held back: the check would not bite"
    assert all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], tokens))
    health = httpx.get(f"{plain.url}/health", timeout=10).json()
    assert health["kv_errors"] == 0


def test_json_under_every_strategy_is_the_same_greedy_answer(plain: Served) -> None:
    client = plain.client()
    answers = set()
    for strategy in ("ar", "sps", "tree", "lookup", "lookahead", "auto"):
        r = client.chat.completions.create(model="target", messages=USER, max_tokens=300, temperature=0,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "p", "schema": PERSON}},
                                           extra_body=spec(strategy))
        answers.add(r.choices[0].message.content)
    assert len(answers) == 1
    jsonschema.validate(json.loads(answers.pop()), PERSON)


def test_openai_errors_are_raised_by_the_client_for_bad_grammar(plain: Served) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        plain.client().chat.completions.create(model="target", messages=USER, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {
                "a": {"$ref": "#/nope"}}}}})
    assert "cannot be compiled" in str(e.value)


def test_a_tool_named_like_a_tool_choice_keyword_is_just_a_tool() -> None:
    """Tools may be named "auto", "required" or "none" (the name pattern allows it): the keyword and the name
    are told apart, so the default choice offers every tool and forces none, and naming one forces that one."""
    from app.chat_template import ChatMessage
    from app.serve.tools import grammar_for, parse_tool_choice, parse_tools, prompt_messages

    body = {"tools": [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
                      for name in ("auto", "required", "none", "get_time")]}
    tools = parse_tools(body)
    messages = [ChatMessage("user", "hi")]
    default = parse_tool_choice(body, tools)
    assert [t["function"]["name"] for t in prompt_messages(messages, tools, default, "hermes")[1]] == \
        ["auto", "required", "none", "get_time"]
    kind, schema = grammar_for(tools, default, "generic")
    assert len(schema["anyOf"]) == 2, "auto: a call or an answer"
    assert len(schema["anyOf"][0]["properties"]["tool_call"]["anyOf"]) == 4, "any of the four tools"
    for name in ("auto", "required", "none"):
        named = parse_tool_choice({**body, "tool_choice": {"type": "function", "function": {"name": name}}}, tools)
        assert [t["function"]["name"] for t in prompt_messages(messages, tools, named, "hermes")[1]] == [name]
        kind, schema = grammar_for(tools, named, "generic")
        assert schema["properties"]["tool_call"]["properties"]["name"] == {"const": name}, "that one, forced"
    required = parse_tool_choice({**body, "tool_choice": "required"}, tools)
    kind, schema = grammar_for(tools, required, "generic")
    assert len(schema["properties"]["tool_call"]["anyOf"]) == 4, "required: a call to any of the four"
    none = parse_tool_choice({**body, "tool_choice": "none"}, tools)
    assert grammar_for(tools, none, "generic") is None and prompt_messages(messages, tools, none, "hermes")[1] is None


def test_tool_stream_decodes_a_streamed_response_and_calls_piece_by_piece() -> None:
    """The generic format's response string is decoded as it comes (escapes split across pieces included) into
    exactly its JSON value; Hermes calls come out once each, with their indices, as their closing tags arrive."""
    from app.serve.tools import ToolStream

    value = 'caf\u00e9 "quoted" \\ back\nline \U0001F600 end'
    answer = json.dumps({"response": value})
    for size in (1, 2, 3, 7):
        stream = ToolStream("generic", must_call=False, names=["get_time"])
        got = "".join(stream.push(answer[i:i + size])[0] for i in range(0, len(answer), size))
        assert got + stream.finish()[0] == value, size
    call = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Rome"}}\n</tool_call>'
    text = f"Let me check.\n{call}\n{call.replace('Rome', 'Oslo')}"
    stream = ToolStream("hermes", must_call=False, names=["get_time"])
    calls = [c for i in range(0, len(text), 3) for c in stream.push(text[i:i + 3])[1]] + stream.finish()[1]
    assert [(i, json.loads(c.arguments)["city"]) for i, c in calls] == [(0, "Rome"), (1, "Oslo")]


def test_only_calls_to_offered_functions_are_calls_and_a_cut_response_is_its_text() -> None:
    """Llama 3.x's bare JSON is a call only with its name among the offered functions and its arguments key (as
    llama.cpp reads one): an answer in JSON with a "name" of its own is content. A Hermes call to a function not
    offered is none. The generic format's response cut short (max_tokens, a stop) is its text so far, whole as
    streamed."""
    from app.serve.tools import ToolStream, parse_answer

    names = ["get_time"]
    person = '{"name": "Alice", "age": 30}'
    assert parse_answer(person, "llama3", names) == (person, [])
    assert parse_answer('{"name": "get_time"}', "llama3", names) == ('{"name": "get_time"}', [])
    content, calls = parse_answer('{"name": "get_time", "parameters": {"city": "Rome"}}', "llama3", names)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"city": "Rome"})]
    stream = ToolStream("llama3", must_call=False, names=names)
    assert "".join(stream.push(person[i:i + 4])[0] for i in range(0, len(person), 4)) + stream.finish()[0] == person
    other = '<tool_call>\n{"name": "not_offered", "arguments": {}}\n</tool_call>'
    assert parse_answer(other, "hermes", names) == (other, [])
    cut = '{"response": "The capital is \\"Par'
    assert parse_answer(cut, "generic", names) == ('The capital is "Par', [])
    stream = ToolStream("generic", must_call=False, names=names)
    streamed = "".join(stream.push(cut[i:i + 3])[0] for i in range(0, len(cut), 3))
    assert streamed + stream.finish()[0] == 'The capital is "Par'
