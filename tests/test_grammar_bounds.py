"""JSON schemas read as llama-server reads them (backends.grammar.llama_server_schema): a number without bounds
has at most 16 digits before its point, an object with properties has only those. Without them, llguidance lets
SmolLM2 at temperature 0 write `{"population": 1111…` until max_tokens, with every strategy."""

from __future__ import annotations

import json

import pytest

from backends.engine import Engine
from backends.grammar import NUMBER_BOUND, compile_grammar, llama_server_schema
from backends.registry import NEEDS_DRAFT, STRATEGIES
from backends.sampling import GenParams
from app.prompt_format import PromptFormat
from engine_helpers import run_to_done


def test_unbounded_numbers_are_bounded_and_objects_closed_and_nothing_else_changes() -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "x": {"type": ["number", "null"]}, "k": {"type": "integer", "minimum": 0},
        "items": {"type": "array", "items": {"type": "integer"}},
        "free": {"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": True},
        "e": {"enum": [{"type": "integer"}]}}}
    out = llama_server_schema(schema)
    props = out["properties"]
    assert props["n"] == {"type": "integer", "minimum": -NUMBER_BOUND, "maximum": NUMBER_BOUND}
    assert props["x"]["maximum"] == NUMBER_BOUND and props["k"] == {"type": "integer", "minimum": 0}
    assert props["items"]["items"]["maximum"] == NUMBER_BOUND
    assert out["additionalProperties"] is False and props["free"]["additionalProperties"] is True
    assert props["e"] == {"enum": [{"type": "integer"}]}, "values are not schemas"
    assert schema["properties"]["n"] == {"type": "integer"}, "the caller's schema is not changed"
    assert len(str(NUMBER_BOUND)) == 16


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_population_schema_closes_with_every_strategy(instruct_engine: Engine, strategy: str) -> None:
    """Every strategy of the registry (those that draft with a model, sps and tree, with SmolLM2's Q2_K draft,
    which instruct_engine loads)."""
    assert instruct_engine.draft_model is not None or strategy not in NEEDS_DRAFT
    model = instruct_engine.target_model
    schema = {"type": "object", "properties": {"population": {"type": "integer"}}}
    grammar = compile_grammar("json_schema", schema, model.guidance_tokenizer, model.n_vocab)
    prompt = PromptFormat(instruct_engine).prompt("What is the population of Paris? Answer in JSON.")
    done = run_to_done(instruct_engine, strategy, prompt, GenParams(max_tokens=60, grammar=grammar))
    assert done.reason == "stop", done.text
    value = json.loads(done.text)
    assert list(value) == ["population"] and abs(value["population"]) <= NUMBER_BOUND
