"""A DFlash / DSpark block draft as the drafter (backends.dflash), on real llama.cpp with the tiny pairs of
tests/dflash_factory.py.

The pairs make the first draft of each block follow the target (`agreeing`)
or not (`random`); `dspark` is the DSpark layout (a Markov head, drafts from
the anchor's row on). Greedy output is `ar`'s token for token for every
strategy that drafts with it, alone and under the server's scheduler; with
sampling, the law of the first two tokens is the target's (chi-square at
stats_helpers.ALPHA); one draft decode gives a whole chain; the draft's
cells are exactly the committed tokens after every request; a draft that
does not fit its target is refused in one line; and the default pair gives
llama-server `--spec-type draft-dflash`'s greedy tokens (docs/dflash-protocol.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from backends.config import StrategyOptions, TreeConfig
from backends.dflash import DFlashSequence
from backends.engine import Engine, EngineConfig
from backends.events import StepEnd, Token
from backends.sampling import GenParams
from backends.strategies.sps import SpsConfig
from conftest import TINY_VOCAB_WORDS
from dflash_factory import DFlashPair, dflash_vocab, write_dflash_pair
from auto_helpers import unchecked
from engine_helpers import assert_strategy_greedy, run_to_done
from models.errors import ModelError
from stats_helpers import assert_drafts_keep_the_law

SPS = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0, adaptive=False))
PROMPTS = ([1, 300, 301, 302, 303], [1, 260 + 4, 260 + 9, 260 + 2], [1, 272, 284, 291, 306, 301, 272])
SERVER_PROMPT = "once upon a time the cat"
LLAMA_SERVER = Path.home() / ".cache/specchat-reference/0.3.36/build/bin/llama-server"


@dataclass(frozen=True)
class Pair:
    target: Path
    draft: Path


@dataclass(frozen=True)
class DFlashFiles:
    agreeing: Pair
    random: Pair
    dspark: Pair
    server: Pair  # the default pair (tests/perf/drafter_fixtures.py's dflash-*.gguf)
    small: Pair  # a 17-token vocabulary, for the chi-square test


def _pair(d: Path, name: str, seed: int = 0, model: DFlashPair = DFlashPair(), **kw) -> Pair:
    pair = Pair(d / f"{name}-target.gguf", d / f"{name}-draft.gguf")
    write_dflash_pair(pair.target, pair.draft, seed=seed, model=model, **kw)
    return pair


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> DFlashFiles:
    d = tmp_path_factory.mktemp("dflash")
    return DFlashFiles(
        agreeing=_pair(d, "agreeing",
                       model=DFlashPair(residual=0.02, sharpness=3.0, noise=0.1, ffn_noise=0.1, mix=8.0)),
        random=_pair(d, "random", seed=3, model=DFlashPair(sharpness=0.0, noise=1.0, ffn_noise=1.0)),
        dspark=_pair(d, "dspark", model=DFlashPair(residual=0.02, sharpness=3.0, markov_rank=8, anchor_first=True,
                                                   mix=0.2)),
        server=_pair(d, "server"),
        small=_pair(d, "small", model=DFlashPair(residual=0.3, logit_scale=0.35),
                    vocab=dflash_vocab(TINY_VOCAB_WORDS, with_bytes=False)),
    )


def _engine(pair: Pair, draft: bool = True, **kw) -> Engine:
    """An engine on the pair whose `auto` drafts where its costs say so, unchecked by its ticks' timing on these
    tiny models (auto_helpers.unchecked)."""
    return unchecked(Engine(EngineConfig(target=pair.target, draft=pair.draft if draft else None, n_ctx=512,
                                         threads=1, n_seq_max=16, cost_cache=Path(""), memory=False, **kw)))


@pytest.fixture(scope="module")
def agreeing(files: DFlashFiles) -> Engine:
    engine = _engine(files.agreeing)
    yield engine
    engine.close()


def test_a_dflash_file_drafts_as_dflash(agreeing: Engine) -> None:
    assert agreeing.drafter == "dflash" and not agreeing.mtp
    draft = agreeing.draft
    assert isinstance(draft, DFlashSequence) and draft.label == "dflash"
    assert draft.ctx is not agreeing.target.ctx
    assert draft.spec.block_size == 8 and draft.chain_max == 7 and draft.spec.mask == 3


@pytest.mark.parametrize("which", ["agreeing", "random", "dspark"])
def test_greedy_output_is_the_targets(files: DFlashFiles, which: str) -> None:
    engine = _engine(getattr(files, which))
    try:
        accepted = drafted = auto_drafted = 0
        for prompt in PROMPTS:
            params = GenParams(max_tokens=40, temperature=0.0)
            want = run_to_done(engine, "ar", prompt, params).tokens
            for strategy in ("sps", "auto", "tree"):
                done = run_to_done(engine, strategy, prompt, params, SPS)
                # auto's batches follow live timings: it may part from ar at a near-tie, and only there
                # (the agreeing pair's first prompt wins its 13th token by 0.0027: tests/perf/greedy_margins.py)
                assert_strategy_greedy(engine, strategy, list(prompt), want, done.tokens, f"on {which}")
                if strategy == "sps":
                    accepted += done.stats.accepted
                    drafted += done.stats.drafted
                elif strategy == "auto":
                    auto_drafted += done.stats.drafted
        assert auto_drafted > 0, "auto drafted with the DFlash draft (its drafting path ran)"
        rate = accepted / drafted
        if which == "random":
            assert rate < 0.15, (accepted, drafted)
        else:  # the first draft of a block follows the target, the later ones rarely
            assert accepted > 20 and rate > 0.15, (accepted, drafted)
    finally:
        engine.close()


def test_drafted_tokens_are_labelled_dflash(agreeing: Engine) -> None:
    events = list(agreeing.strategy("sps", SPS).generate(PROMPTS[0], GenParams(max_tokens=24, temperature=0.0)))
    sources = {e.source for e in events if isinstance(e, Token) and e.source != "target"}
    assert sources == {"dflash"}


def test_one_draft_decode_gives_a_whole_chain(agreeing: Engine) -> None:
    """sps with K = 4: every chain is one block of [last token, <mask> x 4] (one llama.cpp decode, with the
    injection of the tokens verified since the last one), however many of its drafts are proposed."""
    draft, lane = agreeing.draft, agreeing.draft_lane
    agreeing.slots[0].reset()
    blocks, decodes = draft.blocks, lane.decodes
    done = run_to_done(agreeing, "sps", PROMPTS[2], GenParams(max_tokens=30, temperature=0.0), SPS)
    steps = done.stats.target_forwards
    assert 0 < done.stats.drafted <= 4 * (draft.blocks - blocks)
    assert draft.blocks - blocks <= steps
    assert lane.decodes - decodes <= 2 * (draft.blocks - blocks), "one injection and one block per chain at most"
    # a chain never outgrows the block: K = 20 drafts 7 at most
    options = StrategyOptions(sps=SpsConfig(draft_max=20, p_min=0.0, adaptive=False))
    events = list(agreeing.strategy("sps", options).generate(PROMPTS[0], GenParams(max_tokens=24, temperature=0.0)))
    per_step, longest = 0, 0
    for e in events:
        if isinstance(e, Token) and e.source == "dflash":
            per_step += 1
        elif isinstance(e, StepEnd):
            longest, per_step = max(longest, per_step), 0
    assert 0 < longest <= 7


def test_the_drafts_cells_are_the_committed_tokens(agreeing: Engine) -> None:
    """After each request the draft holds one cell per token of its record (the target's features injected at
    their positions), the record is what was committed, no cell of a block outlives its decode, and every
    injected row had the target's features; reset leaves nothing."""
    draft = agreeing.draft
    agreeing.slots[0].reset()
    for strategy in ("sps", "auto", "tree", "sps"):
        for prompt in PROMPTS:
            missing, blocks = draft.missing, draft.blocks
            done = run_to_done(agreeing, strategy, prompt, GenParams(max_tokens=30, temperature=0.0), SPS)
            committed = list(prompt) + list(done.tokens)
            if draft.blocks > blocks:  # the draft drafted in this request (auto may leave it out)
                assert draft.tokens == committed[:len(draft.tokens)]
                if strategy != "auto":  # which may draft a few times and then decode plainly, the draft left behind
                    assert len(draft.tokens) >= len(committed) - 10  # the last chain (7 drafts at most) is not injected
            assert draft.cells() == len(draft.tokens) and draft.ctx.pos_max(draft.base) == len(draft.tokens) - 1
            for s in range(1, draft.n_seq_max):
                assert draft.ctx.pos_max(draft.base + s) == -1, "a tree leaves no scratch cells in the draft"
            assert draft.missing == missing, f"{strategy}: every injected row had the target's features"
    agreeing.slots[0].reset()
    assert draft.cells() == 0 and agreeing.target.cells() == 0 and not draft.stash.rows


def test_a_block_reads_the_injected_context(files: DFlashFiles) -> None:
    """The block's logits depend on the injected cells (a row at the wrong place would show; the default pair's
    attention leaves the context a share): the same last token after two different contexts gives different
    logits, the same context the same ones, and a context the target never decoded (zeros injected) others."""
    engine = _engine(files.server)
    try:
        draft, target = engine.draft, engine.target
        got = []
        for prompt in (PROMPTS[0], PROMPTS[2], PROMPTS[0]):
            ctx = list(prompt) + [300]
            target.sync(ctx[:-1], logits=False)
            draft.sync(ctx)
            got.append(draft.logits().copy())
            assert draft.cells() == len(ctx) - 1 and draft.missing == 0
        assert not np.allclose(got[0], got[1], atol=1e-3)
        np.testing.assert_allclose(got[0], got[2], atol=1e-4)
        engine.slots[0].reset()
        draft.sync(list(PROMPTS[0]) + [300])  # the target decoded nothing: every row injected as zeros
        assert draft.missing == len(PROMPTS[0])
        assert not np.allclose(draft.logits(), got[0], atol=1e-3)
    finally:
        engine.close()


@pytest.mark.parametrize("strategy", ["sps", "tree"])
def test_sampling_keeps_the_targets_law(files: DFlashFiles, strategy: str) -> None:
    """Chains and trees of the block draft's drafts, rejection-sampled: the first two tokens' law is the target's
    (chi-square at stats_helpers.ALPHA)."""
    engine = _engine(files.small)
    try:
        assert engine.drafter == "dflash"
        options = StrategyOptions(sps=SPS.sps, tree=TreeConfig(2, 2, 4))
        assert_drafts_keep_the_law(engine, strategy, [1, 5, 7, 9], options, 300, "the block draft")
    finally:
        engine.close()


def test_a_mixed_batch_with_the_draft_gives_each_request_its_text_alone(files: DFlashFiles) -> None:
    """Four slots decoding together (the server's scheduler), every strategy: at temperature 0 each request
    gives its text alone (or differs only at a near-tie under llama.cpp's batch noise), several slots' blocks
    share one draft decode, and no slot keeps cells beyond its record."""
    from backends.slot_pool import SlotPool
    from engine_helpers import BATCH_NOISE, divergences_from_alone
    from test_batching import _collect, _leaks

    strategies = ["ar", "sps", "auto", "tree", "sps", "lookup", "auto", "sps"]
    options = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0))
    engine = _engine(files.agreeing, n_parallel=4)
    alone = _engine(files.agreeing, draft=False)
    try:
        assert engine.drafter == "dflash"
        params = GenParams(max_tokens=40, temperature=0.0)
        prompts = [list(PROMPTS[i % len(PROMPTS)]) + [300 + i] for i in range(len(strategies))]
        jobs = [(s, p, params) for s, p in zip(strategies, prompts)]
        lane = engine.draft_lane
        blocks = sum(slot.draft.blocks for slot in engine.slots)
        decodes = lane.decodes
        got = _collect(SlotPool(engine), jobs, options)
        divergences = divergences_from_alone(alone, jobs, got)
        assert all(gap < BATCH_NOISE for _, _, gap in divergences), divergences
        assert len(divergences) <= 2, divergences
        drafted = sum(1 for ev in got for e in ev if isinstance(e, Token) and e.source == "dflash")
        assert drafted > 20, "the draft drafted under load"
        blocks = sum(slot.draft.blocks for slot in engine.slots) - blocks
        assert lane.decodes - decodes < 2 * blocks, "blocks of several slots shared a decode"
        assert not _leaks(engine), _leaks(engine)
    finally:
        engine.close()
        alone.close()


@pytest.mark.parametrize("why, model, words", [
    ("hidden", DFlashPair(n_embd_draft=128), "its hidden size is 128, the target's 64"),
    ("mask", DFlashPair(mask_token=False), "it names no mask token"),
])
def test_a_draft_that_does_not_fit_its_target_is_refused_in_one_line(
        tmp_path: Path, why: str, model: DFlashPair, words: str) -> None:
    write_dflash_pair(tmp_path / "t.gguf", tmp_path / "d.gguf", model=model)
    with pytest.raises(ModelError) as err:
        _engine(Pair(tmp_path / "t.gguf", tmp_path / "d.gguf")).close()
    message = str(err.value)
    assert "\n" not in message and words in message and "d.gguf" in message, message


def test_a_draft_of_layers_the_target_lacks_is_refused_in_one_line(tmp_path: Path) -> None:
    write_dflash_pair(tmp_path / "t.gguf", tmp_path / "unused.gguf", model=DFlashPair(n_layer=2, target_layers=(0, 1)))
    write_dflash_pair(tmp_path / "unused-t.gguf", tmp_path / "d.gguf")
    with pytest.raises(ModelError) as err:
        _engine(Pair(tmp_path / "t.gguf", tmp_path / "d.gguf")).close()
    assert "\n" not in str(err.value) and "it reads layers [2, 3], the target has 2" in str(err.value), err.value


def test_models_info_and_check(files: DFlashFiles, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from app.cli import main
    from drafter_factory import write_mtp_target

    assert main(["models", "info", str(files.agreeing.draft), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["architecture"] == "dflash" and data["dflash_target_layers"] == [1, 2, 3]
    assert data["drafters"] == "DFlash draft for target layers [1, 2, 3], blocks of 8 (up to 7 drafts from one decode)"
    assert main(["models", "info", str(files.dspark.draft), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["drafters"].startswith("DSpark draft for target layers [1, 2, 3]")
    assert main(["models", "check", str(files.agreeing.target), str(files.agreeing.draft)]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("compatible:")
    # the MTP fixture's trunk has 2 layers: a draft that reads layer 3 cannot run on it
    mtp = write_mtp_target(tmp_path / "mtp.gguf")
    assert main(["models", "check", str(mtp), str(files.agreeing.draft)]) == 1
    out = capsys.readouterr().out
    assert "it reads layers [2, 3], the target has 2" in out


def _llama_server_tokens(pair: Pair, k: int, tmp_path: Path, kind: str = "dflash") -> tuple[list[int], dict]:
    """The reference llama-server's greedy tokens for SERVER_PROMPT with the DFlash (or DSpark) draft, and its
    timings."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / f"llama-server-{k}.log"
    env = dict(os.environ, LD_LIBRARY_PATH=str(LLAMA_SERVER.parent))
    with open(log, "w") as out:
        proc = subprocess.Popen([str(LLAMA_SERVER), "-m", str(pair.target), "-md", str(pair.draft),
                                 "--spec-type", f"draft-{kind}", "--spec-draft-n-max", str(k), "--host", "127.0.0.1",
                                 "--port", str(port), "-c", "512", "-np", "1", "-t", "2"],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=120, json={
            "prompt": SERVER_PROMPT, "n_predict": 32, "temperature": 0, "return_tokens": True, "cache_prompt": False})
        r.raise_for_status()
        body = r.json()
        return body["tokens"], body["timings"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(not LLAMA_SERVER.exists(), reason="the reference llama-server build is absent")
@pytest.mark.parametrize("kind, k", [("dflash", 4), ("dflash", 7), ("dspark", 4)])
def test_the_same_greedy_tokens_as_llama_server(files: DFlashFiles, tmp_path: Path, kind: str, k: int) -> None:
    pair = files.server if kind == "dflash" else files.dspark
    tokens, timings = _llama_server_tokens(pair, k, tmp_path, kind)
    assert timings["draft_n"] > 0, timings  # llama-server drafted with the block draft
    engine = _engine(pair)
    try:
        prompt = engine.tokenize(SERVER_PROMPT)
        params = GenParams(max_tokens=32, temperature=0.0)
        assert list(run_to_done(engine, "ar", prompt, params).tokens) == tokens
        options = StrategyOptions(sps=SpsConfig(draft_max=k, p_min=0.0, adaptive=False))
        done = run_to_done(engine, "sps", prompt, params, options)
        assert list(done.tokens) == tokens
        assert done.stats.accepted > 0 and timings["draft_n_accepted"] > 0, (done.stats, timings)
        if kind == "dflash":  # the same drafts: specchat drafts k for the first token too (none accepted here), where
            # llama-server samples it from the prompt's logits; after it, step for step the same chains
            assert (done.stats.accepted, done.stats.drafted) == (timings["draft_n_accepted"], timings["draft_n"] + k)
    finally:
        engine.close()


# The server test's prompts, each with its strategy: their 32-token greedy answers on the agreeing pair have no
# near-tie that batching could flip (the smallest gap 0.037, checked below; tests/perf/greedy_margins.py). The
# prompts this test had before parted at gaps down to 0.001 ("print hello world", its 24th token): four slots'
# batches follow the clients' arrival, and a batch shared with others may rightly flip such a choice.
CONCURRENT = [("red big", "sps"), ("was time print house", "auto"), ("world a", "ar"), ("small sat red", "tree"),
              ("big small on print", "sps"), ("return code a", "auto"), ("hello world code", "sps"),
              ("mat a cat dog", "lookup")]
CONCURRENT_N = 32


def test_the_concurrent_prompts_have_no_near_tie(files: DFlashFiles) -> None:
    """The precondition of the test below: every greedy choice wins by more than batching can move a logit."""
    from engine_helpers import BATCH_NOISE, min_greedy_gap

    engine = _engine(files.agreeing, draft=False)
    try:
        for prompt, _ in CONCURRENT:
            gap = min_greedy_gap(engine, engine.tokenize(prompt), CONCURRENT_N)
            assert gap > BATCH_NOISE, f"{prompt!r}: a greedy choice wins by {gap:.4f} only"
    finally:
        engine.close()


def test_serve_with_four_slots_drafts_with_the_block_and_each_client_gets_its_text(
        files: DFlashFiles, tmp_path: Path) -> None:
    """`specchat serve -np 4 -md draft.gguf`: eight clients at once, mixed strategies, each gets `ar`'s text; the
    answers' timings count the block draft's accepted drafts; no request is left running."""
    import threading

    from serve_helpers import API_KEY, spec, start_server, stop_server, timings_of

    pair = files.agreeing
    served = start_server(["-m", str(pair.target), "-md", str(pair.draft), "--api-key", API_KEY, "-np", "4",
                           "--no-memory"], tmp_path / "server.log")
    try:
        prompts = CONCURRENT

        def answer(prompt: str, strategy: str):
            out = served.client().completions.create(model=pair.target.stem, prompt=prompt, max_tokens=CONCURRENT_N,
                                                     temperature=0, extra_body=spec(strategy))
            return out.choices[0].text, timings_of(out)

        plain = [answer(p, "ar")[0] for p, _ in prompts]
        got: list = [None] * len(prompts)

        def ask(i: int) -> None:
            got[i] = answer(*prompts[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [text for text, _ in got] == plain
        assert sum(t.get("draft_n_accepted", 0) for _, t in got) > 0, [t for _, t in got]
        health = served.health()
        assert health["parallel"] == 4 and health["running"] == 0 and health["kv_errors"] == 0
    finally:
        stop_server(served)
