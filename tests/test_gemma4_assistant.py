"""Gemma 4's assistant file as the drafter (backends.gemma4_assistant), on real llama.cpp with tiny pairs.

tests/gemma4_factory.py writes a gemma4 target and a gemma4-assistant for it
whose agreement is tunable: `agreeing` has most drafts accepted, `random`
few, so both the accepting and the rejecting paths run. Greedy output is
`ar`'s token for token for sps, auto and tree, alone and under the server's
scheduler; with sampling, the law of the first two tokens is the target's
(chi-square at stats_helpers.ALPHA); the assistant writes no cell, reads the
target's, and the target's cells are its record after every request. A pair
that does not fit is refused in one line, before llama.cpp sees it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from backends.config import StrategyOptions, TreeConfig
from backends.engine import Engine, EngineConfig
from backends.events import ACCEPTED, REJECTED, Token
from backends.gemma4_assistant import AssistantSequence
from backends.sampling import GenParams
from backends.strategies.sps import SpsConfig
from conftest import TINY_VOCAB_WORDS
from engine_helpers import assert_strategy_greedy, run_to_done
from gemma4_factory import Gemma4Pair, write_gemma4_pair
from gguf_factory import spm_vocab, write_llama_gguf
from hub_server import hub  # noqa: F401  (a fixture used by name: a data dir of its own, where F6 lists models)
from models.compat import check_pair
from models.drafters import describe_drafters
from models.errors import ModelError
from models.gguf_info import validate_gguf
from stats_helpers import assert_drafts_keep_the_law
from test_mtp import PROMPTS, SPS


@dataclass(frozen=True)
class Pair:
    target: Path
    assistant: Path


@dataclass(frozen=True)
class Files:
    agreeing: Pair
    random: Pair
    small: Pair  # a 12-token vocabulary, for the chi-square test
    narrow: Pair  # an assistant built for a target of another width
    llama: Path  # a target of another architecture
    # Pairs whose assistant reads the target's KV cells with another layout, each differing in one field alone:
    # the assistant's KV heads, its head size, the target's sliding-window pattern (LAYOUTS).
    layouts: dict[str, Pair]


# Each layout mismatch, the field named in its refusal, and the words of it.
LAYOUTS = {
    "head_count_kv": (dict(assistant=Gemma4Pair(n_head_kv=1)),
                      ["its sliding-window blocks read the target's layer 0 as 1 KV head, the layer has 2 "
                       "(attention.head_count_kv)",
                       "its full blocks read the target's layer 1 as 1 KV head, the layer has 2 "
                       "(attention.head_count_kv)"]),
    "key_length": (dict(assistant=Gemma4Pair(head_dim=16)),
                   ["its sliding-window blocks read the target's layer 0 in KV heads of 16, the layer's are of 32 "
                    "(attention.key_length_swa)",
                    "its full blocks read the target's layer 1 in KV heads of 16, the layer's are of 32 "
                    "(attention.key_length)"]),
    "sliding_window_pattern": (dict(model=Gemma4Pair(swa_pattern=(False, True)), assistant=Gemma4Pair()),
                               ["its sliding-window blocks read the target's layer 0, which is a full layer "
                                "(attention.sliding_window_pattern)",
                                "its full blocks read the target's layer 1, which is a sliding-window layer "
                                "(attention.sliding_window_pattern)"]),
}


def _pair(d: Path, name: str, model: Gemma4Pair, **kw) -> Pair:
    target, assistant = write_gemma4_pair(d / f"{name}-target.gguf", d / f"{name}-assistant.gguf", model=model, **kw)
    return Pair(target, assistant)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Files:
    d = tmp_path_factory.mktemp("gemma4")
    return Files(agreeing=_pair(d, "agreeing", Gemma4Pair(residual=0.05, head_noise=0.05)),
                 random=_pair(d, "random", Gemma4Pair(residual=1.0, head_noise=1.0), seed=3),
                 small=_pair(d, "small", Gemma4Pair(residual=0.3, head_noise=0.3, logit_scale=0.35),
                             vocab=spm_vocab(TINY_VOCAB_WORDS, with_bytes=False)),
                 narrow=_pair(d, "narrow", Gemma4Pair(), backbone=48),
                 llama=write_llama_gguf(d / "llama.gguf"),
                 layouts={name: _pair(d, name, **({"model": Gemma4Pair()} | kw))
                          for name, (kw, _) in LAYOUTS.items()})


def _engine(pair: Pair, **kw) -> Engine:
    return Engine(EngineConfig(target=pair.target, draft=pair.assistant, n_ctx=512, threads=1, cost_cache=Path(""),
                               memory=False, **kw))


@pytest.fixture(scope="module")
def agreeing(files: Files) -> Engine:
    engine = _engine(files.agreeing, n_seq_max=16)  # sequence ids for a tree's paths
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def random_pair(files: Files) -> Engine:
    engine = _engine(files.random, n_seq_max=16)
    yield engine
    engine.close()


def test_models_say_what_the_assistant_is_and_which_target_it_fits(files: Files) -> None:
    info = validate_gguf(files.agreeing.assistant)
    assert info.architecture == "gemma4-assistant" and info.embedding_length_out == 64
    assert info.summary()["assistant_target_hidden_size"] == 64
    assert describe_drafters(info).startswith("Gemma 4 assistant (MTP) for a gemma4 target of hidden size 64")
    target = validate_gguf(files.agreeing.target)
    assert check_pair(target, info).ok
    narrow = check_pair(target, validate_gguf(files.narrow.assistant))
    assert narrow.problems == ("it reads hidden states of 48, the target's are 64",)
    other = check_pair(validate_gguf(files.llama), info)
    assert "a Gemma 4 assistant drafts for a gemma4 target, this one is llama" in other.problems


@pytest.mark.parametrize("which", ["narrow", "llama"])
def test_a_mismatched_pair_is_refused_in_one_line(files: Files, which: str) -> None:
    pair = files.narrow if which == "narrow" else Pair(files.llama, files.agreeing.assistant)
    with pytest.raises(ModelError) as e:
        _engine(pair)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"draft {pair.assistant.name} cannot speculate for target")
    assert ("hidden states of 48" if which == "narrow" else "this one is llama") in line


def test_the_headers_say_each_files_kv_layout(files: Files) -> None:
    """GGUFInfo reads the fields llama.cpp lays a layer's KV cells out by (src/llama-model.cpp:1396-1466)."""
    target, assistant = (validate_gguf(p) for p in (files.agreeing.target, files.agreeing.assistant))
    assert target.swa_pattern == assistant.swa_pattern == (True, False)
    assert target.head_count_kv == assistant.head_count_kv == (2, 2)
    assert (target.key_length, target.key_length_swa) == (assistant.key_length, assistant.key_length_swa) == (32, 32)
    assert [target.kv_layout(i) for i in range(2)] == [(True, 2, 32), (False, 2, 32)]
    assert validate_gguf(files.layouts["head_count_kv"].assistant).head_count_kv == (1, 1)


@pytest.mark.parametrize("field", list(LAYOUTS))
def test_an_assistant_built_for_other_layers_is_refused_in_one_line(files: Files, field: str) -> None:
    """The assistant views the target's KV cells with its own KV heads and head size, and finds the layer it
    reads among the target's layers of its own kind: a pair that differs in one of these fields is refused
    before anything loads, by `models check`, the engine and `specchat run`, each in one line naming the field;
    the matching pair passes."""
    pair, want = files.layouts[field], LAYOUTS[field][1]
    target, assistant = validate_gguf(pair.target), validate_gguf(pair.assistant)
    assert check_pair(target, assistant).problems == tuple(want)
    assert check_pair(validate_gguf(files.agreeing.target), validate_gguf(files.agreeing.assistant)).ok
    with pytest.raises(ModelError) as e:
        _engine(pair)
    assert "\n" not in str(e.value) and str(e.value).endswith("; ".join(want))
    r = _cli("models", "check", str(pair.target), str(pair.assistant))  # its list: one line a problem
    lines = r.stdout.splitlines()
    assert r.returncode == 1 and lines[2].startswith("incompatible:") and lines[3:] == [f"  - {w}" for w in want], \
        r.stdout
    r = _cli("run", "the cat sat", "-m", str(pair.target), "-md", str(pair.assistant), "-t", "1", "-n", "4",
             "--no-memory")
    errors = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(errors) == 1 and f"attention.{field}" in errors[0], r.stderr[-2000:]
    assert errors[0].endswith("; ".join(want)), errors[0]


def test_the_assistant_drafts_for_its_target(agreeing: Engine) -> None:
    assert agreeing.drafter == "gemma4-assistant" and not agreeing.mtp
    draft = agreeing.draft
    assert isinstance(draft, AssistantSequence) and draft.label == "mtp"
    assert draft.ctx is not agreeing.target.ctx and draft.width == agreeing.target_model.n_embd


@pytest.mark.parametrize("which", ["agreeing", "random_pair"])
def test_greedy_output_is_the_targets(which: str, request: pytest.FixtureRequest) -> None:
    """sps, auto and tree give ar's tokens; every draft row found the target holding context[:-1]."""
    engine: Engine = request.getfixturevalue(which)
    accepted = rejected = 0
    tree = {"drafted": 0, "accepted": 0}
    for prompt in PROMPTS:
        params = GenParams(max_tokens=48, temperature=0.0)
        want = run_to_done(engine, "ar", prompt, params).tokens
        for strategy in ("sps", "auto", "tree"):
            done = run_to_done(engine, strategy, prompt, params, SPS)
            assert_strategy_greedy(engine, strategy, prompt, want, done.tokens, f"on {which}")
            if strategy == "sps":
                accepted += done.stats.accepted
                rejected += done.stats.drafted - done.stats.accepted
            elif strategy == "tree":
                tree["drafted"] += done.stats.drafted
                tree["accepted"] += done.stats.accepted
    assert engine.draft.misaligned == 0
    assert tree["drafted"] > 0, "the tree drafted with the assistant"
    rate = accepted / (accepted + rejected)
    if which == "agreeing":  # the accepting paths ran (chains of 4: deep ones fail)
        assert accepted > 50 and rate > 0.4, (accepted, rejected)
        assert tree["accepted"] > 50, tree
    else:
        assert rate < 0.2, (accepted, rejected)


def test_drafted_tokens_are_labelled_mtp(agreeing: Engine) -> None:
    events = list(agreeing.strategy("sps", SPS).generate(PROMPTS[0], GenParams(max_tokens=24, temperature=0.0)))
    sources = {e.source for e in events if isinstance(e, Token) and e.source != "target"}
    assert sources == {"mtp"}


def test_the_assistant_reads_the_targets_cells_and_writes_none(agreeing: Engine) -> None:
    """A draft row leaves the target's cells as they were, and what it predicts depends on them: the same row
    (token, hidden state) after two contexts the target holds gives other logits."""
    target, draft = agreeing.target, agreeing.draft
    agreeing.slots[0].reset()
    logits = []
    for prompt in ([1, 300, 301, 302, 303], [1, 290, 280, 270, 303]):
        target.sync(prompt[:-1], logits=False)
        held = target.cells()
        draft.sync(prompt)
        assert target.cells() == held == len(prompt) - 1 and draft.cells() == held  # its context answers the target's
        logits.append(draft.logits().copy())
        draft.extend([5])  # a drafted token: at the same position, no cell written either
        assert target.cells() == held
    assert not np.allclose(logits[0], logits[1])
    agreeing.slots[0].reset()
    assert target.cells() == 0 and draft.cells() == 0 and not draft.stash.rows


def test_the_targets_cells_return_to_its_record_after_every_request(agreeing: Engine) -> None:
    """After each request the target holds exactly its record (the prompt and the output less the last token),
    no scratch sequence a cell past it, and the slot's consistency check (which reads the target's cells once:
    the assistant owns none) passes."""
    from backends.slot_pool import SlotPool

    pool = SlotPool(agreeing)
    target = agreeing.target
    for prompt in PROMPTS:
        for strategy in ("sps", "tree", "auto"):
            done = run_to_done(agreeing, strategy, prompt, GenParams(max_tokens=30, temperature=0.0), SPS)
            assert target.tokens == (list(prompt) + list(done.tokens))[:-1]
            assert target.cells() == len(target.tokens), strategy
            assert all(target.ctx.pos_max(target.base + s) < len(target.tokens) for s in range(1, target.n_seq_max))
            assert pool.consistent(0), strategy
    agreeing.slots[0].reset()
    assert target.cells() == 0


def test_the_servers_cell_count_holds_the_targets_cells_once(files: Files) -> None:
    """The server's `kv_cells` / `kv_cached` (SlotPool.cells, after every request as /health shows them): the
    assistant's context answers for the target's cells, which it does not own, so with it the count is the
    target's own, as the same requests leave it with the target alone under `ar` (it was twice that)."""
    from backends.slot_pool import SlotPool

    def counts(engine: Engine, strategies: list[str]) -> list[tuple[int, int, int]]:
        pool, out = SlotPool(engine), []
        for i, strategy in enumerate(strategies):  # one at a time: each request's tokens as it gives them alone
            pool.admit(strategy, StrategyOptions(sps=SPS.sps), list(PROMPTS[i % len(PROMPTS)]) + [300 + i],
                       GenParams(max_tokens=24, temperature=0.0), lambda _e: None)
            pool.run()
            own = sum(len(slot.target.tokens) for slot in engine.slots)
            assert own == sum(slot.target.cells() for slot in engine.slots) > 0
            out.append((pool.kv_cells, pool.kv_cached, own))
        return out

    strategies = ["sps", "tree", "auto", "sps"]
    engine = _engine(files.agreeing, n_seq_max=16, n_parallel=2)
    alone = Engine(EngineConfig(target=files.agreeing.target, n_ctx=512, threads=1, n_seq_max=16, n_parallel=2,
                                cost_cache=Path(""), memory=False))
    try:
        assert engine.draft is not None and not engine.draft.owns_cells
        with_assistant = counts(engine, strategies)
        plain = counts(alone, ["ar"] * len(strategies))
    finally:
        engine.close()
        alone.close()
    assert all(held == recorded == own for held, recorded, own in with_assistant), with_assistant
    assert [c[0] for c in with_assistant] == [c[0] for c in plain], (with_assistant, plain)


@pytest.mark.parametrize("strategy", ["sps", "tree"])
def test_sampling_keeps_the_targets_law(files: Files, strategy: str) -> None:
    """Chains and trees of the assistant's drafts, rejection-sampled: the first two tokens' law is the target's."""
    engine = _engine(files.small, n_seq_max=16)
    try:
        options = StrategyOptions(sps=SPS.sps, tree=TreeConfig(2, 2, 4))
        assert_drafts_keep_the_law(engine, strategy, [1, 4, 6, 8], options, 100, "the assistant")
    finally:
        engine.close()


def test_auto_prices_the_assistant_with_its_measured_cost(files: Files) -> None:
    """The device cost's draft share is one assistant decode measured against a target decode, and `auto` prices
    the assistant from it: the draft lane's live curve (what auto reads a draft decode's cost from) is seeded with
    that share of the target's curve, then follows the assistant's own decodes."""
    import math

    engine = _engine(files.agreeing, n_seq_max=16)
    try:
        engine.target.sync(PROMPTS[0], logits=False)
        cost = engine.device_cost(k_max=4, remeasure=True)
        assert cost is not None and 0.0 < cost.draft < 5.0, cost
        engine.slots[0].reset()
        live = engine.draft_lane.live
        assert not live.seeded
        want = run_to_done(engine, "ar", PROMPTS[1], GenParams(max_tokens=40, temperature=0.0)).tokens
        done = run_to_done(engine, "auto", PROMPTS[1], GenParams(max_tokens=40, temperature=0.0), SPS)
        assert done.tokens == want
        assert live.seeded, "auto priced the assistant from the measured cost"
        assert abs(math.log(live.seconds(1) / (cost.draft * cost.batch.seconds[0]))) < 1.0
    finally:
        engine.close()


def test_a_mixed_batch_with_the_assistant_gives_each_request_its_text_alone(files: Files) -> None:
    """Four slots decoding together (the server's scheduler), every strategy: at temperature 0 each request
    gives its text alone (or differs only at a near-tie under llama.cpp's batch noise), the assistant's rows of
    several sequences share its lane's batches, and no slot keeps cells beyond its record."""
    from backends.slot_pool import SlotPool
    from engine_helpers import BATCH_NOISE, divergences_from_alone
    from test_batching import _collect, _leaks

    strategies = ["ar", "sps", "auto", "tree", "sps", "lookup", "auto", "sps"]
    options = StrategyOptions(sps=SpsConfig(draft_max=4, p_min=0.0))
    engine = _engine(files.agreeing, n_seq_max=16, n_parallel=4)
    alone = Engine(EngineConfig(target=files.agreeing.target, n_ctx=512, threads=1, cost_cache=Path(""),
                                memory=False))
    try:
        assert engine.drafter == "gemma4-assistant"
        params = GenParams(max_tokens=40, temperature=0.0)
        prompts = [list(PROMPTS[i % len(PROMPTS)]) + [300 + i] for i in range(len(strategies))]
        jobs = [(s, p, params) for s, p in zip(strategies, prompts)]
        got = _collect(SlotPool(engine), jobs, options)
        divergences = divergences_from_alone(alone, jobs, got)
        assert all(gap < BATCH_NOISE for _, _, gap in divergences), divergences
        assert len(divergences) <= 2, divergences
        rows = sum(1 for ev in got for e in ev if isinstance(e, Token) and e.source == "mtp")
        assert rows > 20, "the assistant drafted under load"
        assert not _leaks(engine), _leaks(engine)
        assert all(slot.draft.misaligned == 0 for slot in engine.slots)
    finally:
        engine.close()
        alone.close()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, timeout=300)


def test_the_cli_runs_the_pair_and_labels_its_drafts_mtp(files: Files) -> None:
    """`specchat run -m gemma4.gguf -md assistant.gguf --json`: sps, tree and auto give ar's tokens, every drafted
    token's source is "mtp"; `models info` and `models check` say what the file is and that it fits."""
    pair = files.agreeing
    base = ["run", "the cat sat on the mat and", "-m", str(pair.target), "-md", str(pair.assistant), "-t", "1",
            "--temp", "0", "--json", "--no-memory", "-n", "32"]

    def events(*args: str) -> list[dict]:
        r = _cli(*base, *args)
        assert r.returncode == 0, r.stderr[-2000:]
        return [json.loads(line) for line in r.stdout.splitlines()]

    want = events("-s", "ar")[-1]["tokens"]
    for strategy in ("sps", "tree", "auto"):
        got = events("-s", strategy)
        assert got[-1]["tokens"] == want, strategy
        drafted = {e["source"] for e in got if e["type"] == "token" and e["kind"] in (ACCEPTED, REJECTED)}
        assert drafted <= {"mtp"} and (strategy == "auto" or drafted == {"mtp"}), (strategy, drafted)
    r = _cli("models", "info", str(pair.assistant), "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["drafters"].startswith("Gemma 4 assistant (MTP) for")
    r = _cli("models", "check", str(pair.target), str(pair.assistant))
    assert r.returncode == 0 and r.stdout.splitlines()[-1].startswith("compatible:"), r.stdout
    r = _cli("models", "check", str(files.narrow.target), str(files.narrow.assistant))
    assert r.returncode == 1 and "it reads hidden states of 48, the target's are 64" in r.stdout


def test_f6_lists_the_assistant_as_a_draft_and_offers_it_first_for_its_target(hub, files: Files, tiny,  # noqa: F811
                                                                             tmp_path) -> None:
    """The models screen (F6): the assistant is no target of its own ("Gemma 4 assistant draft: pick its
    target"), and picking its target highlights it first among the drafts, before a model that could only
    speculate as a draft model; Enter loads the pair and the chat drafts with it, labelled mtp."""
    import asyncio
    from dataclasses import replace

    from textual.widgets import OptionList

    from app.tui.models_screen import ModelsScreen
    from models.store import ModelStore, StoredModel
    from tui_helpers import app_for, option_labels, tiny_settings, wait_for, wait_loaded

    store = ModelStore()  # in the hub fixture's data dir: the local models F6 lists
    store.add(StoredModel("a-gemma4-target", files.agreeing.target))
    store.add(StoredModel("b-gemma4-assistant", files.agreeing.assistant))
    store.add(StoredModel("c-narrow-assistant", files.narrow.assistant))
    settings = replace(tiny_settings(tiny.target, tiny.draft, "sps"), params=GenParams(max_tokens=16, temperature=0))

    async def scenario() -> None:
        app = app_for(settings, tmp_path)
        async with app.run_test(size=(160, 40)) as pilot:
            await wait_loaded(pilot)
            await pilot.press("f6")
            screen = app.screen
            assert isinstance(screen, ModelsScreen)
            local = screen.query_one("#local", OptionList)
            rows = option_labels(local)
            row = next(label for label in rows if label.startswith("b-gemma4-assistant "))
            assert not rows[row] and "Gemma 4 assistant draft: pick its target" in row, row
            names = [m.name for m in screen.local]
            local.focus()
            local.highlighted = names.index("a-gemma4-target")
            await pilot.press("enter")
            drafts = screen.query_one("#drafts", OptionList)
            offered = drafts.get_option_at_index(drafts.highlighted)
            assert names[int(offered.id)] == "b-gemma4-assistant", offered.prompt
            assert str(offered.prompt).endswith(" · Gemma 4 assistant"), offered.prompt
            narrow = next(label for label in option_labels(drafts) if label.startswith("c-narrow-assistant"))
            assert "—" in narrow, f"a mismatched assistant is listed with its reason: {narrow}"
            await pilot.press("enter")
            chat = app.chat
            await wait_for(pilot, lambda: chat.engine is not None and not chat.loading and chat.session is not None,
                           "the picked pair")
            assert chat.engine.draft is not None and chat.engine.draft.label == "mtp"

    asyncio.run(scenario())
