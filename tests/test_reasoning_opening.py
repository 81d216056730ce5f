"""A thinking block the model opens itself (Qwen3's prompt leaves `<think>` to it), over a stand-in model.

Two behaviours of llama.cpp that backends.reasoning.Thinking follows there:
- a grammar on the answer (a JSON schema, a required tool call) lets the model think first: llama.cpp's grammar
  is `space ("<think>" until("</think>") "</think>")? space answer` (common/chat-auto-parser-generator.cpp:
  120-155), so the model may open the block or answer at once; the thinking is free text and the answer's grammar
  holds from the end tag (backends.grammar.opening_grammar);
- the reasoning budget counts the tokens after the start tag, wherever the model writes it (after text of its
  answer too), and forces the end tag when they are spent (common/reasoning-budget.cpp:78-118: idle until the
  start tag's tokens, then one less per token). specchat's also counts from a block the parser reads as the
  thinking whose tag is spelt with other tokens, which llama.cpp's would let run on.

The stand-in writes bytes (a tag is several tokens, as SmolLM2 spells `<think>`) under each phase's grammar: a
token the grammar refuses fails the test, as no real model could write it. On real llama.cpp (SmolLM2 re-packed
with Qwen3's template) and beside llama-server: tests/test_serve_reasoning_opening.py.
"""

from __future__ import annotations

import json
from typing import Callable

import llguidance

from backends.events import Done, GenStats, Prefilled, Token
from backends.grammar import Grammar, compile_grammar, opening_grammar
from backends.reasoning import ReasoningFormat, Thinking
from backends.sampling import GenParams
from backends.text import TextStream
from engine_helpers import split_output

EOS = 256
THINK = 257  # `<think>` as one control token, as Qwen3's own vocabulary has it (the stand-in model spells it out)
SPACE_LT = 258  # " <", one token, as SmolLM2 spells `<` after a word
QWEN3 = ReasoningFormat("<think>", "</think>", opened=False, can_disable=True, after="\n\n")
NUMBER = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WORD = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
# A required tool call as Qwen3's template writes it (app.serve's grammar for it is Lark of this shape).
CALL = ('start: "<tool_call>\\n" %json {"type": "object", "properties": {"name": {"const": "open_page"}}, '
        '"required": ["name"], "additionalProperties": false} "\\n</tool_call>"')


class Model:
    """Bytes for tokens (token i < 256 is byte i), one end-of-generation token, and " <" (which the tokenizer
    never uses: `<think>` is its bytes, the tag's own tokens)."""

    eog_ids = (EOS,)
    n_vocab = SPACE_LT + 1

    def tokenize(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        return list(text.encode())

    def piece(self, token: int, special: bool = False) -> bytes:
        return {EOS: b"", THINK: b"", SPACE_LT: b" <"}.get(token) or bytes([token])


def _grammar(schema: dict | str, kind: str = "json_schema") -> Grammar:
    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id, bos_token_id, special_token_ids = EOS, None, [EOS, THINK]
        tokens = [bytes([i]) for i in range(256)] + [b"\xff</s>", b"\xff<think>", b" <"]

        def __call__(self, text: str | bytes) -> list[int]:
            return list(text.encode() if isinstance(text, str) else text)

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocabulary()), n_vocab=SPACE_LT + 1, eos_token=[EOS])
    return compile_grammar(kind, schema, tokenizer, SPACE_LT + 1)


class Writer:
    """A greedy stand-in strategy: the model's next token is the next byte of `wants(output so far)` (the text
    after the first prompt, earlier phases' and forced tokens included), then EOS (a space where the end is
    masked: ignore_eos); under the phase's grammar and stop strings (the tokens include the stop's, the text
    does not), up to max_tokens, as backends.run ends a generation (a grammar complete is a stop). With
    `space_lt`, " <" is written as its one token. Each phase's parameters are kept."""

    name = "ar"

    def __init__(self, wants: Callable[[str], str], prompt_len: int, space_lt: bool = False) -> None:
        self.wants, self.prompt_len, self.space_lt, self.phases = wants, prompt_len, space_lt, []

    def steps(self, prompt, params, should_stop):
        self.phases.append(params)
        yield Prefilled(len(prompt), 0.0)
        constraint = params.grammar.start() if params.grammar is not None else None
        model = Model()
        stream = TextStream(model.piece, params.stop)  # as backends.run releases text: a stop's start held
        before = b"".join(model.piece(t) for t in prompt[self.prompt_len:]).decode()
        out: list[int] = []
        reason = "length"
        while len(out) < params.max_tokens:
            so_far = before + b"".join(model.piece(t) for t in out).decode()
            want = self.wants(so_far).encode()
            assert want.startswith(so_far.encode()), (want, so_far)
            tok = want[len(so_far.encode())] if len(want) > len(so_far.encode()) else EOS
            if self.space_lt and want[len(so_far.encode()):].startswith(b" <"):
                tok = SPACE_LT
            if tok == EOS and params.ignore_eos:
                tok = ord(" ")
            if constraint is not None:
                assert constraint.allowed()[tok], f"the grammar refuses {bytes([tok])!r} after {so_far!r}"
                constraint.commit(tok)
            if tok == EOS:
                reason = "eos"
                break
            out.append(tok)
            yield Token(tok, stream.push(tok), "target")
            if stream.stopped or (constraint is not None and constraint.done):
                reason = "stop"
                break
        tail = stream.flush()
        yield Done(reason, GenStats("ar", len(prompt), 0, 0.0, len(out), 0.0, len(out), 0, 0), tuple(out),
                   stream.text, tail)


PROMPT = [ord(c) for c in "<|im_start|>assistant\n"]


def _generate(wants: Callable[[str], str], params: GenParams,
              space_lt: bool = False) -> tuple[list[Token], Done, Writer]:
    writer = Writer(wants, len(PROMPT), space_lt)
    events = list(Thinking(writer, Model()).generate(PROMPT, params))
    tokens, done = split_output(events)
    return tokens, done, writer


def _writes(*parts: str) -> Callable[[str], str]:
    """A model that writes `parts` in turn; where a forced `</think>\n\n` took it off its way, it answers
    with the last part after it."""
    whole = "".join(parts)

    def wants(so_far: str) -> str:
        if whole.startswith(so_far):
            return whole
        forced = so_far.index("</think>\n\n") + len("</think>\n\n")
        return so_far[:forced] + parts[-1]
    return wants


def _after(done: Done, tag: str) -> str:
    text = b"".join(Model().piece(t) for t in done.tokens).decode()
    return text[text.index(tag) + len(tag):]


# -- a grammar where the model opens the block itself -------------------------------------------------------------


def test_a_grammar_lets_the_model_think_first_and_holds_the_answer_from_the_end_tag() -> None:
    """The model opens the block (after a little whitespace or none, as llama.cpp's `space` allows): the first
    phase's grammar lets it, its thinking is free text (no grammar on that phase), and the JSON after `</think>`
    is the answer's grammar's."""
    grammar = _grammar(NUMBER)
    for lead in ("", "\n"):
        _, done, writer = _generate(_writes(lead + "<think>\nFirst 17, then 3 {not json}.\n</think>", '{"a": 51}'),
                                    GenParams(max_tokens=96, reasoning=QWEN3, grammar=grammar))
        assert (done.reasoning, done.text, done.reason) == ("First 17, then 3 {not json}.", '{"a": 51}', "stop")
        opening, thinking, answer = writer.phases
        assert opening.grammar is not None and opening.grammar is not grammar and opening.stop[0] == "<think>"
        assert thinking.grammar is None and thinking.reasoning_phase and thinking.stop[0] == "</think>"
        assert answer.grammar is grammar


def test_a_model_that_answers_at_once_answers_under_the_grammar() -> None:
    """No block: the answer is the grammar's from its first token, or after a little whitespace (llama.cpp's
    `space`), in one phase, and nothing is reasoning."""
    for lead in ("", "\n", " "):
        _, done, writer = _generate(_writes(lead + '{"a": 51}'),
                                    GenParams(max_tokens=48, reasoning=QWEN3, grammar=_grammar(NUMBER)))
        assert (done.reasoning, done.text, len(writer.phases)) == ("", '{"a": 51}', 1), lead


def test_a_required_tool_call_may_come_after_thinking_or_at_once() -> None:
    """A tool call's grammar (Lark) where the call starts with `<` too: the model may think, then call, or call
    at once; either way the call is the grammar's."""
    call = '<tool_call>\n{"name": "open_page"}\n</tool_call>'
    for thought, reasoning in (("<think>\nI should open it.\n</think>", "I should open it."), ("", "")):
        _, done, _ = _generate(_writes(thought, call), GenParams(max_tokens=96, reasoning=QWEN3,
                                                                 grammar=_grammar(CALL, "lark")))
        assert (done.reasoning, done.text) == (reasoning, call)


def test_a_start_tag_inside_the_answer_leaves_it_under_its_grammar() -> None:
    """`<think>` in a JSON string stops the first phase as a stop string: the answer goes on where it was, its
    grammar continued past what it wrote (backends.grammar.Grammar.after), and nothing is reasoning."""
    _, done, writer = _generate(_writes('{"s": "a <think> tag"}'),
                                GenParams(max_tokens=48, reasoning=QWEN3, grammar=_grammar(WORD)))
    assert (done.reasoning, json.loads(done.text)) == ("", {"s": "a <think> tag"})
    assert len(writer.phases) == 2 and writer.phases[1].grammar.prefix == tuple(b'{"s": "a <think>')


def test_a_budget_still_ends_the_thinking_under_a_grammar() -> None:
    """The budget counts from the start tag: after 6 tokens of thinking, `</think>` (and the template's blank
    line) is forced, and the answer follows under its grammar."""
    _, done, _ = _generate(_writes("<think>\n" + "hmm " * 20, '{"a": 51}'),
                           GenParams(max_tokens=96, reasoning=QWEN3, grammar=_grammar(NUMBER), reasoning_budget=6))
    assert (done.reasoning, done.text) == ("hmm h", '{"a": 51}')
    assert _after(done, "<think>").startswith("\nhmm h</think>\n\n{")


def test_a_grammar_that_needs_an_answer_keeps_the_turn_from_ending_inside_the_block() -> None:
    """The model would end its turn inside the block: the thinking phase masks the end (llama.cpp's grammar spans
    the thinking and needs the answer after it), so it thinks on to the budget, and the answer follows."""
    thought = "<think>\nshort"

    def wants(so_far: str) -> str:
        if "</think>" in so_far:
            return so_far[:so_far.index("</think>")] + '</think>\n\n{"a": 1}'
        return thought if thought.startswith(so_far) else so_far + " more"

    _, done, writer = _generate(wants, GenParams(max_tokens=64, reasoning=QWEN3, grammar=_grammar(NUMBER),
                                                 reasoning_budget=12))
    assert writer.phases[1].ignore_eos and done.text == '{"a": 1}' and done.reasoning.startswith("short")


# -- the budget counts from the start tag ---------------------------------------------------------------------------


def test_the_budget_counts_the_tokens_after_the_start_tag() -> None:
    """Wherever the model writes `<think>`, exactly `budget` tokens follow it before the forced `</think>`. After
    whitespace, the block is reasoning; after text (llama.cpp's parser: the block is optional and comes first, so
    such a block is the answer's text, tags and all), it is the answer, and what is forced is too."""
    budget = 5
    for lead in ("", "\n\n", "Let me think. "):
        _, done, writer = _generate(_writes(lead + "<think>\n" + "abcdefghij" * 3, "Answer: 51."),
                                    GenParams(max_tokens=96, reasoning=QWEN3, reasoning_budget=budget))
        after = _after(done, "<think>")
        assert after.startswith("\nabcd</think>\n\nAnswer: 51."), (lead, after)  # the newline and 4 letters
        assert writer.phases[1].max_tokens == budget
        if lead.strip():
            assert done.reasoning == "" and done.text == lead + "<think>\nabcd</think>\n\nAnswer: 51."
        else:
            assert (done.reasoning, done.text) == ("abcd", "Answer: 51.")


def test_the_budget_message_comes_before_the_forced_tag_in_an_answers_block() -> None:
    _, done, _ = _generate(_writes("Well. <think>" + "xyz" * 10, "Done."),
                           GenParams(max_tokens=96, reasoning=QWEN3, reasoning_budget=3,
                                     reasoning_message=" Time is up."))
    assert done.text == "Well. <think>xyz Time is up.</think>\n\nDone." and done.reasoning == ""


def test_a_block_closed_after_text_keeps_its_tags_in_the_answer() -> None:
    """Without a budget or grammar: text, then a block the model closes itself; all of it is the answer, the end
    tag included (it ends the phase as a stop string, and is handed on as text)."""
    _, done, _ = _generate(_writes("Sure. <think>hm</think> 51."), GenParams(max_tokens=64, reasoning=QWEN3))
    assert (done.reasoning, done.text) == ("", "Sure. <think>hm</think> 51.")


def test_a_tag_spelt_with_other_tokens_is_not_the_budgets() -> None:
    """llama.cpp's budget matches the tag's own tokens: after a word SmolLM2 spells ` <think>` with its ` <`
    token, which the budget does not see (llama-server forces nothing there), and a later tag spelt with the
    tag's tokens is seen; the same text spelt with the tag's tokens throughout is budgeted at its first tag."""
    text = "The <think> tag marks a thought.\n<think>\nabcdefgh"
    _, done, writer = _generate(_writes(text, "Answer."),
                                GenParams(max_tokens=96, reasoning=QWEN3, reasoning_budget=3), space_lt=True)
    assert done.text == "The <think> tag marks a thought.\n<think>\nab</think>\n\nAnswer." and done.reasoning == ""
    assert [p.stop[:1] for p in writer.phases] == [("<think>",), ("<think>",), ("</think>",), ("<think>",)]
    _, done, _ = _generate(_writes(text, "Answer."), GenParams(max_tokens=96, reasoning=QWEN3, reasoning_budget=3))
    assert done.text == "The <think> ta</think>\n\nAnswer." and done.reasoning == ""


def test_a_block_the_parser_reads_is_budgeted_however_its_tag_is_spelt() -> None:
    """A block opened at the answer's start (after a space) with ` <` + `think>`: llama.cpp's budget, which waits
    for the tag's own tokens, would let it run on; the parser reads it as the thinking, so the budget ends it."""
    _, done, writer = _generate(_writes(" <think>\nabcdefgh", "Answer."),
                                GenParams(max_tokens=96, reasoning=QWEN3, reasoning_budget=3), space_lt=True)
    assert (done.reasoning, done.text) == ("ab", "Answer."), done
    assert [p.max_tokens for p in writer.phases if p.reasoning_phase] == [3]


def test_a_model_that_never_opens_the_block_is_one_phase_and_the_budget_cuts_nothing() -> None:
    _, done, writer = _generate(_writes("Seventeen times three is fifty-one, as I count it."),
                                GenParams(max_tokens=64, reasoning=QWEN3, reasoning_budget=2))
    assert (done.reasoning, done.text, done.reason, len(writer.phases)) == \
        ("", "Seventeen times three is fifty-one, as I count it.", "eos", 1)


# -- a second block gets a budget of its own ---------------------------------------------------------------------------

QWQ = ReasoningFormat("<think>", "</think>", opened=True, after="\n\n")  # the prompt opens the block


def _rethinks(*parts: str) -> Callable[[str], str]:
    """A model that writes `parts[0]`, and after each `</think>\n\n` (forced or its own) the next part."""
    def wants(so_far: str) -> str:
        k = so_far.count("</think>\n\n")
        return so_far[:so_far.rfind("</think>\n\n") + len("</think>\n\n")] * (k > 0) + parts[min(k, len(parts) - 1)]
    return wants


def test_a_start_tag_after_the_block_gets_a_fresh_budget() -> None:
    """After the block ends (the budget forced its end, or the model closed it), a `<think>` opens a block that
    the budget counts again from its tag: llama.cpp's budget goes back to counting there (common/
    reasoning-budget.cpp:147-160). The first block is the reasoning; the second, after text, is the answer's
    (llama.cpp's parser: one optional block, first), its forced end too. Where the model opens the block itself
    and where the prompt opens it."""
    for fmt, first in ((QWEN3, "<think>\nabcdefgh"), (QWQ, "\nabcdefgh")):
        _, done, writer = _generate(_rethinks(first, "Then <think>\nwxyzwxyz", "Answer."),
                                    GenParams(max_tokens=96, reasoning=fmt, reasoning_budget=3))
        assert (done.reasoning, done.text, done.reason) == ("ab", "Then <think>\nwx</think>\n\nAnswer.", "eos"), fmt
        assert [p.max_tokens for p in writer.phases if p.reasoning_phase] == [3, 3]
    _, done, _ = _generate(_rethinks("<think>\nok</think>\n\n", "Well: <think>\n" + "wxyz" * 5, "Answer."),
                           GenParams(max_tokens=96, reasoning=QWEN3, reasoning_budget=12))
    assert (done.reasoning, done.text) == ("ok", "Well: <think>\nwxyzwxyzwxy</think>\n\nAnswer.")


def test_without_a_budget_a_second_block_is_the_answers_text() -> None:
    """No budget, no grammar: llama.cpp runs no budget sampler (common/sampling.cpp:311), so nothing ends a second
    block; the answer is one phase after the thinking."""
    _, done, writer = _generate(_rethinks("\nab</think>\n\n", "Then <think>\nwxyz", "Answer."),
                                GenParams(max_tokens=96, reasoning=QWQ))
    assert (done.reasoning, done.text, len(writer.phases)) == ("ab", "Then <think>\nwxyz", 2)


# -- the grammar itself --------------------------------------------------------------------------------------------


def test_the_opening_grammar_allows_the_tag_or_the_answer_after_llama_cpps_space() -> None:
    grammar = _grammar(NUMBER)
    opening = opening_grammar(grammar, "<think>")
    assert {bytes([t]) for t in range(256) if opening.start().allowed()[t]} == {b"<", b"{", b" ", b"\n"}
    for text in ("<think>", "\n\n  <think>x", ' {"a": 1}', "\n\t{"):
        assert opening.start().valid_prefix(list(text.encode())) == len(text), text
    for text in ("\n\n\n<think>", "  {", "x<think>", "<thinj"):
        assert opening.start().valid_prefix(list(text.encode())) < len(text), text
    assert not grammar.start().allowed()[ord("<")], "the answer's own grammar does not take the tag"
    after = opening.after(b'{"a": 5')
    assert after.start().allowed()[ord("}")] and not after.start().allowed()[ord("<")]
    special = opening_grammar(grammar, "<think>", [THINK])  # a tag that is one control token: allowed by id too
    assert special.start().allowed()[THINK] and not opening.start().allowed()[THINK]
