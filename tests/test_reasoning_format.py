"""The reasoning splitter and thinking-format detection, against llama.cpp's own expectations.

The parse cases come from llama.cpp's tests/test-chat.cpp (the copy vendored in
llama-cpp-python 0.3.36; each case cites its line): the model's output (the
text after the generation prompt) in, the reasoning_content and content that
test-chat.cpp expects with reasoning_format auto or deepseek out, for the tag
formats backends/reasoning.py knows: `<think>` (Qwen3.5, QwQ, Nemotron 3,
DeepSeek R1/V3.x, GLM-4.7, Granite 3.3, LFM2.5, MiniMax-M2, Reka, StepFun,
Ling, MiniCPM5), `[THINK]` (Ministral/Magistral), `<|START_THINKING|>` (Command
R7B, Cohere2 MoE), `<seed:think>` (Seed-OSS) and Gemma 4's `<|channel>thought`.
A case whose template opens the block in its generation prompt ("forced open":
test-chat.cpp's input starts after the tag) runs the splitter opened.
test-chat.cpp compares with surrounding whitespace stripped
(assert_msg_equals(..., true), line 1191/1197); the splitter trims the
reasoning and the answer's start, so the expectations here are those strings
stripped (only line 3983's "REASONING\n" changes).

Every case is also streamed: one character at a time and in seeded random
chunks through Splitter.push, then flush(): the pieces joined give the same
reasoning and content (test-chat.cpp's harness does the same with prefixes,
lines 1167-1195).

Not taken from test-chat.cpp, as things the splitter does not do:
- cases with tool calls (`.tools(...)`) or a response format (`.json_schema(...)`): they parse the answer further;
- continuation cases (`continue_final_message`): the prefilled reasoning is the request's, not the output's;
- formats with tags specchat does not split: Kimi-K3's <|close|>think<|sep|>, MiniMax-M3's <mm:think>,
  Apriel's [BEGIN FINAL RESPONSE]. gpt-oss's harmony channels have their own file, tests/test_harmony.py.
Kept with a difference: Command R7B and Cohere2 MoE wrap the answer in <|START_RESPONSE|>/<|START_TEXT|>
markers that llama.cpp's parsers remove; the splitter leaves them in the content, so those cases expect
test-chat.cpp's content inside its markers. The content-only cases marked "(none)" run under reasoning_format
none there: an output with no tag splits the same under auto. test-chat.cpp has no unclosed-block case for a
tag format; the unclosed cases cite Kimi-K3's (line 4889, whose input has no tag at all) and chat.cpp's
lenient parse (line 1465: an until() at the end of the input matches it).

Gemma 4's stray-tag edge cases (lines 3155-3177: a block opened again after the answer, a stray <channel|>
after it, a <|channel> doubled before the block) are here, whole, streamed and at every prefix as test-chat.cpp's
harness parses them; so are the rules of its parser behind them and a tail cut inside a tag at the end
(PARSER_CASES), with the results of llama.cpp's own parse (common_chat_parse, built by
../shared/tools/build-llama-cpp-reference.sh) where test-chat.cpp has no case.

reasoning_format none (test-chat.cpp's `COMMON_REASONING_FORMAT_NONE` cases for these formats, lines 2156,
2704, 3011; 4716 has tools): nothing split, the content is the output as written after what the generation
prompt wrote of the block (backends.reasoning.opening: llama.cpp parses the two as one text), through the
server's stream (app.serve.responses.RawStream) one character at a time too.

Detection: the templates from llama.cpp's models/templates (copied into tests/data/templates) rendered
through app.chat_template.render_chat with enable_thinking true and false; the expected tags, `opened` and
`can_disable` are read from the templates' generation prompts (and test-chat.cpp's
test_template_generation_prompt, lines 6942-7245), which the test checks too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.chat_template import ChatMessage, render_chat
from backends.harmony import ANALYSIS, END, FINAL
from backends.reasoning import (ReasoningFormat, Splitter, detect_format, new_splitter, opening, split,
                                template_thinks)

THINK = ReasoningFormat("<think>", "</think>")
THINK_OPEN = ReasoningFormat("<think>", "</think>", opened=True)
MISTRAL = ReasoningFormat("[THINK]", "[/THINK]")
R7B = ReasoningFormat("<|START_THINKING|>", "<|END_THINKING|>")
R7B_OPEN = ReasoningFormat("<|START_THINKING|>", "<|END_THINKING|>", opened=True)
SEED = ReasoningFormat("<seed:think>", "</seed:think>")
GEMMA4 = ReasoningFormat("<|channel>thought", "<channel|>")

# test-chat.cpp's messages (lines 1030-1081)
THOUGHTS = "I'm\nthinking"  # message_assist_thoughts' reasoning
ANSWER = "Hello, world!\nWhat's up?"  # message_assist's content


@dataclass(frozen=True)
class Case:
    line: int  # in `source`
    fmt: ReasoningFormat
    text: str
    reasoning: str
    content: str
    source: str = "test-chat.cpp"

    def __str__(self) -> str:
        where = "" if self.source == "test-chat.cpp" else f"{self.source}-"
        return f"{where}L{self.line}-{self.fmt.start}{'-open' if self.fmt.opened else ''}"


CASES = [
    # <think> families
    Case(2150, THINK_OPEN, "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", THOUGHTS, ANSWER),  # Qwen3.5
    Case(2699, THINK, "Hello, world!\nWhat's up?", "", ANSWER),  # Nemotron 3 Nano, enable_thinking false
    Case(2710, THINK_OPEN, "I'm\nthinking\n</think>\nHello, world!\nWhat's up?", THOUGHTS, ANSWER),  # Nemotron 3
    Case(3299, THINK_OPEN, "Let me think about this...\n</think>\nThe answer is 42.",  # QwQ
         "Let me think about this...", "The answer is 42."),
    Case(3305, THINK_OPEN, "</think>Hello, world!", "", "Hello, world!"),  # QwQ: empty reasoning
    Case(3369, THINK, "Hello, world!\nWhat's up?", "", ANSWER),  # Granite 3.3 (none)
    Case(3371, THINK, "<think>I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # Granite 3.3
    Case(3983, THINK_OPEN, "REASONING</think>\nCONTENT", "REASONING", "CONTENT"),  # DeepSeek V3.1
    Case(3992, THINK, "CONTENT", "", "CONTENT"),  # DeepSeek V3.1, enable_thinking false
    Case(4008, THINK, "Hello, world!\nWhat's up?", "", ANSWER),  # DeepSeek V3.2, enable_thinking false
    Case(4015, THINK_OPEN, "I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # DeepSeek V3.2
    Case(4241, THINK_OPEN, "I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # DeepSeek V4
    Case(4404, THINK, "Hello, world!\nWhat's up?", "", ANSWER),  # GLM-4.7-Flash, enable_thinking false (none)
    Case(4411, THINK_OPEN, "I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # GLM-4.7-Flash
    Case(4725, THINK, "Here is the answer.\nNo think block at all.", "",  # Ling 3.0, enable_thinking false
         "Here is the answer.\nNo think block at all."),
    Case(5270, THINK, "<think>I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # LFM2.5, off
    Case(5443, THINK_OPEN, "\n</think>\n\nHello, world!\nWhat's up?", "", ANSWER),  # MiniMax-M2: empty
    Case(5445, THINK_OPEN, "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", THOUGHTS, ANSWER),  # MiniMax-M2
    Case(5990, THINK_OPEN, "</think>Hello, world!\nWhat's up?", "", ANSWER),  # R1 Distill Llama: empty
    Case(5994, THINK_OPEN, "I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # R1 Distill Llama
    Case(6024, THINK_OPEN, "</think>Hello, world!\nWhat's up?", "", ANSWER),  # llama.cpp's deepseek-r1
    Case(6025, THINK_OPEN, "I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # ibid.
    Case(6063, THINK_OPEN, "</think>Hello, world!\nWhat's up?", "", ANSWER),  # R1 Distill Qwen: empty
    Case(6066, THINK_OPEN, "I'm\nthinking</think>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),  # R1 Distill Qwen
    Case(6129, THINK_OPEN, "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", THOUGHTS, ANSWER),  # Reka Edge
    Case(6607, THINK_OPEN, "I was thinking\n</think>\nNow I'm not.", "I was thinking", "Now I'm not."),  # StepFun
    Case(6874, THINK, "Hello, world!\nWhat's up?", "", ANSWER),  # MiniCPM5, enable_thinking false
    # [THINK] (Ministral 3 Reasoning / Magistral)
    Case(2604, MISTRAL, "Hello, world!\nWhat's up?", "", ANSWER),  # (none)
    Case(2611, MISTRAL, "[THINK]I'm\nthinking[/THINK]Hello, world!\nWhat's up?", THOUGHTS, ANSWER),
    # Command R7B (content keeps its response markers: see the docstring)
    Case(2824, R7B, "<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!\nWhat's up?"
         "<|END_RESPONSE|>", THOUGHTS, "<|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>"),
    Case(2877, R7B_OPEN, "I'm\nthinking<|END_THINKING|><|START_TEXT|>Hello, world!\nWhat's up?<|END_TEXT|>",  # Cohere2
         THOUGHTS, "<|START_TEXT|>Hello, world!\nWhat's up?<|END_TEXT|>"),
    Case(2888, R7B_OPEN, "<|END_THINKING|><|START_TEXT|>Hello, world!\nWhat's up?<|END_TEXT|>", "",  # Cohere2: empty
         "<|START_TEXT|>Hello, world!\nWhat's up?<|END_TEXT|>"),
    # Seed-OSS
    Case(3447, SEED, "Hello, world!\nWhat's up?", "", ANSWER),  # (none)
    Case(3449, SEED, "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!",
         "I'm thinking about the answer", "Hello, world!"),
    # Gemma 4
    Case(2994, GEMMA4, "Hello, world!", "", "Hello, world!"),  # (none)
    Case(2997, GEMMA4, "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", THOUGHTS, ANSWER),
    Case(3004, GEMMA4, "<|channel>thought<channel|>Hello, world!\nWhat's up?", "", ANSWER),  # empty reasoning
    # Gemma 4's stray tags: a block opened again after the answer, a stray end tag, a doubled channel marker
    Case(3155, GEMMA4, "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<channel|>", "", ANSWER),
    Case(3161, GEMMA4, "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|>", "", ANSWER),
    Case(3167, GEMMA4, "<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|><channel|>",
         "", ANSWER),
    Case(3173, GEMMA4, "<|channel><|channel>thought\n<channel|>Hello, world!\nWhat's up?", "", ANSWER),
    # Unclosed at the end: all reasoning (Kimi-K3's case, 4889; then chat.cpp:1465's lenient parse with a tag)
    Case(4889, THINK_OPEN, "I was still thinking when the budget ran out",
         "I was still thinking when the budget ran out", ""),
    Case(4889, THINK, "<think>I'm\nthinking", THOUGHTS, ""),
    Case(4889, MISTRAL, "[THINK]I'm\nthinking\n", THOUGHTS, ""),
    Case(4889, GEMMA4, "<|channel>thought\nI'm\nthinking", THOUGHTS, ""),
]

# The rules behind Gemma 4's stray-tag cases, and an output cut inside a tag, with the results of llama.cpp's own
# parse (common_chat_parse of the reference build's libllama-common, the template from models/templates, stripped
# as above). Gemma 4's parser (common/parsers/gemma4.cpp:285-290) reads messages, each an optional block, then an
# answer up to the next <|channel> or <channel|>: another block adds to the reasoning and the answers join as
# written; a stray <channel|>, or a <|channel> that opens no block, ends the parse, the rest dropped. The tag
# formats' parsers keep a stray end tag in the answer. At the end of the output, a tail that may begin a tag is
# dropped (peg-parser.cpp:718: an until() stops before a delimiter's partial match).
PARSER_CASES = [
    Case(288, GEMMA4, "Hello<channel|>World", "", "Hello", "gemma4.cpp"),
    Case(288, GEMMA4, "Hello<|channel>foo bar", "", "Hello", "gemma4.cpp"),
    Case(288, GEMMA4, "A<|channel>thought\nmid<channel|> B", "mid", "A B", "gemma4.cpp"),
    Case(288, GEMMA4, "<|channel>thought\nA<channel|><|channel>thought\nB<channel|>  C", "AB", "C", "gemma4.cpp"),
    Case(718, GEMMA4, "Hello<|chan", "", "Hello", "peg-parser.cpp"),
    Case(718, GEMMA4, "<|channel>thought\nabc<chan", "abc", "", "peg-parser.cpp"),
    Case(718, THINK, "<think>abc</thi", "abc", "", "peg-parser.cpp"),  # Qwen3
    Case(718, THINK_OPEN, "abc</thi", "abc", "", "peg-parser.cpp"),  # QwQ
    Case(168, THINK, "<think>abc</think>Hello</think>World", "abc", "Hello</think>World",  # the answer: p.rest()
         "chat-auto-parser-generator.cpp"),
]
CASES += PARSER_CASES


def _streamed(fmt: ReasoningFormat, pieces: list[str]) -> tuple[str, str]:
    """The splitter fed `pieces`, then flushed: its released pieces joined (and checked against its totals)."""
    s = new_splitter(fmt)
    reasoning = content = ""
    for piece in pieces:
        r, c = s.push(piece)
        reasoning += r
        content += c
    r, c = s.flush()
    reasoning += r
    content += c
    assert (s.reasoning, s.content) == (reasoning, content), "the totals differ from the released pieces"
    return reasoning, content


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 8)))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_whole(case: Case) -> None:
    assert split(case.fmt, case.text) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_one_character_at_a_time(case: Case) -> None:
    assert _streamed(case.fmt, list(case.text)) == (case.reasoning, case.content)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_split_random_chunks(case: Case) -> None:
    rng = random.Random(f"{case.line}:{case.text}")
    for _ in range(25):
        pieces = _chunks(case.text, rng)
        assert _streamed(case.fmt, pieces) == (case.reasoning, case.content), pieces


@pytest.mark.parametrize("case", [c for c in CASES if not c.fmt.opened and c.text.lstrip().startswith(c.fmt.start)],
                         ids=str)
def test_opened_argument_overrides_the_format(case: Case) -> None:
    """Splitter(fmt, opened=True) reads a forced-open output: the same case less its start tag (the cases that
    have one: a case without it does not think)."""
    body = case.text.lstrip()
    s = Splitter(case.fmt, opened=True)
    s.push(body[len(case.fmt.start):])
    s.flush()
    assert (s.reasoning, s.content) == (case.reasoning, case.content)


STRAY_TAGS = [c for c in CASES if c.fmt == GEMMA4 and 3155 <= c.line <= 3177]


@pytest.mark.parametrize("case", STRAY_TAGS, ids=str)
def test_every_prefix_releases_what_llama_cpps_partial_parse_does(case: Case) -> None:
    """test-chat.cpp's harness parses every prefix of its input as partial (lines 1173-1195). On Gemma 4's
    stray-tag cases llama.cpp's partial parses (common_chat_parse of the reference build, is_partial) give the
    answer as far as the prefix has come and nothing of a tag, before, between or after: the splitter, fed the
    same prefixes, has released the same."""
    s = new_splitter(case.fmt)
    at = case.text.index(case.content)
    released = ["", ""]
    for n, char in enumerate(case.text, 1):
        for i, piece in enumerate(s.push(char)):
            released[i] += piece
        assert released == ["", case.content[:max(0, min(n - at, len(case.content)))]], case.text[:n]


# --- reasoning_format none ---


@dataclass(frozen=True)
class NoneCase:
    line: int  # in test-chat.cpp
    fmt: ReasoningFormat
    prompt: str  # the template's generation prompt
    text: str
    content: str
    template: str = ""  # in tests/data/templates: the whole prompt rendered from it (ending with `prompt`)

    def __str__(self) -> str:
        return f"L{self.line}-{self.fmt.start}"


NONE_CASES = [
    # Qwen3.5 with enable_thinking (its generation prompt: test-chat.cpp:7001)
    NoneCase(2156, THINK_OPEN, "<|im_start|>assistant\n<think>\n",
             "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?",
             "<think>\nI'm\nthinking\n</think>\n\nHello, world!\nWhat's up?", "Qwen3.5-4B"),
    # Nemotron 3 Nano with enable_thinking (llama.cpp's models/templates/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja:200)
    NoneCase(2704, THINK_OPEN, "<|im_start|>assistant\n<think>\n", "I'm\nthinking\n</think>\nHello, world!\nWhat's up?",
             "<think>\nI'm\nthinking\n</think>\nHello, world!\nWhat's up?"),
    # Gemma 4: the model opens the block itself (its generation prompt: test-chat.cpp:7013)
    NoneCase(3011, GEMMA4, "<|turn>model\n", "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?",
             "<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", "google-gemma-4-31B-it"),
]


@pytest.mark.parametrize("case", NONE_CASES, ids=str)
def test_reasoning_format_none_is_the_prompts_opening_and_the_output_as_written(case: NoneCase) -> None:
    """The content of test-chat.cpp's reasoning_format none cases: whole, and streamed through the server's
    RawStream one character (a stand-in token) at a time, the opening in its first piece."""
    from app.serve.responses import RawStream

    prompt = case.prompt
    if case.template:
        template = (TEMPLATES / f"{case.template}.jinja").read_text(encoding="utf-8")
        prompt = render_chat(template, [ChatMessage("user", "Hey there!")], "", "", kwargs={"enable_thinking": True})
        assert prompt.endswith(case.prompt), prompt[-200:]
    opened = opening(case.fmt, prompt)
    assert opened + case.text == case.content
    stream = RawStream(lambda i: case.text[i].encode(), (), opened)
    pieces = [stream.push(i) for i in range(len(case.text))] + [stream.flush()]
    assert pieces[0] == opened + case.text[0] and "".join(pieces) == case.content


# --- template detection ---

TEMPLATES = Path(__file__).parent / "data" / "templates"


@dataclass(frozen=True)
class TemplateCase:
    name: str
    bos: str
    eos: str
    on_tail: str  # the end of the prompt with enable_thinking true: the generation prompt (and what precedes it)
    off_tail: str  # the same with enable_thinking false
    expected: ReasoningFormat | None

    def __str__(self) -> str:
        return self.name


TEMPLATE_CASES = [
    # generation prompt: "<|im_start|>assistant\n", and "<think>\n\n</think>\n\n" when enable_thinking is false
    TemplateCase("Qwen-Qwen3-0.6B", "", "<|im_end|>", "<|im_start|>assistant\n",
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                 ReasoningFormat("<think>", "</think>", opened=False, can_disable=True, after="\n\n")),
    # test-chat.cpp:7001: "<|im_start|>assistant\n<think>\n" (forced open); off: "<think>\n\n</think>\n\n"
    TemplateCase("Qwen3.5-4B", "", "<|im_end|>", "<|im_start|>assistant\n<think>\n",
                 "<|im_start|>assistant\n<think>\n\n</think>\n\n",
                 ReasoningFormat("<think>", "</think>", opened=True, can_disable=True, after="\n\n")),
    # llama.cpp's QwQ: "<|im_start|>assistant\n<think>\n", then "</think>" if not enable_thinking; earlier
    # answers are split at "</think>" and `.lstrip('\n')`: the model writes newlines after the tag
    TemplateCase("Qwen-QwQ-32B", "", "<|im_end|>", "<|im_start|>assistant\n<think>\n",
                 "<|im_start|>assistant\n<think>\n</think>",
                 ReasoningFormat("<think>", "</think>", opened=True, can_disable=True, after="\n\n")),
    # llama.cpp's R1 distill: "<｜Assistant｜><think>\n", then "</think>" if not enable_thinking
    TemplateCase("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 "<｜Assistant｜><think>\n", "<｜Assistant｜><think>\n</think>",
                 ReasoningFormat("<think>", "</think>", opened=True, can_disable=True)),
    # "/think": "<|im_start|>assistant\n"; "/no_think": "<|im_start|>assistant\n<think>\n\n</think>\n"
    # (its /think system prompt quotes "<think> Thought section </think>", closed)
    TemplateCase("HuggingFaceTB-SmolLM3-3B", "", "<|im_end|>", "<|im_start|>assistant\n",
                 "<|im_start|>assistant\n<think>\n\n</think>\n",
                 ReasoningFormat("<think>", "</think>", opened=False, can_disable=True, after="\n")),
    # test-chat.cpp:7013: "<|turn>model\n"; off: "<|channel>thought\n<channel|>" after it
    TemplateCase("google-gemma-4-31B-it", "<bos>", "<eos>", "<|turn>model\n",
                 "<|turn>model\n<|channel>thought\n<channel|>",
                 ReasoningFormat("<|channel>thought", "<channel|>", opened=False, can_disable=True)),
    # test-chat.cpp:7008: no generation prompt; the template has no enable_thinking (its default system prompt
    # quotes "[THINK]...[/THINK]", closed)
    TemplateCase("mistralai-Ministral-3-14B-Reasoning-2512", "<s>", "</s>", "[INST]Hey there![/INST]",
                 "[INST]Hey there![/INST]", ReasoningFormat("[THINK]", "[/THINK]", opened=False, can_disable=False)),
    # test-chat.cpp:7010: "<|start|>assistant". Harmony channels (<|channel|>analysis<|message|>…<|end|>, then
    # the final channel's header), as llama.cpp's gpt-oss handler (common/parsers/gpt-oss.cpp); no enable_thinking
    TemplateCase("openai-gpt-oss-120b", "<|startoftext|>", "<|return|>", "<|start|>assistant",
                 "<|start|>assistant", ReasoningFormat(ANALYSIS, END, after=FINAL, channels=True)),
    # not a thinking model
    TemplateCase("Qwen-Qwen2.5-7B-Instruct", "", "<|im_end|>", "<|im_start|>assistant\n",
                 "<|im_start|>assistant\n", None),
]


def _renderer(case: TemplateCase):
    template = (TEMPLATES / f"{case.name}.jinja").read_text(encoding="utf-8")
    messages = [ChatMessage("user", "Hey there!")]  # test-chat.cpp's message_user

    def render(kwargs: dict) -> str:
        return render_chat(template, messages, case.bos, case.eos, kwargs=kwargs)

    return template, render


@pytest.mark.parametrize("case", TEMPLATE_CASES, ids=str)
def test_generation_prompts(case: TemplateCase) -> None:
    """The premise of the expectations below: the prompts end as read from the templates."""
    _, render = _renderer(case)
    on, off = render({"enable_thinking": True}), render({"enable_thinking": False})
    assert on.endswith(case.on_tail), on[-200:]
    assert off.endswith(case.off_tail), off[-200:]
    assert render({}) == on  # enable_thinking defaults to true, as in llama.cpp


@pytest.mark.parametrize("case", TEMPLATE_CASES, ids=str)
def test_detect_format(case: TemplateCase) -> None:
    template, render = _renderer(case)
    assert detect_format(template, render) == case.expected
    # The listings' reading of a template without rendering it says the same of whether the model thinks
    assert template_thinks(template) == (case.expected is not None)


@pytest.mark.parametrize("case", [c for c in TEMPLATE_CASES if c.expected is not None], ids=str)
def test_detected_format_splits_its_own_generation(case: TemplateCase) -> None:
    """What a model would write after each template's prompt, split with the detected format."""
    template, render = _renderer(case)
    fmt = detect_format(template, render)
    assert fmt is not None
    body = f"{THOUGHTS}{fmt.end}\n\n{ANSWER}"
    text = body if case.expected.opened else f"{fmt.start}\n{body}"
    assert split(fmt, text) == (THOUGHTS, ANSWER)
    assert _streamed(fmt, list(text)) == (THOUGHTS, ANSWER)


# What each template's generation prompt writes of the block, thinking on and off: llama.cpp's content under
# reasoning_format none starts with it (the prompt's part from the start tag: chat-auto-parser-generator.cpp:134).
OPENINGS = {
    "Qwen-Qwen3-0.6B": ("", "<think>\n\n</think>\n\n"),
    "Qwen3.5-4B": ("<think>\n", "<think>\n\n</think>\n\n"),
    "Qwen-QwQ-32B": ("<think>\n", "<think>\n</think>"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("<think>\n", "<think>\n</think>"),
    "HuggingFaceTB-SmolLM3-3B": ("", "<think>\n\n</think>\n"),  # its /think system prompt's closed tags are not it
    "google-gemma-4-31B-it": ("", "<|channel>thought\n<channel|>"),
    "mistralai-Ministral-3-14B-Reasoning-2512": ("", ""),  # nor is the tag pair its system prompt quotes
    "openai-gpt-oss-120b": ("", ""),
}


@pytest.mark.parametrize("case", [c for c in TEMPLATE_CASES if c.expected is not None], ids=str)
def test_the_opening_is_what_the_generation_prompt_wrote_of_the_block(case: TemplateCase) -> None:
    _, render = _renderer(case)
    on, off = render({"enable_thinking": True}), render({"enable_thinking": False})
    assert (opening(case.expected, on), opening(case.expected, off)) == OPENINGS[case.name]
    for text, opened in ((on, OPENINGS[case.name][0]), (off, OPENINGS[case.name][1])):
        assert text.endswith(opened) and (case.expected.start in opened or not opened)


def test_a_tag_that_is_one_control_token_is_seen_though_it_renders_as_nothing() -> None:
    """Where `<think>` and `</think>` are control tokens (their pieces are empty, as LlamaModel.piece renders
    them without `special`), the runs render them as text for the splitter (backends.text.rendering). Pure
    logic: a stand-in model and a stand-in strategy that emits fixed tokens as a run renders them; the same on
    a real vocabulary: tests/test_control_tags.py."""
    from backends.events import Done, GenStats, Prefilled, Token
    from backends.reasoning import Thinking
    from backends.sampling import GenParams
    from backends.text import rendering

    pieces = {1: b"", 2: b"", 3: b"plan", 4: b" answer"}
    special = {**pieces, 1: b"<think>", 2: b"</think>"}

    class Model:
        def tokenize(self, text, add_special=False, parse_special=True):
            return {"<think>": [1], "</think>": [2]}.get(text, [9])

        def piece(self, token, special_=False):
            return (special if special_ else pieces).get(token, b"?")

    class Inner:
        name = "ar"

        def steps(self, prompt, params, should_stop):
            yield Prefilled(len(prompt), 0.0)
            out = [1, 3, 2, 4]
            render = rendering(model, params.reasoning.tags)
            for tok in out:
                yield Token(tok, render(tok).decode(), "target")
            yield Done("eos", GenStats("ar", len(prompt), 0, 0.0, len(out), 0.0, len(out), 0, 0), tuple(out),
                       "plan answer")

    fmt = ReasoningFormat("<think>", "</think>")
    model = Model()
    events = list(Thinking(Inner(), model).generate([5], GenParams(max_tokens=8, reasoning=fmt)))
    done = events[-1]
    assert (done.reasoning, done.text) == ("plan", "answer")
    assert [e.channel for e in events if isinstance(e, Token)] == ["reasoning", "reasoning", "content", "content"]


def test_the_catalogs_thinking_models_say_what_their_templates_say() -> None:
    """The catalog's Qwen3 and Qwen3.5 models declare their thinking (tags, can be turned off), gpt-oss-20b harmony's
    channels (cannot): the same as detect_format finds in their templates (llama.cpp's copies, tests/data/templates;
    llama.cpp keeps gpt-oss's harmony template as the 120b's)."""
    from models.catalog import HARMONY, load_catalog

    template_of = {"qwen3-8b": "Qwen-Qwen3-0.6B.jinja", "qwen3-0.6b": "Qwen-Qwen3-0.6B.jinja",
                   "qwen3.5-4b-mtp": "Qwen3.5-4B.jinja", "gpt-oss-20b": "openai-gpt-oss-120b.jinja"}
    declared = [m for m in load_catalog().models if m.thinking]
    assert {m.alias for m in declared} == set(template_of)
    for m in declared:
        template = (TEMPLATES / template_of[m.alias]).read_text()
        fmt = detect_format(template, lambda kw: render_chat(template, [ChatMessage("user", "Hi")], "", "<|im_end|>",
                                                             kwargs=kw))
        assert fmt is not None and fmt.channels == (m.thinking.format == HARMONY), m.alias
        assert m.thinking.tags == (() if fmt.channels else (fmt.start, fmt.end)), m.alias
        assert m.thinking.can_disable == fmt.can_disable, m.alias
        assert ("--no-think" in m.thinking_note) == fmt.can_disable, m.alias
