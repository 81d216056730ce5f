"""gpt-oss under a grammar (a response_format, a required or named tool call): analysis first, then the answer.

llama.cpp's grammar for gpt-oss (common/parsers/gpt-oss.cpp:97-135, 0.3.36's
vendored copy; not lazy, the generation prompt's `<|start|>assistant` fed to it
first, common/sampling.cpp:278-308) is `(<|start|>assistant analysis)*
<|start|>assistant` and then the final channel's header and the schema's JSON
(a response_format), or a call's header and its arguments (tools, required):
the model may think in analysis messages before the answer, and the analysis
is free text up to `<|end|>`. backends.reasoning.Thinking does the same
(`_harmony`): at each message's start the model writes an analysis header or
the answer's (backends.harmony.opening_grammar); an analysis it ends itself is
followed by another message's start; a budget spent inside an analysis
forces its end and the answer's header.

The stand-in model writes bytes (harmony's markers are several tokens, as
SmolLM2 spells them) under each phase's grammar: a token the grammar refuses
fails the test, as no real model could write it (tests/test_reasoning_opening's
Writer). The last test builds the grammar over a vocabulary that has the
markers as control tokens, as gpt-oss's own has them. On real llama.cpp
(SmolLM2 re-packed with gpt-oss's template) and beside llama-server:
tests/test_harmony_tools.py and tests/test_serve_reasoning_harmony.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Callable

import llguidance

from app.serve.harmony_tools import calls_of, forced_header
from backends.events import REJECTED, Done, Token
from backends.grammar import compile_grammar
from backends.harmony import ANALYSIS, END, FINAL, START, lark_text, marker_terminal, opening_grammar
from backends.reasoning import HARMONY, Thinking
from backends.sampling import GenParams
from engine_helpers import split_output
from test_reasoning_opening import NUMBER, Model, Writer, _grammar

PROMPT = [ord(c) for c in START]  # gpt-oss's generation prompt ends with `<|start|>assistant`
OPEN = replace(HARMONY, opened=True)  # a prompt that opens the analysis itself
FINAL_REST = FINAL[len(START):]  # `<|channel|>final<|message|>`
ANSWER = '{"a": 51}'
TIME = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}


def _generate(wants: Callable[[str], str], params: GenParams,
              prompt: list[int] = PROMPT) -> tuple[list[Token], Done, Writer]:
    writer = Writer(wants, len(prompt))
    events = list(Thinking(writer, Model()).generate(prompt, params))
    tokens, done = split_output(events)
    return tokens, done, writer


def _writes(*parts: str, forced: str = END + FINAL) -> Callable[[str], str]:
    """A model that writes `parts` in turn; where a forced end and header (`forced`) took it off its way, it goes
    on with the last part after them."""
    whole = "".join(parts)

    def wants(so_far: str) -> str:
        if whole.startswith(so_far):
            return whole
        return so_far[:so_far.index(forced) + len(forced)] + parts[-1]
    return wants


def _text(done: Done) -> str:
    return b"".join(Model().piece(t) for t in done.tokens).decode()


def test_the_model_thinks_in_the_analysis_then_answers_under_the_schema() -> None:
    """The analysis is free (no grammar on that phase: text that is no JSON, braces and all), its end the model's;
    then the next message's start is the model's to write, the final header, and the JSON under the schema."""
    thought = "First 17, then 3 {not json}."
    tokens, done, writer = _generate(_writes(f"{ANALYSIS}{thought}{END}{FINAL}{ANSWER}"),
                                     GenParams(max_tokens=160, reasoning=HARMONY, grammar=_grammar(NUMBER)))
    assert (done.reasoning, done.text, done.reason) == (thought, ANSWER, "stop")
    assert not any(t.source == "grammar" for t in tokens), "nothing forced"
    opening, thinking, again = writer.phases
    assert opening.grammar is not None and opening.stop[0] == ANALYSIS
    assert thinking.grammar is None and thinking.reasoning_phase and thinking.stop[0] == END
    assert again.grammar is not None and again.grammar is not opening.grammar and again.stop[0] == ANALYSIS


def test_a_model_that_answers_at_once_writes_the_final_header_itself() -> None:
    """No analysis: the final header (with or without llama.cpp's optional constraint) and the JSON, in one
    phase under the opening grammar; nothing is reasoning and nothing is forced."""
    for header in (FINAL_REST, "<|channel|>final <|constrain|>json<|message|>", "<|channel|>final json<|message|>"):
        tokens, done, writer = _generate(_writes(header + ANSWER),
                                         GenParams(max_tokens=64, reasoning=HARMONY, grammar=_grammar(NUMBER)))
        assert (done.reasoning, done.text, len(writer.phases)) == ("", ANSWER, 1), header
        assert not any(t.source == "grammar" for t in tokens)


def test_several_analysis_messages_come_before_the_answer() -> None:
    """`(start analysis)*`: after an analysis the model ended, it may open another; each is reasoning."""
    text = f"{ANALYSIS}one{END}{START}{ANALYSIS}two{END}{FINAL}{ANSWER}"
    _, done, writer = _generate(_writes(text), GenParams(max_tokens=200, reasoning=HARMONY, grammar=_grammar(NUMBER)))
    assert (done.reasoning, done.text) == ("onetwo", ANSWER)
    assert [p.reasoning_phase for p in writer.phases] == [False, True, False, True, False]


def test_a_budget_ends_the_analysis_and_forces_the_final_header() -> None:
    """The budget counts from the analysis header's own tokens: after 6 tokens, `<|end|>` and the final header
    are forced (llama-server forces `<|end|>` alone: docs/serve.md), and the JSON follows under the schema."""
    tokens, done, _ = _generate(_writes(ANALYSIS + "hmm " * 20, ANSWER),
                                GenParams(max_tokens=160, reasoning=HARMONY, grammar=_grammar(NUMBER),
                                          reasoning_budget=6))
    assert (done.reasoning, done.text) == ("hmm hm", ANSWER)
    assert _text(done) == f"{ANALYSIS}hmm hm{END}{FINAL}{ANSWER}"
    assert sum(t.source == "grammar" for t in tokens) == len(END + FINAL)  # one byte a token


def test_each_analysis_gets_a_budget_of_its_own() -> None:
    """An analysis the model ended within the budget, then another: its budget counts from its own header."""
    text = f"{ANALYSIS}ok{END}{START}{ANALYSIS}" + "wxyz" * 10
    _, done, writer = _generate(_writes(text, ANSWER),
                                GenParams(max_tokens=240, reasoning=HARMONY, grammar=_grammar(NUMBER),
                                          reasoning_budget=10))
    assert (done.reasoning, done.text) == ("okwxyzwxyzwx", ANSWER)  # `ok<|end|>` is 9 tokens of the first 10
    assert [p.max_tokens for p in writer.phases if p.reasoning_phase] == [10, 10]


def test_where_the_prompt_opens_the_analysis_the_thinking_comes_first() -> None:
    """The prompt opened the analysis: the first phase is the thinking (its budget counted from the prompt's
    header, as llama.cpp's budget sampler is fed the generation prompt), then the same as above."""
    prompt = PROMPT + [ord(c) for c in ANALYSIS]
    _, done, writer = _generate(_writes("mull" * 10, ANSWER),
                                GenParams(max_tokens=96, reasoning=OPEN, grammar=_grammar(NUMBER), reasoning_budget=4),
                                prompt=prompt)
    assert (done.reasoning, done.text) == ("mull", ANSWER)
    assert writer.phases[0].reasoning_phase and writer.phases[0].max_tokens == 4
    _, done, writer = _generate(_writes(f"short{END}{FINAL}{ANSWER}"),
                                GenParams(max_tokens=96, reasoning=OPEN, grammar=_grammar(NUMBER)), prompt=prompt)
    assert (done.reasoning, done.text, len(writer.phases)) == ("short", ANSWER, 2)


def test_a_required_call_comes_after_the_analysis() -> None:
    """tool_choice named: the answer's header is the call's (harmony_tools.forced_header); the model thinks, then
    writes the call's header itself and its arguments under the function's schema. With a budget, the call's
    header is forced after `<|end|>`."""
    fmt = replace(HARMONY, after=forced_header(["get_time"]))
    call = fmt.after[len(START):] + '{"tz": "CET"}'
    names = ("get_time",)
    for budget, text, reasoning in ((None, f"{ANALYSIS}It asks the time.{END}{START}{call}", "It asks the time."),
                                    (5, f"{ANALYSIS}" + "time " * 10, "time")):
        wants = _writes(text, '{"tz": "CET"}', forced=END + fmt.after)
        _, done, _ = _generate(wants, GenParams(max_tokens=200, reasoning=fmt, grammar=_grammar(TIME),
                                                reasoning_budget=budget))
        assert (done.reasoning, done.text) == (reasoning, "")
        [got] = calls_of(done.tokens, Model().piece, names)
        assert (got.name, json.loads(got.arguments)) == ("get_time", {"tz": "CET"})


def test_the_opening_grammar_allows_an_analysis_or_the_answers_header() -> None:
    """What the model may write at a message's start: the analysis header (then anything: the analysis is free),
    or the final header and the answer's JSON; not plain text, not another channel, not JSON without a header."""
    grammar = _grammar(NUMBER)
    marker = marker_terminal(Model())
    opening = opening_grammar(grammar, FINAL_REST, marker)
    for text in (ANALYSIS + "{{ anything", FINAL_REST + '{"a": 5', "<|channel|>final <|constrain|>json<|message|>{"):
        assert opening.start().valid_prefix(list(text.encode())) == len(text), text
    for text in ("Hello", '{"a": 1}', "<|channel|>commentary<|message|>", FINAL_REST + "plain", START + ANALYSIS):
        assert opening.start().valid_prefix(list(text.encode())) < len(text), text
    led = opening_grammar(grammar, FINAL_REST, marker, lead=START)
    assert led.start().valid_prefix(list((START + ANALYSIS).encode())) == len(START + ANALYSIS)
    assert led.start().valid_prefix(list(ANALYSIS.encode())) == len("<|")  # `<|start|>` first


def test_markers_that_are_control_tokens_are_allowed_by_id() -> None:
    """In gpt-oss's vocabulary the markers are control tokens (their pieces empty unless rendered): the opening
    grammar names them by id, so the model's own `<|channel|>` token opens the analysis, and the text spelling
    is not what it takes."""
    markers = ["<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>"]
    ids = {m: 256 + i for i, m in enumerate(markers)}
    n_vocab, eos = 256 + len(markers) + 1, 256 + len(markers)

    class Vocab:
        eos_token_id, bos_token_id, special_token_ids = eos, None, [*ids.values(), eos]
        tokens = [bytes([i]) for i in range(256)] + [b"\xff" + m.encode() for m in markers] + [b"\xff</s>"]

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    class Special:
        def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
            return [ids[text]] if text in ids else list(text.encode())

        def piece(self, token: int, special: bool = False) -> bytes:
            return markers[token - 256].encode() if token in ids.values() and special else \
                b"" if token >= 256 else bytes([token])

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()), n_vocab=n_vocab, eos_token=[eos])
    grammar = compile_grammar("json_schema", NUMBER, tokenizer, n_vocab)
    marker = marker_terminal(Special())
    assert lark_text(ANALYSIS, marker) == f'<[{ids["<|channel|>"]}]> "analysis" <[{ids["<|message|>"]}]>'
    opening = opening_grammar(grammar, FINAL_REST, marker).start()
    allowed = opening.allowed()
    assert allowed[ids["<|channel|>"]] and not allowed[ord("<")] and not allowed[ord("{")]
    analysis = [ids["<|channel|>"], *b"analysis", ids["<|message|>"], *b"free text"]
    assert opening.valid_prefix(analysis) == len(analysis)
    final = [ids["<|channel|>"], *b"final", ids["<|message|>"], *b'{"a": 1}']
    assert opening.valid_prefix(final) == len(final)


# --- real llama.cpp: SmolLM2 with gpt-oss's template ---

from test_harmony import oss, oss_files  # noqa: E402,F401 - the fixtures (the engine loads the opened file)


def test_smollm2_thinks_then_answers_the_schema_with_every_strategy(oss) -> None:  # noqa: F811
    """The prompt as gpt-oss's own template writes it (the opened file's, less its analysis header): SmolLM2 opens
    an analysis, spelling `analysis` as `analy`+`sis` (llama.cpp's budget, which waits for the header's own
    tokens, does not see it and lets such an analysis run on: docs/serve.md), and the budget ends it after 16
    tokens all the same; the final header is forced and the JSON follows under the schema. ar, sps and auto give
    the same greedy tokens. With a budget longer than its analyses, the model ends each itself and another
    message's opening follows, an analysis again."""
    from app.chat_template import ChatMessage
    from app.prompt_format import PromptFormat

    fmt = PromptFormat(oss)
    messages = [ChatMessage("user", "What is 17 times 3? Answer in JSON.")]
    kwargs = fmt.thinking_kwargs(True, {"reasoning_effort": "low"})
    text = fmt.render(messages, kwargs=kwargs)
    assert text.endswith(START + ANALYSIS)
    prompt = fmt.encode(text[:-len(ANALYSIS)])
    reasoning = replace(fmt.reasoning_for(messages, kwargs=kwargs), opened=False)
    model = oss.target_model
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    grammar = compile_grammar("json_schema", schema, model.guidance_tokenizer, model.n_vocab)
    header = model.tokenize(ANALYSIS, add_special=False, parse_special=True)
    forced = model.tokenize(END + FINAL, add_special=False, parse_special=True)
    results = {}
    for strategy in ("ar", "sps", "auto"):
        events = list(oss.strategy(strategy).generate(prompt, GenParams(max_tokens=200, reasoning=reasoning,
                                                                         grammar=grammar, reasoning_budget=16)))
        done = events[-1]
        assert isinstance(done, Done) and done.reason == "stop", done
        shown = [e for e in events if isinstance(e, Token) and e.kind != REJECTED]
        assert [e.id for e in shown] == list(done.tokens)
        assert "".join(e.reasoning for e in shown) == done.reasoning
        assert done.reasoning and "<|" not in done.reasoning
        assert isinstance(json.loads(done.text)["answer"], int)
        tokens = list(done.tokens)
        written = model.detokenize(tokens)
        assert written.count(ANALYSIS) == 1 and written.count(END + FINAL) == 1, written
        k = next(k for k in range(len(tokens)) if model.detokenize(tokens[:k]).endswith(ANALYSIS))
        assert tokens[:k] != header, "the header is spelt with other tokens than its own"
        assert tokens[k + 16:k + 16 + len(forced)] == forced, "16 tokens of thinking, then the forced end"
        assert sum(e.source == "grammar" for e in shown) >= len(forced)
        results[strategy] = done.tokens
    assert results["sps"] == results["ar"] == results["auto"]
    done = list(oss.strategy("ar").generate(prompt, GenParams(max_tokens=200, reasoning=reasoning, grammar=grammar,
                                                              reasoning_budget=120)))[-1]
    written = model.detokenize(list(done.tokens))
    assert done.reason == "length" and written.count(END + START + ANALYSIS) >= 1 and FINAL not in written, written
