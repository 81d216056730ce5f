"""A target's own MTP head as the drafter (backends.mtp), on real llama.cpp with tiny files that carry heads.

Every test runs on two kinds of file: glm4moe with one head, reused for every
draft (tests/drafter_factory.py), and hy_v3 with three heads chained, draft k
by head k (tests/mtp_chain_factory.py, backends.mtp_chain). The files make
the heads' agreement with the target tunable: `agreeing` has most drafts
accepted, `random` few, so both the accepting and the rejecting paths run. Greedy output is `ar`'s token for token
for every strategy that drafts with the head, alone and under the server's
scheduler; with sampling, the law of the first two tokens is the target's
(chi-square at stats_helpers.ALPHA); the head's cells follow the accepted text
and nothing leaks between requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from backends.config import StrategyOptions, TreeConfig
from backends.engine import Engine, EngineConfig
from backends.events import Token
from backends.mtp import MtpSequence
from backends.mtp_chain import ChainedMtpSequence
from backends.sampling import GenParams
from backends.strategies.sps import SpsConfig
from conftest import TINY_VOCAB_WORDS
from drafter_factory import MtpModel, write_mtp_target
from mtp_chain_factory import ChainModel, write_chained_mtp_target
from engine_helpers import assert_strategy_greedy, run_to_done
from gguf_factory import spm_vocab
from models.drafters import describe_drafters, mtp_heads
from models.errors import ModelError
from models.gguf_info import validate_gguf
from stats_helpers import assert_drafts_keep_the_law

SPS = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0, adaptive=False))
PROMPTS = ([1, 300, 301, 302, 303], [1, 259 + 4, 259 + 9, 259 + 2], [1, 271, 283, 290, 305, 300, 271])


@dataclass(frozen=True)
class MtpFiles:
    architecture: str
    heads: int  # the file's MTP heads: 1 reused, or several chained
    agreeing: Path
    random: Path
    small: Path  # a 12-token vocabulary, for the chi-square test


def _files(kind: str, d: Path) -> MtpFiles:
    if kind == "one":
        return MtpFiles("glm4moe", 1,
                        agreeing=write_mtp_target(d / "agreeing.gguf", MtpModel(residual=0.1, head_noise=0.1)),
                        random=write_mtp_target(d / "random.gguf", MtpModel(residual=1.0, head_noise=1.0, seed=3)),
                        small=write_mtp_target(d / "small.gguf", MtpModel(residual=0.3, head_noise=0.3,
                                                                          logit_scale=0.35),
                                               vocab=spm_vocab(TINY_VOCAB_WORDS, with_bytes=False)))
    write, model = write_chained_mtp_target, ChainModel
    return MtpFiles("hy_v3", model().n_heads_mtp,
                    agreeing=write(d / "agreeing.gguf", model(residual=0.1, head_noise=0.1)),
                    random=write(d / "random.gguf", model(residual=1.0, head_noise=1.0, seed=3)),
                    small=write(d / "small.gguf", model(residual=0.3, head_noise=0.3, logit_scale=0.35),
                                vocab=spm_vocab(TINY_VOCAB_WORDS, with_bytes=False)))


@pytest.fixture(scope="module", params=["one", "chained"])
def mtp_files(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> MtpFiles:
    return _files(request.param, tmp_path_factory.mktemp(f"mtp-{request.param}"))


def _engine(path: Path, **kw) -> Engine:
    return Engine(EngineConfig(target=path, n_ctx=512, threads=1, cost_cache=Path(""), memory=False, **kw))


@pytest.fixture(scope="module")
def agreeing(mtp_files: MtpFiles) -> Engine:
    engine = _engine(mtp_files.agreeing, n_seq_max=16)  # sequence ids for a tree's paths
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def random_head(mtp_files: MtpFiles) -> Engine:
    engine = _engine(mtp_files.random, n_seq_max=16)
    yield engine
    engine.close()


def test_the_file_says_it_carries_a_head(mtp_files: MtpFiles) -> None:
    info = validate_gguf(mtp_files.agreeing)
    n = mtp_files.heads
    assert info.architecture == mtp_files.architecture and info.nextn_layers == n and mtp_heads(info) == n
    assert info.summary()["mtp_heads"] == n
    assert describe_drafters(info).startswith(f"MTP heads: {n}")
    assert ("chained" in describe_drafters(info)) == (n > 1)


def test_the_head_drafts_without_a_draft_model(agreeing: Engine, mtp_files: MtpFiles) -> None:
    assert agreeing.mtp and isinstance(agreeing.draft, MtpSequence)
    assert agreeing.target_model.n_layer_nextn == mtp_files.heads
    chained = mtp_files.heads > 1
    assert isinstance(agreeing.draft, ChainedMtpSequence) == chained
    assert agreeing.draft.depth_max == (mtp_files.heads if chained else None)


def test_no_mtp_loads_the_target_alone(mtp_files: MtpFiles) -> None:
    engine = _engine(mtp_files.agreeing, mtp=False)
    try:
        assert not engine.mtp and engine.draft is None and engine.target_model.n_layer_nextn == 0
    finally:
        engine.close()


@pytest.mark.parametrize("which", ["agreeing", "random_head"])
def test_greedy_output_is_the_targets(which: str, request: pytest.FixtureRequest, mtp_files: MtpFiles) -> None:
    """sps, auto and tree give ar's tokens; chained heads draft no deeper than they are many (one head a draft
    position, as llama.cpp caps n_max), a single head as deep as asked."""
    engine: Engine = request.getfixturevalue(which)
    accepted = rejected = 0
    tree = {"drafted": 0, "accepted": 0}
    deepest = {"sps": 0, "tree": 0.0}
    for prompt in PROMPTS:
        params = GenParams(max_tokens=48, temperature=0.0)
        want = run_to_done(engine, "ar", prompt, params).tokens
        for strategy in ("sps", "auto", "tree"):
            done = run_to_done(engine, strategy, prompt, params, SPS)
            assert_strategy_greedy(engine, strategy, prompt, want, done.tokens, f"on {which}")
            if strategy == "sps":
                accepted += done.stats.accepted
                rejected += done.stats.drafted - done.stats.accepted
                deepest["sps"] = max(deepest["sps"], len(done.stats.drafted_per_position))
            elif strategy == "tree":
                tree["drafted"] += done.stats.drafted
                tree["accepted"] += done.stats.accepted
                deepest["tree"] = max(deepest["tree"], float(done.stats.extra["mean_tree_depth"]))
    assert tree["drafted"] > 0, "the tree drafted with the head (its verifying path ran)"
    assert deepest["sps"] == min(SPS.sps.draft_max, mtp_files.heads if mtp_files.heads > 1 else SPS.sps.draft_max)
    if mtp_files.heads > 1:
        assert deepest["tree"] <= mtp_files.heads
    rate = accepted / (accepted + rejected)
    if which == "agreeing":  # the head often agrees: the accepting paths ran (chains of 4, so deep ones fail)
        assert accepted > 50 and rate > 0.4, (accepted, rejected)
        assert tree["accepted"] > 50, tree  # the tree's accepting path ran too
    else:
        assert rate < 0.2, (accepted, rejected)


def test_drafted_tokens_are_labelled_mtp(agreeing: Engine) -> None:
    events = list(agreeing.strategy("sps", SPS).generate(PROMPTS[0], GenParams(max_tokens=24, temperature=0.0)))
    sources = {e.source for e in events if isinstance(e, Token) and e.source != "target"}
    assert sources == {"mtp"}


def _mtp_cells(draft: MtpSequence) -> int:
    """The cells the head's context holds, all its sequences together (the whole cache: one slot here)."""
    return sum(draft.ctx.pos_max(draft.base + s) + 1 for s in range(draft.n_seq_max))


def test_the_heads_cells_follow_the_accepted_text(agreeing: Engine) -> None:
    """After each request the head holds the context's paired cells and what the last chain drafted, no scratch
    sequence's (a tree's paths), and back to the paired cells nothing; a second request on another prompt
    starts from their common prefix, and the target's and the head's cells agree."""
    draft = agreeing.draft
    for prompt in PROMPTS:
        for strategy in ("sps", "tree"):
            done = run_to_done(agreeing, strategy, prompt, GenParams(max_tokens=30, temperature=0.0), SPS)
            assert draft.tokens[:draft.paired] == (list(prompt) + list(done.tokens))[:draft.paired]
            assert draft.cells() == len(draft.tokens)  # llama.cpp holds exactly what the record says
            assert _mtp_cells(draft) == len(draft.tokens), strategy  # and nothing under another id
            draft.truncate(draft.paired)
            assert draft.cells() == draft.paired == _mtp_cells(draft)
    agreeing.slots[0].reset()
    assert _mtp_cells(draft) == 0 and agreeing.target.cells() == 0 and not draft.stash.rows


@pytest.mark.parametrize("strategy", ["sps", "tree"])
def test_sampling_keeps_the_targets_law(mtp_files: MtpFiles, strategy: str) -> None:
    """Chains and trees of the head's drafts, rejection-sampled: the first two tokens' law is the target's."""
    engine = _engine(mtp_files.small, n_seq_max=16)
    try:
        options = StrategyOptions(sps=SPS.sps, tree=TreeConfig(2, 2, 4))
        assert_drafts_keep_the_law(engine, strategy, [1, 4, 6, 8], options, 100, "the head")
    finally:
        engine.close()


def test_a_mixed_batch_with_the_head_gives_each_request_its_text_alone(mtp_files: MtpFiles) -> None:
    """Four slots decoding together (the server's scheduler), every strategy: at temperature 0 each request
    gives its text alone (or differs only at a near-tie under llama.cpp's batch noise), the head's rows of
    several sequences share its lane's batches, and no slot keeps cells beyond its record."""
    from backends.slot_pool import SlotPool
    from engine_helpers import BATCH_NOISE, divergences_from_alone
    from test_batching import _collect, _leaks

    strategies = ["ar", "sps", "auto", "tree", "sps", "lookup", "auto", "sps"]
    options = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0))
    engine = Engine(EngineConfig(target=mtp_files.agreeing, n_ctx=512, threads=1, n_seq_max=16, n_parallel=4,
                                 cost_cache=Path(""), memory=False))
    alone = _engine(mtp_files.agreeing, mtp=False)
    try:
        assert engine.mtp
        params = GenParams(max_tokens=40, temperature=0.0)
        prompts = [list(PROMPTS[i % len(PROMPTS)]) + [300 + i] for i in range(len(strategies))]
        jobs = [(s, p, params) for s, p in zip(strategies, prompts)]
        got = _collect(SlotPool(engine), jobs, options)
        divergences = divergences_from_alone(alone, jobs, got)
        assert all(gap < BATCH_NOISE for _, _, gap in divergences), divergences
        assert len(divergences) <= 2, divergences
        mtp_rows = sum(1 for ev in got for e in ev if isinstance(e, Token) and e.source == "mtp")
        assert mtp_rows > 20, "the head drafted under load"
        assert not _leaks(engine), _leaks(engine)
    finally:
        engine.close()
        alone.close()


@pytest.fixture(scope="module")
def qwen35_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Qwen3.5's layout (tests/qwen35_factory.py): a recurrent trunk (gated delta-net) and an MTP head."""
    from qwen35_factory import Qwen35Model, write_qwen35_mtp_target

    d = tmp_path_factory.mktemp("qwen35")
    return (write_qwen35_mtp_target(d / "agreeing.gguf", Qwen35Model(residual=0.1, head_noise=0.1)),
            write_qwen35_mtp_target(d / "random.gguf", Qwen35Model(residual=1.0, head_noise=1.0, seed=3)))


def test_a_recurrent_target_speculates_from_its_state_snapshots(qwen35_files: tuple[Path, Path]) -> None:
    """Qwen3.5/3.6 keep a recurrent state that llama.cpp cuts back only from per-token snapshots (n_rs_seq):
    rejected drafts are undone from them, so sps and auto with the model's own head give ar's tokens; and a
    later prompt that shares only part of what the cache holds decodes again from the start instead of
    failing (a state has no history to cut back to)."""
    for path in qwen35_files:
        engine = _engine(path)
        try:
            assert engine.mtp and engine.target.n_seq_max == 1
            rejected = 0
            for prompt in PROMPTS:
                params = GenParams(max_tokens=40, temperature=0.0)
                want = run_to_done(engine, "ar", prompt, params).tokens
                for strategy in ("sps", "auto", "ar"):
                    done = run_to_done(engine, strategy, prompt, params, SPS)
                    assert_strategy_greedy(engine, strategy, prompt, want, done.tokens, f"on {path.name}")
                    rejected += done.stats.drafted - done.stats.accepted
            assert rejected > 0, "drafts were rejected and rolled back"
            with pytest.raises(ModelError, match="recurrent state"):  # a tree needs several sequences: said why
                engine.strategy("tree")
        finally:
            engine.close()
