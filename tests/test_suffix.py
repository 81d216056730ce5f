"""The speculation memory: its store on disk (backends.memory) and the strategies that draft from it.

The store is tested with real files (crashes are real kill -9s, corrupt files
real bytes); `suffix` and `auto` on real llama.cpp: greedy output equal to
`ar`'s with a warm memory, the sampling law kept (chi-square, alpha 1e-4),
and a second process drafting from what the first one wrote.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from backends.config import AutoConfig, StrategyOptions, SuffixConfig
from backends.engine import Engine, EngineConfig
from backends.memory import Continuations, SpeculationMemory, merge_continuations
from backends.memory_file import MemoryFile, describe_file
from backends.sampling import GenParams
from backends.strategies.suffix import prune_by_grammar, shaped
from backends.token_tree import TokenTree
from engine_helpers import assert_greedy_agrees, remember_continuations, run_to_done
from stats_helpers import ALPHA, assert_target_law, outcome, target_law

HASH = bytes(range(32))
N_VOCAB = 300


def _store(path: Path | None, **kw) -> SpeculationMemory:
    return SpeculationMemory(path, HASH, N_VOCAB, **kw)


def _likeliest(found: Continuations, limit: int) -> list[int]:
    """The tokens of the path through each node's heaviest child (the largest share), up to `limit`."""
    nodes = found.tree.likeliest_path(limit)
    return found.tree.path(nodes[-1]) if nodes else []


def test_a_continuation_seen_before_is_proposed_with_its_share(tmp_path: Path) -> None:
    store = _store(tmp_path / "m.bin")
    store.add([5, 6, 7, 8, 9, 10, 11, 12, 13])
    store.add([1, 7, 8, 9, 20, 21, 22, 23, 24])
    store.add([2, 3, 4, 40, 41, 42, 43, 44, 45])
    found = store.continuations([99, 6, 7, 8, 9], 4, 16)
    assert found.match >= 4  # "6 7 8 9" matched the first document further back than the second
    tree = found.tree
    assert _likeliest(found, 4) == [10, 11, 12, 13]
    assert {tree.tokens[i] for i in tree.children()} == {10, 20}
    assert tree.weights[tree.likeliest_path(1)[0]] > 0.5  # the longer match weighs more
    assert not len(store.continuations([200, 201, 202], 4, 16))
    assert store.stats()["hits"] == 1 and store.stats()["lookups"] == 2


def test_the_memory_persists_and_a_new_store_proposes_from_it(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    first = _store(path)
    doc = list(range(50, 90))
    first.add(doc)
    first.flush()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the owner's text: readable by the owner only"
    second = _store(path)
    assert _likeliest(second.continuations(doc[:10], 5, 8), 5) == doc[10:15]


def test_a_record_cut_by_a_crash_is_dropped_and_the_rest_loads(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    store = _store(path)
    docs = [list(range(i, i + 20)) for i in range(0, 200, 20)]
    for d in docs:
        store.add(d)
    store.flush()
    whole = path.read_bytes()
    for cut in (len(whole) - 3, len(whole) - 40, len(whole) - 81):
        path.write_bytes(whole[:cut])
        got = _store(path)
        assert 8 <= got.stats()["documents"] <= 9
        assert _likeliest(got.continuations(docs[0][:5], 3, 4), 3) == docs[0][5:8]


def test_kill_9_while_writing_leaves_a_store_that_loads(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    writer = (
        "import sys; sys.path.insert(0, %r)\n"
        "from backends.memory_file import MemoryFile\n"
        "f = MemoryFile(__import__('pathlib').Path(%r), bytes(range(32)), 300)\n"
        "i = 0\n"
        "while True:\n"
        "    f.append([[(i + j) %% 300 for j in range(4000)]]); i += 1\n"
    ) % (str(Path(__file__).resolve().parents[1]), str(path))
    for delay in (0.3, 0.55, 0.8):
        proc = subprocess.Popen([sys.executable, "-c", writer])
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        docs, _cut = MemoryFile(path, HASH, N_VOCAB).read()
        assert docs and all(len(d) == 4000 for d in docs)
        assert _store(path).stats()["documents"] >= 1
        path.unlink()


def test_an_append_after_another_writers_cut_record_keeps_the_file_whole(tmp_path: Path) -> None:
    """The chat app and a server share the file: one killed mid-append leaves a cut record at its end, and the
    other's next append goes after it. It trims the cut record first, so the file reads whole (it read as "a
    damaged record in the middle" and was set aside, the whole memory lost)."""
    path = tmp_path / "m.bin"
    first, second = MemoryFile(path, HASH, N_VOCAB), MemoryFile(path, HASH, N_VOCAB)
    first.append([list(range(10, 30)), list(range(30, 50))])
    path.write_bytes(path.read_bytes() + MemoryFile.record(list(range(50, 90)))[:37])  # a writer killed midway
    second.append([list(range(90, 100))])
    docs, cut = MemoryFile(path, HASH, N_VOCAB).read()
    assert not cut and [d.tolist() for d in docs] == [list(range(10, 30)), list(range(30, 50)), list(range(90, 100))]


@pytest.mark.parametrize("damage", ["truncated header", "garbage", "other vocabulary", "bad token ids",
                                    "middle record"])
def test_a_damaged_or_foreign_file_is_set_aside_with_one_line(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "m.bin"
    store = _store(path)
    for i in range(3):
        store.add(list(range(i * 10, i * 10 + 12)))
    store.flush()
    data = bytearray(path.read_bytes())
    if damage == "truncated header":
        data = data[:10]
    elif damage == "garbage":
        data = bytearray(os.urandom(len(data)))
    elif damage == "other vocabulary":
        data[12] ^= 0xFF  # a byte of the vocabulary hash
    elif damage == "bad token ids":
        data = bytearray(MemoryFile(path, HASH, N_VOCAB).header() + MemoryFile.record([5, 10_000, 6]))
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    said: list[str] = []
    fresh = _store(path, warn=said.append)
    assert fresh.stats()["documents"] == 0
    assert len(said) == 1 and "\n" not in said[0] and "set aside" in said[0]
    assert list(tmp_path.glob("m.bin.bad-*")), "the damaged file is kept aside, not deleted"
    fresh.add(list(range(100, 120)))
    fresh.flush()
    assert _store(path).stats()["documents"] == 1


def test_ten_thousand_generations_stay_under_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "m.bin"
    store = _store(path, max_tokens=20_000)
    rng = np.random.default_rng(0)
    for i in range(10_000):
        store.add(rng.integers(0, N_VOCAB, size=int(rng.integers(20, 80))).tolist())
        if i % 1000 == 0:
            store.continuations(rng.integers(0, N_VOCAB, size=8).tolist(), 8, 16)
    store.flush()
    assert store.n_tokens <= 20_000
    info = describe_file(path)
    assert info["tokens"] == store.n_tokens and info["file_bytes"] < 20_000 * 4 + 60_000
    recent = store._docs[-1].tolist()
    assert _likeliest(store.continuations(recent[:6], 4, 8), 4) == recent[6:10], "the newest are kept"


def test_merged_tree_keeps_the_heaviest_nodes_parents_first() -> None:
    found = merge_continuations([[1, 2, 3], [1, 2, 4], [1, 5], [6]], [3, 2, 1, 1], 4, 3)
    assert found.match == 3 and found.support == 4
    # Masses: 1 -> 6, 1 2 -> 5, 1 2 3 -> 3, 1 2 4 -> 2, 1 5 -> 1, 6 -> 1; the four heaviest, shares of 7.
    assert found.tree == TokenTree((1, 2, 3, 4), (-1, 0, 1, 1), (6 / 7, 5 / 7, 3 / 7, 2 / 7))
    assert _likeliest(found, 3) == [1, 2, 3]


def _shares() -> Continuations:
    """root -> 10 (0.6) -> 12 (0.5) -> 14 (0.3); 10 -> 13 (0.1); root -> 11 (0.4) -> 15 (0.2)."""
    return Continuations(TokenTree((10, 11, 12, 13, 14, 15), (-1, -1, 0, 0, 2, 1), (0.6, 0.4, 0.5, 0.1, 0.3, 0.2)),
                         match=2, support=5)


def test_suffix_verifies_the_heaviest_nodes_within_factor_x_match() -> None:
    found = _shares()
    # Budget ceil(1.5 x 2) = 3: the three heaviest, a tree.
    assert shaped(found, SuffixConfig(factor=1.5, min_prob=0.0), 24) == TokenTree((10, 11, 12), (-1, -1, 0),
                                                                                  (0.6, 0.4, 0.5))
    # Only nodes at least min_prob of the occurrences go through; max_nodes bounds the budget too.
    assert shaped(found, SuffixConfig(factor=8.0, min_prob=0.25), 24).tokens == (10, 11, 12, 14)
    assert shaped(found, SuffixConfig(factor=8.0, min_prob=0.0), 2).tokens == (10, 12)


def test_the_grammar_cuts_a_refused_node_with_its_subtree() -> None:
    class Refusing:  # a Run under a grammar that refuses token 12 wherever it comes
        constraint = object()
        params = SimpleNamespace(mask_drafts=True)

        @staticmethod
        def valid_prefix(path: list[int]) -> list[int]:
            return path[:path.index(12)] if 12 in path else path

    found = _shares()
    cut = prune_by_grammar(Refusing(), found)  # type: ignore[arg-type]
    assert cut == Continuations(TokenTree((10, 11, 13, 15), (-1, -1, 0, 1), (0.6, 0.4, 0.1, 0.2)), 2, 5)
    Refusing.params = SimpleNamespace(mask_drafts=False)
    assert prune_by_grammar(Refusing(), found) is found, "drafts unmasked: nothing is cut"  # type: ignore[arg-type]


# -- on real llama.cpp ------------------------------------------------------------------------------------------


@pytest.fixture()
def memory_engine(tiny, tmp_path: Path) -> Engine:
    engine = Engine(EngineConfig(target=tiny.target, draft=tiny.draft, n_ctx=1024, threads=1, n_seq_max=32,
                                 memory_dir=tmp_path / "memory"))
    yield engine
    engine.close()


def test_suffix_and_auto_with_a_warm_memory_give_ars_greedy_output(memory_engine: Engine) -> None:
    """auto's steps follow live timings, so its batches differ from run to run, and the last prompt's 28th token
    wins by 0.0011 only (tests/perf/greedy_margins.py): the answer is ar's, or parts from it at a near-tie."""
    prompts = [memory_engine.tokenize(p) for p in ("the cat sat on the mat", "once upon a time there was",
                                                   "def print hello world", "the big red dog ran")]
    params = GenParams(max_tokens=60)
    alone = {i: run_to_done(memory_engine, "ar", p, params).tokens for i, p in enumerate(prompts)}  # remembered
    for strategy in ("suffix", "auto"):
        for i, p in enumerate(prompts):
            done = run_to_done(memory_engine, strategy, p, params)
            if strategy == "suffix":  # the memory's drafts, the same in every run: token for token
                assert done.tokens == alone[i], f"{strategy} on prompt {i}"
            else:
                assert_greedy_agrees(memory_engine, p, alone[i], done.tokens, f"{strategy} on prompt {i}")
    again = run_to_done(memory_engine, "suffix", prompts[0], params)
    assert again.stats.tokens_by_source.get("memory", 0) > 30, "an exact repeat drafts from the memory"
    assert again.stats.target_forwards < len(again.tokens) / 3


def test_a_seeded_sampled_answer_comes_again_from_the_memory_with_every_strategy(memory_engine: Engine) -> None:
    """At temperature 0.8 the target's draws are fixed by the seed (backends.sampling.Noise) whoever proposes: a
    request sent again with its seed gets `ar`'s answer from `suffix` and `auto` (here without the draft model,
    whose sampled chains rejection sampling verifies; on this tiny pair it mostly decodes plainly), and the
    memory, which holds that answer, drafts most of it for `suffix`. (With a draw that depended on the
    proposals, the memory's record of an answer would be right only until the first place the new answer drew
    otherwise.)"""
    prompt = memory_engine.tokenize("once upon a time there was")
    options = StrategyOptions(auto=AutoConfig(draft=False))
    for seed in (1, 2, 3):
        params = GenParams(max_tokens=48, temperature=0.8, seed=seed)
        first = run_to_done(memory_engine, "ar", prompt, params)  # remembered
        for strategy in ("suffix", "auto"):
            again = run_to_done(memory_engine, strategy, prompt, params, options)
            assert again.tokens == first.tokens, (strategy, seed)
            if strategy == "suffix":
                assert again.stats.tokens_by_source.get("memory", 0) >= len(first.tokens) // 2, seed


def test_a_request_that_must_not_be_remembered_neither_reads_nor_writes(memory_engine: Engine) -> None:
    prompt = memory_engine.tokenize("hello world and the house")
    off = StrategyOptions(memory=False)
    first = run_to_done(memory_engine, "suffix", prompt, GenParams(max_tokens=40), off)
    memory = memory_engine.memory()
    assert memory is not None and memory.stats()["documents"] == 0
    run_to_done(memory_engine, "ar", prompt, GenParams(max_tokens=40))  # remembered
    again = run_to_done(memory_engine, "suffix", prompt, GenParams(max_tokens=40), off)
    assert again.tokens == first.tokens and again.stats.tokens_by_source.get("memory", 0) <= \
        first.stats.tokens_by_source.get("memory", 0)


@pytest.mark.parametrize("strategy", ["suffix"])
def test_suffix_trees_keep_the_target_law(tiny, tmp_path: Path, strategy: str) -> None:
    """With a memory that holds several continuations of the prompt, trees are proposed and verified; the
    output's law is the target's (chi-square at alpha 1e-4 on the 15-token vocabulary)."""
    engine = Engine(EngineConfig(target=tiny.small_target, n_ctx=256, threads=1, n_seq_max=32,
                                 memory_dir=tmp_path / "memory"))
    try:
        prompt = [1, 4, 6, 8]
        remember_continuations(engine, [4, 6, 8], seed=1)
        params = GenParams(max_tokens=2, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
        law = target_law(engine, prompt, params)
        options = StrategyOptions(suffix=SuffixConfig(min_prob=0.0, factor=8.0), memory=True)
        counts: dict[tuple[int, ...], int] = {}
        drafted = 0
        strat = engine.strategy(strategy, replace(options))
        for seed in range(3000):
            events = list(strat.inner.generate(prompt, replace(params, seed=seed)))  # not remembered: fixed memory
            done = events[-1]
            counts[outcome(engine, done)] = counts.get(outcome(engine, done), 0) + 1
            drafted += done.stats.drafted
        assert drafted > 3000, "trees were proposed"
        assert_target_law(counts, law, alpha=ALPHA, what="the law differs from the target's")
    finally:
        engine.close()


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], capture_output=True, text=True, env=env, timeout=300)


def test_a_second_process_drafts_from_what_the_first_wrote_and_cache_commands(tiny, tmp_path: Path) -> None:
    env = {**os.environ, "SPECCHAT_MEMORY_DIR": str(tmp_path / "memory")}
    args = ["run", "the cat sat on the mat", "-m", str(tiny.target), "-s", "suffix", "-n", "60", "--temp", "0",
            "-t", "1", "--json"]
    first = _run(args, env)
    assert first.returncode == 0, first.stderr
    second = _run(args, env)
    done1, done2 = (json.loads(r.stdout.strip().splitlines()[-1]) for r in (first, second))
    assert done1["tokens"] == done2["tokens"]
    assert done2["stats"]["tokens_by_source"].get("memory", 0) > done1["stats"]["tokens_by_source"].get("memory", 0)
    stats = _run(["cache", "stats", "--json"], env)
    info = json.loads(stats.stdout.splitlines()[0])
    assert info["documents"] == 1 and info["tokens"] > 60 and info["accepted"] > 0
    no = _run([*args[:-1], "--no-memory", "--json"], env)
    # Without the memory, suffix drafts from the request alone: as the first run did, with an empty memory.
    assert json.loads(no.stdout.strip().splitlines()[-1])["stats"]["tokens_by_source"] == \
        done1["stats"]["tokens_by_source"]
    assert json.loads(_run(["cache", "stats", "--json"], env).stdout.splitlines()[0])["documents"] == 1
    other = tmp_path / "notes.txt"  # `cache clear FILE` deletes the memory's files only, never another file
    other.write_text("mine")
    for name in (str(other), "notes.txt", "memory-0000000000000000.bin"):
        refused = _run(["cache", "clear", name], env)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert "not a memory file" in refused.stderr
    assert other.read_text() == "mine"
    assert json.loads(_run(["cache", "stats", "--json"], env).stdout.splitlines()[0])["documents"] == 1
    cleared = _run(["cache", "clear"], env)
    assert cleared.returncode == 0 and "cleared 1" in cleared.stdout
    assert "empty" in _run(["cache", "stats"], env).stdout
    empty = _run(["cache", "stats", "--json"], env)  # every line JSON under --json, an empty memory's too
    assert [json.loads(line) for line in empty.stdout.splitlines()][-1] == \
        {"memory": {"folder": str(tmp_path / "memory"), "files": 0}}
    off = {**env, "SPECCHAT_MEMORY_DIR": ""}  # the memory off, as documented: nothing to show or clear, no error
    for verb in (["stats"], ["stats", "--json"], ["clear"]):
        r = _run(["cache", *verb], off)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip().endswith('{"memory": null}' if "--json" in verb else "is empty)"), r.stdout
    home = {**env, "SPECCHAT_MEMORY_DIR": "~/mem", "HOME": str(tmp_path / "home")}  # "~" is the home, not ./~
    assert f"empty ({tmp_path / 'home' / 'mem'})" in _run(["cache", "stats"], home).stdout


def test_the_memory_at_the_end_of_the_room_proposes_nothing_and_fails_nothing(memory_engine: Engine) -> None:
    """With one token of room left (max_tokens reached but for one, a full context), a memory that knows the
    continuation has nothing to propose: the generation ends as ar's does (a lookup of depth 0 once raised)."""
    prompt = memory_engine.tokenize("the cat sat on the mat")
    memory = memory_engine.memory()
    assert memory is not None
    for n in (1, 2, 3):
        alone = run_to_done(memory_engine, "ar", prompt, GenParams(max_tokens=n))  # remembered
        memory._rebuild()  # into the sorted index, as a memory loaded from its file is
        for strategy in ("auto", "suffix"):
            assert run_to_done(memory_engine, strategy, prompt, GenParams(max_tokens=n)).tokens == alone.tokens
    assert not len(memory.continuations(prompt, 0, 8))
