"""gpt-oss's tool calls (app.serve.harmony_tools): llama.cpp's parse cases, the prompt, and `specchat serve`.

The parse cases come from llama.cpp's tests/test-chat.cpp (the copy vendored
in llama-cpp-python 0.3.36; its "GPT-OSS format tests", each case citing its
line), with the expectations it has with tools given (`special_function`,
whose call is `{"arg1": 1}`): the output after the generation prompt
(`<|start|>assistant`) in, the reasoning, content and calls out. Each is parsed
whole and streamed as token ids whose pieces are the text cut one character
at a time and in seeded random chunks, and once more with harmony's markers
as control tokens (gpt-oss's vocabulary: they render as nothing unless
rendered for the parse). The prompt is gpt-oss's template's own rendering of
the tools and of earlier calls and their results.

End to end: SmolLM2-Instruct re-packed with gpt-oss's template (test_harmony's
`oss_files`) under `specchat serve`, driven with the `openai` client. Under
tool_choice named or required, and under a response_format, the model may write
analysis messages first, as llama.cpp's grammar lets it (gpt-oss.cpp:97-135),
then the answer's header (the final channel's, a call's) and the answer under
the grammar. SmolLM2 left free calls at once on some questions, and on others
thinks on in analysis messages: a reasoning budget ends an analysis whose
header it wrote with the header's own tokens (llama.cpp's budget waits for
those), not one it spelt otherwise. With tools offered and the choice left to
it, its plain answer is content.
"""

from __future__ import annotations

import json
import random

import pytest

from app.chat_template import ChatMessage, ToolCall, render_chat
from app.serve.harmony_tools import (CALL_HEADER, CALL_HEADER_END, HarmonyToolStream, as_call, calls_of,
                                     forced_header, grammar, parse)
from app.serve.tools import Tool, ToolChoice, grammar_for, prompt_messages, tool_format
from backends.harmony import PRESERVED
from backends.text import rendering
from test_harmony import TEMPLATE, oss, oss_files  # noqa: F401 - the fixtures, for the end-to-end tests

NAMES = ("special_function",)
ARGS = '{"arg1": 1}'
THOUGHTS = "I'm\nthinking"
CALL = ("special_function", ARGS)

# (test-chat.cpp line, output, reasoning, content, calls as (name, arguments))
CASES = [
    (6457, ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", [CALL]),
    (6464, '<|channel|>analysis to=functions.special_function<|message|>{"arg1": 1}', "", "", [CALL]),
    (6471, ' to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{"arg1": 1}', "", "",
     [CALL]),
    (6478, '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "", [CALL]),
    (6485, f"<|channel|>analysis<|message|>{THOUGHTS}<|end|>"
           '<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}',
     THOUGHTS, "", [CALL]),
    # "Complex tool calling": the function is `edit`
    (6494, "<|channel|>analysis<|message|>Thinking about edit...<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.edit <|constrain|>json"
           '<|message|>{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}',
     "Thinking about edit...", "",
     [("edit", '{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}')]),
    # Unsolicited calls (builtins): neither content nor a call (6545: "we return empty content")
    (6547, "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
           "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
     "I will execute python to say hello", "", []),
    (6556, "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
           '<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>print("hello")',
     "I will execute python to say hello", "", []),
    # Tools given, the model answers (6428, 6434: no call)
    (6428, "<|channel|>final<|message|>Hello, world!\nWhat's up?", "", "Hello, world!\nWhat's up?", []),
    (6434, f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>final<|message|>"
           "Hello, world!\nWhat's up?", THOUGHTS, "Hello, world!\nWhat's up?", []),
    # Beyond test-chat.cpp (line 0): the call's `<|call|>` spelled as text (a vocabulary without it) ends it, a
    # function not offered, a call cut short (max_tokens), and a call after a preamble.
    (0, '<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>{"arg1": 1}<|call|>',
     "", "", [CALL]),
    (0, '<|channel|>commentary to=functions.not_offered <|constrain|>json<|message|>{"arg1": 1}', "", "", []),
    (0, '<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>{"arg1": ', "", "", []),
    (0, "<|channel|>commentary<|message|>Let me look.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.special_function<|message|> {"arg1": 1} ',
     "", "Let me look.", [CALL]),
]
OFFERED = ("special_function", "edit")


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 10))))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _streamed(pieces: list[str], names=OFFERED) -> list[tuple[str, str]]:
    """The pieces as token ids (token i's piece is pieces[i]), through the stream: the calls it sends, each checked
    to come once its text is whole."""
    stream = HarmonyToolStream(lambda t: pieces[t].encode(), names)
    out = []
    for i in range(len(pieces)):
        for index, call in stream.push_token(i):
            assert index == len(out)
            assert "".join(pieces[:i + 1]).rstrip().endswith(("<|call|>", "<|end|>", "<|return|>"))
            out.append((call.name, call.arguments))
    content, rest = stream.finish()
    assert content == ""
    out += [(c.name, c.arguments) for _, c in rest]
    assert stream.sent_calls == len(out)
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"line{c[0]}:{c[1][:40]}")
def test_parse_whole_per_character_and_in_random_chunks(case) -> None:
    line, text, reasoning, content, calls = case
    got_reasoning, got_content, got_calls = parse(text, OFFERED)
    assert (got_reasoning, got_content, [(c.name, c.arguments) for c in got_calls]) == (reasoning, content, calls)
    assert all(c.id.startswith("call_") for c in got_calls) and len({c.id for c in got_calls}) == len(got_calls)
    assert _streamed(list(text)) == calls
    rng = random.Random(f"{line}:{text}")
    for _ in range(25):
        pieces = _chunks(text, rng)
        assert _streamed(pieces) == calls, pieces


class ControlVocab:
    """Harmony's markers as single control tokens (as in gpt-oss's vocabulary: empty pieces unless `special`), any
    other character a token of its own."""

    def __init__(self) -> None:
        self.markers = [*PRESERVED, "<|start|>"]

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        out = []
        while text:
            marker = next((m for m in self.markers if text.startswith(m)), None)
            out.append(1000 + self.markers.index(marker) if marker else ord(text[0]))
            text = text[len(marker):] if marker else text[1:]
        return out

    def piece(self, token: int, special: bool = False) -> bytes:
        if token >= 1000:
            return self.markers[token - 1000].encode() if special else b""
        return chr(token).encode()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"line{c[0]}")
def test_markers_that_are_control_tokens_are_rendered_for_the_parse(case) -> None:
    """In gpt-oss's vocabulary the markers are control tokens that render as nothing: the parse renders them
    (llama.cpp's preserved_tokens); without that, no header would be seen and no call found."""
    _, text, _, _, calls = case
    vocab = ControlVocab()
    tokens = vocab.tokenize(text)
    assert [(c.name, c.arguments) for c in calls_of(tokens, rendering(vocab, PRESERVED), OFFERED)] == calls
    if calls:
        assert calls_of(tokens, vocab.piece, OFFERED) == []


def test_a_call_is_its_function_and_a_json_body() -> None:
    call = as_call("functions.f", ' {"a": [1, "é"]} ', ["f"])
    assert call is not None and (call.name, call.arguments) == ("f", '{"a": [1, "é"]}')
    assert as_call("functions.f", "{", ["f"]) is None
    assert as_call("functions.g", "{}", ["f"]) is None
    assert as_call("python", "{}", ["python"]) is None


# --- the prompt and the grammar ---

WEATHER = Tool("get_weather", "The weather in a city.",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = Tool("get_time", "The time in a timezone.",
            {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["tz"]})


def test_gpt_oss_s_template_is_the_harmony_format_and_renders_the_tools_and_earlier_calls() -> None:
    """The tools go to the template (its developer message declares `namespace functions`); an earlier call and
    its result go back as the template writes them (a message to functions.NAME ended by <|call|>, the result
    from functions.NAME to=assistant), and the call's reasoning as its analysis."""
    assert tool_format(TEMPLATE) == "harmony"
    assert tool_format("{{ '<tool_call>' }}") == "hermes"
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    messages = [ChatMessage("user", "Weather in Paris?"),
                ChatMessage("assistant", "", (call,), reasoning="I should look it up."),
                ChatMessage("tool", "sunny", tool_call_id="call_1", name="get_weather")]
    sent, tools = prompt_messages(messages, [WEATHER, TIME], ToolChoice("auto"), "harmony")
    assert sent == messages and tools == [WEATHER.openai(), TIME.openai()]
    text = render_chat(TEMPLATE, sent, "", "<|return|>", tools=tools)
    assert "namespace functions {" in text and "type get_weather = (_: {" in text and "type get_time" in text
    assert ("<|start|>assistant<|channel|>analysis<|message|>I should look it up.<|end|>"
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
            "<|start|>assistant") in text
    assert text.endswith("<|start|>assistant")
    none, no_tools = prompt_messages(messages[:1], [WEATHER], ToolChoice("none"), "harmony")
    assert no_tools is None and "namespace functions" not in render_chat(TEMPLATE, none, "", "")


def test_required_and_named_force_the_call_header_and_hold_the_rest_to_a_grammar() -> None:
    """Named (or one tool required): the whole header is forced and the grammar is the arguments' schema;
    several required: the header up to the name, and a Lark grammar picks the name and holds the arguments.
    auto: no grammar (the model chooses; its call is parsed from the text)."""
    assert forced_header(["get_weather"]) == CALL_HEADER + "get_weather" + CALL_HEADER_END
    assert forced_header(["get_weather", "get_time"]) == CALL_HEADER
    assert grammar_for([WEATHER, TIME], ToolChoice("named", "get_weather"), "harmony") == \
        ("json_schema", dict(WEATHER.parameters))
    assert grammar_for([WEATHER, TIME], ToolChoice("auto"), "harmony") is None
    kind, source = grammar_for([WEATHER, TIME], ToolChoice("required"), "harmony",
                               marker=lambda m: {"<|message|>": "<[7]>"}.get(m, json.dumps(m)))
    assert kind == "lark" and source.startswith("start: call0 | call1\n")
    assert 'call0: "get_weather" " " "<|constrain|>" "json" <[7]> args0' in source
    assert kind == grammar([(t.name, dict(t.parameters)) for t in (WEATHER, TIME)], json.dumps)[0]


def test_the_grammar_compiles_and_a_call_through_it_parses() -> None:
    """The Lark grammar compiles (llguidance's Lark reader; on a vocabulary, end to end below), and the output that
    the forced header and the grammar make together parses as the call."""
    from backends.grammar import grammar_text

    kind, source = grammar_for([WEATHER, TIME], ToolChoice("required"), "harmony")
    assert "get_time" in grammar_text(kind, source)
    # The parse of what the forced header and the grammar make together:
    output = (forced_header(["get_weather", "get_time"])[len("<|start|>assistant"):]
              + 'get_time <|constrain|>json<|message|>{"tz": "CET"}')
    assert [(c.name, c.arguments) for c in parse(output, ["get_weather", "get_time"])[2]] == \
        [("get_time", '{"tz": "CET"}')]


# --- end to end: specchat serve on real llama.cpp ---


@pytest.fixture(scope="module")
def served(oss_files, tmp_path_factory: pytest.TempPathFactory):  # noqa: F811 - the fixture imported above
    from serve_helpers import API_KEY, start_server, stop_server

    server = start_server(["-m", str(oss_files[0]), "--api-key", API_KEY, "-np", "1", "--temp", "0", "-n", "64"],
                          tmp_path_factory.mktemp("oss-tools") / "server.log")
    yield server
    stop_server(server)


OPENAI_TOOLS = [WEATHER.openai(), TIME.openai()]
MODEL = "smollm2-gpt-oss"
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


# A budget ends the analysis (see the module): the call follows it within max_tokens.
BOUNDED = {"max_tokens": 200, "extra_body": {"reasoning_budget_tokens": 16}}


def _stream_calls(served, **kw) -> tuple[list[dict], str, str | None, str]:
    calls: dict[int, dict] = {}
    content, finish, reasoning = "", None, ""
    for chunk in served.client().chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS, stream=True,
                                                         temperature=0, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            finish = choice.finish_reason or finish
            for tc in choice.delta.tool_calls or []:
                assert tc.index not in calls, "a call is sent whole, once"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
    return [calls[i] for i in sorted(calls)], content, finish, reasoning


def test_serve_named_tool_choice_returns_the_call(served) -> None:
    """Named: at the message's start the model may open an analysis or write the call's header; on this question
    SmolLM2 calls at once, its arguments under the function's schema: the answer is that call, finish_reason
    tool_calls, no content; streamed, the same call once."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = served.client().chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS, temperature=0,
                                                     tool_choice=choice, **BOUNDED).choices[0]
    assert answer.finish_reason == "tool_calls" and not answer.message.content
    [call] = answer.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    calls, content, finish, _ = _stream_calls(served, tool_choice=choice, **BOUNDED)
    assert (finish, content) == ("tool_calls", "")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_serve_required_picks_one_of_the_tools(served) -> None:
    """Required over two tools: the model may think first; on this question it writes the call's header at once,
    the grammar picks the name, and the call parses and matches its function's schema."""
    answer = served.client().chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS, temperature=0,
                                                     tool_choice="required", **BOUNDED).choices[0]
    assert answer.finish_reason == "tool_calls"
    [call] = answer.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_time":
        assert arguments["tz"] in ("UTC", "CET")
    else:
        assert call.function.name == "get_weather" and isinstance(arguments["city"], str)


def test_serve_a_schema_answer_comes_after_the_analysis(served) -> None:
    """response_format: the model thinks in analysis messages (free text, no JSON), the budget ends the one it
    began with the header's own tokens, and the final message is JSON matching the schema; whole and streamed
    alike."""
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    ask = [{"role": "user", "content": "What is 17 times 3? Answer in JSON."}]
    kw = dict(model=MODEL, messages=ask, temperature=0, max_tokens=200,
              response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
              extra_body={"reasoning_budget_tokens": 16, "reasoning_effort": "low"})
    answer = served.client().chat.completions.create(**kw).choices[0]
    reasoning = (answer.message.model_extra or {}).get("reasoning_content")
    assert answer.finish_reason == "stop" and reasoning and "<|" not in reasoning
    jsonschema.validate(json.loads(answer.message.content), schema)
    streamed = ["", ""]
    for chunk in served.client().chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            streamed[0] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            streamed[1] += choice.delta.content or ""
    assert streamed == [reasoning, answer.message.content]


def test_serve_a_plain_answer_with_tools_offered_is_content(served) -> None:
    """auto: SmolLM2 writes no harmony, so its text is the answer, content, and no call (it goes on until
    max_tokens: a stop string ends its first line, finish_reason "stop"), whole and streamed alike; a conversation
    with an earlier call and its result goes through the template."""
    answer = served.client().chat.completions.create(model=MODEL, messages=ASK, tools=OPENAI_TOOLS, temperature=0,
                                                     max_tokens=64, stop=["\n"]).choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason == "stop"
    calls, content, finish, _ = _stream_calls(served, max_tokens=64, stop=["\n"])
    assert (calls, content, finish) == ([], answer.message.content, "stop")
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    again = served.client().chat.completions.create(model=MODEL, messages=history, tools=OPENAI_TOOLS, temperature=0,
                                                    max_tokens=32).choices[0]
    assert again.message.content and not again.message.tool_calls


def test_a_marker_that_is_a_control_token_is_its_id_in_the_grammar(oss) -> None:  # noqa: F811
    """marker_terminal on a real vocabulary: SmolLM2 spells harmony's markers as text (a Lark string), and a
    control token (its `<|im_end|>`, standing in for gpt-oss's `<|message|>`) is its id, which compiles."""
    from backends.grammar import compile_grammar
    from backends.harmony import marker_terminal

    model = oss.target_model
    terminal = marker_terminal(model)
    assert terminal("<|message|>") == '"<|message|>"'
    [im_end] = model.tokenize("<|im_end|>", add_special=False, parse_special=True)
    assert terminal("<|im_end|>") == f"<[{im_end}]>"
    source = grammar([(t.name, dict(t.parameters)) for t in (WEATHER, TIME)],
                     lambda m: terminal("<|im_end|>") if m == "<|message|>" else terminal(m))[1]
    compile_grammar("lark", source, model.guidance_tokenizer, model.n_vocab)


def test_serve_a_prompt_that_opens_the_analysis_thinks_before_the_forced_call(oss_files, tmp_path_factory) -> None:  # noqa: F811
    """Where the prompt opens the analysis (test_harmony's opened file), the thinking runs first, within its budget;
    then `<|end|>` and the call's header are forced and the grammar holds the arguments: the analysis is
    reasoning_content, the call a call (llama.cpp's required grammar also lets analysis come first)."""
    from serve_helpers import API_KEY, start_server, stop_server

    served = start_server(["-m", str(oss_files[1]), "--api-key", API_KEY, "-np", "1", "--temp", "0", "-n", "64"],
                          tmp_path_factory.mktemp("oss-tools-open") / "server.log")
    try:
        answer = served.client().chat.completions.create(
            model="smollm2-gpt-oss-open", messages=ASK, tools=OPENAI_TOOLS, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            extra_body={"reasoning_budget_tokens": 6}).choices[0]
        assert answer.finish_reason == "tool_calls" and not answer.message.content
        assert (answer.message.model_extra or {}).get("reasoning_content")
        [call] = answer.message.tool_calls
        assert call.function.name == "get_time" and json.loads(call.function.arguments)["tz"] in ("UTC", "CET")
        answer = served.client().chat.completions.create(
            model="smollm2-gpt-oss-open", messages=ASK, tools=OPENAI_TOOLS, temperature=0, tool_choice="required",
            extra_body={"reasoning_budget_tokens": 6}).choices[0]
        assert answer.finish_reason == "tool_calls" and (answer.message.model_extra or {}).get("reasoning_content")
        assert [c.function.name in ("get_time", "get_weather") for c in answer.message.tool_calls] == [True]
    finally:
        stop_server(served)
