"""gpt-oss's harmony channels (backends.harmony), against llama.cpp's own expectations and on real llama.cpp.

The parse cases come from llama.cpp's tests/test-chat.cpp (the copy vendored in
llama-cpp-python 0.3.36; its "GPT-OSS format tests", lines 6423-6602, each
case citing its line): the model's output after the generation prompt
(`<|start|>assistant`) in, the reasoning_content and content test-chat.cpp
expects with reasoning_format auto out. A case with tools (`.tools(...)`) keeps
its reasoning and content: the call itself is not the splitter's to parse, and
it leaves the call's message out of both, as llama.cpp leaves out a call it was
not asked for (lines 6546-6563). The structured-output case (6531) is taken
for its split only. reasoning_format none (6442) keeps the analysis as written
in the content (backends.harmony.AsWritten). Not taken: the content
continuation (6583: the prefilled answer is the request's); the reasoning
continuation (6593) runs the splitter opened, and its reasoning is the
output's part of "I'm thinking". test-chat.cpp compares with surrounding
whitespace stripped, as the splitter trims. Every case is also streamed one
character at a time and in seeded random chunks, and a harmony answer over
SmolLM2's real token boundaries, where each tag is spelled as several tokens.

Then the wrapper (backends.reasoning.Thinking) over stand-in models with
gpt-oss's vocabulary shape (`<|end|>` one control token that renders as
nothing), and on real llama.cpp: SmolLM2-Instruct re-packed with gpt-oss's
template (tests/data/templates), as is (the model writes no channel: its
text is the answer) and with its generation prompt opening the analysis
channel (llama.cpp's prompt for continuing a reasoning, test-chat.cpp:7011),
through the engine, `specchat run --json` and `specchat serve`. Under a
grammar (the model thinks in analysis messages, then answers under it):
tests/test_harmony_grammar.py.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from app.chat_template import ChatMessage, ToolCall, render_chat
from backends.events import REJECTED, Done, GenStats, Prefilled, Token
from backends.harmony import ANALYSIS, END, FINAL, AsWritten, HarmonySplitter
from backends.reasoning import HARMONY, ReasoningFormat, Thinking, detect_format, new_splitter, split
from backends.sampling import GenParams
from backends.text import rendering

ROOT = Path(__file__).resolve().parents[1]
TEMPLATE = (ROOT / "tests" / "data" / "templates" / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
THOUGHTS = "I'm\nthinking"  # test-chat.cpp's message_assist_thoughts' reasoning
ANSWER = "Hello, world!\nWhat's up?"  # message_assist's content
OPEN = replace(HARMONY, opened=True)


@dataclass(frozen=True)
class Case:
    line: int  # in test-chat.cpp
    text: str
    reasoning: str
    content: str
    fmt: ReasoningFormat = HARMONY

    def __str__(self) -> str:
        return f"L{self.line}{'-open' if self.fmt.opened else ''}"


CALL = '{"arg1": 1}'
CASES = [
    Case(6428, f"<|channel|>final<|message|>{ANSWER}", "", ANSWER),  # straight to final
    Case(6431, f"<|channel|>commentary<|message|>{ANSWER}", "", ANSWER),  # a preamble is the answer
    Case(6434, f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
         THOUGHTS, ANSWER),
    Case(6450, f"<|channel|>analysis<|message|>{THOUGHTS}", THOUGHTS, ""),  # partial: an analysis never closed
    # calls (tools given there): neither reasoning nor content
    Case(6457, f" to=functions.special_function<|channel|>analysis<|message|>{CALL}", "", ""),
    Case(6464, f"<|channel|>analysis to=functions.special_function<|message|>{CALL}", "", ""),
    Case(6471, f" to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>{CALL}", "", ""),
    Case(6478, f"<|channel|>commentary to=functions.special_function<|message|>{CALL}", "", ""),
    Case(6485, f"<|channel|>analysis<|message|>{THOUGHTS}<|end|>"
         f"<|start|>assistant to=functions.special_function<|channel|>analysis<|message|>{CALL}", THOUGHTS, ""),
    Case(6494, "<|channel|>analysis<|message|>Thinking about edit...<|end|>"
         "<|start|>assistant<|channel|>commentary to=functions.edit <|constrain|>json"
         '<|message|>{"oldString": "if (part < railCount - 1) {", "newString": "if (part < 4) {", "replaceAll": false}',
         "Thinking about edit...", ""),
    Case(6531, "<|channel|>analysis<|message|>I need to output the invoice details in JSON<|end|>"
         '<|start|>assistant<|channel|>final <|constrain|>json<|message|>{"amount": 123.45, "date": "2025-12-03"}',
         "I need to output the invoice details in JSON", '{"amount": 123.45, "date": "2025-12-03"}'),
    # unsolicited calls: "we return empty content"
    Case(6547, "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
         "<|start|>assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'",
         "I will execute python to say hello", ""),
    Case(6556, "<|channel|>analysis<|message|>I will execute python to say hello<|end|>"
         "<|start|>assistant<|channel|>commentary to=python <|constrain|>code<|message|>print(\"hello\")",
         "I will execute python to say hello", ""),
    # a stray "<|channel|>commentary to=assistant" before the analysis, and before the final message
    Case(6567, f"<|channel|>commentary to=assistant<|channel|>analysis<|message|>{THOUGHTS}<|end|>"
         f"<|start|>assistant<|channel|>final<|message|>{ANSWER}", THOUGHTS, ANSWER),
    Case(6575, f"<|channel|>analysis<|message|>{THOUGHTS}<|end|><|start|>assistant<|channel|>commentary "
         f"to=assistant<|channel|>final<|message|>{ANSWER}", THOUGHTS, ANSWER),
    # continuing a reasoning: the prompt ends "<|channel|>analysis<|message|>I'm"
    Case(6593, f" thinking<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}", "thinking", ANSWER, OPEN),
]

# Beyond test-chat.cpp: what a model may also write (line 0: not from it).
MORE = [
    Case(0, "Just text, no channel at all.", "", "Just text, no channel at all."),  # a model that writes no harmony
    Case(0, "\n\n<|start|>assistant\nHello <|channel|> there", "", "<|start|>assistant\nHello <|channel|> there"),
    Case(0, f"{ANALYSIS}\n First.\n<|end|><|start|>assistant{ANALYSIS}Second.<|end|>"  # two analysis messages
         f"<|start|>assistant<|channel|>final<|message|>\n\n{ANSWER}<|return|>", "First.Second.", ANSWER),
    Case(0, f"{ANALYSIS}{THOUGHTS}<|end|>", THOUGHTS, ""),  # the analysis only (the output ended there)
    Case(0, f"{ANALYSIS}{THOUGHTS}<|end|><|start|>assist", THOUGHTS, ""),  # a header cut off at max_tokens
    Case(0, f"{THOUGHTS}\n<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}", THOUGHTS, ANSWER, OPEN),
    Case(0, "still thinking when the budget ran out <|e", "still thinking when the budget ran out <|e", "", OPEN),
]


def _streamed(fmt: ReasoningFormat, pieces: list[str]) -> tuple[str, str]:
    s = new_splitter(fmt)
    assert isinstance(s, HarmonySplitter)
    reasoning = content = ""
    for piece in pieces:
        r, c = s.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = s.flush()
    reasoning, content = reasoning + r, content + c
    assert (s.reasoning, s.content) == (reasoning, content), "the totals differ from the released pieces"
    return reasoning, content


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 8)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", CASES + MORE, ids=str)
def test_split_whole_per_character_and_in_random_chunks(case: Case) -> None:
    expected = (case.reasoning, case.content)
    assert split(case.fmt, case.text) == expected
    assert _streamed(case.fmt, list(case.text)) == expected
    rng = random.Random(f"{case.line}:{case.text}")
    for _ in range(25):
        pieces = _chunks(case.text, rng)
        assert _streamed(case.fmt, pieces) == expected, pieces


# reasoning_format none: (line, what the generation prompt wrote of the analysis, the output, the content)
NONE = [
    (6442, "", f"{ANALYSIS}{THOUGHTS}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}",
     f"{ANALYSIS}{THOUGHTS}<|end|>{ANSWER}"),
    # beyond it: a call is left out; the reasoning continued (6593's prompt) stays in it; text that is not harmony
    (0, "", f"{ANALYSIS}x<|end|><|start|>assistant to=functions.f<|channel|>commentary<|message|>{CALL}<|call|>",
     f"{ANALYSIS}x<|end|>"),
    (0, f"{ANALYSIS}I'm", f" thinking<|end|>{FINAL}{ANSWER}", f"{ANALYSIS}I'm thinking<|end|>{ANSWER}"),
    (0, "", f"  {THOUGHTS} ", f"  {THOUGHTS} "),
]


@pytest.mark.parametrize("line, opened, text, content", NONE, ids=[f"L{n[0]}-{i}" for i, n in enumerate(NONE)])
def test_reasoning_format_none_keeps_the_analysis_as_written(line: int, opened: str, text: str, content: str) -> None:
    """All of it content, whole and streamed (per character, random chunks), and through the server's RawStream
    with the prompt's opening."""
    from app.serve.responses import RawStream

    rng = random.Random(text)
    for pieces in ([opened + text], list(opened + text), *(_chunks(opened + text, rng) for _ in range(10))):
        s = AsWritten(HARMONY)
        out = [s.push(p) for p in pieces] + [s.flush()]
        assert ("".join(r for r, _ in out), "".join(c for _, c in out)) == ("", content) == (s.reasoning, s.content)
    stream = RawStream(lambda i: text[i].encode(), (), opened, harmony=True)
    assert "".join(stream.push(i) for i in range(len(text))) + stream.flush() == content


def test_the_tag_splitter_refuses_harmony() -> None:
    from backends.reasoning import Splitter

    with pytest.raises(ValueError, match="new_splitter"):
        Splitter(HARMONY)


# --- the template ---


def _render(messages: list[ChatMessage], **kwargs: object) -> str:
    return render_chat(TEMPLATE, messages, "<|startoftext|>", "<|return|>", kwargs=kwargs)


def test_the_template_is_found_and_takes_reasoning_effort() -> None:
    """detect_format finds harmony (llama.cpp's test: `<|channel|>` in the template); thinking cannot be turned
    off (no enable_thinking: the prompt is the same), and reasoning_effort goes to the template (test-chat.cpp:7500,
    supports_reasoning_effort), "medium" unless given."""
    user = [ChatMessage("user", "Hey there!")]
    fmt = detect_format(TEMPLATE, lambda kw: _render(user, **kw))
    assert fmt == ReasoningFormat(ANALYSIS, END, opened=False, can_disable=False, after=FINAL, channels=True)
    assert _render(user).endswith("<|start|>user<|message|>Hey there!<|end|><|start|>assistant")
    assert _render(user, enable_thinking=False) == _render(user)
    assert "Reasoning: medium\n" in _render(user)
    for effort in ("low", "high"):
        assert f"Reasoning: {effort}\n" in _render(user, reasoning_effort=effort)
    opened = TEMPLATE.replace("<|start|>assistant\n{%- endif -%}", "<|start|>assistant<|channel|>analysis<|message|>"
                              "\n{%- endif -%}")
    assert detect_format(opened, lambda kw: render_chat(opened, user, "", "", kwargs=kw)).opened


def test_reasoning_goes_back_as_the_template_reads_it() -> None:
    """gpt-oss's template reads an assistant's reasoning as `thinking` (llama.cpp's gpt-oss handler copies
    reasoning_content there): it writes it for a turn that called a tool (content dropped: the template refuses
    both), and drops it from an answered turn, as harmony does."""
    call = ChatMessage("assistant", "Let me look.", tool_calls=(ToolCall("c1", "get_weather", '{"city": "Paris"}'),),
                       reasoning="I need the weather.")
    text = _render([ChatMessage("user", "Weather?"), call,
                    ChatMessage("tool", "sunny", tool_call_id="c1", name="get_weather")])
    assert "<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|>" \
           "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" in text
    assert "Let me look." not in text
    answered = _render([ChatMessage("user", "Hi"), ChatMessage("assistant", "Hello.", reasoning="Greet back."),
                        ChatMessage("user", "Again")])
    assert "<|channel|>final<|message|>Hello.<|end|>" in answered and "Greet back." not in answered


# --- the wrapper, over stand-ins: gpt-oss's vocabulary shape ---

VOCAB = {"<|channel|>": 1, "analysis": 2, "<|message|>": 3, "plan": 4, "<|end|>": 5, "<|start|>": 6, "assistant": 7,
         "final": 8, " answer": 9, " more": 10}


class Model:
    """A tokenizer over VOCAB (greedy, longest first); `<|end|>` a control token (rendered as nothing unless
    `special`, as llama.cpp's token_to_piece), or an ordinary one with `end_visible` (as llama.cpp 0.3.36 makes
    it in gpt-oss's own vocabulary: tests/test_control_tags.py)."""

    eog_ids: tuple[int, ...] = ()  # the scripts end where they end: no end-of-generation token
    def __init__(self, end_visible: bool = False) -> None:
        self.pieces = {i: ("" if t == "<|end|>" and not end_visible else t).encode() for t, i in VOCAB.items()}
        self.special = {i: t.encode() for t, i in VOCAB.items()}

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        out = []
        while text:
            tag = max((t for t in VOCAB if text.startswith(t)), key=len)
            out.append(VOCAB[tag])
            text = text[len(tag):]
        return out

    def piece(self, token: int, special: bool = False) -> bytes:
        return (self.special if special else self.pieces)[token]


class Inner:
    """A strategy that writes `script(prompt)`, up to max_tokens, and stops at a stop string as strategies do
    (the tokens include the stop's, the text does not), its text rendered as their runs render it."""

    name = "ar"

    def __init__(self, model: Model, script) -> None:
        self.model, self.script = model, script

    def steps(self, prompt, params, should_stop):
        yield Prefilled(len(prompt), 0.0)
        out, text, reason = [], "", "eos"
        render = rendering(self.model, params.reasoning.tags) if params.reasoning is not None else self.model.piece
        for tok in self.script(prompt)[:params.max_tokens]:
            out.append(tok)
            piece = render(tok).decode()
            stop = next((s for s in params.stop if (text + piece).endswith(s)), None)
            if stop is not None:  # its token is handed on, with what its text released before the stop
                released = (text + piece)[:-len(stop)]
                yield Token(tok, released[len(text):], "target")
                text, reason = released, "stop"
                break
            yield Token(tok, piece, "target")
            text += piece
        else:
            reason = "length" if len(out) == params.max_tokens else "eos"
        yield Done(reason, GenStats("ar", len(prompt), 0, 0.0, len(out), 0.0, len(out), 0, 0), tuple(out), text)


def _generate(model: Model, script, params: GenParams, prompt=(6, 7)) -> tuple[list[Token], Done]:
    events = list(Thinking(Inner(model, script), model).generate(list(prompt), params))
    done = events[-1]
    assert isinstance(done, Done)
    return [e for e in events if isinstance(e, Token)], done


def test_a_one_token_end_that_renders_as_nothing_still_ends_the_analysis() -> None:
    """An `<|end|>` that is a control token (its piece is empty) is rendered as its text where the format is in
    use (backends.text.rendering): it ends the analysis as a stop string, and the final message follows."""
    model = Model()
    out = [1, 2, 3, 4, 5, 6, 7, 1, 8, 3, 9]
    tokens, done = _generate(model, lambda prompt: out[len(prompt) - 2:], GenParams(max_tokens=32, reasoning=HARMONY))
    assert (done.reasoning, done.text, done.tokens) == ("plan", "answer", tuple(out))
    # The end tag's token ends the analysis: handed on in its channel, as a multi-token tag's last token is.
    assert [t.channel for t in tokens] == ["content", "content"] + ["reasoning"] * 3 + ["content"] * 6
    assert "".join(t.reasoning for t in tokens) == "plan" and "".join(t.text for t in tokens) == "answer"


def test_a_budget_forces_the_end_and_the_final_header() -> None:
    """The budget spent inside the analysis: `<|end|><|start|>assistant<|channel|>final<|message|>` is forced
    (llama-server forces `<|end|>` alone), and the answer phase writes the final message."""
    model = Model()

    def script(prompt):
        return [9] if prompt[-2:] == [8, 3] else [1, 2, 3] + [10] * 40

    tokens, done = _generate(model, script, GenParams(max_tokens=32, reasoning=HARMONY, reasoning_budget=2))
    forced = model.tokenize(END + FINAL)
    assert done.tokens == (1, 2, 3, 10, 10, *forced, 9)
    assert (done.reasoning, done.text) == ("more more", "answer")
    assert [t.source for t in tokens if t.source == "grammar"] == ["grammar"] * len(forced)
    assert [t.channel for t in tokens][-len(forced) - 1:] == ["content"] * (len(forced) + 1)
    assert done.stats.tokens_by_source["grammar"] == len(forced)


# --- real llama.cpp: SmolLM2 with gpt-oss's template ---

QUESTION = "What is 17 times 3? Think it through."
GEN_PROMPT = "<|start|>assistant\n{%- endif -%}"


@pytest.fixture(scope="module")
def oss_files(instruct_pair, tmp_path_factory: pytest.TempPathFactory):
    """SmolLM2-Instruct with gpt-oss's template as is, and with its generation prompt opening the analysis."""
    from conftest import repack_with_template

    assert TEMPLATE.count(GEN_PROMPT) == 1
    opened = TEMPLATE.replace(GEN_PROMPT, "<|start|>assistant<|channel|>analysis<|message|>\n{%- endif -%}")
    d = tmp_path_factory.mktemp("harmony")
    return (repack_with_template(instruct_pair.target, d / "smollm2-gpt-oss.gguf", TEMPLATE),
            repack_with_template(instruct_pair.target, d / "smollm2-gpt-oss-open.gguf", opened),
            instruct_pair.draft)


@pytest.fixture(scope="module")
def oss(oss_files):
    from backends.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(target=oss_files[1], draft=oss_files[2], n_ctx=2048, threads=os.cpu_count(),
                                 n_seq_max=16))
    yield engine
    engine.close()


def _prompt(engine, question: str = QUESTION):
    from app.prompt_format import PromptFormat

    fmt = PromptFormat(engine)
    messages = [ChatMessage("user", question)]
    kwargs = fmt.thinking_kwargs(True, {"reasoning_effort": "low"})
    return fmt.tokens(messages, kwargs=kwargs), fmt.reasoning_for(messages, kwargs=kwargs)


def test_harmony_is_split_over_smollm2s_token_boundaries(oss) -> None:
    """SmolLM2's vocabulary has none of harmony's special tokens: each tag is several tokens, and the text split
    at the tokens' boundaries splits as it does whole."""
    model = oss.target_model
    for tag in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"):
        assert len(model.tokenize(tag, add_special=False, parse_special=True)) > 1, tag
    text = f"{ANALYSIS}{THOUGHTS}<|end|><|start|>assistant<|channel|>final<|message|>{ANSWER}"
    ids = model.tokenize(text, add_special=False, parse_special=True)
    pieces = [model.piece(t).decode("utf-8") for t in ids]
    assert "".join(pieces) == text
    assert _streamed(HARMONY, pieces) == (THOUGHTS, ANSWER)


def test_the_engine_splits_the_analysis_from_the_final_answer(oss) -> None:
    """The prompt opens the analysis: SmolLM2 never writes `<|end|>`, so without a budget all it writes is
    reasoning (unclosed at max_tokens); with one, the end and the final header are forced and the answer
    follows. Each token's channel, the pieces and the Done's texts agree, and ar and the speculating strategies
    give the same greedy tokens."""
    prompt, fmt = _prompt(oss)
    assert fmt.channels and fmt.opened
    text = oss.target_model.detokenize(prompt)
    assert "Reasoning: low" in text and text.endswith("<|start|>assistant<|channel|>analysis<|message|>")
    unbounded = list(oss.strategy("ar").generate(prompt, GenParams(max_tokens=24, reasoning=fmt)))[-1]
    assert unbounded.reason == "length" and unbounded.reasoning and unbounded.text == ""
    results = {}
    for strategy in ("ar", "sps", "auto"):
        events = list(oss.strategy(strategy).generate(prompt, GenParams(max_tokens=64, reasoning=fmt,
                                                                         reasoning_budget=12)))
        done = events[-1]
        assert isinstance(done, Done) and done.reason != "error", done
        shown = [e for e in events if isinstance(e, Token) and e.kind != REJECTED]
        assert [e.id for e in shown] == list(done.tokens)
        assert "".join(e.reasoning for e in shown) == done.reasoning
        assert "".join(e.text for e in shown) + done.tail == done.text
        assert done.reasoning and done.text, done
        for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"):
            assert marker not in done.reasoning + done.text
        channels = [e.channel for e in shown]
        first_content = channels.index("content")
        assert set(channels[:first_content]) == {"reasoning"} and set(channels[first_content:]) == {"content"}
        assert sum(e.source == "grammar" for e in shown) == len(oss.target_model.tokenize(
            END + FINAL, add_special=False, parse_special=True))
        assert unbounded.reasoning.startswith(done.reasoning[:20])
        results[strategy] = done.tokens
    assert results["sps"] == results["ar"] == results["auto"]


def test_thinking_off_is_refused_and_names_reasoning_effort(oss) -> None:
    from app.prompt_format import PromptFormat, ThinkingError

    with pytest.raises(ThinkingError, match="cannot turn thinking off.*reasoning_effort"):
        PromptFormat(oss).thinking_kwargs(False)


def test_reasoning_effort_reaches_the_template_and_is_refused_where_none_is_read(oss, instruct_pair) -> None:
    """`--reasoning-effort` (run, chat): gpt-oss's template writes it into the system message; a template that
    reads none (SmolLM2's own) refuses it in one line, exit 1 (a user's mistake)."""
    from app.prompt_format import PromptFormat

    fmt = PromptFormat(oss)
    kwargs = fmt.thinking_kwargs(True, effort="low")
    assert kwargs["reasoning_effort"] == "low"
    assert "Reasoning: low" in fmt.render([ChatMessage("user", QUESTION)], kwargs=kwargs)
    refused = _cli("-m", str(instruct_pair.target), "Hi", "-n", "2", "-t", "2", "--reasoning-effort", "low")
    assert refused.returncode == 1 and "takes no reasoning_effort" in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "SPECCHAT_MEMORY_DIR": ""})


def test_run_json_events_carry_the_channel(oss_files) -> None:
    """`run --json` on both files: the opened one thinks, then answers after the forced final header; the one
    as shipped gets no channel from SmolLM2 (a model that writes no harmony): all of it is the answer."""
    as_is, opened, _ = oss_files
    lines = [json.loads(line) for line in _cli("-m", str(opened), QUESTION, "-n", "48", "--temp", "0", "-t", "2",
                                                "--reasoning-budget", "12", "-s", "ar", "--json").stdout.splitlines()]
    done, tokens = lines[-1], [line for line in lines if line["type"] == "token"]
    assert done["type"] == "done" and done["reasoning"] and done["text"]
    assert {t["channel"] for t in tokens} == {"reasoning", "content"}
    assert "".join(t.get("reasoning", "") for t in tokens) == done["reasoning"]
    assert "<|channel|>" not in done["text"] + done["reasoning"]
    lines = [json.loads(line) for line in _cli("-m", str(as_is), QUESTION, "-n", "16", "--temp", "0", "-t", "2",
                                                "-s", "ar", "--json").stdout.splitlines()]
    done = lines[-1]
    assert done["type"] == "done" and not done.get("reasoning") and done["text"]
    assert {line["channel"] for line in lines if line["type"] == "token"} == {"content"}


def test_serve_returns_reasoning_content(oss_files, tmp_path_factory: pytest.TempPathFactory) -> None:
    """`specchat serve` on the opened file: reasoning_content apart from content, whole and streamed alike;
    reasoning_effort goes to the template, "none" is a 400 that names it; /props says how the model thinks."""
    import httpx
    from serve_helpers import API_KEY, assert_error, start_server, stop_server

    served = start_server(["-m", str(oss_files[1]), "--api-key", API_KEY, "-np", "1", "--temp", "0", "-n", "48"],
                          tmp_path_factory.mktemp("oss") / "server.log")
    try:
        user = [{"role": "user", "content": QUESTION}]
        extra = {"reasoning_budget_tokens": 12, "reasoning_effort": "low"}
        whole = served.client().chat.completions.create(model="smollm2-gpt-oss-open", messages=user, temperature=0,
                                                        extra_body=extra).choices[0].message
        reasoning = (whole.model_extra or {}).get("reasoning_content")
        assert reasoning and whole.content
        for marker in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"):
            assert marker not in reasoning + whole.content
        streamed = ["", ""]
        for chunk in served.client().chat.completions.create(model="smollm2-gpt-oss-open", messages=user,
                                                             temperature=0, stream=True, extra_body=extra):
            for choice in chunk.choices:
                streamed[0] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
                streamed[1] += choice.delta.content or ""
        assert streamed == [reasoning, whole.content]
        message = assert_error(served.post("/v1/chat/completions", {"messages": user, "reasoning_effort": "none"}),
                               400, param="reasoning_effort")
        assert "reasoning_effort" in message
        props = httpx.get(f"{served.url}/props", headers={"Authorization": f"Bearer {API_KEY}"}).json()
        assert props["reasoning"] == {"start": ANALYSIS, "end": END, "opened": True, "can_disable": False}
    finally:
        stop_server(served)
