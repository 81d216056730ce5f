"""Grammar-masked drafts from the drafters a model carries (issue 44, item 3), on real llama.cpp.

With an MTP head, an EAGLE-3 draft and a DFlash block draft (tests/drafter_files.py), `sps`, `tree` and `auto`
under a grammar give `ar`'s greedy tokens under the same grammar, and no drafted token the grammar forbids ever
reaches the target: every chain and every tree path handed to verification is checked, token by token, against a
matcher of its own that follows the committed output. The same drafters with `mask_drafts` off do propose such
tokens (the check has something to find), and the output stays `ar`'s all the same (verification masks the target).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import backends.strategies.chain as chain_module
import backends.strategies.tree as tree_module
from auto_helpers import flat, unchecked
from backends.config import AutoConfig, StrategyOptions
from backends.device_cost import DeviceCost
from backends.engine import Engine, EngineConfig
from backends.events import ACCEPTED, REJECTED, Done, Token
from backends.grammar import Grammar, compile_grammar
from backends.sampling import GenParams
from backends.strategies.auto.state import AutoState
from backends.strategies.sps import SpsConfig
from drafter_files import DRAFTERS, write_drafter_files

STRATEGIES = ("sps", "tree", "auto")
# auto with the drafter as its only proposer, on a synthetic device where drafting pays (its times are not learnt),
# so that its chains are the drafter's and this machine's load does not decide whether it drafts at all.
OPTIONS = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0, adaptive=False),
                          auto=AutoConfig(lookup=False, lookahead=False, memory=False))
SCHEMAS = {
    # free text between forced keys: where the drafters draft, and where most of the vocabulary is allowed
    "story": {"type": "object", "properties": {"story": {"type": "string", "maxLength": 80}},
              "required": ["story"], "additionalProperties": False},
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
}
PROMPT = "the cat sat on the mat and"


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    files = write_drafter_files(tmp_path_factory.mktemp("drafters"))
    out = {}
    for label, f in files.items():
        engine = Engine(EngineConfig(target=f.target, draft=f.draft, n_ctx=512, threads=1, n_seq_max=16,
                                     cost_cache=Path(""), memory=False))
        engine._cost = DeviceCost(flat(), 0.05)
        engine.auto_states = {mode: AutoState(learn_timing=False) for mode in ("greedy", "sampled")}
        unchecked(engine)  # its decisions by the synthetic costs alone
        assert engine.drafter == label and engine.draft.label == label
        out[label] = engine
    yield out
    for engine in out.values():
        engine.close()


class VerifiedDrafts:
    """Every proposal handed to the target for verification (a chain, or each root-to-leaf path of a tree), each
    token checked against a fresh matcher of `grammar` that has consumed the committed output before it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.grammar: Grammar | None = None
        self.checked = 0
        self.forbidden: list[tuple[list[int], list[int]]] = []  # (output, path) pairs the grammar refuses
        real_chain, real_tree = chain_module.verify_chain, tree_module.verify_tree

        def verify_chain(run, target, drafts, dists):
            self.check(run.output, list(drafts))
            return (yield from real_chain(run, target, drafts, dists))

        def verify_tree(run, target, tree, *args, **kwargs):
            for leaf in tree.leaves:
                self.check(run.output, tree.path(leaf))
            return (yield from real_tree(run, target, tree, *args, **kwargs))

        monkeypatch.setattr(chain_module, "verify_chain", verify_chain)
        monkeypatch.setattr(tree_module, "verify_tree", verify_tree)

    def check(self, output: list[int], path: list[int]) -> None:
        assert self.grammar is not None
        matcher = self.grammar.start()
        for token in output:
            matcher.commit(token)
        for i, token in enumerate(path):
            self.checked += 1
            if not matcher.allowed(path[:i])[token]:
                self.forbidden.append((list(output), path[:i + 1]))
                return


@pytest.fixture
def verified(monkeypatch: pytest.MonkeyPatch) -> VerifiedDrafts:
    return VerifiedDrafts(monkeypatch)


def _grammar(engine: Engine, schema: dict) -> Grammar:
    model = engine.target_model
    return compile_grammar("json_schema", schema, model.guidance_tokenizer, model.n_vocab)


def _generate(engine: Engine, strategy: str, params: GenParams) -> tuple[Done, list[Token]]:
    """The answer and its drafted tokens of the engine's drafter (accepted or rejected)."""
    events = list(engine.strategy(strategy, OPTIONS).generate(engine.tokenize(PROMPT), params))
    done = events[-1]
    assert isinstance(done, Done) and done.reason != "error", getattr(done, "error", None)
    label = engine.draft.label
    return done, [e for e in events if isinstance(e, Token) and e.source == label and e.kind in (ACCEPTED, REJECTED)]


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_output_under_a_grammar_is_ars_and_every_draft_is_allowed(drafter: str, engines,
                                                                         verified: VerifiedDrafts) -> None:
    engine = engines[drafter]
    for name, schema in SCHEMAS.items():
        grammar = verified.grammar = _grammar(engine, schema)
        params = GenParams(max_tokens=60, temperature=0.0, grammar=grammar)
        want, _ = _generate(engine, "ar", params)
        for strategy in STRATEGIES:
            done, drafted = _generate(engine, strategy, params)
            assert done.tokens == want.tokens, f"{strategy} with the {drafter} drafter differs from ar on {name}"
            if name == "story":  # the free text: the drafter drafts there, and is accepted there
                assert sum(t.kind == ACCEPTED for t in drafted) >= 5, (strategy, len(drafted))
    assert verified.checked > 200
    assert not verified.forbidden, f"the {drafter} drafter sent tokens the grammar forbids: {verified.forbidden[:3]}"


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_sampled_drafts_are_masked_and_unmasked_ones_would_not_be(drafter: str, engines,
                                                                  verified: VerifiedDrafts) -> None:
    """At temperature 1 the drafts are drawn from the drafter's masked distribution: none is forbidden. With
    `mask_drafts` off the same drafter proposes forbidden tokens (so the check above can fail), which
    verification refuses: the greedy output is still `ar`'s."""
    engine = engines[drafter]
    grammar = verified.grammar = _grammar(engine, SCHEMAS["story"])
    for strategy in STRATEGIES:
        for seed in range(2):
            _, drafted = _generate(engine, strategy, GenParams(max_tokens=60, temperature=1.0, seed=seed,
                                                               grammar=grammar))
            assert drafted, f"{strategy}: the {drafter} drafter drafted nothing"
    assert verified.checked > 100 and not verified.forbidden, verified.forbidden[:3]

    unmasked = GenParams(max_tokens=60, temperature=0.0, grammar=grammar, mask_drafts=False)
    want, _ = _generate(engine, "ar", unmasked)
    for strategy in STRATEGIES:
        before = len(verified.forbidden)
        done, drafted = _generate(engine, strategy, unmasked)
        assert done.tokens == want.tokens, strategy
        assert len(verified.forbidden) > before, f"{strategy}: unmasked, the {drafter} drafter proposed nothing " \
                                                 "the grammar forbids (the check would find nothing)"
