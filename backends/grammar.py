"""Constrained generation: a grammar says which tokens may come next, for the target and for every drafter.

The grammar engine is llguidance (Microsoft's, the engine behind guidance and
llama.cpp's -DLLAMA_LLGUIDANCE build, and one of vLLM's two structured-output
backends), chosen by measurement over llama.cpp's own grammar sampler on this
project's models (docs/results.md, "Grammar engines"): it computes the mask
of allowed tokens for the whole vocabulary in tens of microseconds where
llama.cpp's sampler checks candidates one by one (and its grammar state is
not cloneable through llama-cpp-python, which speculation needs to look
ahead along a draft and roll back). llguidance also compiles JSON schemas,
Lark and llama.cpp's GBNF, validates a grammar up front (an uncompilable one
is a clear error, never ignored), and says how many tokens of a proposal the
grammar admits.

How speculation stays lossless under a grammar (vLLM's structured outputs
with speculation and XGrammar do the same): the target's distribution at
every position is the masked one, `softmax(logits)` with the tokens the
grammar forbids after that position's path at -inf, then the sampling
transform. A row's path is what it follows past the committed output: a
chain's drafts before it, a tree node's ancestors (backends.run.Run.logits
applies the mask for it; the matcher consumes the path, computes the mask
and rolls back). Verification (greedy, rejection sampling, the one-hot
rule) then compares the proposals with that distribution, so the output is
exactly a sample of the constrained target. Proposals obey the grammar too:
the draft model samples from its own masked distribution, and lookup's,
lookahead's and a tree's candidates are cut at their first forbidden token
before they cost a batch row.

Forced stretches (SGLang's jump-forward): where the grammar admits only some
fixed bytes next (a key, `": "`, a closing bracket), their canonical
tokenization (llguidance's fast-forward tokens) is proposed as a draft. It is
verified like any other: the model may spell the same bytes with other
tokens, which the grammar also allows, so these drafts are very likely, not
certain.

A thinking model that opens its block itself (Qwen3: the generation prompt
leaves `<think>` to the model) may think before an answer a grammar holds:
`opening_grammar` is what it may write first, as llama.cpp's grammar for a
response format or a required tool call has it (the reasoning block optional
before the answer, common/chat-auto-parser-generator.cpp), and `Grammar.after`
continues a grammar past tokens already written under it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

GrammarKind = Literal["json_schema", "json_object", "gbnf", "lark", "regex"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "gbnf", "lark", "regex")
# How many forced tokens one step proposes at most (a long fixed stretch goes over several steps).
FORCED_MAX = 16
# JSON as Python's json.dumps writes it by default: `{"a": 1, "b": [2, 3]}`, one space after ':' and ',' and no
# other whitespace. A fixed layout is what makes keys, separators and brackets forced stretches; whitespace
# allowed anywhere (llguidance's default) would leave a choice before every one of them. A schema's
# "x-guidance" object may ask otherwise ({"whitespace_flexible": true}).
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled: the user's mistake, said in one line."""


# A JSON schema is read as llama-server reads it (common/json-schema.cpp, json-schema-to-grammar.cpp), where
# llguidance's defaults differ and let a small model write forever:
#  - an integer or number without bounds has at most 16 digits before its point (llama.cpp: [1-9] [0-9]{0,15}):
#    llguidance lets an unbounded integer grow, and SmolLM2 at temperature 0 writes `1111…` until max_tokens;
#  - an object with `properties` and no `additionalProperties` has only those (llama.cpp's default; llguidance
#    allows others, and the same model then adds keys until max_tokens).
NUMBER_BOUND = 10**16 - 1
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_NOT_SCHEMAS = ("enum", "const", "default", "examples")  # values, not subschemas: left as they are


def llama_server_schema(schema: object) -> object:
    """A copy of a JSON schema with llama-server's defaults made explicit: numbers without bounds bounded to
    NUMBER_BOUND, objects with properties closed to others."""
    if isinstance(schema, list):
        return [llama_server_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _NOT_SCHEMAS else llama_server_schema(v)) for k, v in schema.items()}
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if ("integer" in kinds or "number" in kinds) and not any(b in schema for b in _BOUNDS):
        out["minimum"], out["maximum"] = -NUMBER_BOUND, NUMBER_BOUND
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def grammar_text(kind: GrammarKind, source: str | dict) -> str:
    """llguidance's grammar for a JSON schema (a dict or its text), any JSON object, GBNF, Lark or a regex."""
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if kind == "json_schema":
            schema = json.loads(source) if isinstance(source, str) else source
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(llama_server_schema(schema), defaults=JSON_LAYOUT)
        assert isinstance(source, str)
        if kind == "gbnf":
            try:
                lark = any_to_lark(source)
            except Exception as e:  # noqa: BLE001 - the converter raises bare Exceptions for undefined rules
                raise GrammarError(f"the GBNF grammar cannot be compiled: {_first_line(e)}") from None
            return llguidance.LLMatcher.grammar_from_lark(lark)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(source)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
    except GrammarError:
        raise
    except (ValueError, TypeError, json.JSONDecodeError, GbnfToLarkError) as e:
        raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {_first_line(e)}") from None
    raise GrammarError(f"unknown grammar kind {kind!r}; one of {', '.join(KINDS)}")


def _first_line(e: object) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


@dataclass(frozen=True)
class Grammar:
    """A grammar compiled and checked for one vocabulary (a `Vocabulary`'s llguidance tokenizer); immutable,
    shared by every generation that uses it. Build it with `compile_grammar`."""

    kind: GrammarKind
    text: str  # llguidance's grammar
    tokenizer: Any  # llguidance.LLTokenizer
    n_vocab: int
    prefix: tuple[int, ...] = ()  # tokens already written under it: a Constraint starts past them

    def start(self) -> "Constraint":
        return Constraint(self)

    def after(self, tokens: Sequence[int]) -> "Grammar":
        """This grammar continued past `tokens` (a phase of an answer that another phase began under it)."""
        return replace(self, prefix=self.prefix + tuple(tokens))


def compile_grammar(kind: GrammarKind, source: str | dict, tokenizer: Any, n_vocab: int) -> Grammar:
    """Compile and check a grammar, or raise GrammarError with llguidance's reason."""
    text = grammar_text(kind, source)
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {_first_line(error)}")
    return Grammar(kind, text, tokenizer, n_vocab)


# llama.cpp's grammar where the model opens its thinking block itself (common/chat-auto-parser-generator.cpp:
# 120-125 for a response format, 237/356/475 for tool calls, 134 for the space after the generation prompt):
# `space ("<think>" until("</think>") "</think>")? space answer`, the reasoning rule optional (:138-155) and
# `space` json-schema-to-grammar's SPACE_RULE (`| " " | "\n"{1,2} [ \t]{0,20}`, json-schema-to-grammar.cpp:229).
SPACE = r"/ |\n{1,2}[ \t]{0,20}/"
ANSWER = "specchat_answer"  # the answer's grammar, by name, in the opening's


def opening_grammar(grammar: Grammar, tag: str, tag_tokens: Sequence[int] = ()) -> Grammar:
    """What a model that opens its thinking block itself may write first where `grammar` holds the answer:
    the start tag, or the answer, either after a little whitespace (llama.cpp's `space`). After the tag anything
    may follow: backends.reasoning ends this phase at the tag (a stop string) and thinks freely, and the answer's
    grammar starts again at the end tag, as llama.cpp's reasoning rule is free text up to the end tag. Where the
    tag is one control token (`tag_tokens`, Qwen3's own `<think>`), that token is allowed as well as the text."""
    opener = json.dumps(tag)  # a Lark string is a JSON string
    if len(tag_tokens) == 1:
        opener = f"({opener} | <[{tag_tokens[0]}]>)"
    lark = f"start: SPACE? (opener | @{ANSWER})\nopener: {opener} ANY\nSPACE: {SPACE}\nANY: /(?s:.*)/\n"
    return under_opening(grammar, "opening", lark, "a thinking block")


def under_opening(grammar: Grammar, name: str, lark: str, after: str) -> Grammar:
    """`grammar` as the rule @ANSWER of a new start grammar `lark` (named `name`), checked for the vocabulary: what
    a model may write first where `grammar` holds the answer (a thinking block's start tag, harmony's analysis
    header: backends.harmony.opening_grammar), or GrammarError saying the answer's grammar cannot follow `after`."""
    text = grammar.text.strip()
    top = json.loads(text) if text.startswith("{") else {"grammars": [{"lark_grammar": text}]}
    first, *others = top["grammars"]  # the first is the start; specchat's kinds compile to one grammar
    text = json.dumps({**top, "grammars": [{"name": name, "lark_grammar": lark}, {**first, "name": ANSWER}, *others]})
    error = llguidance.LLMatcher.validate_grammar(text, grammar.tokenizer)
    if error and not error.startswith("WARNING"):
        raise GrammarError(f"the {grammar.kind.replace('_', ' ')} cannot follow {after}: {_first_line(error)}")
    return Grammar(grammar.kind, text, grammar.tokenizer, grammar.n_vocab)


class Constraint:
    """One generation's place in its grammar: which tokens may follow the committed output, or follow a path
    of proposals after it. Advanced by `commit` as tokens are emitted (verification accepts them one by one,
    so a rejected proposal never enters it: looking along a path consumes it and rolls it back)."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._m = llguidance.LLMatcher(grammar.tokenizer, grammar.text, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"the grammar cannot be used: {_first_line(self._m.get_error())}")
        if grammar.prefix and not self._m.consume_tokens(list(grammar.prefix)):
            raise GrammarError(f"the grammar refused the output it continues: {_first_line(self._m.get_error())}")
        self._words = (grammar.n_vocab + 31) // 32
        self._bits = np.zeros(self._words, dtype=np.int32)
        self.masks = 0
        self.seconds = 0.0  # spent computing masks and looking ahead (the grammar's cost)

    # -- what may come next --------------------------------------------------

    def allowed(self, path: Sequence[int] = ()) -> np.ndarray:
        """A boolean array over the vocabulary: the tokens the grammar allows after the output and `path`."""
        t0 = time.perf_counter()
        m = self._m
        consumed = 0
        if path:
            consumed = m.validate_tokens(list(path))  # never puts the matcher in its error state
            if consumed:
                m.consume_tokens(list(path[:consumed]))
        try:
            if consumed < len(path) or m.is_stopped():
                # Past a refused token, or past the grammar's end: only the end may follow (a row there is never
                # accepted, but its distribution must stay one).
                out = np.zeros(self.grammar.n_vocab, dtype=bool)
                out[[t for t in self.grammar.tokenizer.eos_tokens if t < self.grammar.n_vocab]] = True
                return out
            m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        finally:
            if consumed:
                m.rollback(consumed)
            self.masks += 1
            self.seconds += time.perf_counter() - t0
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little", count=self.grammar.n_vocab).astype(bool)

    def apply(self, logits: np.ndarray, path: Sequence[int] = ()) -> None:
        """Set the logits of the tokens the grammar forbids after `path` to -inf, in place."""
        allowed = self.allowed(path)
        n = min(logits.shape[0], allowed.shape[0])
        np.putmask(logits[:n], ~allowed[:n], -np.inf)
        if logits.shape[0] > n:  # padding rows past the tokenizer's words
            logits[n:] = -np.inf

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of a proposal the grammar admits after the output (the rest is cut)."""
        if not tokens:
            return 0
        t0 = time.perf_counter()
        n = self._m.validate_tokens(list(tokens))
        self.seconds += time.perf_counter() - t0
        return n

    def forced(self, limit: int = FORCED_MAX) -> list[int]:
        """The canonical tokens of the bytes the grammar forces next (none when it leaves a choice)."""
        if limit <= 0 or self._m.is_stopped():
            return []
        t0 = time.perf_counter()
        tokens = list(self._m.compute_ff_tokens()[:limit])
        # The fast-forward tokens come from the model's own tokenizer, which may spell the forced bytes in a way
        # the vocabulary's pieces do not (a tokenizer that does not round-trip): only what the grammar admits.
        tokens = tokens[: self._m.validate_tokens(tokens)] if tokens else tokens
        self.seconds += time.perf_counter() - t0
        return tokens

    # -- the committed output ----------------------------------------------

    def commit(self, token: int) -> None:
        """The token was emitted: the grammar moves past it."""
        if not self._m.consume_token(token):
            raise GrammarError(f"the grammar refused token {token} that was emitted: "
                               f"{_first_line(self._m.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing may follow but the end (the generation stops here)."""
        return self._m.is_stopped()
