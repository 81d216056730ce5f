"""An EAGLE-3 draft as the drafter (backends.eagle3), on real llama.cpp with the tiny pairs of tests/eagle3_factory.py.

The pairs make the draft's agreement with the target tunable: `agreeing`
has many drafts accepted, `random` few, so both the accepting and the
rejecting paths run; both draft from a reduced vocabulary (`d2t`), so the
draft's logits are -inf outside it. Greedy output is `ar`'s token for token
for every strategy that drafts with it, alone and under the server's
scheduler; with sampling, the law of the first two tokens is the target's
(chi-square at stats_helpers.ALPHA); the draft's cells follow the accepted
text; a draft that does not fit its target is refused in one line; and the
default pair gives the greedy tokens (and accepted drafts) that llama-server
`--spec-type draft-eagle3` gave for it (docs/eagle3-protocol.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from backends.config import StrategyOptions, TreeConfig
from backends.eagle3 import Eagle3Sequence, check_eagle3
from backends.engine import Engine, EngineConfig
from backends.events import Token
from backends.llama import LlamaModel
from backends.sampling import GenParams, probabilities
from backends.strategies.sps import SpsConfig
from conftest import TINY_VOCAB_WORDS
from eagle3_factory import Eagle3Pair, write_eagle3_pair
from auto_helpers import unchecked
from engine_helpers import assert_strategy_greedy, run_to_done
from gguf_factory import spm_vocab
from models.errors import ModelError
from stats_helpers import assert_drafts_keep_the_law

SPS = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0, adaptive=False))
PROMPTS = ([1, 300, 301, 302, 303], [1, 259 + 4, 259 + 9, 259 + 2], [1, 271, 283, 290, 305, 300, 271])
# llama-server --spec-type draft-eagle3 on the default pair (seed 0), docs/eagle3-protocol.md
SERVER_PROMPT = "once upon a time the cat"
SERVER_PROMPT_TOKENS = [1, 269, 102, 104, 229, 153, 132, 120, 115, 270, 261, 229, 153, 132, 119, 108, 112, 104, 229,
                        153, 132, 119, 107, 104, 229, 153, 132, 102, 262, 119]
SERVER_TOKENS = [248, 284, 273, 265, 195, 100, 114, 280, 85, 57, 13, 144, 215, 300, 100, 114, 280, 85, 57, 13, 144,
                 215, 300, 195, 100, 114, 280, 85, 57, 13, 144, 312]
SERVER_ACCEPTED = {4: 17, 3: 15}  # --spec-draft-n-max: draft_n_accepted


@dataclass(frozen=True)
class Pair:
    target: Path
    draft: Path


@dataclass(frozen=True)
class Eagle3Files:
    agreeing: Pair
    random: Pair
    server: Pair  # the default pair, as docs/eagle3-protocol.md ran it in llama-server
    small: Pair  # a 16-token vocabulary (8 of them the draft's), for the chi-square test


def _pair(d: Path, name: str, seed: int = 0, model: Eagle3Pair = Eagle3Pair(), **kw) -> Pair:
    pair = Pair(d / f"{name}-target.gguf", d / f"{name}-draft.gguf")
    write_eagle3_pair(pair.target, pair.draft, seed=seed, model=model, **kw)
    return pair


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Eagle3Files:
    d = tmp_path_factory.mktemp("eagle3")
    return Eagle3Files(
        agreeing=_pair(d, "agreeing", model=Eagle3Pair(residual=0.02, head_noise=0.1)),
        random=_pair(d, "random", seed=3, model=Eagle3Pair(head_noise=1.0)),
        server=_pair(d, "server"),
        small=_pair(d, "small", model=Eagle3Pair(draft_vocab=8, residual=0.3, head_noise=0.3, logit_scale=0.35),
                    vocab=spm_vocab(TINY_VOCAB_WORDS, with_bytes=False)),
    )


def _engine(pair: Pair, draft: bool = True, **kw) -> Engine:
    """An engine on the pair whose `auto` drafts where its costs say so, unchecked by its ticks' timing on these
    tiny models (auto_helpers.unchecked)."""
    return unchecked(Engine(EngineConfig(target=pair.target, draft=pair.draft if draft else None, n_ctx=512,
                                         threads=1, n_seq_max=16, cost_cache=Path(""), memory=False, **kw)))


@pytest.fixture(scope="module")
def agreeing(files: Eagle3Files) -> Engine:
    engine = _engine(files.agreeing)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def random_draft(files: Eagle3Files) -> Engine:
    engine = _engine(files.random)
    yield engine
    engine.close()


def test_an_eagle3_file_drafts_as_eagle3(agreeing: Engine) -> None:
    assert agreeing.drafter == "eagle3" and not agreeing.mtp
    assert isinstance(agreeing.draft, Eagle3Sequence) and agreeing.draft.label == "eagle3"
    assert agreeing.draft.ctx is not agreeing.target.ctx


@pytest.mark.parametrize("which", ["agreeing", "random_draft"])
def test_greedy_output_is_the_targets(which: str, request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(which)
    accepted = drafted = auto_drafted = 0
    for prompt in PROMPTS:
        params = GenParams(max_tokens=48, temperature=0.0)
        want = run_to_done(engine, "ar", prompt, params).tokens
        for strategy in ("sps", "auto", "tree"):
            done = run_to_done(engine, strategy, prompt, params, SPS)
            # auto's batches follow live timings: it may part from ar at a near-tie, and only there
            # (the random draft's second prompt wins its 22nd token by 0.0027: tests/perf/greedy_margins.py)
            assert_strategy_greedy(engine, strategy, list(prompt), want, done.tokens, f"on {which}")
            if strategy == "sps":
                accepted += done.stats.accepted
                drafted += done.stats.drafted
            elif strategy == "auto":
                auto_drafted += done.stats.drafted
    rate = accepted / drafted
    assert auto_drafted > 0, "auto drafted with the EAGLE-3 draft (its drafting path ran)"
    if which == "agreeing":  # chains of 4 from a 128-token vocabulary: the deep ones often fail
        assert accepted > 50 and rate > 0.3, (accepted, drafted)
    else:
        assert rate < 0.1, (accepted, drafted)


def test_drafted_tokens_are_labelled_eagle3(agreeing: Engine) -> None:
    events = list(agreeing.strategy("sps", SPS).generate(PROMPTS[0], GenParams(max_tokens=24, temperature=0.0)))
    sources = {e.source for e in events if isinstance(e, Token) and e.source != "target"}
    assert sources == {"eagle3"}


def test_the_drafts_cells_follow_the_accepted_text(agreeing: Engine) -> None:
    """After each request the draft holds a cell for every token of its record but the first (whose row llama.cpp
    never writes: cells() counts it), paired ones up to `paired`, and nothing drafted; a second request on another
    prompt starts from their common prefix, its rows paired with the target's features (the first token's are
    kept for it); reset leaves nothing."""
    draft = agreeing.draft
    agreeing.slots[0].reset()
    for prompt in PROMPTS:
        missing = draft.missing
        done = run_to_done(agreeing, "sps", prompt, GenParams(max_tokens=30, temperature=0.0), SPS)
        assert draft.tokens[:draft.paired] == (list(prompt) + list(done.tokens))[:draft.paired]
        assert draft.cells() == len(draft.tokens)  # llama.cpp holds exactly what the record says
        assert draft.ctx.pos_max(draft.base) == len(draft.tokens) - 1
        draft.truncate(draft.paired)
        assert draft.cells() == draft.paired
        assert draft.missing == missing, "every row was paired with the target's features"
    # The same prompt again: the target keeps its cells, and the state behind the prompt's last row, read and
    # dropped, is not decoded again: that one row is paired with zeros (llama.cpp's draft() pairs it with the last
    # request's stale pending state). Drafts degrade there, never the output.
    missing = draft.missing
    run_to_done(agreeing, "sps", PROMPTS[-1], GenParams(max_tokens=30, temperature=0.0), SPS)
    assert draft.missing - missing <= 1
    agreeing.slots[0].reset()
    assert draft.cells() == 0 and agreeing.target.cells() == 0 and not draft.stash.rows


def test_a_lone_first_token_drafts_from_a_placeholder(agreeing: Engine) -> None:
    """A context of one token has no draft row (llama.cpp drafts only after the target's first token): a
    placeholder row gives logits and goes at the next syncing."""
    params = GenParams(max_tokens=16, temperature=0.0)
    want = run_to_done(agreeing, "ar", [1], params).tokens
    assert run_to_done(agreeing, "sps", [1], params, SPS).tokens == want
    draft = agreeing.draft
    agreeing.slots[0].reset()
    draft.sync([1])
    assert draft.paired == 0 and draft.cells() == 1
    missing = draft.missing
    draft.sync([1, 300], logits=False)  # the placeholder goes; row 1 waits for the target's state at 0
    assert draft.tokens == [1] and draft.ctx.pos_max(draft.base) == -1
    agreeing.target.sync([1, 300], logits=False)
    draft.sync([1, 300], logits=False)
    assert draft.cells() == 2 and draft.ctx.pos_max(draft.base) == 1 and draft.paired == 2
    assert draft.missing == missing
    agreeing.slots[0].reset()


def test_the_drafts_reduced_vocabulary_keeps_q_a_distribution(agreeing: Engine) -> None:
    """Outside its d2t vocabulary the draft's logits are -inf in llama.cpp; raised to a finite floor, q stays the
    same, and stays a distribution when a grammar masks every token the draft can name."""
    draft = agreeing.draft
    draft.sync(list(PROMPTS[0]))
    raw = draft.logits().copy()
    inside = raw > -1e29
    assert 0 < inside.sum() == Eagle3Pair().draft_vocab < raw.size and np.isfinite(raw).all()
    params = GenParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0)
    q = probabilities(raw, params)
    assert q[~inside].sum() == 0.0 and abs(q.sum() - 1.0) < 1e-9
    masked = raw.copy()
    masked[inside] = -np.inf  # what a grammar that allows none of the draft's tokens leaves
    q = probabilities(masked, params)
    assert np.isfinite(q).all() and abs(q.sum() - 1.0) < 1e-9 and q[inside].sum() == 0.0
    agreeing.slots[0].reset()


@pytest.mark.parametrize("strategy", ["sps", "tree"])
def test_sampling_keeps_the_targets_law(files: Eagle3Files, strategy: str) -> None:
    """Chains and trees of the EAGLE-3 draft's drafts, rejection-sampled: the first two tokens' law is the target's
    (chi-square at stats_helpers.ALPHA)."""
    engine = _engine(files.small)
    try:
        assert engine.drafter == "eagle3"
        options = StrategyOptions(sps=SPS.sps, tree=TreeConfig(2, 2, 4))
        assert_drafts_keep_the_law(engine, strategy, [1, 4, 6, 8], options, 500, "the EAGLE-3 draft")
    finally:
        engine.close()


def test_the_same_greedy_tokens_and_accepted_drafts_as_llama_server(files: Eagle3Files) -> None:
    engine = _engine(files.server)
    try:
        prompt = engine.tokenize(SERVER_PROMPT)
        assert prompt == SERVER_PROMPT_TOKENS
        params = GenParams(max_tokens=32, temperature=0.0)
        assert list(run_to_done(engine, "ar", prompt, params).tokens) == SERVER_TOKENS
        for k, accepted in SERVER_ACCEPTED.items():
            options = StrategyOptions(sps=SpsConfig(draft_max=k, p_min=0.0, adaptive=False))
            done = run_to_done(engine, "sps", prompt, params, options)
            assert list(done.tokens) == SERVER_TOKENS
            # llama-server drafts from the second token on; specchat drafts for the first too (k drafts, none
            # accepted here): the same drafts are accepted after it
            assert done.stats.accepted == accepted, (k, done.stats.accepted, done.stats.drafted)
    finally:
        engine.close()


def test_a_mixed_batch_with_the_draft_gives_each_request_its_text_alone(files: Eagle3Files) -> None:
    """Four slots decoding together (the server's scheduler), every strategy: at temperature 0 each request
    gives its text alone (or differs only at a near-tie under llama.cpp's batch noise), the draft's rows of
    several sequences share its lane's batches (one slot's catch-up beside another's drafts), and no slot keeps
    cells beyond its record."""
    from backends.slot_pool import SlotPool
    from engine_helpers import BATCH_NOISE, divergences_from_alone
    from test_batching import _collect, _leaks

    strategies = ["ar", "sps", "auto", "tree", "sps", "lookup", "auto", "sps"]
    options = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0))
    engine = _engine(files.agreeing, n_parallel=4)
    alone = _engine(files.agreeing, draft=False)
    try:
        assert engine.drafter == "eagle3"
        params = GenParams(max_tokens=40, temperature=0.0)
        prompts = [list(PROMPTS[i % len(PROMPTS)]) + [300 + i] for i in range(len(strategies))]
        jobs = [(s, p, params) for s, p in zip(strategies, prompts)]
        got = _collect(SlotPool(engine), jobs, options)
        divergences = divergences_from_alone(alone, jobs, got)
        assert all(gap < BATCH_NOISE for _, _, gap in divergences), divergences
        assert len(divergences) <= 2, divergences
        drafted = sum(1 for ev in got for e in ev if isinstance(e, Token) and e.source == "eagle3")
        assert drafted > 20, "the draft drafted under load"
        assert engine.draft_lane.split > 0, "batches that mix rows asking for logits and not were decoded"
        assert not _leaks(engine), _leaks(engine)
    finally:
        engine.close()
        alone.close()


def test_each_row_of_a_mixed_batch_gets_its_own_logits(files: Eagle3Files) -> None:
    """Two slots catch up in one draft batch (the scheduler packs them so), each ending with the row it wants
    logits of: each gets the logits it gets alone. (llama.cpp's eagle3 graph hands back the first rows of a batch
    as its outputs; backends.eagle3 decodes such a batch in two passes.)"""
    engine = _engine(files.agreeing, n_parallel=2)
    try:
        prompts = [list(PROMPTS[0]), list(PROMPTS[2])]
        for slot, prompt in zip(engine.slots, prompts):
            slot.target.sync(prompt[:-1], logits=False)
        alone = []
        for slot, prompt in zip(engine.slots, prompts):
            slot.draft.sync(prompt)
            alone.append(slot.draft.logits().copy())
            slot.draft.truncate(1)
        machines = [slot.draft.syncing(prompt) for slot, prompt in zip(engine.slots, prompts)]
        requests = [next(m) for m in machines]
        assert all(not r.entries[0][3] and r.entries[-1][3] for r in requests)
        split = engine.draft_lane.split
        rows = engine.draft_lane.decode([r.entries for r in requests])
        assert engine.draft_lane.split == split + 1
        for machine, r in zip(machines, rows):
            with pytest.raises(StopIteration):
                machine.send(r)
        for slot, want in zip(engine.slots, alone):
            got = slot.draft.logits()
            assert int(np.argmax(got)) == int(np.argmax(want))
            np.testing.assert_allclose(got[want > -1e29], want[want > -1e29], atol=1e-3)
    finally:
        engine.close()


@pytest.mark.parametrize("why, target_model, draft_layers, words", [
    ("layers", Eagle3Pair(n_layer=2, target_layers=(0, 1, 1)), None, "reads layers [3], the target has 2"),
    ("hidden", Eagle3Pair(n_embd=32), None, "hidden states of 64, the target's are 32"),
    ("count", Eagle3Pair(), (1, 2), "reads 3 target layers, this one names 2"),
])
def test_a_draft_that_does_not_fit_its_target_is_refused_in_one_line(
        tmp_path: Path, why: str, target_model: Eagle3Pair, draft_layers: tuple | None, words: str) -> None:
    target = tmp_path / "t.gguf"
    write_eagle3_pair(target, tmp_path / "unused-draft.gguf", model=target_model)
    draft = tmp_path / "d.gguf"
    write_eagle3_pair(tmp_path / "unused-target.gguf", draft, draft_layers=draft_layers)
    with pytest.raises(ModelError) as err:
        _engine(Pair(target, draft)).close()
    message = str(err.value)
    assert "\n" not in message and words in message and "d.gguf" in message, message


def test_a_target_whose_graph_gives_no_layer_inputs_is_refused_in_one_line(tmp_path: Path) -> None:
    """llama.cpp aborts the process at the first decode that asks a graph without them for its layer inputs: a
    glm4moe target (the MTP fixture's, 4 trunk layers) is refused before, in one line."""
    from drafter_factory import MtpModel, write_mtp_target

    target = write_mtp_target(tmp_path / "glm.gguf", MtpModel(n_layer=4))
    write_eagle3_pair(tmp_path / "unused-target.gguf", tmp_path / "d.gguf")
    with pytest.raises(ModelError) as err:
        _engine(Pair(target, tmp_path / "d.gguf")).close()
    assert "\n" not in str(err.value) and "no layer inputs of a glm4moe target" in str(err.value), err.value


def test_the_engine_checks_the_loaded_draft_too(tmp_path: Path) -> None:
    """What llama.cpp loaded is checked again before the draft's context reads the target (llama.cpp aborts on a
    layer beyond the target's): one ModelError line, whatever the header said."""
    write_eagle3_pair(tmp_path / "t.gguf", tmp_path / "x.gguf", model=Eagle3Pair(n_layer=2, target_layers=(0, 1, 1)))
    write_eagle3_pair(tmp_path / "y.gguf", tmp_path / "d.gguf")
    models = [LlamaModel(tmp_path / name) for name in ("t.gguf", "y.gguf", "d.gguf")]
    short, fitting, draft = models
    try:
        with pytest.raises(ModelError, match=r"reads layers \[3\], the target has 2"):
            check_eagle3(short, draft)
        assert check_eagle3(fitting, draft) == (1, 2, 3)
    finally:
        for model in models:
            model.close()
