"""Constrained generation on real llama.cpp: valid output, lossless speculation, grammar-pruned proposals.

Every strategy, at temperature 0 and 0.8, on eleven JSON schemas: every
output parses and validates (the `jsonschema` library); at temperature 0 each
strategy's output is `ar`'s constrained output token for token. The sampling
law under a grammar is checked by chi-square (alpha 1e-4) against the exact
masked law of the target on the 15-token vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema
import numpy as np
import pytest

from backends.engine import Engine
from backends.config import StrategyOptions
from backends.grammar import GrammarError, compile_grammar
from backends.sampling import GenParams, probabilities
from backends.strategies.lookahead import LookaheadConfig
from backends.strategies.lookup import LookupConfig
from backends.strategies.sps import SpsConfig
from engine_helpers import DEMO_NOISE, assert_greedy_agrees, run_to_done
from stats_helpers import ALPHA, assert_target_law, outcome

STRATEGIES = ("ar", "sps", "tree", "lookup", "lookahead", "auto")
SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    "nested": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                  "minItems": 1, "maxItems": 3}},
        "required": ["id", "tags"], "additionalProperties": False}}, "required": ["user"]},
    "int_array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                  "minItems": 2, "maxItems": 4},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
    "nullable": {"type": "object", "properties": {"ok": {"type": "boolean"},
                                                  "note": {"type": ["string", "null"], "maxLength": 8}},
                 "required": ["ok", "note"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 9}, {"type": "string", "enum": ["none", "many"]}]}},
        "required": ["value"]},
    "objects": {"type": "object", "properties": {"items": {
        "type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
                                             "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    "number": {"type": "object", "properties": {"version": {"const": 2},
                                                "score": {"type": "number", "minimum": 0, "maximum": 1}},
               "required": ["version", "score"]},
    "lengths": {"type": "object", "properties": {"word": {"type": "string", "minLength": 2, "maxLength": 5}},
                "required": ["word"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 50},
                                                  "b": {"type": "string", "maxLength": 4}},
                 "required": ["a"], "additionalProperties": False},
}


def _closed(schema: object) -> object:
    """Every object of the schema closed to other properties: a random model would otherwise fill an open
    object with keys of its own until max_tokens (valid JSON, but never finished)."""
    if isinstance(schema, dict):
        out = {k: _closed(v) for k, v in schema.items()}
        if out.get("type") == "object":
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


SCHEMAS = {name: _closed(schema) for name, schema in SCHEMAS.items()}
OPTIONS = StrategyOptions(lookahead=LookaheadConfig(4, 3, 4, seed_pool_from_prompt=True))


def _grammar(engine: Engine, schema: dict):
    model = engine.target_model
    return compile_grammar("json_schema", schema, model.guidance_tokenizer, model.n_vocab)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_strategy_writes_valid_json_for_every_schema(json_engine: Engine, temperature: float) -> None:
    prompt = json_engine.tokenize("the cat sat on the mat and")
    for name, schema in SCHEMAS.items():
        params = GenParams(max_tokens=400, temperature=temperature, seed=5, grammar=_grammar(json_engine, schema))
        outputs = {}
        for strategy in STRATEGIES:
            done = run_to_done(json_engine, strategy, prompt, params, OPTIONS)
            assert done.reason == "stop", f"{name}/{strategy}: ended by {done.reason} before the JSON closed"
            value = json.loads(done.text)
            jsonschema.validate(value, schema)
            outputs[strategy] = done.tokens
        if temperature == 0:  # ar's tokens, or (auto's batches follow live timings) parting at a near-tie only
            for strategy, out in outputs.items():
                assert_greedy_agrees(json_engine, prompt, outputs["ar"], out, f"{name}/{strategy}",
                                     grammar=params.grammar)


def test_instruct_model_greedy_constrained_output_is_ars_for_every_strategy(instruct_engine: Engine) -> None:
    """On SmolLM2 with its draft: the same valid JSON from every strategy, and the drafts do work under it."""
    from app.chat_template import ChatMessage
    from app.prompt_format import PromptFormat

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                               "city": {"type": "string", "maxLength": 30}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    prompt = PromptFormat(instruct_engine).tokens([ChatMessage("user", "Extract name, age and city as JSON: "
                                                               "Maria Lopez, 31, moved to Rome last year.")])
    params = GenParams(max_tokens=80, temperature=0.0, grammar=_grammar(instruct_engine, schema))
    outputs = {}
    for strategy in STRATEGIES:
        done = run_to_done(instruct_engine, strategy, prompt, params, OPTIONS)
        jsonschema.validate(json.loads(done.text), schema)
        outputs[strategy] = done
    for strategy, done in outputs.items():  # parting at a near-tie only: auto's batches follow live timings
        assert_greedy_agrees(instruct_engine, prompt, outputs["ar"].tokens, done.tokens, strategy, DEMO_NOISE,
                             params.grammar)
    assert outputs["sps"].stats.accepted > 0 and outputs["auto"].stats.tokens_by_source.get("grammar", 0) > 0


def test_forced_stretches_are_proposed_and_accepted(json_engine: Engine) -> None:
    """The keys and separators of a schema are drafts of the grammar's: proposed, verified, almost all accepted."""
    schema = SCHEMAS["nested"]
    prompt = json_engine.tokenize("the cat")
    done = run_to_done(json_engine, "lookup", prompt, GenParams(max_tokens=300, grammar=_grammar(json_engine, schema)))
    assert done.stats.tokens_by_source.get("grammar", 0) >= len('{"user": {"id": ') // 4
    plain = run_to_done(json_engine, "ar", prompt, GenParams(max_tokens=300, grammar=_grammar(json_engine, schema)))
    assert done.tokens == plain.tokens and done.stats.target_forwards < plain.stats.target_forwards


def test_masked_draft_never_proposes_what_the_grammar_forbids(json_engine: Engine) -> None:
    """Every drafted token (accepted or refused) of sps and tree is one the grammar allowed at its place."""
    schema = SCHEMAS["objects"]
    grammar = _grammar(json_engine, schema)
    prompt = json_engine.tokenize("once upon a time")
    for strategy in ("sps", "tree"):
        events = list(json_engine.strategy(strategy, OPTIONS).generate(prompt, GenParams(max_tokens=300, temperature=1.0,
                                                                                     seed=3, grammar=grammar)))
        check = grammar.start()
        for ev in events:
            if type(ev).__name__ != "Token":
                continue
            assert check.allowed()[ev.id], f"{strategy} proposed {ev.id}, which the grammar forbids there"
            if ev.kind != "rejected":
                check.commit(ev.id)


def _masked_law(engine: Engine, prompt: list[int], params: GenParams) -> dict[tuple[int, ...], float]:
    """The exact law of the first two tokens under the grammar: the target's masked distributions."""
    seq = engine.target
    constraint = params.grammar.start()

    def dist(prefix: list[int]) -> np.ndarray:
        seq.sync(prompt + prefix)
        logits = seq.logits().copy()
        constraint.apply(logits, prefix)
        return probabilities(logits, params)

    law: dict[tuple[int, ...], float] = {}
    p1 = dist([])
    for t1 in np.flatnonzero(p1):
        p2 = dist([int(t1)])
        for t2 in np.flatnonzero(p2):
            law[(int(t1), int(t2))] = p1[t1] * p2[t2]
    return law


@pytest.mark.parametrize("strategy", ["sps", "tree", "lookup"])
def test_constrained_sampling_law_is_the_masked_targets(json_engine: Engine, strategy: str) -> None:
    """A grammar that leaves a handful of tokens at each place: the law of the first two output tokens is the
    masked target's, with every proposal verified against it."""
    model = json_engine.target_model
    grammar = compile_grammar("regex", "( a| b| cat|c)( a| dog|e| the)+", model.guidance_tokenizer, model.n_vocab)
    prompt = json_engine.tokenize("the cat sat on the mat and the cat")
    params = GenParams(max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, grammar=grammar)
    law = _masked_law(json_engine, prompt, params)
    assert 8 <= len(law) <= 200
    options = StrategyOptions(sps=SpsConfig(draft_max=3, p_min=0.0, adaptive=False),
                              lookup=LookupConfig(draft_max=3, ngram_max=2, ngram_min=1))
    counts: dict[tuple[int, ...], int] = {}
    drafted = 0
    for seed in range(3000):
        done = run_to_done(json_engine, strategy, prompt, replace(params, seed=seed), options)
        key = outcome(json_engine, done)
        counts[key] = counts.get(key, 0) + 1
        drafted += done.stats.drafted
    assert drafted > 500, "the test must exercise verification"
    assert_target_law(counts, law, alpha=ALPHA, what="the constrained law differs from the masked target's")


def test_logprobs_are_the_masked_targets_and_equal_under_speculation(json_engine: Engine) -> None:
    """Each output token's log-probability (the target's, after the mask) is the same whichever strategy
    produced it, and the top list is ordered and holds only allowed tokens."""
    grammar = _grammar(json_engine, SCHEMAS["flat"])
    prompt = json_engine.tokenize("the dog")
    params = GenParams(max_tokens=200, logprobs=3, grammar=grammar)
    per: dict[str, list] = {}
    for strategy in ("ar", "sps", "lookup", "tree"):
        events = list(json_engine.strategy(strategy, OPTIONS).generate(prompt, params))
        tokens = [e for e in events if type(e).__name__ == "Token" and e.kind != "rejected"]
        done = events[-1]
        assert len(tokens) == len(done.tokens) and all(t.logprob is not None and t.logprob <= 0 for t in tokens)
        for t in tokens:
            lps = [lp for _i, lp in t.top_logprobs]
            assert lps == sorted(lps, reverse=True) and t.top_logprobs[0][1] >= t.logprob - 1e-9
        per[strategy] = [t.logprob for t in tokens]
    for strategy, lps in per.items():
        assert np.allclose(lps, per["ar"], atol=1e-3), strategy


def test_a_grammar_that_does_not_compile_is_one_clear_error(json_engine: Engine) -> None:
    model = json_engine.target_model
    for kind, source in (("gbnf", "root ::= (unclosed"), ("json_schema", "{not json"), ("regex", "(a"),
                         ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}})):
        with pytest.raises(GrammarError) as e:
            compile_grammar(kind, source, model.guidance_tokenizer, model.n_vocab)
        assert "\n" not in str(e.value) and "cannot be compiled" in str(e.value)


def test_a_vocabulary_that_cannot_spell_text_back_refuses_grammars_in_one_line(tiny) -> None:
    """The bare tiny vocabulary spells a space as the three bytes of '▁': llguidance would allow a forced
    stretch only in tokens that do not spell it. Refused up front, never an error halfway through an answer."""
    from backends.llama import LlamaModel
    from models.errors import ModelError

    with pytest.raises(ModelError) as e:
        LlamaModel(tiny.target).guidance_tokenizer
    assert "grammars cannot run on it" in str(e.value) and "\n" not in str(e.value)
